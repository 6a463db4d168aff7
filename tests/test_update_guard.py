"""The update guard (megatron/update_guard.py) on real megatron-core: a tiny GPTModel in Megatron DDP with the
optimizer megatron-core builds (torch AdamW here), 2 gloo ranks, in the three layouts whose norm reductions differ:
DP=2 (non-distributed optimizer: every rank holds all parameters), DP=2 with the distributed optimizer (each rank owns
a shard of the fp32 main parameters), TP=2 (tensor-parallel shards plus duplicated norms). In each:

- the ||delta theta|| / ||theta|| predicted before a step equals the one the step then applies (first and second
  update: without and with Adam state), the same on both ranks;
- an update above the limit is refused on both ranks and changes nothing (weights and optimizer state);
- a NaN loss on one rank, an inf gradient on the other: refused on both ("loss", "grad");
- a NaN weight on one rank after an update: check_finite_weights raises on both.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

LAYOUTS = {"dp2": (1, False), "dp2_distributed_optimizer": (1, True), "tp2": (2, True)}


def _ranks(rank: int, world: int, ports: list[int], out: str) -> None:
    """Every layout in turn in one pair of processes (megatron-core is imported once)."""
    from da3po_megatron.megatron.runtime import destroy_parallel

    for layout, port in zip(LAYOUTS, ports):
        _rank(rank, world, port, out, layout)
        destroy_parallel()


def _rank(rank: int, world: int, port: int, out: str, layout: str) -> None:
    import torch.distributed as dist
    from megatron.core.distributed import finalize_model_grads

    from da3po_megatron.config import ModelConfig, OptimConfig
    from da3po_megatron.megatron.arch import GPTArch
    from da3po_megatron.megatron.model import build_gpt_model
    from da3po_megatron.megatron.optimizer import build_ddp_optimizer
    from da3po_megatron.megatron.runtime import ParallelLayout, init_parallel, join_rendezvous
    from da3po_megatron.megatron.update_guard import check_finite_weights, guarded_step

    tp, dist_opt = LAYOUTS[layout]
    init_parallel(ParallelLayout(tp), rank=rank, world_size=world, store=join_rendezvous("127.0.0.1", port), seed=3)
    arch = GPTArch(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                   kv_channels=8, vocab_size=64, max_sequence_length=32)
    gpt = build_gpt_model(arch, ModelConfig(params_dtype="float32"))
    optim = OptimConfig(lr=1e-3, weight_decay=0.1, use_distributed_optimizer=dist_opt)
    model, optimizer, _ = build_ddp_optimizer(gpt, optim, total_steps=10, lr_decay_style="constant")
    torch.manual_seed(100 + rank)  # DP ranks see different data
    ids = torch.randint(0, 64, (2, 12))
    pos = torch.arange(12).repeat(2, 1)

    def backward(loss_scale: float = 1.0) -> torch.Tensor:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        logits = model(ids, pos, None)
        loss = logits.float().logsumexp(-1).mean() * loss_scale
        loss.backward()
        finalize_model_grads([model])
        return loss.detach()

    def flat_params() -> list[torch.Tensor]:  # the test's own snapshot (the guard never makes one)
        return [p.detach().clone() for p in model.parameters()]

    def true_ratio(before: list[torch.Tensor], after: list[torch.Tensor]) -> float:
        # over the whole model: this rank's TP shard (duplicates counted once), summed over the TP ranks
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        t = torch.zeros(2, dtype=torch.float64)
        for p, b, a in zip(model.parameters(), before, after):
            if param_is_not_tensor_parallel_duplicate(p):
                t += torch.stack([(a - b).double().square().sum(), b.double().square().sum()])
        dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
        return float(t[0].sqrt() / t[1].sqrt())

    res: dict = {}
    for k in (1, 2):  # the first update (no Adam state yet) and the second
        loss = backward()
        before = flat_params()
        u = guarded_step(optimizer, [loss], 0.0)
        res[f"update{k}"] = {"applied": u.applied, "predicted": u.update_ratio, "grad_norm": u.grad_norm,
                             "true": true_ratio(before, flat_params())}
    # far too large: refused, nothing changes
    loss = backward()
    for g in optimizer.param_groups:
        g["lr"] = 1e3
    before = flat_params()
    inner = optimizer.chained_optimizers[0].optimizer

    def adam_state() -> list[float]:
        return [float(s["exp_avg"].double().abs().sum() + s["step"]) for s in inner.state.values()]

    state_before = adam_state()
    u = guarded_step(optimizer, [loss], 0.5)
    state_after = adam_state()
    res["huge_lr"] = {"applied": u.applied, "refused": u.refused, "ratio": u.update_ratio,
                      "unchanged": all(torch.equal(x, y) for x, y in zip(before, flat_params()))
                      and state_before == state_after}
    for g in optimizer.param_groups:
        g["lr"] = 1e-3
    loss = backward(float("nan") if rank == 1 else 1.0)  # NaN loss (and so NaN grads) from rank 1 only
    res["nan_loss_rank1"] = guarded_step(optimizer, [loss] if rank == 1 else [], 0.5).refused
    backward()
    if rank == 0:
        model.buffers[0].grad_data[3] = float("inf")  # reaches the main grads in prepare_grads
    res["inf_grad_rank0"] = guarded_step(optimizer, [], 0.5).refused
    with torch.no_grad():
        if rank == 1:
            next(model.parameters()).view(-1)[5] = float("nan")
    try:
        check_finite_weights(model, "3.1")
        res["weights"] = "passed"
    except FloatingPointError as e:
        res["weights"] = str(e)
    Path(out, f"{layout}.rank{rank}.json").write_text(json.dumps(res))


def test_update_ratio_is_predicted_exactly_and_refusals_agree_on_all_ranks(tmp_path):
    import torch.multiprocessing as mp

    from da3po_megatron.megatron.runtime import bind_rendezvous

    stores = [bind_rendezvous(2) for _ in LAYOUTS]  # this process serves each world's store (bound before it is told)
    mp.spawn(_ranks, args=(2, [s.port for s in stores], str(tmp_path)), nprocs=2, join=True)
    for layout in LAYOUTS:
        r0, r1 = (json.loads((tmp_path / f"{layout}.rank{i}.json").read_text()) for i in (0, 1))
        for r in (r0, r1):
            for k in ("update1", "update2"):
                u = r[k]
                assert u["applied"] and u["predicted"] == pytest.approx(u["true"], rel=1e-4), (layout, k, u)
            assert r["huge_lr"]["applied"] is False and r["huge_lr"]["refused"] == ["update_ratio"], r["huge_lr"]
            assert r["huge_lr"]["ratio"] > 0.5 and r["huge_lr"]["unchanged"], r["huge_lr"]
            assert r["nan_loss_rank1"] in (["loss", "grad"], ["loss"]), r
            assert r["inf_grad_rank0"] == ["grad"], r
            assert "became non-finite in optimizer update 3.1" in r["weights"]
        for k in ("update1", "update2"):  # every rank computed the same global values
            assert r0[k]["predicted"] == r1[k]["predicted"] and r0[k]["grad_norm"] == r1[k]["grad_norm"]
        print(layout, {k: r0[k] for k in ("update1", "update2")}, r0["huge_lr"])
