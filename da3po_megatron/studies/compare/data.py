"""What a comparison report reads, prepared once: :class:`ReportData` (the runs' rows, the held-out keys and groups,
the hard groups) and where every table is read (:func:`choose_points`: the last common eval step; the largest common
sample budget and half of it). Below both :mod:`~da3po_megatron.studies.compare.report` (tables, verdict,
``report.md``) and :mod:`~da3po_megatron.studies.compare.plots` (figures), which import it. What the report holds and
why is described in :mod:`da3po_megatron.studies.compare`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from da3po_megatron.studies.compare.grid import Method
from da3po_megatron.studies.compare.keys import HeldOutKeys, discover, train_buckets
from da3po_megatron.studies.compare.stats import Point, mean_std


@dataclass
class ReportData:
    """Everything the tables, verdict and figures read: the runs' rows, the held-out keys (None: no held-out eval in
    the logs), the held-out groups (difficulty buckets or benchmarks) and the hard ones, the training-accuracy
    buckets, and the points (equal steps, equal-sample budgets) chosen once so that every table of a report is read at
    the same places."""

    methods: list[Method]
    grid: dict[str, dict[int, list[dict]]]
    keys: HeldOutKeys | None
    groups: list[str]
    hard: list[str]
    start_acc: dict[str, float]
    step_point: Point | None
    sample_points: list[Point]
    window: int
    z: float
    tau: float
    hard_rule: str = ""
    train_buckets: list[int] = field(default_factory=list)

    @property
    def metric(self) -> str:
        return self.keys.metric if self.keys else "avg@k"

    @property
    def kind(self) -> str:
        return self.keys.group_kind if self.keys else "bucket"


def _eval_steps(rows: Sequence[dict], key: str) -> set[int]:
    return {int(r["step"]) for r in rows if isinstance(r.get(key), int | float)}


def choose_points(grid, key: str | None) -> tuple[Point | None, list[Point]]:
    """The equal-steps point (the last step where every run has ``key``) and the equal-samples budgets (the largest
    budget every run reached, and half of it)."""
    all_rows = [rows for runs in grid.values() for rows in runs.values()]
    if not all_rows:
        return None, []
    step_pt = None
    if key:
        common = set.intersection(*(_eval_steps(rows, key) for rows in all_rows))
        common.discard(0)
        if common:
            step_pt = Point(f"step {max(common)}", "step", float(max(common)))
    if step_pt is None:
        s = min(int(rows[-1]["step"]) for rows in all_rows)
        step_pt = Point(f"step {s}", "step", float(s)) if s > 0 else None
    finals = [max((r["gen/cumulative_samples"] for r in rows if isinstance(r.get("gen/cumulative_samples"),
                                                                          int | float)), default=0.0)
              for rows in all_rows]
    budget = min(finals)
    pts = [Point(f"{b:,.0f} samples", "gen/cumulative_samples", float(b)) for b in (budget / 2, budget) if b > 0]
    return step_pt, pts


def prepare(methods: Sequence[Method], grid: dict[str, dict[int, list[dict]]], window: int = 5, z: float = 2.0,
            tau: float = 0.5, start_acc: dict[str, float] | None = None, keys: HeldOutKeys | None = None,
            prefer: str | None = None) -> ReportData:
    """Find the held-out keys (``keys``, default: discovered from the logs, ``prefer`` as in
    :func:`~da3po_megatron.studies.compare.keys.discover`), choose the table points and the hard groups;
    ``start_acc`` (the starting policy's held-out primary metric per group label) defaults to the runs' step-0 evals."""
    all_rows = [r for runs in grid.values() for rows in runs.values() for r in rows]
    keys = keys or discover(all_rows, prefer)
    groups = list(keys.groups) if keys else []
    step_pt, sample_pts = choose_points(grid, keys.key(0) if keys else None)
    if start_acc is None:  # the starting policy's held-out metric per group: the step-0 eval, averaged over runs
        start_acc = {}
        for g in groups:
            vals = [r.get(keys.key(0, g)) for runs in grid.values() for rows in runs.values()
                    for r in rows[:1] if r.get("step") == 0]
            m, _, n = mean_std([v for v in vals if isinstance(v, int | float)])
            if n:
                start_acc[g] = m
    kind = keys.group_kind if keys else "bucket"
    hard = [g for g in groups if g in start_acc and start_acc[g] < tau]
    hard_rule = f"starting held-out {keys.metric if keys else 'avg@k'} < tau = {tau:g}, where DAA acts"
    if not hard and start_acc:  # a strong starting policy: the hardest quarter of the groups (at least one)
        n = max(1, len(start_acc) // 4)
        lowest = set(sorted(start_acc, key=lambda g: start_acc[g])[:n])
        hard = [g for g in groups if g in lowest]
        hard_rule = (f"no {kind} starts below tau = {tau:g}, so the {n} with the lowest starting held-out "
                     f"{keys.metric}; DAA acts on their prompts with p_hat < tau")
    return ReportData(list(methods), grid, keys, groups, hard, start_acc, step_pt, sample_pts, window, z, tau,
                      hard_rule, train_buckets(all_rows))
