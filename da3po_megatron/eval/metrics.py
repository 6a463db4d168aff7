"""avg@k and the unbiased pass@k estimator, per benchmark and averaged, with standard errors.

What the paper reports (Tables 1-2): for each benchmark, k responses are sampled per problem at temperature 1.0 and
top-p 0.95 (k = 32 for AIME24/25/26 and AMC, k = 8 for Minerva, OlympiadBench and MATH-500), and two numbers are given:

- **avg@k**: the mean accuracy over the k samples of a problem, averaged over problems
  (``mean_j c_j / n_j``; with n = k this is the usual "mean@k" / "pass@1 estimated from k samples").
- **pass@k**: the probability that at least one of k samples is correct, estimated without bias from n >= k samples
  with c correct (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", Eq. 1):

      pass@k = E_problems[ 1 - C(n - c, k) / C(n, k) ]

  computed in the numerically stable product form ``1 - prod_{i = n-c+1}^{n} (1 - k / i)`` (the same rewriting the
  Codex paper's reference code uses), which never forms a large binomial coefficient. When n - c < k every k-subset
  holds a correct sample and the estimate is exactly 1.

Confidence intervals (deliberately cheap and bootstrap-free): both metrics are means over problems of a per-problem
score s_j in [0, 1] (c_j / n_j for avg@k, the per-problem pass@k estimate for pass@k). We report the standard error of
that mean, ``SE = std(s_j, ddof=1) / sqrt(P)`` over the P problems, and ``ci95 = 1.96 * SE``. Treating problems as a
random draw from a population of problems, this SE covers both the sampling noise of the k responses and the
problem-to-problem spread (it is the "clustered" standard error of Miller 2024, "Adding Error Bars to Evals"). It is
not a bound for tiny P (AIME has P = 30: read +-1.96 SE as approximate); with P = 1 it is reported as 0.

Left out on purpose: majority voting (maj@k / cons@k), per-difficulty breakdowns and paired-difference tests between
checkpoints; they are easy to add on top of the correctness matrices kept in the runner's JSON output.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

__all__ = [
    "BenchmarkScore",
    "avg_at_k",
    "average_scores",
    "pass_at_k",
    "per_problem_pass_at_k",
    "score_benchmark",
    "standard_error",
]


def per_problem_pass_at_k(
    n: np.ndarray | Sequence[int] | int, c: np.ndarray | Sequence[int] | int, k: int
) -> np.ndarray:
    """Unbiased pass@k estimate for each problem: ``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021, Eq. 1).

    ``n`` (samples drawn) and ``c`` (correct among them) are integers or integer arrays of the same shape (one entry per
    problem; a scalar broadcasts). Requires ``0 <= c <= n`` and ``1 <= k <= n`` for every problem. Returns float64.
    """
    n_arr = np.asarray(n, dtype=np.int64)
    c_arr = np.asarray(c, dtype=np.int64)
    n_arr, c_arr = np.broadcast_arrays(n_arr, c_arr)
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool):
        raise TypeError(f"pass_at_k: k must be an int, got {type(k).__name__}")
    if k < 1:
        raise ValueError(f"pass_at_k: k must be >= 1, got k={k}")
    if np.any(c_arr < 0) or np.any(c_arr > n_arr):
        bad = int(np.flatnonzero((c_arr < 0) | (c_arr > n_arr))[0])
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got c={int(c_arr.flat[bad])}, n={int(n_arr.flat[bad])} "
                         f"(problem index {bad})")
    if np.any(n_arr < k):
        bad = int(np.flatnonzero(n_arr < k)[0])
        raise ValueError(f"pass_at_k: need n >= k samples per problem, got n={int(n_arr.flat[bad])} < k={k} "
                         f"(problem index {bad})")
    # Vectorised over problems: a [problems x max_n] table of factors (1 - k / i), set to 1 outside n-c < i <= n.
    flat_n, flat_c = n_arr.reshape(-1), c_arr.reshape(-1)
    max_n = int(flat_n.max()) if flat_n.size else 0
    i = np.arange(1, max_n + 1, dtype=np.float64)[None, :]
    in_range = (i > (flat_n - flat_c)[:, None]) & (i <= flat_n[:, None])
    factors = np.where(in_range, 1.0 - k / np.maximum(i, k), 1.0)  # max(i, k) only guards the masked-out entries
    out = 1.0 - np.prod(factors, axis=1)
    out[(flat_n - flat_c) < k] = 1.0  # every k-subset contains a correct sample
    out = out.reshape(n_arr.shape)
    return out


def pass_at_k(n: np.ndarray | Sequence[int] | int, c: np.ndarray | Sequence[int] | int, k: int) -> float | np.ndarray:
    """The stable API: unbiased pass@k for one problem (scalars -> float) or per problem (arrays -> array).

    ``pass_at_k(n, c, k) = 1 - C(n - c, k) / C(n, k)``, the chance that a uniformly random k-subset of the n samples
    holds at least one of the c correct ones. Average the returned array over problems for a benchmark's pass@k.
    """
    out = per_problem_pass_at_k(n, c, k)
    if np.ndim(n) == 0 and np.ndim(c) == 0:
        return float(out)
    return out


def avg_at_k(correct_matrix: np.ndarray | Sequence[Sequence[bool]]) -> float:
    """avg@k: mean over problems of the fraction of correct samples (rows = problems, columns = the k samples)."""
    m = _as_matrix(correct_matrix)
    return float(m.mean(axis=1).mean())


def standard_error(values: np.ndarray | Sequence[float]) -> float:
    """Standard error of the mean of per-problem scores: ``std(ddof=1) / sqrt(P)``; 0 for a single problem."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if v.size <= 1:
        return 0.0
    return float(v.std(ddof=1) / math.sqrt(v.size))


@dataclass
class BenchmarkScore:
    """One benchmark's result at a given k (fractions in [0, 1]; the tables print percentages)."""

    benchmark: str
    k: int
    num_problems: int
    avg_at_k: float
    pass_at_k: float
    avg_at_k_se: float
    pass_at_k_se: float

    def to_dict(self) -> dict:
        d = asdict(self)
        d["avg_at_k_ci95"] = 1.96 * self.avg_at_k_se
        d["pass_at_k_ci95"] = 1.96 * self.pass_at_k_se
        return d


def score_benchmark(name: str, correct_matrix: np.ndarray | Sequence[Sequence[bool]], k: int | None = None
                    ) -> BenchmarkScore:
    """avg@k and pass@k (+ standard errors) of one benchmark from its [problems x samples] correctness matrix.

    ``k`` defaults to the number of samples per problem n; a smaller k (pass@k from n > k samples) is allowed. avg@k is
    always the mean over all n samples (it is the unbiased estimate of pass@1 whatever k is).
    """
    m = _as_matrix(correct_matrix, what=f"benchmark {name!r}")
    n = m.shape[1]
    k = n if k is None else int(k)
    per_avg = m.mean(axis=1)
    per_pass = per_problem_pass_at_k(np.full(m.shape[0], n), m.sum(axis=1), k)
    return BenchmarkScore(
        benchmark=name, k=k, num_problems=int(m.shape[0]),
        avg_at_k=float(per_avg.mean()), pass_at_k=float(per_pass.mean()),
        avg_at_k_se=standard_error(per_avg), pass_at_k_se=standard_error(per_pass),
    )


def average_scores(scores: Mapping[str, BenchmarkScore] | Sequence[BenchmarkScore]) -> dict[str, float]:
    """The "Average" column of Tables 1-2: the unweighted mean over benchmarks of avg@k and of pass@k.

    Each benchmark counts once whatever its size (AIME's 30 problems weigh as much as MATH-500's 500), as in the paper.
    """
    items = list(scores.values()) if isinstance(scores, Mapping) else list(scores)
    if not items:
        raise ValueError("average_scores: no benchmark scores to average")
    return {
        "avg_at_k": float(np.mean([s.avg_at_k for s in items])),
        "pass_at_k": float(np.mean([s.pass_at_k for s in items])),
        "num_benchmarks": len(items),
    }


def _as_matrix(correct_matrix: np.ndarray | Sequence[Sequence[bool]], what: str = "correct_matrix") -> np.ndarray:
    try:
        m = np.asarray(correct_matrix, dtype=np.float64)
    except ValueError as e:  # ragged rows
        raise ValueError(f"{what}: every problem needs the same number of samples (ragged rows): {e}") from None
    if m.ndim != 2 or m.shape[0] == 0 or m.shape[1] == 0:
        raise ValueError(f"{what}: expected a non-empty [problems x samples] matrix, got shape {m.shape}")
    if np.any((m != 0) & (m != 1)):
        raise ValueError(f"{what}: entries must be 0/1 (or bool) correctness flags")
    return m
