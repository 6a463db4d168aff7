"""Replay one rollout dump at several parallel layouts and report the numeric gap of the losses and gradient norms.

The same recorded rollouts (``rollout.dump_dir`` of any run) are trained with ``rollout.replay_mode=train_only`` --
no engines, so the layouts see identical data -- once per layout, and every step's ``train/*`` metrics are compared
with the first layout's (the reference). Step 1 starts from the same weights everywhere, so its gap is the layouts'
own arithmetic (TP splits the matmuls and the vocabulary-parallel loss; packing changes which sequences share a row);
later steps add the drift of the weights that arithmetic produced.

    python tools/studies/replay_layouts.py --config examples/tiny_cpu_da3po.yaml --dump runs/x/dump \\
        --out outputs/replay_layouts model.path=... trainer.total_steps=3 [other overrides of the dumping run]

Layouts: ``--layouts tp1,tp1-nopack,tp2,tp2-nopack`` (default; ``tpN`` = ``parallel.tensor_model_parallel_size=N``,
``-nopack`` = ``actor.packing=false``). Each layout is a ``da3po train`` subprocess (its log in ``OUT/<layout>.log``);
the table goes to stdout and ``OUT/gaps.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
METRICS = ("train/loss", "train/grad_norm", "train/entropy", "train/approx_kl", "train/update_ratio",
           "rollout/logprob_diff_mean")


def layout_overrides(name: str) -> list[str]:
    tp, _, rest = name.partition("-")
    if not tp.startswith("tp") or rest not in ("", "nopack"):
        raise SystemExit(f"--layouts: {name!r} is not tpN or tpN-nopack")
    return [f"parallel.tensor_model_parallel_size={int(tp[2:])}", f"actor.packing={'false' if rest else 'true'}"]


def replay(config: str, dump: str, out: Path, name: str, overrides: list[str], timeout: int) -> dict[int, dict]:
    run_dir = out / name
    cmd = [sys.executable, "-m", "da3po_megatron.cli", "train", "--config", config, *overrides,
           f"trainer.run_dir={run_dir}", f"rollout.replay_dir={dump}", "rollout.replay_mode=train_only",
           "rollout.dump_dir=", "trainer.resume=false", "trainer.save_every=0", "trainer.save_hf_every=0",
           "eval.every=0", *layout_overrides(name)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1"}
    with open(out / f"{name}.log", "w") as log:
        p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"layout {name}: da3po train exited {p.returncode}; see {out / f'{name}.log'}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {int(r["step"]): r for r in rows}


def gaps(reference: dict[int, dict], other: dict[int, dict]) -> dict[str, Any]:
    """Per metric: the max absolute and relative difference over the steps both have, and step 1's."""
    out: dict[str, Any] = {}
    for key in METRICS:
        diffs = []
        for step in sorted(set(reference) & set(other)):
            a, b = reference[step].get(key), other[step].get(key)
            if isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isfinite(a) and math.isfinite(b):
                diffs.append((step, abs(a - b), abs(a - b) / max(abs(a), 1e-12)))
        if diffs:
            out[key] = {"step1_abs": next((d for s, d, _ in diffs if s == 1), None),
                        "max_abs": max(d for _, d, _ in diffs), "max_rel": max(r for _, _, r in diffs)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="the dumping run's YAML recipe")
    ap.add_argument("--dump", required=True, help="its rollout.dump_dir")
    ap.add_argument("--out", required=True, help="where the replays' run directories, logs and gaps.json go")
    ap.add_argument("--layouts", default="tp1,tp1-nopack,tp2,tp2-nopack", help="first = the reference")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per layout")
    ap.add_argument("overrides", nargs="*", help="the dumping run's overrides (model.path=..., ...)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    runs = {}
    for name in names:
        print(f"replaying {args.dump} at {name} ...", flush=True)
        runs[name] = replay(args.config, args.dump, out, name, args.overrides, args.timeout)
    ref = names[0]
    table = {name: gaps(runs[ref], runs[name]) for name in names[1:]}
    (out / "gaps.json").write_text(json.dumps({"reference": ref, "steps": sorted(runs[ref]), "gaps": table,
                                               "values": {n: {s: {k: r.get(k) for k in METRICS} for s, r in
                                                              runs[n].items()} for n in names}}, indent=1) + "\n")
    print(f"\n| layout vs {ref} | metric | step 1 abs gap | max abs gap | max rel gap |")
    print("|---|---|---|---|---|")
    for name, per in table.items():
        for key, g in per.items():
            s1 = "-" if g["step1_abs"] is None else f"{g['step1_abs']:.3g}"
            print(f"| {name} | {key} | {s1} | {g['max_abs']:.3g} | {g['max_rel']:.3g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
