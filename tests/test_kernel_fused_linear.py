"""Fused linear + DAA loss equals the reference applied to logits = hidden @ weight.T (values, dhidden, dweight)."""

import random

import pytest
import torch
from _kernel_cases import loss_inputs, random_case

from da3po_megatron.kernels import (
    LogprobInputs,
    OutputLayer,
    fused_linear_daa_policy_loss,
    fused_linear_vocab_parallel_logprobs,
    reference_daa_policy_loss,
    vocab_parallel_logprobs,
)

KW = dict(clip_ratio_low=0.2, clip_ratio_high=0.28)
B, T, H, V = 2, 11, 16, 53


def _inputs(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    c = random_case(B, T, V, seed=seed)  # per-token inputs; its logits are not used
    with torch.no_grad():
        logp, _ = vocab_parallel_logprobs(hidden @ weight.t(), LogprobInputs(c.targets), backend="reference")
    c.old_logprobs = logp - torch.randn(B, T, generator=g) * 0.35  # ratios around 1: some clipped, most not
    return hidden, weight, c


def _run(fused: bool, hidden, weight, c, chunk_tokens=None, **kw):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    if fused:
        out = fused_linear_daa_policy_loss(h, OutputLayer(w), loss_inputs(c, **KW, **kw), chunk_tokens=chunk_tokens)
    else:
        out = reference_daa_policy_loss(h @ w.t(), loss_inputs(c, **KW, **kw))
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
    logp, ent = fused_linear_vocab_parallel_logprobs(
        h1, OutputLayer(weight), LogprobInputs(c.targets, compute_entropy=True), chunk_tokens=5)
    ((logp * c.g_logp).sum() + (ent * c.g_entropy).sum()).backward()
    h2 = hidden.clone().requires_grad_(True)
    logp2, ent2 = vocab_parallel_logprobs(h2 @ weight.t(), LogprobInputs(c.targets, compute_entropy=True),
                                          backend="reference")
    ((logp2 * c.g_logp).sum() + (ent2 * c.g_entropy).sum()).backward()
    torch.testing.assert_close(logp, logp2.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ent2.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-4)


def test_fused_linear_rejects_mismatched_weight():
    hidden, weight, c = _inputs(torch.float32, 0)
    with pytest.raises(ValueError, match="weight"):
        fused_linear_daa_policy_loss(hidden, OutputLayer(weight[:, :5]), loss_inputs(c, **KW))
    with pytest.raises(ValueError, match="dtype"):
        fused_linear_daa_policy_loss(hidden, OutputLayer(weight.double()), loss_inputs(c, **KW))


# ------------------------------------------------------------------ temperature and padded vocabulary (the policy's)
def _tempered_reference_logits(h, w, temperature, vocab_limit):
    """What the fused path must equal: (h @ w.T) / T in float32, columns >= vocab_limit at -inf."""
    z = (h @ w.t()).float() / temperature
    if vocab_limit is not None:
        z = z.masked_fill(torch.arange(z.shape[-1]) >= vocab_limit, float("-inf"))
    return z


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("vocab_limit", [None, V - 9])
def test_fused_linear_at_temperature_with_padded_vocab_equals_reference(temperature, vocab_limit):
    seed = random.randrange(2**31)
    hidden, weight, c = _inputs(torch.float32, seed)
    if vocab_limit is not None:
        c.targets = c.targets % vocab_limit  # targets are real tokens
    with torch.no_grad():  # old log-probs near the tempered ones: some ratios clip, most do not
        lp, _ = vocab_parallel_logprobs(_tempered_reference_logits(hidden, weight, temperature, vocab_limit),
                                        LogprobInputs(c.targets), backend="reference")
    c.old_logprobs = lp - torch.randn(B, T, generator=torch.Generator().manual_seed(seed)) * 0.35
    daa = dict(correct=c.correct, p_hat=c.p_hat, daa_lambda=2.0, daa_tau=0.5, compute_entropy=True)
    tv = dict(temperature=temperature, vocab_limit=vocab_limit)
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    got = fused_linear_daa_policy_loss(h1, OutputLayer(w1, **tv), loss_inputs(c, **KW, **daa), chunk_tokens=5)
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    want = reference_daa_policy_loss(_tempered_reference_logits(h2, w2, temperature, vocab_limit),
                                     loss_inputs(c, **KW, **daa))
    for out in (got, want):
        (out[0] * c.g_loss + (out[1] * c.g_logp).sum() + (out[2] * c.g_entropy).sum()).backward()
    msg = f"seed {seed}"
    for i in range(3):
        torch.testing.assert_close(got[i].detach(), want[i].detach(), atol=2e-5, rtol=1e-5, msg=msg)
    for k in ("clip_low_count", "clip_high_count", "token_count"):
        assert got[3][k].item() == want[3][k].item(), f"{k} {msg}"
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-4, msg=f"dhidden {msg}")
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-5, rtol=1e-4, msg=f"dweight {msg}")
    if vocab_limit is not None:
        assert torch.all(w1.grad[vocab_limit:] == 0)
    # the log-probs-only entry point takes the same two arguments
    h3 = hidden.clone().requires_grad_(True)
    lp3, ent3 = fused_linear_vocab_parallel_logprobs(h3, OutputLayer(weight, **tv),
                                                     LogprobInputs(c.targets, compute_entropy=True), chunk_tokens=7)
    torch.testing.assert_close(lp3.detach(), want[1].detach(), atol=2e-5, rtol=1e-5, msg=msg)
    torch.testing.assert_close(ent3.detach(), want[2].detach(), atol=2e-5, rtol=1e-5, msg=msg)
    ((lp3 * c.g_logp).sum()).backward()
    h4 = hidden.clone().requires_grad_(True)
    lp4, _ = vocab_parallel_logprobs(_tempered_reference_logits(h4, weight, temperature, vocab_limit),
                                     LogprobInputs(c.targets), backend="reference")
    ((lp4 * c.g_logp).sum()).backward()
    torch.testing.assert_close(h3.grad, h4.grad, atol=1e-5, rtol=1e-4, msg=f"dhidden (logprobs) {msg}")


def test_fused_linear_rejects_bad_temperature_and_vocab_limit():
    hidden, weight, c = _inputs(torch.float32, 0)
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_vocab_parallel_logprobs(hidden, OutputLayer(weight, temperature=0.0), LogprobInputs(c.targets))
    with pytest.raises(ValueError, match="vocab_limit"):
        fused_linear_vocab_parallel_logprobs(hidden, OutputLayer(weight, vocab_limit=0), LogprobInputs(c.targets))


def _tp_worker(rank: int, port: int, inputs: dict, out_dir: str) -> None:
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    from da3po_megatron.megatron.runtime import join_rendezvous

    dist.init_process_group("gloo", store=join_rendezvous("127.0.0.1", port), rank=rank, world_size=2)
    try:
        v_local = inputs["weight"].shape[0] // 2
        sl = slice(rank * v_local, (rank + 1) * v_local)
        h = inputs["hidden"].clone().requires_grad_(True)
        w = inputs["weight"][sl].clone().requires_grad_(True)
        lp, ent = fused_linear_vocab_parallel_logprobs(
            h, OutputLayer(w, temperature=inputs["temperature"], vocab_limit=inputs["vocab_limit"]),
            LogprobInputs(inputs["targets"], vocab_start=rank * v_local, tp_group=dist.group.WORLD,
                          compute_entropy=True), chunk_tokens=6)
        ((lp * inputs["g_logp"]).sum() + (ent * inputs["g_entropy"]).sum()).backward()
        torch.save(dict(logp=lp.detach(), entropy=ent.detach(), dhidden=h.grad, dweight=w.grad),
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("vocab_limit", [40, 30])  # V_local = 32: rank 1 holds 8 real rows, or none at all
def test_fused_linear_tp2_padded_vocab_and_temperature_equal_tp1(tmp_path, monkeypatch, vocab_limit):
    import torch.multiprocessing as mp

    from da3po_megatron.megatron.runtime import bind_rendezvous

    g = torch.Generator().manual_seed(7)
    v = 64
    inputs = dict(hidden=torch.randn(2, 9, H, generator=g), weight=torch.randn(v, H, generator=g) * 0.5,
                  targets=torch.randint(0, vocab_limit, (2, 9), generator=g), g_logp=torch.randn(2, 9, generator=g),
                  g_entropy=torch.randn(2, 9, generator=g), temperature=0.7, vocab_limit=vocab_limit)
    store = bind_rendezvous(2)  # served here, bound before the ranks are told its port (issue 55)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    mp.spawn(_tp_worker, args=(store.port, inputs, str(tmp_path)), nprocs=2, join=True)
    h = inputs["hidden"].clone().requires_grad_(True)
    w = inputs["weight"].clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(_tempered_reference_logits(h, w, 0.7, vocab_limit),
                                      LogprobInputs(inputs["targets"], compute_entropy=True), backend="reference")
    ((lp * inputs["g_logp"]).sum() + (ent * inputs["g_entropy"]).sum()).backward()
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert torch.isfinite(got["entropy"]).all()
        torch.testing.assert_close(got["logp"], lp.detach(), atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(got["entropy"], ent.detach(), atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(got["dhidden"], h.grad, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got["dweight"], w.grad[r * 32:(r + 1) * 32], atol=1e-5, rtol=1e-4)
