"""One method run several ways (e.g. DA3PO synchronous vs streaming vs staleness 1): held-out accuracy side by side.

Each variant is a directory of seed runs (``<dir>/seed<k>/metrics.jsonl``, as ``tools/compare_algorithms.py`` writes
them, or a report's copies ``<report>/logs/<method>/seed<k>.jsonl``); the first is the reference. For every variant:
the held-out primary metric (avg@k) over all groups and over the hard ones (starting value < ``--tau``), mean +-
standard deviation over seeds, at equal training steps (the last step every run reached) and at equal generated
samples (the largest budget every run reached), and its difference from the reference with the same
2-standard-error screen as the comparison report (``studies/compare/stats.py``).
``--per-group`` adds the same at equal generated samples for every group (difficulty bucket or benchmark) alone, and
``--out FILE`` also writes the printed tables there (a report under ``reports/``).

    python tools/compare_variants.py sync=runs/compare/cpu_compare_v3/da3po_2 \
        streaming=runs/compare/cpu_compare_v3_streaming/da3po_2 \
        staleness1=runs/compare/cpu_compare_v3_staleness1/da3po_2
"""

from __future__ import annotations

import argparse
from pathlib import Path

from da3po_megatron.studies.compare.grid import load_variant as load
from da3po_megatron.studies.compare.keys import discover
from da3po_megatron.studies.compare.stats import Point, compare_means, curve_at, mean_std

SAMPLES = "gen/cumulative_samples"
TOKENS = "gen/cumulative_tokens"


def value(rows: list[dict], keys: list[str], pt: Point) -> float | None:
    vals = [curve_at(rows, k, pt.x, pt.x_key) for k in keys]
    return None if any(v is None for v in vals) else sum(vals) / len(vals)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help="NAME=DIR (the first is the reference)")
    ap.add_argument("--tau", type=float, default=0.5, help="hard groups: starting held-out value < tau")
    ap.add_argument("--z", type=float, default=2.0)
    ap.add_argument("--per-group", action="store_true", help="also each group (bucket) at equal generated samples")
    ap.add_argument("--out", type=Path, default=None, help="also write the tables to this Markdown file")
    ap.add_argument("--tokens", action="store_true", help="also at equal generated tokens (gen/cumulative_tokens)")
    args = ap.parse_args(argv)
    lines: list[str] = []

    def emit(line: str = "") -> None:  # every table line also goes to --out
        lines.append(line)
        print(line)

    variants = dict(load(s) for s in args.variants)
    every = [r for runs in variants.values() for rows in runs.values() for r in rows]
    keys = discover(every)
    if keys is None:
        raise SystemExit("no held-out evaluation in these runs")
    start = next(r for r in every if r["step"] == 0 and keys.overall[0] in r)
    hard = [keys.key(0, g) for g in keys.groups if start.get(keys.key(0, g), 1.0) < args.tau]
    last = min(max(r["step"] for r in rows if keys.overall[0] in r) for runs in variants.values()
               for rows in runs.values())
    budget = min(max((r.get(SAMPLES, 0) for r in rows), default=0) for runs in variants.values()
                 for rows in runs.values())
    points = [Point(f"step {last}", "step", float(last)), Point(f"{budget:,.0f} samples", SAMPLES, float(budget))]
    if args.tokens:  # selection (issue 50) changes tokens per sample: compare at equal generated tokens too
        tok = min(max((r.get(TOKENS, 0) for r in rows), default=0) for runs in variants.values()
                  for rows in runs.values())
        points.append(Point(f"{tok:,.0f} tokens", TOKENS, float(tok)))
    ref = next(iter(variants))
    emit(f"held-out {keys.metric}: all {len(keys.groups)} {keys.group_kind}s and the {len(hard)} hard ones "
          f"(starting {keys.metric} < {args.tau:g}); mean +- sd over seeds; diff vs {ref} with a {args.z:g}-SE "
          "screen\n")
    emit(f"| variant | seeds | at | all | diff vs {ref} | hard | diff vs {ref} |")
    emit("|---|---:|---|---:|---|---:|---|")
    for pt in points:
        base = {what: [value(rows, ks, pt) for rows in variants[ref].values()]
                for what, ks in (("all", [keys.overall[0]]), ("hard", hard))}
        for name, runs in variants.items():
            cells = []
            for what, ks in (("all", [keys.overall[0]]), ("hard", hard)):
                vals = [v for v in (value(rows, ks, pt) for rows in runs.values()) if v is not None]
                m, sd, n = mean_std(vals)
                cells.append(f"{100 * m:.1f} +- {100 * sd:.1f}")
                if name == ref:
                    cells.append("-")
                else:
                    c = compare_means(name, vals, ref, [v for v in base[what] if v is not None], args.z)
                    cells.append(f"{100 * c.diff:+.1f} (SE {100 * c.se:.1f}): {c.outcome}")
            emit(f"| {name} | {len(runs)} | {pt.name} | " + " | ".join(cells) + " |")
    if args.per_group:
        pt = points[1]
        names = [n for n in variants if n != ref]
        emit(f"\nper {keys.group_kind} at equal generated samples ({pt.name}): held-out {keys.metric}, {ref} mean +- "
              f"sd, and each variant's diff vs {ref} ({args.z:g}-SE screen)\n")
        emit(f"| {keys.group_kind} | {ref} | " + " | ".join(names) + " |")
        emit("|---|---:|" + "---|" * len(names))
        for g in keys.groups:
            k = [keys.key(0, g)]
            base = [v for v in (value(rows, k, pt) for rows in variants[ref].values()) if v is not None]
            m, sd, _ = mean_std(base)
            cells = []
            for name in names:
                vals = [v for v in (value(rows, k, pt) for rows in variants[name].values()) if v is not None]
                c = compare_means(name, vals, ref, base, args.z)
                flag = "" if c.outcome == "no significant difference" else f": {c.outcome}"
                cells.append(f"{100 * c.diff:+.1f} (SE {100 * c.se:.1f}){flag}")
            emit(f"| {g} | {100 * m:.1f} +- {100 * sd:.1f} | " + " | ".join(cells) + " |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
