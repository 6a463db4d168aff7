"""The pure-torch reference of the fused DAA loss against hand formulas and against algorithms.losses.policy_loss."""

import math
import random
from dataclasses import replace

import pytest
import torch
from _kernel_cases import loss_inputs, random_case, run_loss

from da3po_megatron.kernels import (
    LogprobInputs,
    LossInputs,
    daa_policy_loss,
    reference_daa_policy_loss,
    resolve_backend,
    vocab_parallel_logprobs,
)

EPS_LOW, EPS_HIGH = 0.2, 0.28


def _seed() -> int:
    return random.randrange(2**31)


def test_reference_logprobs_and_entropy_equal_float64_formulas():
    seed = _seed()
    c = random_case(3, 5, 37, seed=seed)
    logp, ent = vocab_parallel_logprobs(c.logits, LogprobInputs(c.targets, compute_entropy=True), backend="reference")
    z = c.logits.double()
    lse = torch.logsumexp(z, -1)
    want_logp = z.gather(-1, c.targets[..., None]).squeeze(-1) - lse
    p = torch.softmax(z, -1)
    want_ent = -(p * torch.log(p)).sum(-1)
    torch.testing.assert_close(logp.double(), want_logp, atol=2e-6, rtol=0, msg=f"seed {seed}")
    torch.testing.assert_close(ent.double(), want_ent, atol=2e-6, rtol=0, msg=f"seed {seed}")


def test_reference_surrogate_on_hand_computed_tokens():
    # 5 tokens, vocab 2 with logits chosen so that logp is known: z = [0, log(q/(1-q))] -> p(target=1) = q.
    q = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5], dtype=torch.float64)
    logits = torch.stack([torch.zeros(5, dtype=torch.float64), torch.log(q / (1 - q))], -1).float()[None]
    targets = torch.ones(1, 5, dtype=torch.long)
    logp = math.log(0.5)
    # ratios: 1.0 (A>0), 2.0 (A>0 -> high clip), 0.5 (A<0 -> low clip), 0.5 (A>0 -> unclipped), 2.0 masked out
    ratios = torch.tensor([1.0, 2.0, 0.5, 0.5, 2.0])
    old = (logp - torch.log(ratios))[None]
    adv = torch.tensor([[1.5, 1.0, -2.0, 3.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    x = logits.clone().requires_grad_(True)
    loss, lp, _, metrics = reference_daa_policy_loss(
        x, LossInputs(targets, old_logprobs=old, advantages=adv, mask=mask, clip_ratio_low=EPS_LOW,
                      clip_ratio_high=EPS_HIGH)
    )
    want = -(1.0 * 1.5) - (1.28 * 1.0) - (0.8 * -2.0) - (0.5 * 3.0)
    assert loss.item() == pytest.approx(want, abs=1e-5)
    assert metrics["clip_high_count"].item() == 1 and metrics["clip_low_count"].item() == 1
    assert metrics["token_count"].item() == 4
    loss.backward()
    # d loss / d logp_t = -A r for unclipped tokens, 0 for clipped or masked; d logp / d z_1 = 1 - q = 0.5
    dlogp = torch.tensor([-1.5 * 1.0, 0.0, 0.0, -3.0 * 0.5, 0.0])
    torch.testing.assert_close(x.grad[0, :, 1], dlogp * 0.5, atol=1e-6, rtol=0)
    torch.testing.assert_close(x.grad[0, :, 0], -dlogp * 0.5, atol=1e-6, rtol=0)


def test_daa_inside_reference_equals_pre_amplified_advantages():
    seed = _seed()
    c = random_case(2, 9, 31, seed=seed)
    lam, tau = 2.0, 0.5
    amplified = torch.where(c.correct & (c.p_hat < tau), c.advantages * lam, c.advantages)
    inside = run_loss(reference_daa_policy_loss, c, clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH,
                      correct=c.correct, p_hat=c.p_hat, daa_lambda=lam, daa_tau=tau)
    c.advantages = amplified
    outside = run_loss(reference_daa_policy_loss, c, clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH)
    for k in ("loss", "dlogits", "clip_low_count", "clip_high_count"):
        torch.testing.assert_close(inside[k], outside[k], msg=f"{k}, seed {seed}")


def test_masked_tokens_with_garbage_inputs_contribute_nothing():
    c = random_case(2, 6, 23, seed=_seed())
    c.mask[1, 3:] = 0.0
    c.old_logprobs[1, 3:] = float("-inf")
    c.advantages[1, 3:] = float("nan")
    out = run_loss(reference_daa_policy_loss, c, upstream="loss", clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH)
    assert torch.isfinite(out["loss"])
    assert torch.all(out["dlogits"][1, 3:] == 0)


@pytest.mark.parametrize("daa", [False, True])
def test_reference_agrees_with_algorithms_policy_loss_token_mean(daa):
    losses = pytest.importorskip("da3po_megatron.algorithms.losses")
    advantages_mod = pytest.importorskip("da3po_megatron.algorithms.advantages")
    seed = _seed()
    c = random_case(4, 7, 29, seed=seed)
    kw = dict(clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH)
    # per-response DAA inputs, as the trainer has them
    correct = torch.tensor([True, False, True, True])
    p_hat = torch.tensor([0.25, 0.25, 0.75, 0.25])
    adv_resp = torch.randn(4, generator=torch.Generator().manual_seed(seed))
    adv_tok = adv_resp[:, None].expand(4, 7)
    x1 = c.logits.clone().requires_grad_(True)
    daa_kw = dict(correct=correct[:, None], p_hat=p_hat[:, None], daa_lambda=2.0, daa_tau=0.5) if daa else {}
    loss_sum, logp, _, metrics = reference_daa_policy_loss(
        x1, LossInputs(c.targets, old_logprobs=c.old_logprobs, advantages=adv_tok, mask=c.mask, **kw, **daa_kw)
    )
    (loss_sum / metrics["token_count"]).backward()

    x2 = c.logits.clone().requires_grad_(True)
    logp2 = torch.log_softmax(x2.float(), -1).gather(-1, c.targets[..., None]).squeeze(-1)
    adv2 = advantages_mod.apply_daa(adv_resp, correct, p_hat, 2.0, 0.5) if daa else adv_resp
    loss2, m2 = losses.policy_loss(logp2, c.old_logprobs, adv2, c.mask, **kw, ratio_level="token",
                                   loss_agg_mode="token-mean")
    loss2.backward()
    n = metrics["token_count"]
    assert (loss_sum / n).item() == pytest.approx(loss2.item(), abs=1e-6), f"seed {seed}"
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-7, rtol=1e-5, msg=f"seed {seed}")
    assert (metrics["clip_low_count"] / n).item() == pytest.approx(m2["clipfrac_low"].item(), abs=1e-7)
    assert (metrics["clip_high_count"] / n).item() == pytest.approx(m2["clipfrac_high"].item(), abs=1e-7)
    assert metrics["token_count"].item() == m2["num_tokens"].item()


def test_invalid_inputs_raise_errors_naming_the_argument():
    c = random_case(2, 4, 11, seed=0)
    clip = dict(clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH)
    good = loss_inputs(c, **clip)
    with pytest.raises(ValueError, match="targets"):
        daa_policy_loss(c.logits, replace(good, targets=c.targets[:, :3]), backend="reference")
    with pytest.raises(ValueError, match="old_logprobs"):
        daa_policy_loss(c.logits, replace(good, old_logprobs=torch.zeros(3, 3)), backend="reference")
    with pytest.raises(ValueError, match="missing.*daa_tau"):  # checked when the inputs are built
        loss_inputs(c, **clip, correct=c.correct, p_hat=c.p_hat, daa_lambda=2.0)
    with pytest.raises(ValueError, match="clip_ratio_low"):
        loss_inputs(c, clip_ratio_low=1.5, clip_ratio_high=0.2)
    with pytest.raises(ValueError, match="backend"):
        daa_policy_loss(c.logits, good, backend="cuda")
    with pytest.raises(TypeError, match="targets"):
        daa_policy_loss(c.logits, replace(good, targets=c.targets.float()), backend="reference")


def test_auto_backend_is_chunked_for_cpu_tensors():
    assert resolve_backend("auto", torch.zeros(2, 3)) == "chunked"
