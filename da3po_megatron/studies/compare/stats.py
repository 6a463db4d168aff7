"""Statistics of the comparison, pure functions over metrics rows (no I/O): a run's curve read at a step or at a
cumulative-sample budget by linear interpolation (never extrapolated), seed mean +- sample std (ddof=1), and the
difference-of-means screen at ``z`` standard errors that the verdict is built from. Why each choice is made is
described in :mod:`da3po_megatron.studies.compare`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def mean_std(values: Sequence[float]) -> tuple[float, float, int]:
    """(mean, sample std with ddof=1 -- 0 for one value, n) of the finite values; (nan, nan, 0) when none."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=np.float64)
    if v.size == 0:
        return math.nan, math.nan, 0
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0, int(v.size)


def interp_at(xs: Sequence[float], ys: Sequence[float], x: float) -> float | None:
    """Linear interpolation of the points (xs increasing) at ``x``; None outside [xs[0], xs[-1]] (no extrapolation).
    Repeated xs keep their last y (a step that generated nothing new)."""
    pts: dict[float, float] = {}
    for a, b in zip(xs, ys, strict=True):
        if a is not None and b is not None and math.isfinite(a) and math.isfinite(b):
            pts[float(a)] = float(b)
    if not pts:
        return None
    px = sorted(pts)
    if x < px[0] - 1e-9 or x > px[-1] + 1e-9:
        return None
    return float(np.interp(x, px, [pts[a] for a in px]))


def trailing_mean(ys: Sequence[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at each position (fewer at the start)."""
    if window < 1:
        raise ValueError(f"trailing_mean: window must be >= 1, got {window}")
    out = []
    for i in range(len(ys)):
        chunk = ys[max(0, i - window + 1): i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def _x_of(row: dict, x_key: str) -> float | None:
    if x_key == "step":
        return float(row["step"])
    v = row.get(x_key)
    if isinstance(v, int | float) and not isinstance(v, bool):
        return float(v)
    return 0.0 if row.get("step") == 0 else None  # the step-0 record (starting policy): nothing generated yet


def series(rows: Sequence[dict], key: str, x_key: str = "step", window: int = 1) -> tuple[list[float], list[float]]:
    """(x, y) of ``key`` over the rows that have it (and x); ``window`` > 1 applies :func:`trailing_mean` to y."""
    xs, ys = [], []
    for r in rows:
        y, x = r.get(key), _x_of(r, x_key)
        if isinstance(y, int | float) and not isinstance(y, bool) and math.isfinite(y) and x is not None:
            xs.append(x)
            ys.append(float(y))
    return xs, (trailing_mean(ys, window) if window > 1 else ys)


def curve_at(rows: Sequence[dict], key: str, x: float, x_key: str = "step", window: int = 1) -> float | None:
    """``key`` of one run at ``x`` (a step or a cumulative-sample budget), interpolated; None if not reached."""
    xs, ys = series(rows, key, x_key, window)
    return interp_at(xs, ys, x)


@dataclass
class Point:
    """Where a table is read: at a step (x_key='step') or at a cumulative-sample budget."""

    name: str
    x_key: str
    x: float


def seed_values(grid: dict[str, dict[int, list[dict]]], method: str, key: str, pt: Point,
                window: int = 1) -> list[float]:
    """``key`` of each seed of ``method`` at ``pt`` (seeds that did not reach it are left out): the sample that
    :func:`mean_std` and :func:`compare_means` summarise."""
    vals = []
    for rows in grid.get(method, {}).values():
        v = curve_at(rows, key, pt.x, pt.x_key, window)
        if v is not None:
            vals.append(v)
    return vals


@dataclass
class Comparison:
    """Difference of seed means a - b with its standard error and the z-screen's outcome."""

    a: str
    b: str
    diff: float
    se: float
    n_a: int
    n_b: int
    outcome: str  # "better" | "worse" | "no significant difference" | "undetermined"


def compare_means(a_label: str, a: Sequence[float], b_label: str, b: Sequence[float], z: float = 2.0) -> Comparison:
    """``a`` vs ``b`` (per-seed values): significant iff |mean_a - mean_b| > z * sqrt(s_a^2/n_a + s_b^2/n_b).
    Fewer than 2 seeds on either side: "undetermined" (no variance estimate)."""
    ma, sa, na = mean_std(a)
    mb, sb, nb = mean_std(b)
    if na == 0 or nb == 0:
        return Comparison(a_label, b_label, math.nan, math.nan, na, nb, "undetermined")
    diff = ma - mb
    if na < 2 or nb < 2:
        return Comparison(a_label, b_label, diff, math.nan, na, nb, "undetermined")
    se = math.sqrt(sa**2 / na + sb**2 / nb)
    if abs(diff) > z * se and diff != 0:
        outcome = "better" if diff > 0 else "worse"
    else:
        outcome = "no significant difference"
    return Comparison(a_label, b_label, diff, se, na, nb, outcome)


def paired(a: dict[int, float], b: dict[int, float]) -> tuple[float, float, int]:
    """Mean over the seeds both have of a[s] - b[s], its standard error sd/sqrt(n) (ddof 1; nan below 2 seeds), n."""
    d = [a[s] - b[s] for s in sorted(set(a) & set(b)) if math.isfinite(a[s]) and math.isfinite(b[s])]
    m, sd, n = mean_std(d)
    return m, (sd / math.sqrt(n) if n >= 2 else math.nan), n


T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}  # two-sided 95 %, n-1 dof


def significant(m: float, se: float, n: int) -> bool:
    """|m| beyond Student's t (two-sided 95 %, n - 1 degrees of freedom) standard errors; 2.0 from 10 seeds on."""
    return n >= 2 and math.isfinite(se) and se > 0 and abs(m) > T95.get(n - 1, 2.0) * se
