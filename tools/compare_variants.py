"""One method run several ways (e.g. DA3PO synchronous vs streaming vs staleness 1): held-out accuracy side by side.

Each variant is a directory of seed runs (``<dir>/seed<k>/metrics.jsonl``, as ``tools/compare_algorithms.py`` writes
them); the first is the reference. For every variant: the held-out primary metric (avg@k) over all groups and over the
hard ones (starting value < ``--tau``), mean +- standard deviation over seeds, at equal training steps (the last step
every run reached) and at equal generated samples (the largest budget every run reached), and its difference from the
reference with the same 2-standard-error screen as the comparison report (``studies/compare/stats.py``).

    python tools/compare_variants.py sync=runs/compare/cpu_compare_v3/da3po_2 \
        streaming=runs/compare/cpu_compare_v3_streaming/da3po_2 \
        staleness1=runs/compare/cpu_compare_v3_staleness1/da3po_2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from da3po_megatron.eval.curves import read_metrics  # noqa: E402
from da3po_megatron.studies.compare.keys import discover  # noqa: E402
from da3po_megatron.studies.compare.stats import Point, compare_means, curve_at, mean_std  # noqa: E402

SAMPLES = "gen/cumulative_samples"


def load(spec: str) -> tuple[str, dict[int, list[dict]]]:
    name, _, path = spec.partition("=")
    if not path:
        raise SystemExit(f"variant {spec!r}: expected NAME=DIR")
    runs = {int(d.name.removeprefix("seed")): read_metrics(d / "metrics.jsonl")
            for d in sorted(Path(path).glob("seed*")) if (d / "metrics.jsonl").exists()}
    if not runs:
        raise SystemExit(f"variant {name}: no seed*/metrics.jsonl under {path}")
    return name, runs


def value(rows: list[dict], keys: list[str], pt: Point) -> float | None:
    vals = [curve_at(rows, k, pt.x, pt.x_key) for k in keys]
    return None if any(v is None for v in vals) else sum(vals) / len(vals)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help="NAME=DIR (the first is the reference)")
    ap.add_argument("--tau", type=float, default=0.5, help="hard groups: starting held-out value < tau")
    ap.add_argument("--z", type=float, default=2.0)
    args = ap.parse_args(argv)
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
    ref = next(iter(variants))
    print(f"held-out {keys.metric}: all {len(keys.groups)} {keys.group_kind}s and the {len(hard)} hard ones "
          f"(starting {keys.metric} < {args.tau:g}); mean +- sd over seeds; diff vs {ref} with a {args.z:g}-SE "
          "screen\n")
    print(f"| variant | seeds | at | all | diff vs {ref} | hard | diff vs {ref} |")
    print("|---|---:|---|---:|---|---:|---|")
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
            print(f"| {name} | {len(runs)} | {pt.name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
