"""Two runs' metrics.jsonl compared exactly: is a change metric-neutral for a run it should not touch?

Every step both runs logged is compared on every metric both logged, leaving out the wall-clock ones
(``trainer.metrics.is_wall_clock``: times, throughput, memory). Metrics only one run has (a new counter) are listed,
not compared. Exit status 0 when every compared value is equal, 1 otherwise -- so "the demo's metrics are unchanged by
this commit" is one command:

    git worktree add /tmp/base <old-commit> && cd /tmp/base && PYTHONPATH=/tmp/base bash scripts/demo.sh <venv python>
    python tools/diff_metrics.py /tmp/base/runs/tiny_cpu_da3po/metrics.jsonl runs/tiny_cpu_da3po/metrics.jsonl

(``PYTHONPATH`` matters: the Ray actors import the package from it, not from the worktree's cwd.)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from da3po_megatron.trainer.observability.metrics import is_wall_clock


def load(path: Path) -> dict[int, dict[str, Any]]:
    """``{step: record}`` of one metrics.jsonl (the last record of a step wins, as a resumed run rewrites it)."""
    rows: dict[int, dict[str, Any]] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}: line {n}: not JSON ({e.msg})") from None
            rows[int(rec["step"])] = rec
    return rows


def same(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def diff(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Compared values, the differing ``(step, key, a, b)`` and the keys logged by one side only."""
    compared, differing, only_a, only_b = 0, [], set(), set()
    for step in sorted(set(a) & set(b)):
        x, y = a[step], b[step]
        only_a |= {k for k in x if k not in y and not is_wall_clock(k)}
        only_b |= {k for k in y if k not in x and not is_wall_clock(k)}
        for k in x:
            if k in y and k != "step" and not is_wall_clock(k):
                compared += 1
                if not same(x[k], y[k]):
                    differing.append((step, k, x[k], y[k]))
    return {"steps": sorted(set(a) & set(b)), "steps_a_only": sorted(set(a) - set(b)),
            "steps_b_only": sorted(set(b) - set(a)), "compared": compared, "differing": differing,
            "only_a": sorted(only_a), "only_b": sorted(only_b)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path, help="metrics.jsonl of the baseline run")
    ap.add_argument("b", type=Path, help="metrics.jsonl of the run to check")
    args = ap.parse_args(argv)
    d = diff(load(args.a), load(args.b))
    print(f"{len(d['steps'])} common steps, {d['compared']} values compared (wall-clock metrics left out): "
          f"{len(d['differing'])} differ")
    for step, k, x, y in d["differing"][:50]:
        print(f"  step {step} {k}: {x!r} -> {y!r}")
    for side in ("a", "b"):
        if d[f"steps_{side}_only"]:
            print(f"steps only in {side}: {d[f'steps_{side}_only']}")
        if d[f"only_{side}"]:
            print(f"metrics only in {side} ({len(d[f'only_{side}'])}): {', '.join(d[f'only_{side}'])}")
    return 1 if d["differing"] or d["steps_a_only"] or d["steps_b_only"] else 0


if __name__ == "__main__":
    sys.exit(main())
