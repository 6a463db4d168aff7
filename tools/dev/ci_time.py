"""What the test suite's last run cost: the slowest tests and the seconds per file, from its recorded durations.

``scripts/run_tests.sh`` (``make test``, each part of ``.ci/run``) records every test phase's duration of each part
in ``.pytest_cache/da3po/durations-PART.json`` (tests/conftest.py; PART: suite, slurm, layouts, long, gpu_prep). This
prints, per part ("pass") and together:

- the slowest tests (setup + call + teardown: a module fixture's start-up is charged to the first test that uses it);
- the seconds per file, sorted, with the number of tests, and each file's share of the pass;
- under pytest-xdist, the busy seconds per worker against the pass's wall time (how evenly the files were spread).

    python tools/dev/ci_time.py [--dir .pytest_cache/da3po] [--top 25] [--compare OLD_DIR]

``--compare`` puts each file's seconds beside those of an earlier record (copy the directory away before a change).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def load(directory: Path) -> dict[str, list[dict]]:
    """``{pass name: [test phase records]}`` of every ``durations-*.json`` in ``directory``."""
    out = {}
    for f in sorted(directory.glob("durations-*.json")):
        try:
            out[f.stem.removeprefix("durations-")] = json.loads(f.read_text())["tests"]
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"error: {f}: not a durations record ({e})") from None
    return out


def per_test(records: list[dict]) -> dict[str, dict]:
    tests: dict[str, dict] = defaultdict(lambda: {"seconds": 0.0, "outcome": "passed", "worker": None})
    for r in records:
        t = tests[r["nodeid"]]
        t["seconds"] += r["seconds"]
        t["worker"] = t["worker"] or r.get("worker")
        if r["outcome"] != "passed" and (r["when"] == "call" or r["outcome"] == "failed"):
            t["outcome"] = r["outcome"]
    return dict(tests)


def per_file(tests: dict[str, dict]) -> dict[str, tuple[float, int]]:
    files: dict[str, list[float]] = defaultdict(list)
    for nodeid, t in tests.items():
        files[nodeid.split("::")[0]].append(t["seconds"])
    return {f: (sum(v), len(v)) for f, v in files.items()}


def report(passes: dict[str, list[dict]], top: int, old: dict[str, list[dict]] | None = None) -> list[str]:
    lines: list[str] = []
    all_tests: dict[str, dict] = {}
    for records in passes.values():
        all_tests.update(per_test(records))
    old_files = per_file({k: v for p in (old or {}).values() for k, v in per_test(p).items()}) if old else {}
    total = sum(t["seconds"] for t in all_tests.values())
    lines.append(f"{len(all_tests)} tests, {total:.0f} s of test time in all ({', '.join(passes)})")
    lines.append(f"\nslowest {top} tests (setup + call + teardown):")
    for nodeid, t in sorted(all_tests.items(), key=lambda kv: -kv[1]["seconds"])[:top]:
        flag = "" if t["outcome"] == "passed" else f"  [{t['outcome']}]"
        lines.append(f"  {t['seconds']:8.1f} s  {nodeid}{flag}")
    files = per_file(all_tests)
    lines.append("\nseconds per file:")
    head = f"  {'file':<48} {'tests':>5} {'seconds':>8} {'share':>6}" + (f" {'before':>8} {'change':>8}" if old else "")
    lines.append(head)
    for f, (sec, n) in sorted(files.items(), key=lambda kv: -kv[1][0]):
        row = f"  {f:<48} {n:>5} {sec:8.1f} {100 * sec / max(total, 1e-9):5.1f}%"
        if old:
            b = old_files.get(f, (0.0, 0))[0]
            row += f" {b:8.1f} {sec - b:+8.1f}"
        lines.append(row)
    for name, records in passes.items():
        workers: dict[str, float] = defaultdict(float)
        for t in per_test(records).values():
            workers[t["worker"] or "main"] += t["seconds"]
        if len(workers) > 1:
            busy = ", ".join(f"{w} {s:.0f} s" for w, s in sorted(workers.items()))
            lines.append(f"\n{name}: busy seconds per worker: {busy}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=".pytest_cache/da3po", help="where run_tests.sh recorded the durations")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--compare", default=None, help="an earlier record's directory, shown beside")
    args = ap.parse_args(argv)
    passes = load(Path(args.dir))
    if not passes:
        print(f"error: no durations-*.json in {args.dir}: run `make test` (scripts/run_tests.sh) first",
              file=sys.stderr)
        return 2
    old = load(Path(args.compare)) if args.compare else None
    print("\n".join(report(passes, args.top, old)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
