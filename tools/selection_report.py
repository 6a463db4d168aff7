"""What pre-rollout selection (``data.selection``, issue 50) saved and what it trained on, variant by variant.

Each variant is ``NAME=DIR`` as for ``tools/compare_variants.py`` (``DIR/seed<k>/metrics.jsonl``); the first is the
reference. Per run, over all its steps: generated (decoded) tokens per trained token = sum rollout/decoded_tokens /
sum rollout/kept_tokens; the trained share of the two hardest buckets (mean over steps of batch/group_frac_bucket of
the two largest buckets); generation rounds per step; surplus groups per step; prompts skipped per step by tail; the
final exploration rates. Mean +- sd over seeds, and each variant's difference from the reference with the comparison
tools' standard error and 2-SE screen (``studies/compare/stats.py``: a two-sample SE over seeds).

    python tools/selection_report.py dapo=runs/compare/sel50_off/dapo dapo+sel=runs/compare/sel50_on/dapo
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_variants import load  # noqa: E402

from da3po_megatron.studies.compare.stats import compare_means, mean_std  # noqa: E402

SHARE = "batch/group_frac_bucket/"


def _buckets(rows: list[dict]) -> list[str]:
    return sorted({k.removeprefix(SHARE) for r in rows for k in r if k.startswith(SHARE)}, key=float)


def run_figures(rows: list[dict], hardest: list[str]) -> dict[str, float]:
    steps = [r for r in rows if "rollout/decoded_tokens" in r]
    n = max(len(steps), 1)
    kept = sum(r["rollout/kept_tokens"] for r in steps)
    out = {"tokens/trained token": sum(r["rollout/decoded_tokens"] for r in steps) / max(kept, 1.0),
           "hardest-2 share %": 100 * sum(sum(r.get(SHARE + b, 0.0) for b in hardest) for r in steps) / n,
           "rounds/step": sum(r.get("dynamic_sampling/rounds", 0.0) for r in steps) / n,
           "surplus/step": sum(r.get("dynamic_sampling/discarded_surplus_groups", 0.0) for r in steps) / n,
           "gen groups/kept": sum(r.get("dynamic_sampling/generated_groups", 0.0) for r in steps) / max(
               sum(r.get("dynamic_sampling/kept_groups", 0.0) for r in steps), 1.0),
           "skipped c/step": sum(r.get("selection/skipped_all_correct", 0.0) for r in steps) / n,
           "skipped w/step": sum(r.get("selection/skipped_all_wrong", 0.0) for r in steps) / n,
           "p_c final": steps[-1].get("selection/explore_all_correct", float("nan")) if steps else float("nan"),
           "p_w final": steps[-1].get("selection/explore_all_wrong", float("nan")) if steps else float("nan")}
    for b in _buckets(steps):
        out[f"share b{b} %"] = 100 * sum(r.get(SHARE + b, 0.0) for r in steps) / n
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help="NAME=DIR (the first is the reference)")
    ap.add_argument("--z", type=float, default=2.0)
    ap.add_argument("--out", type=Path, default=None, help="also write the tables to this Markdown file")
    args = ap.parse_args(argv)
    variants = dict(load(s) for s in args.variants)
    every = [r for runs in variants.values() for rows in runs.values() for r in rows]
    hardest = _buckets(every)[-2:]
    figs = {name: {seed: run_figures(rows, hardest) for seed, rows in runs.items()} for name, runs in variants.items()}
    ref = next(iter(variants))
    lines = [f"cost and trained shares per run (over all steps), mean +- sd over seeds; hardest buckets: "
             f"{', '.join(hardest)}; diff vs {ref} ({args.z:g}-SE screen)\n"]
    cols = ["tokens/trained token", "hardest-2 share %", "rounds/step", "surplus/step", "gen groups/kept",
            "skipped c/step", "skipped w/step", "p_c final", "p_w final"]
    lines.append("| variant | seeds | " + " | ".join(cols) + " |")
    lines.append("|---|---:|" + "---:|" * len(cols))
    for name, per_seed in figs.items():
        cells = []
        for c in cols:
            vals = [f[c] for f in per_seed.values()]
            m, sd, _ = mean_std(vals)
            cell = f"{m:.2f} +- {sd:.2f}"
            if name != ref and c in ("tokens/trained token", "hardest-2 share %"):
                cmp = compare_means(name, vals, ref, [f[c] for f in figs[ref].values()], args.z)
                cell += f" ({cmp.diff:+.2f}, SE {cmp.se:.2f})"
            cells.append(cell)
        lines.append(f"| {name} | {len(per_seed)} | " + " | ".join(cells) + " |")
    buckets = [k for k in next(iter(next(iter(figs.values())).values())) if k.startswith("share b")]
    lines.append("\ntrained share per difficulty bucket (% of the batch's groups, mean over steps and seeds)\n")
    lines.append("| variant | " + " | ".join(b.removesuffix(" %") for b in buckets) + " |")
    lines.append("|---|" + "---:|" * len(buckets))
    for name, per_seed in figs.items():
        lines.append(f"| {name} | " + " | ".join(
            f"{mean_std([f.get(b, 0.0) for f in per_seed.values()])[0]:.1f}" for b in buckets) + " |")
    ratio = {name: mean_std([f["tokens/trained token"] for f in per_seed.values()])[0] for name, per_seed in
             figs.items()}
    lines.append("\ngenerated tokens per trained token, reference / variant: " + ", ".join(
        f"{name} {ratio[ref] / ratio[name]:.2f}x" for name in figs if name != ref))
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
