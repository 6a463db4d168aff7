"""tools/studies/selection_report.py (issue 59): the ceiling 1 / (1 - w) per window, the share of it each rule
reached, and runs from several starting policies paired by (warm-up, seed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(d: Path, seed: int, decoded: float, kept: float, steps: int = 4) -> Path:
    run = d / f"seed{seed}"
    run.mkdir(parents=True)
    rows = [{"step": s, "rollout/decoded_tokens": decoded, "rollout/kept_tokens": kept,
             "rollout/wasted_tokens": decoded - kept, "dynamic_sampling/generated_groups": 4.0,
             "batch/group_frac_bucket/1": 0.5, "batch/group_frac_bucket/2": 0.5} for s in range(1, steps + 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_the_report_prints_the_ceiling_per_window_and_the_share_of_it_each_rule_reached(tmp_path):
    # reference: 4 decoded per trained token (w = 0.75, ceiling 4x) from two warm-ups; the rule: 2 per trained token
    # (saving 2x) -> it avoided (1 - 1/2) / 0.75 = 67 % of the wasted tokens
    ref = [_run(tmp_path / f"w{i}" / "none", 0, 400.0, 100.0) for i in range(2)]
    rule = [_run(tmp_path / f"w{i}" / "rule", 0, 200.0, 100.0) for i in range(2)]
    out = subprocess.run([sys.executable, str(ROOT / "tools/studies/selection_report.py"),
                          "none=" + ",".join(map(str, ref)), "rule=" + ",".join(map(str, rule)), "--window", "2"],
                         capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert "| 1-2 | 0.750 | 4.00x |" in out and "| 3-4 | 0.750 | 4.00x |" in out and "| all | 0.750 | 4.00x |" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("| rule | 2 |"))   # two runs: one per warm-up
    assert "2.00 +- 0.00x | 67 +- 0 |" in line
