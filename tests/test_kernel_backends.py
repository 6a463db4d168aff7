"""Chunked torch path and Triton kernels (interpreter mode on CPU) equal the reference DAA loss, values and gradients.

Shapes are tiny because the Triton interpreter costs ~1.5 ms per program per vocab block: V = 75 with BLOCK_V = 32
(a ragged last block) and token chunks of 5 (a ragged last chunk).
"""

import os
import random
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

# Triton reads TRITON_INTERPRET when it is first imported (it decorates tl.max, tl.sum, ... then). If another module
# imported triton earlier in this process without it (or CUDA is present, where the compiled kernels are wanted), the
# CPU-tensor Triton cases below are run in one child pytest process with the interpreter.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

from _kernel_cases import assert_same_outputs, loss_inputs, random_case, run_loss

from da3po_megatron.kernels import LogprobInputs, daa_policy_loss, reference_daa_policy_loss, vocab_parallel_logprobs

KW = dict(clip_ratio_low=0.2, clip_ratio_high=0.28)
B, T, V = 2, 12, 75
BACKEND_KW = {"chunked": dict(chunk_tokens=5), "triton": dict(block_v=32)}


_CHILD_OUTCOMES: dict[str, str] = {}


def _triton_ran_in_child(request) -> bool:
    """When this process cannot interpret Triton, run all Triton cases of this file once in a child pytest with
    TRITON_INTERPRET=1 from the start, and report this case's outcome there. False: run the case here."""
    from da3po_megatron.kernels.triton_loss import interpreter_ready

    if interpreter_ready():  # (these cases use CPU tensors, so a CUDA machine needs the interpreter too)
        return False
    if os.environ.get("DA3PO_KERNEL_TEST_CHILD"):
        pytest.fail("Triton interpreter unusable even in the child process (TRITON_INTERPRET=1 set before import)")
    if not _CHILD_OUTCOMES:
        env = dict(os.environ, TRITON_INTERPRET="1", DA3PO_KERNEL_TEST_CHILD="1")
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-k", "triton and not compiled",
             __file__],
            env=env, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600,
        )
        for line in r.stdout.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] in ("PASSED", "FAILED", "ERROR", "SKIPPED"):
                _CHILD_OUTCOMES[parts[1].split("::")[-1]] = parts[0]
        _CHILD_OUTCOMES["__log__"] = r.stdout[-6000:] + r.stderr[-2000:]
    outcome = _CHILD_OUTCOMES.get(request.node.name)
    assert outcome == "PASSED", f"{request.node.name}: {outcome} in the child pytest\n{_CHILD_OUTCOMES['__log__']}"
    return True


@pytest.fixture(params=["chunked", "triton"])
def backend(request):
    if request.param == "triton":
        pytest.importorskip("triton")
        if _triton_ran_in_child(request):
            return None  # the case passed in the child process; the test body returns at once
    return request.param


def _loss_fn(backend):
    return partial(daa_policy_loss, backend=backend, **BACKEND_KW[backend])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_equals_reference_with_ragged_vocab_blocks_and_token_chunks(backend, dtype):
    if backend is None:
        return
    c = random_case(B, T, V, dtype=dtype, seed=random.randrange(2**31))
    want = run_loss(reference_daa_policy_loss, c, **KW, compute_entropy=True)
    got = run_loss(_loss_fn(backend), c, **KW, compute_entropy=True)
    assert_same_outputs(want, got, dtype, backend)
    assert want["clip_low_count"] + want["clip_high_count"] > 0, "the mixed case should clip some tokens"


@pytest.mark.parametrize("regime", ["none", "all_high", "all_low"])
def test_backend_clip_regimes_counts_and_zero_gradient_when_all_clipped(backend, regime):
    if backend is None:
        return
    c = random_case(B, T, V, seed=random.randrange(2**31), regime=regime)
    want = run_loss(reference_daa_policy_loss, c, upstream="loss", **KW)
    got = run_loss(_loss_fn(backend), c, upstream="loss", **KW)
    assert_same_outputs(want, got, torch.float32, f"{backend} {regime}")
    n = got["token_count"].item()
    expect_low, expect_high = {"none": (0, 0), "all_high": (0, n), "all_low": (n, 0)}[regime]
    assert (got["clip_low_count"].item(), got["clip_high_count"].item()) == (expect_low, expect_high)
    if regime != "none":
        assert torch.all(got["dlogits"] == 0), "clipped tokens must not receive a policy gradient"
    else:
        assert got["dlogits"].abs().max() > 0


@pytest.mark.parametrize("per_token_lambda", [False, True])
def test_backend_daa_inside_equals_pre_amplified_advantages(backend, per_token_lambda):
    if backend is None:
        return
    c = random_case(B, T, V, seed=random.randrange(2**31))
    tau = 0.5
    lam = torch.rand(B, 1) * 2 + 1 if per_token_lambda else 2.0  # adaptive DAA gives one lambda per response
    inside = run_loss(_loss_fn(backend), c, **KW, correct=c.correct, p_hat=c.p_hat, daa_lambda=lam, daa_tau=tau)
    c.advantages = torch.where(c.correct & (c.p_hat < tau), c.advantages * lam, c.advantages)
    outside = run_loss(_loss_fn(backend), c, **KW)
    assert_same_outputs(outside, inside, torch.float32, f"{backend} DAA")


def test_backend_padding_targets_outside_vocab_and_garbage_inputs(backend):
    if backend is None:
        return
    c = random_case(B, T, V, seed=random.randrange(2**31))
    c.targets[1, 8:] = -100  # an ignore-index style padding id
    c.mask[1, 8:] = 0.0
    c.old_logprobs[1, 8:] = float("-inf")
    c.advantages[1, 8:] = float("nan")
    want = run_loss(reference_daa_policy_loss, c, **KW, compute_entropy=True)
    got = run_loss(_loss_fn(backend), c, **KW, compute_entropy=True)
    assert torch.isfinite(got["loss"])
    assert_same_outputs(want, got, torch.float32, f"{backend} padding")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_logprobs_path_values_and_gradients_equal_reference(backend, dtype):
    if backend is None:
        return
    c = random_case(B, T, V, dtype=dtype, seed=random.randrange(2**31))
    results = {}
    for name, kw in (("reference", {}), (backend, BACKEND_KW[backend])):
        x = c.logits.clone().requires_grad_(True)
        logp, ent = vocab_parallel_logprobs(x, LogprobInputs(c.targets, compute_entropy=True), backend=name, **kw)
        ((logp * c.g_logp).sum() + (ent * c.g_entropy).sum()).backward()
        results[name] = (logp.detach(), ent.detach(), x.grad)
    (lr, er, gr), (lb, eb, gb) = results["reference"], results[backend]
    torch.testing.assert_close(lb, lr, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(eb, er, atol=2e-5, rtol=1e-5)
    tol = dict(atol=1e-5, rtol=8e-3) if dtype == torch.bfloat16 else dict(atol=2e-6, rtol=1e-5)
    assert gb.dtype == dtype
    torch.testing.assert_close(gb.float(), gr.float(), **tol)


def test_backend_inplace_backward_writes_the_same_gradient_into_the_logits(backend):
    if backend is None:
        return
    c = random_case(B, T, V, seed=random.randrange(2**31))
    want = run_loss(_loss_fn(backend), c, **KW, compute_entropy=True)
    logits = c.logits.clone().requires_grad_(False)
    h = logits * 1.0  # a non-leaf that nothing else needs in backward, like the output layer's logits
    h.requires_grad_(True)
    loss, logp, ent, _ = daa_policy_loss(h, loss_inputs(c, **KW, compute_entropy=True), backend=backend,
                                         inplace_backward=True, **BACKEND_KW[backend])
    h.retain_grad()
    (loss * c.g_loss + (logp * c.g_logp).sum() + (ent * c.g_entropy).sum()).backward()
    torch.testing.assert_close(h.grad, want["dlogits"], atol=0, rtol=0)
    assert h.grad.data_ptr() == h.data_ptr(), "inplace_backward must reuse the logits' storage"


def test_backend_entropy_is_none_unless_requested(backend):
    if backend is None:
        return
    c = random_case(1, 3, V, seed=0)
    _, logp, ent, _ = daa_policy_loss(c.logits, loss_inputs(c, **KW), backend=backend, **BACKEND_KW[backend])
    assert ent is None and logp.shape == (1, 3) and logp.dtype == torch.float32


def test_backend_minus_inf_logits_of_masked_vocab_give_finite_entropy_and_gradients(backend):
    if backend is None:
        return
    c = random_case(B, T, V, seed=random.randrange(2**31))
    banned = torch.ones(V, dtype=torch.bool)
    banned[c.targets.unique()] = False
    c.logits[..., banned] = float("-inf")  # e.g. padded vocabulary entries masked with -inf
    want = run_loss(reference_daa_policy_loss, c, **KW, compute_entropy=True)
    got = run_loss(_loss_fn(backend), c, **KW, compute_entropy=True)
    assert torch.isfinite(got["entropy"]).all() and torch.isfinite(got["dlogits"]).all()
    assert torch.all(got["dlogits"][..., banned] == 0)
    assert_same_outputs(want, got, torch.float32, f"{backend} -inf logits")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: compiled Triton kernels (not the interpreter)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_triton_on_cuda_equals_reference_and_is_chosen_by_auto(dtype):
    from da3po_megatron.kernels import resolve_backend

    c = random_case(4, 128, 5003, dtype=dtype, seed=random.randrange(2**31))  # vocab: not a multiple of any block
    for name in ("logits", "targets", "old_logprobs", "advantages", "mask", "correct", "p_hat", "g_logp", "g_entropy"):
        setattr(c, name, getattr(c, name).cuda())
    assert resolve_backend("auto", c.logits) == "triton"
    daa = dict(correct=c.correct, p_hat=c.p_hat, daa_lambda=2.0, daa_tau=0.5, compute_entropy=True)
    want = run_loss(reference_daa_policy_loss, c, **KW, **daa)
    got = run_loss(partial(daa_policy_loss, backend="triton"), c, **KW, **daa)
    assert_same_outputs(want, got, dtype, "compiled triton")
