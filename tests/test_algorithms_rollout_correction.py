"""Truncated importance sampling (TIS) weights for the rollout / training mismatch: formula, cap, statistics."""

import math

import pytest
import torch

from da3po_megatron.algorithms import policy_loss, tis_weights


def test_weights_are_the_probability_ratio_truncated_at_the_cap():
    old = torch.tensor([-1.0, -1.0, -2.0, -0.5, -3.0])
    rollout = torch.tensor([-1.0, -1.5, -1.0, -2.0, -3.0 + math.log(2.0)])
    w, stats = tis_weights(old, rollout, cap=2.0)
    # exp(0), exp(0.5), exp(-1), exp(1.5) -> cap, exp(-log 2)
    expected = [1.0, math.exp(0.5), math.exp(-1.0), 2.0, 0.5]
    assert w.tolist() == pytest.approx(expected, rel=1e-6)
    assert stats["tis/weight_mean"] == pytest.approx(sum(expected) / 5, rel=1e-6)
    assert stats["tis/capped_frac"] == pytest.approx(1 / 5)
    assert stats["tis/ratio_max"] == pytest.approx(math.exp(1.5), rel=1e-6)  # before truncation
    assert not w.requires_grad


def test_a_ratio_exactly_at_the_cap_counts_as_capped_and_the_cap_is_a_free_parameter():
    old = torch.tensor([math.log(3.0), 0.0, 0.0], dtype=torch.float64)
    rollout = torch.zeros(3, dtype=torch.float64)
    w, stats = tis_weights(old, rollout, cap=3.0)
    assert w.tolist() == pytest.approx([3.0, 1.0, 1.0]) and stats["tis/capped_frac"] == pytest.approx(1 / 3)
    w, stats = tis_weights(old, rollout, cap=0.5)  # a cap below 1 truncates every token here
    assert w.tolist() == [0.5, 0.5, 0.5] and stats["tis/capped_frac"] == 1.0


def test_shape_is_kept_and_equal_log_probs_give_weight_one():
    lp = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)) - 2.0
    w, stats = tis_weights(lp, lp.clone(), cap=2.0)
    assert w.shape == (3, 4) and torch.equal(w, torch.ones(3, 4))
    assert stats == {"tis/weight_mean": 1.0, "tis/capped_frac": 0.0, "tis/ratio_max": 1.0}


def test_no_tokens_gives_neutral_statistics():
    w, stats = tis_weights(torch.zeros(0), torch.zeros(0), cap=2.0)
    assert w.numel() == 0
    assert stats == {"tis/weight_mean": 1.0, "tis/capped_frac": 0.0, "tis/ratio_max": 1.0}


def test_infinite_log_probs_give_finite_weights_and_nan_is_an_error():
    old = torch.tensor([0.0, -math.inf, -1.0])
    rollout = torch.tensor([-math.inf, -1.0, -1.0])
    w, stats = tis_weights(old, rollout, cap=2.0)
    assert w[0].item() == 2.0 and 0.0 < w[1].item() < 1e-8 and w[2].item() == 1.0
    assert math.isfinite(stats["tis/ratio_max"])
    with pytest.raises(ValueError, match="1 of 2 tokens have a NaN log-prob ratio"):
        tis_weights(torch.tensor([-math.inf, 0.0]), torch.tensor([-math.inf, 0.0]), cap=2.0)
    with pytest.raises(ValueError, match="same shape"):
        tis_weights(torch.zeros(3), torch.zeros(4), cap=2.0)
    with pytest.raises(ValueError, match="cap must be > 0"):
        tis_weights(torch.zeros(3), torch.zeros(3), cap=0.0)


def test_weighting_the_loss_equals_weighting_the_advantages():
    """Why the policy may apply TIS by scaling advantages: for w > 0, w * min(r A, clip(r) A) = min(r wA, clip(r) wA),
    so the weighted per-token loss (summed by hand here) equals ``policy_loss`` with w * A, and the clip metrics
    are those of the unweighted loss."""
    g = torch.Generator().manual_seed(1)
    lp = -torch.rand(4, 6, generator=g) * 3
    old = lp + 0.3 * torch.randn(4, 6, generator=g)
    adv = torch.tensor([1.0, -1.0, 2.0, -0.5])
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0
    w, _ = tis_weights(old, old + 0.5 * torch.randn(4, 6, generator=g), cap=2.0)
    kw = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}
    loss, m = policy_loss(lp, old, adv.unsqueeze(1) * w, mask, **kw)
    ratio = (lp - old).exp()
    a = adv.unsqueeze(1)
    per_token = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a)
    assert loss.item() == pytest.approx(((w * per_token) * mask).sum().item() / mask.sum().item(), rel=1e-5)
    _, m0 = policy_loss(lp, old, adv, mask, **kw)
    for key in ("clipfrac_low", "clipfrac_high", "ratio_max"):
        assert m[key].item() == m0[key].item(), key
