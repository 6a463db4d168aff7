"""The engine side of MoE routes: where an engine gets them and which completions carry them (moved out of
``rollout/engine.py``, issue 46 M3).

Routes cost 1 byte per position, MoE layer and top-k slot (384 B per position for Qwen3-30B-A3B), so an engine
returns them only for the completions something reads: every completion under routing replay R3, the
``SamplingConfig.routes_fraction`` sample for the router-agreement metric alone (``routes.routes_selected``), none
for evaluation. The worker capture (CPU) still assembles every request's routes -- its prefix-block store needs them
-- and returns only the selected ones, so the others never leave the worker process.

Whether an engine captures at all is :func:`route_capture`, the one decision: only when something reads its routes
(``EngineConfig.return_routed_experts``, set by the trainer from ``memory_host.route_fraction``: R3 or the agreement
metric's sample). On CUDA vLLM's switch is engine-wide -- vLLM 0.32 has no per-request one
(``config/aux_output.py``; ``SamplingParams.routed_experts_prompt_start``, ``sampling_params.py:436``, only trims
prompt rows) -- so an engine that captures for the agreement sample captures every request's routes inside vLLM,
evaluation's included, and drops the unread ones in the engine process (:func:`vllm_routes`); the host plan says how
many bytes that is (``memory_host.route_plan_line``).
"""

from __future__ import annotations

from typing import Any

from da3po_megatron.rollout.types import EngineConfig, RolloutError, SamplingConfig


def route_capture(config: EngineConfig, has_cuda: bool) -> str:
    """Where an engine captures MoE routes (module doc): "none" unless something reads them
    (``config.return_routed_experts``); "vllm" on CUDA (``LLM(enable_return_routed_experts=True)``, engine-wide);
    "worker" elsewhere (``rollout/routes.py: RouteCapture``, installed by ``da3po_routes_enable``)."""
    if not config.return_routed_experts:
        return "none"
    return "vllm" if has_cuda else "worker"


def route_source(config: EngineConfig, has_cuda: bool) -> dict[str, Any]:
    """Where an engine with ``return_routed_experts`` gets its routes. CPU: the worker-side capture
    (``rollout/routes.py``; vLLM's own needs Model Runner V2, which needs a GPU). CUDA: vLLM 0.32's
    ``enable_return_routed_experts`` (``config/aux_output.py``; V2, the default runner where Triton has a GPU,
    ``config/vllm.py`` 702-738), whose ``CompletionOutput.routed_experts`` is ``[positions, all hidden layers,
    top_k]`` (``outputs.py`` 84; dense layers' columns unused): the MoE layers' columns are kept
    (:func:`vllm_routes`). The GPU path has not run in this project's CI (docs/gpu_only.md)."""
    if route_capture(config, has_cuda) != "vllm":
        return {"source": "worker"}
    from da3po_megatron.bridge.hf_config import gpt_arch

    arch = gpt_arch(config.model_path)
    return {"source": "vllm", "columns": [i for i, m in enumerate(arch.moe_pattern()) if m],
            "num_experts": arch.num_moe_experts}


def vllm_routes(outputs: list, ids: list[list[int]], source: dict[str, Any], keep: set | None = None) -> dict:
    """{(request id, sample index): [P + R - 1, MoE layers, top_k]} from vLLM's own ``routed_experts`` (GPU), in
    the worker capture's layout and dtype (rows beyond vLLM's marked missing); only the samples in ``keep``."""
    import numpy as np

    from da3po_megatron.rollout.types import route_dtype, route_missing

    dtype = route_dtype(source["num_experts"])
    out = {}
    for pid, o in zip(ids, outputs):
        for sample in o.outputs:
            key = (o.request_id, int(sample.index))
            if keep is not None and key not in keep:
                continue
            got = getattr(sample, "routed_experts", None)
            if got is None:
                raise RolloutError(f"request {o.request_id}: vLLM returned no routed_experts (needs Model Runner "
                                   "V2: LLM(enable_return_routed_experts=True))")
            got = np.asarray(got)[:, source["columns"], :]
            n = len(pid) + len(sample.token_ids) - 1
            rows = np.full((n, got.shape[1], got.shape[2]), route_missing(dtype), dtype=dtype)
            rows[:min(n, len(got))] = got[:n]
            out[key] = rows
    return out


def take_routes(llm: Any, source: dict[str, Any], outputs: list, ids: list[list[int]], prompt_indices: list[int],
                sampling: SamplingConfig) -> dict:
    """The routes of the finished samples ``sampling.routes_fraction`` selects (``routes.routes_selected`` of the
    prompt's global index and the sample's number): {(request id, sample index): [P + R - 1, MoE layers, top_k]}.
    Worker capture: from worker 0 (the routers of TP workers agree), which takes every sample's capture and returns
    only the kept ones."""
    from da3po_megatron.rollout.routes import routes_selected
    from da3po_megatron.rollout.worker_ext import routes_from_wire

    keep = {(o.request_id, int(s.index)) for gi, o in zip(prompt_indices, outputs) for s in o.outputs
            if routes_selected(gi, int(s.index), sampling.routes_fraction)}
    if source["source"] != "worker":
        return vllm_routes(outputs, ids, source, keep)
    keys, wanted = [], []
    for pid, out in zip(ids, outputs):
        for sample in out.outputs:
            seq = [int(t) for t in (*pid, *sample.token_ids)][:-1]  # positions run as inputs (ints: wire-safe)
            keys.append((out.request_id, int(sample.index)))
            wanted.append((out.request_id, int(sample.index) if sampling.n > 1 else None, seq))
    got = routes_from_wire(llm.collective_rpc("da3po_routes_take", args=(wanted, [k in keep for k in keys]))[0])
    return {k: r for k, r in zip(keys, got) if r is not None}
