"""Eq. 3 group advantages, p_hat, Eq. 14 DAA (constant and adaptive) and the token broadcast."""

import math

import pytest
import torch

from da3po_megatron.algorithms import (
    adaptive_daa_lambda,
    apply_daa,
    broadcast_to_tokens,
    daa_stats,
    gamma,
    group_advantages,
    group_p_hat,
)


def _loop_zscore(rewards: list[float], G: int, ddof: int, eps: float) -> list[float]:
    out = []
    for k in range(0, len(rewards), G):
        grp = rewards[k : k + G]
        mean = sum(grp) / G
        std = math.sqrt(sum((r - mean) ** 2 for r in grp) / (G - ddof))
        out += [(r - mean) / (std + eps) for r in grp]
    return out


@pytest.mark.parametrize("std_mode,ddof", [("unbiased", 1), ("population", 0)])
def test_group_advantages_match_loop_zscore_per_group(std_mode, ddof):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(24, generator=g, dtype=torch.float64)
    got = group_advantages(rewards, 6, eps=1e-6, std_mode=std_mode)
    want = _loop_zscore(rewards.tolist(), 6, ddof, 1e-6)
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-12)


def test_group_advantages_std_mode_none_only_centers():
    r = torch.tensor([1.0, -1.0, -1.0, -1.0])
    assert torch.allclose(group_advantages(r, 4, std_mode="none"), torch.tensor([1.5, -0.5, -0.5, -0.5]))


def test_binary_rewards_give_closed_form_advantages():
    # k correct of G, population std: A_correct = sqrt((1-q)/q), A_incorrect = -sqrt(q/(1-q)), q = k/G
    G, k = 8, 3
    r = torch.tensor([1.0] * k + [-1.0] * (G - k), dtype=torch.float64)
    a = group_advantages(r, G, eps=0.0, std_mode="population")
    q = k / G
    assert a[0].item() == pytest.approx(math.sqrt((1 - q) / q), rel=1e-12)
    assert a[-1].item() == pytest.approx(-math.sqrt(q / (1 - q)), rel=1e-12)
    # the unbiased convention is the population one times sqrt((G-1)/G)
    au = group_advantages(r, G, eps=0.0, std_mode="unbiased")
    assert torch.allclose(au, a * math.sqrt((G - 1) / G), atol=1e-12)


@pytest.mark.parametrize("std_mode", ["unbiased", "population", "none"])
def test_uniform_groups_get_exactly_zero_advantage(std_mode):
    # 0.1 + shaped values whose float mean is not exactly the value itself
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, -1.0, 1.0, -0.7, -0.7, -0.7, 1.0, 1.0, 1.0], dtype=torch.float32)
    a = group_advantages(r, 3, std_mode=std_mode)
    assert torch.equal(a[[0, 1, 2, 6, 7, 8, 9, 10, 11]], torch.zeros(9))
    assert (a[3:6] != 0).all()


def test_group_advantages_reject_bad_layout():
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="group_size >= 2"):
        group_advantages(torch.zeros(3), 1, std_mode="unbiased")
    with pytest.raises(ValueError, match="std_mode"):
        group_advantages(torch.zeros(4), 2, std_mode="sample")


def test_group_p_hat_is_per_response_copy_of_group_accuracy():
    correct = torch.tensor([1, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0], dtype=torch.bool)
    p = group_p_hat(correct, 4)
    assert p.tolist() == [0.25] * 4 + [1.0] * 4 + [0.0] * 4


def test_daa_amplifies_exactly_correct_responses_of_hard_groups():
    # response:       0     1     2     3     4     5     6
    correct = torch.tensor([True, False, True, True, True, False, True])
    p_hat = torch.tensor([0.25, 0.25, 0.5, 0.75, 0.4999, 0.1, 0.125], dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 0.8, 0.3, 1.2, -2.0, 0.0], dtype=torch.float64)
    out = apply_daa(adv, correct, p_hat, lambda_=2.0, tau=0.5)
    # amplified: 0 (correct, p<tau), 4 (correct, p just below tau), 6 (value 0 stays 0)
    # untouched: 1 (incorrect), 2 (p == tau, strict), 3 (p > tau), 5 (incorrect in a hard group)
    assert out.tolist() == [2.0, -0.5, 0.8, 0.3, 2.4, -2.0, 0.0]
    assert adv.tolist() == [1.0, -0.5, 0.8, 0.3, 1.2, -2.0, 0.0], "input must not be modified"


def test_daa_lambda_one_is_identity_and_per_token_advantages_are_scaled_by_row():
    correct = torch.tensor([True, False, True])
    p_hat = torch.tensor([0.2, 0.2, 0.9])
    adv = torch.randn(3)
    assert torch.equal(apply_daa(adv, correct, p_hat, 1.0, 0.5), adv)
    tok = torch.ones(3, 5)
    out = apply_daa(tok, correct, p_hat, 3.0, 0.5)
    assert out[0].tolist() == [3.0] * 5 and out[1].tolist() == [1.0] * 5 and out[2].tolist() == [1.0] * 5


def test_daa_accepts_per_response_lambda_tensor():
    correct = torch.tensor([True, True, False, True])
    p_hat = torch.tensor([0.1, 0.3, 0.1, 0.8])
    lam = torch.tensor([4.0, 1.5, 9.0, 9.0])
    out = apply_daa(torch.ones(4), correct, p_hat, lam, tau=0.5)
    assert out.tolist() == [4.0, 1.5, 1.0, 1.0]
    with pytest.raises(ValueError, match="lambda_ tensor"):
        apply_daa(torch.ones(4), correct, p_hat, torch.ones(3), tau=0.5)


def test_adaptive_lambda_is_inverse_gamma_clipped():
    G = 8
    p = torch.tensor([0.0, 1 / 8, 0.25, 0.5, 0.75, 1.0])
    lam = adaptive_daa_lambda(p, G, lambda_min=1.0, lambda_max=4.0)
    assert lam[0].item() == 4.0  # p_hat = 0: 1/gamma = inf -> lambda_max
    assert lam[1].item() == pytest.approx(1 / gamma(1 / 8, G), rel=1e-6)
    assert lam[2].item() == pytest.approx(1 / gamma(0.25, G), rel=1e-6)
    assert lam[3].item() == 1.0  # gamma(0.5) = 1
    assert lam[4].item() == 1.0  # 1/gamma < 1 -> lambda_min
    assert lam[5].item() == 1.0  # p_hat = 1: 1/gamma = 0 -> lambda_min
    # the adaptive factor equalises the two scalings: alpha+ * lambda == alpha- before clipping
    wide = adaptive_daa_lambda(torch.tensor([0.1]), 16, lambda_min=1e-3, lambda_max=1e3)
    assert wide.item() * gamma(0.1, 16) == pytest.approx(1.0, rel=1e-6)


def test_broadcast_to_tokens_zeroes_non_response_tokens():
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask)
    assert out.tolist() == [[2.0, 2.0, 0.0], [0.0, -1.0, -1.0]]


def test_daa_stats_reports_activation_fraction():
    correct = torch.tensor([True, True, False, True])
    p_hat = torch.tensor([0.25, 0.5, 0.25, 0.75])
    s = daa_stats(correct, p_hat, tau=0.5, lambda_=2.0)
    assert s["daa/active_frac"] == 0.25
    assert s["daa/active_frac_of_correct"] == pytest.approx(1 / 3)
    assert s["daa/num_active"] == 1.0 and s["daa/lambda_mean"] == 2.0
