"""Tensor parallelism: with the vocab split over 2 gloo processes, every backend equals the TP=1 reference.

Each rank holds logits[..., r*V/2:(r+1)*V/2] (and the matching output-weight rows for the fused-linear path); loss,
log-probs, entropy and clip metrics must equal the unsplit result on both ranks, and each rank's dlogits / dweight must
be its slice of the unsplit gradient (dhidden: the full gradient, summed over the TP group inside the kernel).
"""

import os
import random
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # children are spawned fresh and inherit it before importing triton

from _kernel_cases import loss_inputs, random_case  # noqa: E402

from da3po_megatron.kernels import OutputLayer, daa_policy_loss, fused_linear_daa_policy_loss  # noqa: E402

KW = dict(clip_ratio_low=0.2, clip_ratio_high=0.28)
B, T, V, H = 2, 10, 90, 12  # V_local = 45: not a multiple of the Triton block (32)
BACKENDS = ("reference", "chunked", "triton")
BACKEND_KW = {"reference": {}, "chunked": dict(chunk_tokens=7), "triton": dict(block_v=32)}


def _make_inputs(seed: int) -> dict:
    c = random_case(B, T, V, seed=seed)
    c.targets[1, -2:] = -100  # padding ids belong to no shard
    c.mask[1, -2:] = 0.0
    g = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    return dict(case=c, hidden=hidden, weight=weight)


def _daa(c) -> dict:
    return dict(correct=c.correct, p_hat=c.p_hat, daa_lambda=2.0, daa_tau=0.5, compute_entropy=True)


def _backward(c, loss, logp, ent):
    (loss * c.g_loss + (logp * c.g_logp).sum() + (ent * c.g_entropy).sum()).backward()


def _run_all(inputs: dict, vocab_start: int, v_local: int, group, backends=BACKENDS) -> dict:
    c = inputs["case"]
    sl = slice(vocab_start, vocab_start + v_local)
    out = {}
    for backend in backends:
        x = c.logits[..., sl].clone().requires_grad_(True)
        loss, logp, ent, metrics = daa_policy_loss(
            x, loss_inputs(c, **KW, **_daa(c), vocab_start=vocab_start, tp_group=group), backend=backend,
            **BACKEND_KW[backend],
        )
        _backward(c, loss, logp, ent)
        out[backend] = dict(loss=loss.detach(), logp=logp.detach(), entropy=ent.detach(), dlogits=x.grad,
                            **{k: v.detach() for k, v in metrics.items()})
    h = inputs["hidden"].clone().requires_grad_(True)
    w = inputs["weight"][sl].clone().requires_grad_(True)
    loss, logp, ent, metrics = fused_linear_daa_policy_loss(
        h, OutputLayer(w), loss_inputs(c, **KW, **_daa(c), vocab_start=vocab_start, tp_group=group), chunk_tokens=6,
    )
    _backward(c, loss, logp, ent)
    out["fused_linear"] = dict(loss=loss.detach(), logp=logp.detach(), entropy=ent.detach(), dhidden=h.grad,
                               dweight=w.grad, **{k: v.detach() for k, v in metrics.items()})
    return out


def _worker(rank: int, world: int, port: int, inputs: dict, out_dir: str) -> None:
    torch.set_num_threads(1)
    from da3po_megatron.megatron.runtime import join_rendezvous

    dist.init_process_group("gloo", store=join_rendezvous("127.0.0.1", port), rank=rank, world_size=world)
    try:
        v_local = V // world
        out = _run_all(inputs, rank * v_local, v_local, dist.group.WORLD)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_tp2_vocab_split_equals_tp1_for_every_backend(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    seed = random.randrange(2**31)
    inputs = _make_inputs(seed)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spawned ranks import triton fresh, with the interpreter
    from da3po_megatron.megatron.runtime import bind_rendezvous

    store = bind_rendezvous(2)  # served here, bound before the ranks are told its port (issue 55)
    mp.spawn(_worker, args=(2, store.port, inputs, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    # TP = 1 ground truth, in this process: the reference on the full logits; for the fused-linear path the reference
    # on the full logits hidden @ weight.T
    full_logits = _run_all(inputs, 0, V, None, backends=("reference",))["reference"]
    c = inputs["case"]
    h1 = inputs["hidden"].clone().requires_grad_(True)
    w1 = inputs["weight"].clone().requires_grad_(True)
    loss, logp, ent, metrics = daa_policy_loss(h1 @ w1.t(), loss_inputs(c, **KW, **_daa(c)), backend="reference")
    _backward(c, loss, logp, ent)
    full_linear = dict(loss=loss.detach(), logp=logp.detach(), entropy=ent.detach(), **metrics)
    v_local = V // 2
    tol = dict(atol=2e-5, rtol=1e-5)
    for r, got in enumerate(ranks):
        sl = slice(r * v_local, (r + 1) * v_local)
        for name, res in got.items():
            full = full_linear if name == "fused_linear" else full_logits
            tag = f"rank {r} {name} seed {seed}"
            torch.testing.assert_close(res["loss"], full["loss"], **tol, msg=lambda m, tag=tag: f"loss {tag}: {m}")
            torch.testing.assert_close(res["logp"], full["logp"], **tol, msg=lambda m, tag=tag: f"logp {tag}: {m}")
            torch.testing.assert_close(res["entropy"], full["entropy"], **tol, msg=lambda m, tag=tag: f"H {tag}: {m}")
            for k in ("clip_low_count", "clip_high_count", "token_count"):
                assert res[k].item() == full[k].item(), f"{k} {tag}"
            if name == "fused_linear":
                torch.testing.assert_close(res["dhidden"], h1.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"dh {m}")
                torch.testing.assert_close(res["dweight"], w1.grad[sl], atol=1e-5, rtol=1e-4,
                                           msg=lambda m: f"dw {m}")
            else:
                torch.testing.assert_close(res["dlogits"], full["dlogits"][..., sl], atol=2e-6, rtol=1e-5,
                                           msg=lambda m, tag=tag: f"dlogits {tag}: {m}")
