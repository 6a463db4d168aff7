"""Where a grid's held-out evaluation lives in ``metrics.jsonl``, whatever the benchmark: the report and the figures
read every held-out number through one :class:`HeldOutKeys`, discovered from the logs (pure functions, no I/O).

Two producers write held-out metrics during training (``trainer/evaluation.py``):

- the synthetic task: ``eval/synthetic/avg@<k>`` and ``eval/synthetic/greedy`` overall, and the same per difficulty
  bucket as ``eval/synthetic/bucket<n>/...``. Groups are the buckets (``b1``, ``b2``, ...);
- math benchmarks (``eval.benchmarks: [aime24, amc, math500, ...]``, ``eval.runner.flat_metrics``):
  ``eval/<bench>/avg@k`` and ``eval/<bench>/pass@k`` per benchmark (the value of k in ``eval/<bench>/k``) and their
  mean ``eval/avg/avg@k`` / ``eval/avg/pass@k``. Groups are the benchmarks; the overall value is ``eval/avg/...``
  (or the only benchmark's own keys when there is one).

The synthetic task wins when both are present (it is what the CPU study trains on); ``prefer`` picks the other.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

_SYN_AVG = re.compile(r"^eval/synthetic/avg@(\d+)$")
_SYN_BUCKET = re.compile(r"^eval/synthetic/bucket(\d+)/avg@(\d+)$")
_BENCH_AVG = re.compile(r"^eval/([^/]+)/avg@k$")
_TRAIN_BUCKET = re.compile(r"^gen/acc_bucket/(\d+)$")


@dataclass(frozen=True)
class HeldOutKeys:
    """The metric keys of one grid's held-out evaluation.

    ``names`` = (primary, secondary) display names, e.g. ("avg@4", "greedy") or ("avg@32", "pass@32");
    ``overall`` = their overall keys; ``groups`` = {column label: (primary key, secondary key)} in display order;
    ``group_kind`` = "bucket" or "benchmark" (used in sentences); ``source`` = "synthetic" or "benchmarks".
    A secondary key may be None (no such metric logged).
    """

    source: str
    names: tuple[str, str]
    overall: tuple[str, str | None]
    groups: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    group_kind: str = "bucket"

    @property
    def metric(self) -> str:
        return self.names[0]

    def key(self, which: int, group: str | None = None) -> str | None:
        """The key of metric ``which`` (0 = primary, 1 = secondary), overall or for ``group``."""
        return (self.overall if group is None else self.groups[group])[which]


def discover(rows: Iterable[Mapping], prefer: str | None = None) -> HeldOutKeys | None:
    """Find the held-out keys present in ``rows`` (every row of every run). Returns None when no run logged a
    held-out evaluation. ``prefer`` = "synthetic" or "benchmarks" chooses when both are present."""
    keys: set[str] = set()
    ks: dict[str, float] = {}
    for r in rows:
        keys.update(r)
        for k, v in r.items():
            if k.endswith("/k") and isinstance(v, int | float):
                ks[k] = float(v)
    syn = _synthetic(keys)
    bench = _benchmarks(keys, ks)
    if prefer == "benchmarks" and bench:
        return bench
    return syn or bench


def _synthetic(keys: set[str]) -> HeldOutKeys | None:
    avg = [int(m.group(1)) for k in keys if (m := _SYN_AVG.match(k))]
    if not avg:
        return None
    k = max(avg)
    metric = f"avg@{k}"
    second = "eval/synthetic/greedy" if "eval/synthetic/greedy" in keys else None
    buckets = sorted({int(m.group(1)) for key in keys if (m := _SYN_BUCKET.match(key)) and int(m.group(2)) == k})
    groups = {f"b{b}": (f"eval/synthetic/bucket{b}/{metric}",
                        f"eval/synthetic/bucket{b}/greedy" if f"eval/synthetic/bucket{b}/greedy" in keys else None)
              for b in buckets}
    return HeldOutKeys("synthetic", (metric, "greedy"), (f"eval/synthetic/{metric}", second), groups, "bucket")


def _benchmarks(keys: set[str], ks: Mapping[str, float]) -> HeldOutKeys | None:
    benches = sorted(m.group(1) for key in keys if (m := _BENCH_AVG.match(key)) and m.group(1) not in
                     ("avg", "synthetic"))
    if not benches:
        return None
    kvals = {ks[f"eval/{b}/k"] for b in benches if f"eval/{b}/k" in ks}
    kk = f"{int(next(iter(kvals)))}" if len(kvals) == 1 else "k"  # mixed k (avg@32 and avg@8 benchmarks): "k"

    def pair(prefix: str) -> tuple[str, str | None]:
        second = f"{prefix}/pass@k"
        return f"{prefix}/avg@k", second if second in keys else None

    groups = {b: pair(f"eval/{b}") for b in benches}
    if len(benches) == 1:  # one benchmark: it is the overall value, no per-group columns
        return HeldOutKeys("benchmarks", (f"avg@{kk}", f"pass@{kk}"), groups[benches[0]], {}, "benchmark")
    return HeldOutKeys("benchmarks", (f"avg@{kk}", f"pass@{kk}"), pair("eval/avg"), groups, "benchmark")


def train_buckets(rows: Iterable[Mapping]) -> list[int]:
    """Difficulty buckets of the training accuracy (``gen/acc_bucket/<n>``; logged for data with a bucket field)."""
    return sorted({int(m.group(1)) for r in rows for k in r if (m := _TRAIN_BUCKET.match(k))})
