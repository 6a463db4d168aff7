"""The `da3po` command: one sub-command per product entry point.

Each sub-command lives in the module that owns it and exposes ``main(argv: list[str] | None) -> int``; this file only
dispatches, importing the owning module lazily so that ``da3po --help`` stays fast and works without the heavy stack.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# name -> (module with main(argv), one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("da3po_megatron.trainer.main", "run RL training (DA3PO / DAPO / GRPO / GSPO) from a YAML config"),
    "eval": ("da3po_megatron.eval.runner", "evaluate a checkpoint: avg@k / pass@k on math benchmarks"),
    "convert": ("da3po_megatron.bridge.convert", "convert checkpoints between Hugging Face and Megatron"),
    "bench": ("da3po_megatron.bench", "run a throughput / memory benchmark"),
    "theory": ("da3po_megatron.algorithms.theory", "print alpha+, alpha-, gamma of Theorem 3.1 for given p and G"),
    "doctor": ("da3po_megatron.doctor", "check this machine's stack and what the defaults will use here"),
    "checkpoint": ("da3po_megatron.trainer.checkpoint", "verify run checkpoints against their manifests"),
}


def available() -> dict[str, tuple[str, str]]:
    """The sub-commands whose module is present in this installation."""
    out = {}
    for name, (mod, help_) in SUBCOMMANDS.items():
        try:
            found = importlib.util.find_spec(mod) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            out[name] = (mod, help_)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmds = available()
    parser = argparse.ArgumentParser(
        prog="da3po",
        description="DA3PO training recipe on megatron-core + vLLM + Ray.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="sub-commands:\n" + "\n".join(f"  {n:<9} {h}" for n, (_, h) in cmds.items())
        + "\n\nRun `da3po SUBCOMMAND --help` for its options.",
    )
    parser.add_argument("command", choices=sorted(cmds), metavar="SUBCOMMAND", help="one of: " + ", ".join(cmds))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    args = parser.parse_args(argv[:1])
    module = importlib.import_module(cmds[args.command][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
