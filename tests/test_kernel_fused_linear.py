"""Fused linear + DAA loss equals the reference applied to logits = hidden @ weight.T (values, dhidden, dweight)."""

import random

import pytest
import torch

from da3po_megatron.kernels import (
    fused_linear_daa_policy_loss,
    fused_linear_vocab_parallel_logprobs,
    reference_daa_policy_loss,
    vocab_parallel_logprobs,
)
from da3po_megatron.kernels.testing import random_case

KW = dict(clip_ratio_low=0.2, clip_ratio_high=0.28)
B, T, H, V = 2, 11, 16, 53


def _inputs(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    c = random_case(B, T, V, seed=seed)  # per-token inputs; its logits are not used
    with torch.no_grad():
        logp, _ = vocab_parallel_logprobs(hidden @ weight.t(), c.targets, backend="reference")
    c.old_logprobs = logp - torch.randn(B, T, generator=g) * 0.35  # ratios around 1: some clipped, most not
    return hidden, weight, c


def _run(fused: bool, hidden, weight, c, **kw):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    if fused:
        out = fused_linear_daa_policy_loss(h, w, c.targets, c.old_logprobs, c.advantages, c.mask, **KW, **kw)
    else:
        out = reference_daa_policy_loss(h @ w.t(), c.targets, c.old_logprobs, c.advantages, c.mask, **KW, **kw)
    loss, logp, ent, metrics = out
    (loss * c.g_loss + (logp * c.g_logp).sum() + (ent * c.g_entropy).sum()).backward()
    return loss.detach(), logp.detach(), ent.detach(), metrics, h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_tokens", [4, 64])
def test_fused_linear_equals_reference_on_materialised_logits(dtype, chunk_tokens):
    seed = random.randrange(2**31)
    hidden, weight, c = _inputs(dtype, seed)
    daa = dict(correct=c.correct, p_hat=c.p_hat, daa_lambda=2.0, daa_tau=0.5, compute_entropy=True)
    want = _run(False, hidden, weight, c, **daa)
    got = _run(True, hidden, weight, c, chunk_tokens=chunk_tokens, **daa)
    msg = f"seed {seed}"
    # bf16: the chunk matmul and the full matmul give the same bf16 logits; gradients are rounded to bf16 once
    # (reference: per op) -> a few bf16 ulps on dhidden/dweight sums.
    vt = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[0], want[0], **vt, msg=msg)
    torch.testing.assert_close(got[1], want[1], **vt, msg=msg)
    torch.testing.assert_close(got[2], want[2], **vt, msg=msg)
    for k in ("clip_low_count", "clip_high_count", "token_count"):
        assert got[3][k].item() == want[3][k].item(), f"{k} {msg}"
    assert want[3]["clip_low_count"] + want[3]["clip_high_count"] > 0
    assert got[4].dtype == got[5].dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got[4], want[4], atol=1e-5, rtol=1e-4, msg=f"dhidden {msg}")
        torch.testing.assert_close(got[5], want[5], atol=1e-5, rtol=1e-4, msg=f"dweight {msg}")
    else:
        # dhidden: one bf16 rounding of the same fp32 values (measured: bit-equal). dweight: each chunk's bf16 product
        # is rounded before the fp32 accumulation, vs one bf16 matmul in the reference (measured <= 0.7% of max|dw|).
        torch.testing.assert_close(got[4].float(), want[4].float(), atol=1e-5, rtol=8e-3, msg=f"dhidden {msg}")
        scale = want[5].float().abs().max().item()
        torch.testing.assert_close(got[5].float(), want[5].float(), atol=2**-6 * scale, rtol=0, msg=f"dweight {msg}")


def test_fused_linear_logprobs_path_and_frozen_weight():
    seed = random.randrange(2**31)
    hidden, weight, c = _inputs(torch.float32, seed)
    h1 = hidden.clone().requires_grad_(True)
    logp, ent = fused_linear_vocab_parallel_logprobs(h1, weight, c.targets, compute_entropy=True, chunk_tokens=5)
    ((logp * c.g_logp).sum() + (ent * c.g_entropy).sum()).backward()
    h2 = hidden.clone().requires_grad_(True)
    logp2, ent2 = vocab_parallel_logprobs(h2 @ weight.t(), c.targets, compute_entropy=True, backend="reference")
    ((logp2 * c.g_logp).sum() + (ent2 * c.g_entropy).sum()).backward()
    torch.testing.assert_close(logp, logp2.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ent2.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-4)


def test_fused_linear_rejects_mismatched_weight():
    hidden, weight, c = _inputs(torch.float32, 0)
    with pytest.raises(ValueError, match="weight"):
        fused_linear_daa_policy_loss(hidden, weight[:, :5], c.targets, c.old_logprobs, c.advantages, c.mask, **KW)
    with pytest.raises(ValueError, match="dtype"):
        fused_linear_daa_policy_loss(hidden, weight.double(), c.targets, c.old_logprobs, c.advantages, c.mask, **KW)
