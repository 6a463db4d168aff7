"""Routing replay on a real megatron-core MoE model, one process (gloo, world 1): run by tests/test_moe.py as
``python tests/_moe_replay.py HF_DIR OUT_JSON``. Records the routes of a forward, replays them (logits must not
change), replays other routes (logits must change, agreement < 1), checks the router keeps its gradient under
replay, and measures the routing agreement between the same weights computed in float32 and in bfloat16."""

from __future__ import annotations

import json
import sys

import torch


def main(hf_dir: str, out: str) -> None:
    from da3po_megatron.bridge.hf_config import gpt_arch
    from da3po_megatron.bridge.megatron_io import load_hf_weights
    from da3po_megatron.config import ModelConfig, MoEConfig
    from da3po_megatron.megatron import moe
    from da3po_megatron.megatron.model import build_gpt_model, import_megatron_core

    import_megatron_core()
    from da3po_megatron.megatron.runtime import ParallelLayout, destroy_parallel, init_parallel

    init_parallel(ParallelLayout(), rank=0, world_size=1)
    try:
        arch = gpt_arch(hf_dir)
        model = build_gpt_model(arch, ModelConfig(params_dtype="float32"), moe=MoEConfig(routing_replay="rollout"))
        load_hf_weights(model, hf_dir)
        tokens = torch.randint(0, arch.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
        pos = torch.arange(40).unsqueeze(0)

        def logits():
            return model(tokens, pos, None).detach().clone()

        moe.record_routes(model)
        base = logits()
        routes = moe.recorded_routes(model)
        moe.replay_routes(model, routes)
        same = logits()
        other = routes.clone()
        other[::2] = (other[::2] + 1) % arch.num_moe_experts  # every other token routed elsewhere
        moe.replay_routes(model, other)
        changed = logits()
        moe.replay_routes(model, routes)
        model.zero_grad()
        model(tokens, pos, None).sum().backward()
        grad = moe.routers(model)[0].weight.grad
        moe.clear_routes(model)
        free = logits()
        result = {"routes_shape": list(routes.shape), "replay_same_max_diff": float((same - base).abs().max()),
                  "replay_other_max_diff": float((changed - base).abs().max()),
                  "free_max_diff": float((free - base).abs().max()),
                  "agreement_self": moe.router_agreement(routes, routes),
                  "agreement_other": moe.router_agreement(routes, other),
                  "router_grad_norm": float(grad.norm()) if grad is not None else 0.0}
        # the mismatch R3 removes: the same weights computed in bf16 route some (token, layer) pairs differently
        long = torch.randint(0, arch.vocab_size, (1, 400), generator=torch.Generator().manual_seed(1))
        lpos = torch.arange(400).unsqueeze(0)
        moe.record_routes(model)
        model(long, lpos, None)
        fp32_routes = moe.recorded_routes(model)
        half = build_gpt_model(arch, ModelConfig(params_dtype="bfloat16"), moe=MoEConfig(routing_replay="rollout"))
        load_hf_weights(half, hf_dir)
        moe.record_routes(half)
        half(long, lpos, None)
        result["agreement_fp32_vs_bf16"] = moe.router_agreement(fp32_routes, moe.recorded_routes(half))
        with open(out, "w") as f:
            json.dump(result, f)
    finally:
        destroy_parallel()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
