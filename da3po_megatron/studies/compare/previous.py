"""A new comparison report next to a previous one: the held-out numbers of the methods both grids ran, side by side,
at equal steps and at the full equal-samples budget, and the two verdicts' DAA-vs-baseline comparisons, read from the
two reports' ``summary.json`` (what :func:`~da3po_megatron.studies.compare.report.build_report` writes). Pure: no
runs are read, nothing is recomputed, so the previous report's numbers appear exactly as it published them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _pct(ms: Any) -> str:
    if not isinstance(ms, list | tuple) or len(ms) < 3 or not ms[2] or not math.isfinite(ms[0]):
        return "--"
    return f"{100 * ms[0]:.1f} ± {100 * ms[1]:.1f}"


def _points(summary: dict) -> tuple[str | None, str | None]:
    """(equal-steps table name, largest equal-samples table name) of a summary."""
    steps = [k for k, t in summary["tables"].items() if t.get("x_key") == "step"]
    samples = sorted((t["x"], k) for k, t in summary["tables"].items() if t.get("x_key") != "step")
    return (steps[0] if steps else None), (samples[-1][1] if samples else None)


def _own(summary: dict) -> dict[tuple[str, str], dict]:
    """{(point kind "steps"|"samples", subset): {method: comparison with its own baseline}} of a summary."""
    out: dict[tuple[str, str], dict] = {}
    steps, _ = _points(summary)
    for key, cs in summary.get("verdict", {}).get("comparisons", {}).items():
        point, subset = key.rsplit("|", 1)
        kind = "steps" if point == steps else "samples"
        for c in cs:
            out.setdefault((kind, subset), {}).setdefault(c["a"], c)  # the first comparison is with its baseline
    return out


def _outcome(c: dict | None) -> str:
    if c is None:
        return "--"
    word = {"better": "**better**", "worse": "**worse**", "no significant difference": "n.s."}.get(c["outcome"],
                                                                                                   c["outcome"])
    return f"{100 * c['diff']:+.1f} ({word})"


def side_by_side(previous: dict, current: dict, previous_name: str = "previous", current_name: str = "this run"
                 ) -> str:
    """Markdown: held-out primary metric (all, hard) per method in both reports at equal steps and at the largest
    equal-samples budget, then each DAA method's difference from its own baseline in both verdicts."""
    methods = [m for m in current["tables"][next(iter(current["tables"]))]["heldout"]
               if m in previous["tables"][next(iter(previous["tables"]))]["heldout"]]
    metric = current.get("metric", "avg@k")
    lines = []
    for kind, (p_pt, c_pt) in (("equal steps", (_points(previous)[0], _points(current)[0])),
                               ("equal generated samples", (_points(previous)[1], _points(current)[1]))):
        if not (p_pt and c_pt):
            continue
        lines += [f"Held-out {metric} (%) at {kind}: {previous_name} at {p_pt}, {current_name} at {c_pt}.", "",
                  f"| method | all ({previous_name}) | all ({current_name}) | hard ({previous_name}) | "
                  f"hard ({current_name}) |", "|---|---|---|---|---|"]
        for m in methods:
            p, c = previous["tables"][p_pt]["heldout"].get(m, {}), current["tables"][c_pt]["heldout"].get(m, {})
            lines.append(f"| {m} | {_pct(p.get('all'))} | {_pct(c.get('all'))} | {_pct(p.get('hard'))} | "
                         f"{_pct(c.get('hard'))} |")
        lines.append("")
    p_own, c_own = _own(previous), _own(current)
    rows = []
    for kind, subset in (("steps", "all"), ("steps", "hard"), ("samples", "all"), ("samples", "hard")):
        for m, c in c_own.get((kind, subset), {}).items():
            p = p_own.get((kind, subset), {}).get(m)
            rows.append(f"| {m} vs {c['b']} | equal {kind}, {subset} | {_outcome(p)} | {_outcome(c)} |")
    if rows:
        lines += ["Each DAA method against its own baseline (difference of seed means in points, and the 2-SE "
                  "screen):", "", f"| comparison | where | {previous_name} | {current_name} |", "|---|---|---|---|",
                  *rows, ""]
    pc, cc = (s.get("verdict", {}).get("own_baseline_counts", {}) for s in (previous, current))
    if pc and cc:
        lines.append(f"Own-baseline comparisons significantly better / worse / not different: {previous_name} "
                     f"{pc.get('better', 0)} / {pc.get('worse', 0)} / {pc.get('no significant difference', 0)}; "
                     f"{current_name} {cc.get('better', 0)} / {cc.get('worse', 0)} / "
                     f"{cc.get('no significant difference', 0)}.")
    return "\n".join(lines)


def load_summary(report_dir: str | Path) -> dict:
    path = Path(report_dir) / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no summary.json (a report directory written by tools/compare_algorithms.py)")
    return json.loads(path.read_text())
