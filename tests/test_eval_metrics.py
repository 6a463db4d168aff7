"""avg@k and unbiased pass@k (Chen et al. 2021) against brute force; standard errors; benchmark averaging."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from da3po_megatron.eval.metrics import (
    average_scores,
    avg_at_k,
    pass_at_k,
    per_problem_pass_at_k,
    score_benchmark,
    standard_error,
)


def _brute_force_pass_at_k(correct: list[bool], k: int) -> float:
    """Fraction of all k-subsets of the samples that contain at least one correct sample."""
    subsets = list(itertools.combinations(range(len(correct)), k))
    return sum(any(correct[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_pass_at_k_equals_brute_force_enumeration_of_all_k_subsets(n):
    for c in range(n + 1):
        correct = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_brute_force_pass_at_k(correct, k), abs=1e-12), (n, c, k)


def test_pass_at_k_equals_closed_form_binomial_ratio():
    for n, c, k in [(32, 3, 8), (32, 1, 32), (16, 0, 4), (100, 7, 10), (8, 8, 8)]:
        expected = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_pass_at_k_is_vectorised_over_problems_and_matches_scalar_calls():
    rng = np.random.default_rng(0)
    n = rng.integers(8, 40, size=50)
    c = rng.integers(0, 9, size=50)
    got = pass_at_k(n, c, 8)
    assert isinstance(got, np.ndarray) and got.shape == (50,)
    assert np.allclose(got, [pass_at_k(int(a), int(b), 8) for a, b in zip(n, c)], rtol=0, atol=1e-14)


def test_pass_at_k_stays_finite_for_large_n_where_binomials_overflow_floats():
    # C(2000, 1000) ~ 1e600 overflows float64; the product form must not.
    got = pass_at_k(2000, 3, 1000)
    expected = 1 - math.comb(1997, 1000) / math.comb(2000, 1000)  # exact integers in Python
    assert math.isfinite(got) and got == pytest.approx(expected, rel=1e-12)


def test_pass_at_1_is_the_fraction_correct_and_pass_at_n_is_any_correct():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 1, 10) == 1.0
    assert pass_at_k(10, 0, 10) == 0.0


@pytest.mark.parametrize("n,c,k,msg", [(4, 5, 1, "0 <= c <= n"), (4, -1, 1, "0 <= c <= n"), (4, 1, 5, "n >= k"),
                                       (4, 1, 0, "k must be >= 1")])
def test_pass_at_k_rejects_impossible_inputs_with_a_clear_message(n, c, k, msg):
    with pytest.raises(ValueError, match=msg):
        pass_at_k(n, c, k)


def test_avg_at_k_is_the_mean_over_problems_of_per_problem_accuracy():
    m = [[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    assert avg_at_k(m) == pytest.approx((0.25 + 1 + 0) / 3)
    assert avg_at_k(np.array(m, dtype=bool)) == pytest.approx((0.25 + 1 + 0) / 3)


def test_avg_at_k_rejects_ragged_or_non_binary_matrices():
    with pytest.raises(ValueError, match="ragged"):
        avg_at_k([[1, 0], [1]])
    with pytest.raises(ValueError, match="0/1"):
        avg_at_k([[0.5, 1.0]])


def test_score_benchmark_reports_avg_pass_and_standard_errors_over_problems():
    m = np.array([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 0, 1]])
    s = score_benchmark("toy", m)
    assert s.k == 4 and s.num_problems == 4
    assert s.avg_at_k == pytest.approx(np.mean([0.25, 1, 0, 0.5]))
    assert s.pass_at_k == pytest.approx(0.75)  # 3 of 4 problems have a correct sample among all 4
    assert s.avg_at_k_se == pytest.approx(np.std([0.25, 1, 0, 0.5], ddof=1) / 2)
    assert s.pass_at_k_se == pytest.approx(np.std([1, 1, 0, 1], ddof=1) / 2)
    d = s.to_dict()
    assert d["avg_at_k_ci95"] == pytest.approx(1.96 * s.avg_at_k_se)
    # pass@2 from 4 samples: per-problem 1 - C(4-c,2)/C(4,2)
    s2 = score_benchmark("toy", m, k=2)
    expected = np.mean([1 - math.comb(3, 2) / 6, 1.0, 0.0, 1 - math.comb(2, 2) / 6])
    assert s2.pass_at_k == pytest.approx(expected) and s2.avg_at_k == pytest.approx(s.avg_at_k)


def test_standard_error_of_a_single_problem_is_zero():
    assert standard_error([0.3]) == 0.0


def test_average_weighs_each_benchmark_once_regardless_of_size():
    big = score_benchmark("big", np.ones((500, 2)))
    small = score_benchmark("small", np.zeros((30, 2)))
    avg = average_scores({"big": big, "small": small})
    assert avg["avg_at_k"] == pytest.approx(0.5) and avg["pass_at_k"] == pytest.approx(0.5)
    assert avg["num_benchmarks"] == 2


def test_per_problem_pass_at_k_broadcasts_a_scalar_n():
    assert np.allclose(per_problem_pass_at_k(4, [0, 1, 4], 4), [0, 1, 1])
