#!/usr/bin/env python
"""The MoE step of ``tools/gpu/gpu_check.sh`` (issue 46 point 4): a tiny Qwen3-MoE of Qwen3-30B-A3B's proportions on one
device, through megatron-core's local spec (the device image has no Transformer-Engine and no vLLM).

What it exercises, on CUDA: megatron-core's ``MoELayer`` with the local spec's ``SequentialMLP`` experts and the
``alltoall`` dispatcher at EP 1 (bf16, fp32 router); routing replay R3 on the policy side (``moe.routing_replay=
rollout``: engine-like routes -- random distinct top-k experts per position, the shape an engine returns -- replayed
in the old-log-prob and the training forwards through ``megatron/moe.py``; agreement must be 1.0 in both, the loss
and gradient finite, the router's gradient present); and the expert weight export a sync streams (the bridge's
``export_policy`` into buckets, ``rollout/buckets.iter_buckets``) with its peak extra device memory (CUDA:
``torch.cuda.max_memory_allocated`` above the start; CPU: the ``torch.profiler`` memory timeline, as
``tools/measure/expert_sync_memory.py`` measures) against the bound docs/moe.md states for a sender: two buckets and
one gathered tensor -- here at most ``2 x bucket + 2 x largest tensor``.

What it cannot: EP > 1 (one GPU), the TE spec's grouped experts (no TE), vLLM's route capture (Model Runner V2) and
the receiving engine (no vLLM), NCCL between ranks. One process, world size 1; prints one JSON line, exit 1 on a
failed check. ``--small``: the tiny CPU shape (tests/test_gpu_check_script.py).

    python tools/gpu/check_moe_gpu.py [--small]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile


def _routes(n: int, layers: int, k: int, experts: int, seed: int):
    """Engine-like routes: [n positions, layers, k] uint8, k distinct experts per (position, layer)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, layers, experts, generator=g).argsort(-1)[..., :k].to(torch.uint8).numpy()


def _peak_extra(fn) -> int:
    """Peak bytes allocated above the start while ``fn()`` runs: CUDA's allocator counter, or on CPU the torch
    profiler's memory timeline (:func:`da3po_megatron.testing.memory_probe.traced`)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - base)
    from da3po_megatron.testing.memory_probe import traced

    return traced(None, lambda _w: fn())["peak_bytes"]


def check(small: bool, bucket_mb: float) -> dict:
    import torch

    from da3po_megatron import tiny
    from da3po_megatron.bridge.export import export_policy, load_policy_hf
    from da3po_megatron.bridge.hf_config import gpt_arch
    from da3po_megatron.config import standalone_policy_config
    from da3po_megatron.megatron.batching import PolicyBatch
    from da3po_megatron.megatron.policy import PolicyWorker
    from da3po_megatron.rollout.buckets import iter_buckets

    cuda = torch.cuda.is_available()
    shape = tiny.real_shape("Qwen3-30B-A3B")  # expert width 0.375 x hidden, untied head
    if not small:  # wider on the GPU: 1024 hidden, 64 experts of 384, 4 layers (~0.3 B parameters)
        shape.update(hidden_size=1024, moe_intermediate_size=384, ffn_hidden_size=3072, num_experts=64,
                     num_experts_per_tok=8, num_layers=4, num_heads=8, num_kv_heads=4, max_position_embeddings=2048)
    work = tempfile.mkdtemp(prefix="check_moe_gpu_")
    family = shape.pop("family")
    hf = str(tiny.build_model(os.path.join(work, "hf"), family=family, seed=0, **shape))
    arch = gpt_arch(hf)
    cfg = standalone_policy_config(hf, [
        "moe.routing_replay=rollout", f"model.params_dtype={'bfloat16' if cuda else 'float32'}",
        "actor.loss_backend=torch", "optim.lr=1e-4", "actor.max_tokens_per_microbatch=4096",
        "actor.ppo_mini_batch_size=512", "data.train_batch_size=512"])
    w = PolicyWorker(cfg, arch)
    assert load_policy_hf(w, hf)
    n, plen, rlen = (4, 8, 24) if small else (16, 256, 768)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, arch.vocab_size, (n, plen), generator=g).tolist()
    responses = torch.randint(10, arch.vocab_size, (n, rlen), generator=g).tolist()
    layers = sum(arch.moe_pattern())
    routes = [_routes(plen + rlen - 1, layers, arch.moe_router_topk, arch.num_moe_experts, i) for i in range(n)]
    lp = w.compute_logprobs(PolicyBatch(prompts, responses, routed_experts=routes))
    replay_lp = w.routing_stats()
    adv = [1.0 if i % 2 else -1.0 for i in range(n)]
    m = w.train_step(PolicyBatch(prompts, responses, lp, adv, routed_experts=routes))
    bucket = int(bucket_mb * 2**20)
    largest = 0

    def export() -> None:
        nonlocal largest
        for b in iter_buckets(export_policy(w), bucket):
            largest = max([largest, *(t.numel() * t.element_size() for t in b.values())])

    peak = _peak_extra(export)
    w.shutdown()
    bound = 2 * bucket + 2 * largest
    res = {"check": "moe_step", "device": "cuda" if cuda else "cpu", "dtype": cfg.model.params_dtype,
           "shape": {"hidden": arch.hidden_size, "experts": arch.num_moe_experts, "top_k": arch.moe_router_topk,
                     "expert_width": arch.moe_ffn_hidden_size, "moe_layers": layers}, "tokens": n * (plen + rlen),
           "logprob_router_agreement": replay_lp.get("router_agreement"),
           "train_router_agreement": m.get("router_agreement"), "loss": m["loss"], "grad_norm": m["grad_norm"],
           "export_peak_extra_bytes": peak, "largest_tensor_bytes": largest, "bucket_bytes": bucket,
           "export_bound_bytes": bound}
    res["ok"] = bool(replay_lp.get("router_agreement") == 1.0 and m.get("router_agreement") == 1.0
                     and math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
                     and peak <= bound)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="the tiny CPU shape")
    ap.add_argument("--bucket-mb", type=float, default=None, help="export bucket size (default 16, --small 0.25)")
    args = ap.parse_args(argv)
    res = check(args.small, args.bucket_mb or (0.25 if args.small else 16.0))
    print(json.dumps(res))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
