"""Thm 3.1 / Cor 3.2: closed forms, the paper's remark numbers, exact binomial sums and Monte Carlo with the real
Eq. 3 advantages, the CLI and the figure script."""

import math
import os
import subprocess
import sys

import pytest
import torch

from da3po_megatron.algorithms import (
    alpha_minus,
    alpha_plus,
    exact_conditional_advantages,
    gamma,
    monte_carlo_conditional_advantages,
)
from da3po_megatron.algorithms.theory import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_paper_remark_numbers():
    # paper remark after Thm 3.1: G=8, p=0.1 -> alpha- ~ 1.92, gamma ~ 0.52; G=16, p=0.1 -> alpha- ~ 1.26, gamma ~ 0.79
    assert alpha_minus(0.1, 8) == pytest.approx(1.92, abs=0.005)
    assert gamma(0.1, 8) == pytest.approx(0.52, abs=0.005)
    assert alpha_minus(0.1, 16) == pytest.approx(1.26, abs=0.005)
    assert gamma(0.1, 16) == pytest.approx(0.79, abs=0.005)
    assert alpha_plus(0.1, 8) == pytest.approx(1.0, abs=1e-6)


def test_gamma_below_one_iff_p_below_half_and_symmetry():
    p = torch.linspace(0.01, 0.99, 99, dtype=torch.float64)
    for G in (2, 4, 8, 16, 32):
        g = gamma(p, G)
        if G > 2:
            assert ((g < 1) == (p < 0.5 - 1e-12)).all()
        # alpha+(p) == alpha-(1-p): the roles of correct and incorrect swap
        assert torch.allclose(alpha_plus(p, G), alpha_minus(1 - p, G))
        assert torch.allclose(g, alpha_plus(p, G) / alpha_minus(p, G))
    assert gamma(0.5, 8) == 1.0
    assert alpha_plus(1.0, 8) == math.inf and alpha_minus(0.0, 8) == math.inf


def test_theory_rejects_bad_arguments():
    with pytest.raises(ValueError, match="p must lie"):
        alpha_plus(1.5, 8)
    with pytest.raises(ValueError, match="G"):
        gamma(0.3, 1)


@pytest.mark.parametrize("std_mode", ["unbiased", "population", "none"])
@pytest.mark.parametrize("p,G", [(0.1, 8), (0.1, 16), (0.3, 4), (0.7, 8), (0.5, 32)])
def test_exact_binomial_sum_ratios_equal_closed_form(p, G, std_mode):
    ex = exact_conditional_advantages(p, G, std_mode=std_mode)
    assert ex["alpha_plus"] == pytest.approx(alpha_plus(p, G), rel=1e-10)
    assert ex["alpha_minus"] == pytest.approx(alpha_minus(p, G), rel=1e-10)
    assert ex["E_A_correct"] > 0 > ex["E_A_incorrect"]


# Tolerance: 4 delta-method standard errors, plus 3 / n_trials (rule of three): an event rarer than that, e.g. "the
# 7 other responses are all correct" at p=0.1 (1e-7), is usually never drawn, so its estimate is exact with se = 0.
@pytest.mark.parametrize("p,G", [(0.1, 4), (0.1, 8), (0.3, 4), (0.25, 8), (0.6, 4), (0.8, 8), (0.05, 16)])
def test_monte_carlo_confirms_alpha_plus_and_alpha_minus(p, G):
    n = 100_000
    mc = monte_carlo_conditional_advantages(p, G, n_trials=n, seed=1234)
    assert abs(mc.alpha_plus - alpha_plus(p, G)) <= 4 * mc.alpha_plus_se + 3 / n
    assert abs(mc.alpha_minus - alpha_minus(p, G)) <= 4 * mc.alpha_minus_se + 3 / n
    # the conditional means themselves agree with the exact binomial sums
    ex = exact_conditional_advantages(p, G)
    for key in ("E_A_correct", "E_A_correct_kept", "E_A_incorrect", "E_A_incorrect_kept"):
        assert getattr(mc, key) == pytest.approx(ex[key], rel=0.02), key


def test_monte_carlo_is_sensitive_enough_to_tell_alpha_from_its_neighbours():
    # at (p=0.3, G=4) alpha- = 1.52: the check rejects alpha- computed with the wrong exponent (G instead of G-1)
    mc = monte_carlo_conditional_advantages(0.3, 4, n_trials=100_000, seed=7)
    wrong = 1 / (1 - 0.7**4)
    assert abs(mc.alpha_minus - wrong) > 8 * mc.alpha_minus_se


def test_alphas_are_per_response_conditional_ratios_not_joint_mass_ratio():
    # E[A 1{correct} | F] / E[A 1{correct}] = 1 / P(F), the same for both classes: NOT the theorem's alpha+
    p, G = 0.25, 4
    mc = monte_carlo_conditional_advantages(p, G, n_trials=100_000, seed=3)
    p_keep = 1 - p**G - (1 - p) ** G
    assert mc.kept_frac == pytest.approx(p_keep, abs=0.01)
    assert mc.joint_ratio == pytest.approx(1 / p_keep, rel=0.01)
    assert abs(mc.joint_ratio - alpha_plus(p, G)) > 0.05


def test_cli_prints_table(capsys):
    assert main(["--p", "0.1", "--G", "8", "16"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:5] == ["G", "p", "alpha+", "alpha-", "gamma"]
    row8 = out[1].split()
    assert row8[0] == "8" and float(row8[3]) == pytest.approx(1.9168, abs=1e-4) and float(row8[4]) == pytest.approx(
        0.5217, abs=1e-4
    )
    with pytest.raises(SystemExit):
        main(["--p", "1.0"])


def test_plot_theory_writes_both_figures(tmp_path):
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "plot_theory.py"), "--out", str(tmp_path / "fig")],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout.split()
    assert [os.path.basename(p) for p in out] == ["fig1_alpha.png", "fig2_gamma.png"]
    for p in out:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert os.path.getsize(p) > 10_000
