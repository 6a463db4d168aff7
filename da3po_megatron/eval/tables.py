"""Markdown tables in the layout of the paper's Tables 1-2: one row per method / checkpoint, one column per benchmark
holding avg@k and pass@k (percent), and an "Average" column (unweighted mean over the benchmarks of that row).

Input: result JSONs written by ``da3po eval`` (``eval/runner.py``), given as paths or already-loaded dicts:

    {"name": str, "benchmarks": {bench: {"k", "num_problems", "avg_at_k", "pass_at_k", "avg_at_k_se", ...}},
     "average": {"avg_at_k", "pass_at_k"}, ...}

    python -m da3po_megatron.eval.tables runs/dapo/eval/results.json runs/da3po/eval/results.json [--ci] [--out T.md]

Benchmarks appear in the paper's order (AIME24, AIME25, AIME26, AMC, Minerva, OlympiadBench, MATH-500), then any
others alphabetically. The best value of each column is bolded when several rows are compared (as in the paper).
Left out: LaTeX output and significance markers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from da3po_megatron.data.benchmarks import BENCHMARKS

__all__ = ["load_result", "main", "render_table"]


def load_result(src: str | os.PathLike | dict) -> dict:
    """A result dict from a path (a results JSON, or a directory holding ``results.json``) or a dict (kept as is)."""
    if isinstance(src, dict):
        return src
    path = Path(src)
    if path.is_dir():
        path = path / "results.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such result file (written by `da3po eval --out DIR`)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg})") from None
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), dict):
        raise ValueError(f"{path}: not a `da3po eval` result (no 'benchmarks' object)")
    data.setdefault("name", path.parent.name if path.name == "results.json" else path.stem)
    return data


def _ordered_benchmarks(results: Sequence[dict]) -> list[str]:
    present: set[str] = set()
    for r in results:
        present.update(r["benchmarks"])
    known = [b for b in BENCHMARKS if b in present]
    return known + sorted(present - set(known))


def _title(bench: str) -> str:
    return BENCHMARKS[bench].title if bench in BENCHMARKS else bench


def _k_label(results: Sequence[dict], bench: str) -> str:
    ks = sorted({int(r["benchmarks"][bench]["k"]) for r in results if bench in r["benchmarks"]})
    return "k" if len(ks) != 1 else str(ks[0])


def _average(r: dict) -> dict[str, float] | None:
    if isinstance(r.get("average"), dict) and "avg_at_k" in r["average"]:
        return r["average"]
    scores = list(r["benchmarks"].values())
    if not scores:
        return None
    return {m: sum(s[m] for s in scores) / len(scores) for m in ("avg_at_k", "pass_at_k")}


def render_table(results: Sequence[str | os.PathLike | dict], names: Sequence[str] | None = None, ci: bool = False,
                 bold_best: bool = True, style: str = "combined") -> str:
    """Render result JSONs side by side as a Markdown table (values in percent, one decimal).

    ``style="combined"``: one column per benchmark with "avg / pass" cells (compact, like the paper's paired
    sub-columns); ``style="split"``: separate avg@k and pass@k columns. ``ci`` appends +-1.96 standard errors.
    ``names`` overrides the row labels (default: each result's "name").
    """
    if style not in ("combined", "split"):
        raise ValueError(f"render_table: style must be 'combined' or 'split', got {style!r}")
    loaded = [load_result(r) for r in results]
    if not loaded:
        raise ValueError("render_table: no results given")
    if names is not None and len(names) != len(loaded):
        raise ValueError(f"render_table: {len(names)} names for {len(loaded)} results")
    labels = list(names) if names is not None else [str(r.get("name", f"run{i}")) for i, r in enumerate(loaded)]
    benches = _ordered_benchmarks(loaded)

    # columns: (group title, k label, metric, per-row (value or None, se or None)); metrics alternate avg, pass
    cols: list[tuple[str, str, str, list[tuple[float | None, float | None]]]] = []
    for b in benches:
        k = _k_label(loaded, b)
        for metric in ("avg", "pass"):
            vals = []
            for r in loaded:
                s = r["benchmarks"].get(b)
                vals.append((s[f"{metric}_at_k"], s.get(f"{metric}_at_k_se")) if s else (None, None))
            cols.append((_title(b), k, metric, vals))
    averages = [_average(r) for r in loaded]
    for metric in ("avg", "pass"):
        cols.append(("Average", "k", metric, [(a[f"{metric}_at_k"], None) if a else (None, None) for a in averages]))

    def fmt(v: float | None, se: float | None, best: bool) -> str:
        if v is None:
            return "–"
        text = f"{100 * v:.1f}"
        if ci and se is not None:
            text += f" ± {100 * 1.96 * se:.1f}"
        return f"**{text}**" if best else text

    cells: list[list[str]] = [[] for _ in loaded]
    for _, _, _, vals in cols:
        present = [v for v, _ in vals if v is not None]
        top = max(present) if present else None
        compare = bold_best and len(present) > 1
        for i, (v, se) in enumerate(vals):
            cells[i].append(fmt(v, se, compare and v is not None and abs(v - top) < 1e-12))
    if style == "combined":
        headers = [f"{title} avg/pass@{k}" for title, k, _, _ in cols[0::2]]
        cells = [["–" if a == p == "–" else f"{a} / {p}" for a, p in zip(row[0::2], row[1::2])] for row in cells]
    else:
        headers = [f"{title} {metric}@{k}" for title, k, metric, _ in cols]

    lines = ["| Method | " + " | ".join(headers) + " |", "|" + "---|" * (len(headers) + 1)]
    for label, row in zip(labels, cells):
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    notes = []
    sets = {tuple(sorted(r["benchmarks"])) for r in loaded}
    if len(sets) > 1:
        notes.append("rows cover different benchmark sets: their averages are not directly comparable")
    if ci:
        notes.append("± is 1.96 standard errors over problems")
    if notes:
        lines.append("")
        lines.extend(f"_Note: {n}._" for n in notes)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m da3po_megatron.eval.tables",
                                description="Render `da3po eval` result JSONs side by side (paper Tables 1-2).")
    p.add_argument("results", nargs="+", help="results.json files or eval output directories")
    p.add_argument("--names", default=None, help="comma-separated row labels (default: each result's name)")
    p.add_argument("--ci", action="store_true", help="append ±1.96 standard errors")
    p.add_argument("--split", action="store_true", help="separate avg@k and pass@k columns")
    p.add_argument("--out", type=Path, default=None, help="write the table here as well as to stdout")
    args = p.parse_args(argv)
    try:
        table = render_table(args.results, names=args.names.split(",") if args.names else None, ci=args.ci,
                             style="split" if args.split else "combined")
    except (FileNotFoundError, ValueError) as e:
        print(f"tables: error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
