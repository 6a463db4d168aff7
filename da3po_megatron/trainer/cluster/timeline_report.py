"""The device-memory timeline of a shipped recipe, printed:
``python -m da3po_megatron.trainer.cluster.timeline_report RECIPE --hf-config config.json``.

A command on top of the plan (``megatron/memory.py``) and the timeline (``megatron/memory_timeline.py``), so that
neither imports the other (the plan replays the timeline in its preflight; this report needs the plan's estimate),
and above the bridge, which reads the model's HF config into a ``GPTArch`` (``megatron/`` never imports the bridge).
The table of docs/colocation.md ("The device-memory timeline") is its output.
"""

from __future__ import annotations

from da3po_megatron.megatron.memory import estimate_for_config
from da3po_megatron.megatron.memory_timeline import GPU_80GB, H200, DeviceTimeline, GiB, figures_for_config
from da3po_megatron.megatron.memory_timeline_calls import call_sequence


def main(argv: list[str] | None = None) -> int:
    """``RECIPE --hf-config config.json [--device h200|80gb|MiB] [--order today|fixed] [overrides ...]``: the
    timeline table of one GPU of the recipe (a resume, an engine restart, an asynchronous save with its HF copy
    included) and its violations; exit status 1 when it does not fit."""
    import argparse
    import json

    from da3po_megatron.bridge.hf_config import gpt_arch
    from da3po_megatron.config import load_config

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--hf-config", required=True, help="the model's HF config.json")
    ap.add_argument("--device", default="h200", help="h200, 80gb, or the device's total in MiB")
    ap.add_argument("--order", default="fixed", choices=("today", "fixed"))
    a = ap.parse_args(argv)
    total = {"h200": H200, "80gb": GPU_80GB}.get(a.device.lower()) or int(a.device) * 2**20
    cfg = load_config(a.recipe, ["model.path=/unused", *a.overrides])
    with open(a.hf_config) as fh:
        arch = gpt_arch(json.load(fh))
    tl = DeviceTimeline(figures_for_config(cfg, arch, total, estimate_for_config(cfg, arch, device="cuda", te=True)))
    tl.run(call_sequence(a.order, cfg.actor.offload, resume=True, restart_at=2, async_save=True, hf=True))
    print(tl.table())
    print("peak per phase (GiB of " + f"{total / GiB:.1f}): " + ", ".join(f"{p} {v / GiB:.1f}" for p, v, _ in
                                                                        tl.phases()))
    for v in tl.violations:
        print(f"VIOLATION {v}")
    return 1 if tl.violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
