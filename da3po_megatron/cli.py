"""The `da3po` command: one sub-command per product entry point.

Each sub-command lives in the module that owns it and exposes ``main(argv: list[str] | None) -> int``; this file only
dispatches, importing the owning module lazily so that ``da3po --help`` stays fast and works without the heavy stack.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import importlib.util
import os
import sys

# name -> (module with main(argv), one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("da3po_megatron.trainer.main", "run RL training (DA3PO / DAPO / GRPO / GSPO) from a YAML config"),
    "eval": ("da3po_megatron.eval.command", "evaluate a checkpoint: avg@k / pass@k on math benchmarks"),
    "convert": ("da3po_megatron.bridge.convert", "convert checkpoints between Hugging Face and Megatron"),
    "bench": ("da3po_megatron.bench", "run a throughput / memory benchmark"),
    "theory": ("da3po_megatron.algorithms.theory", "print alpha+, alpha-, gamma of Theorem 3.1 for given p and G"),
    "doctor": ("da3po_megatron.doctor", "check this machine's stack and what the defaults will use here"),
    "checkpoint": ("da3po_megatron.trainer.resume.checkpoint", "verify run checkpoints against their manifests"),
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


# the sub-commands that start Ray / vLLM / torch process groups in this process or its actors
_HEAVY = ("train", "eval", "bench")


def run() -> None:
    """The console entry point (``da3po``, ``python -m da3po_megatron.cli``): :func:`main`, then, after a sub-command
    that ran the heavy stack, a quick exit: the exit handlers run (Ray's shutdown, logging, wandb), the streams are
    flushed, and the process ends without the interpreter's module teardown -- the finalisers of torch, vLLM, Ray and
    megatron-core modules, 2-3 s of a 2-core machine at the end of every run that write nothing (metrics files,
    checkpoints and the loggers are closed by then; checkpoints are atomic). ``main`` itself never exits the process,
    so tests and tools call it in-process."""
    rc = main()
    if len(sys.argv) > 1 and sys.argv[1] in _HEAVY:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)


if __name__ == "__main__":
    run()
