"""MoE routes are captured only when something reads them, also on CUDA (issue 57; the fourth GPU read's M3 residual).

The decision runs from the run config to what ``vllm.LLM`` is given: ``trainer/cluster/bringup.engine_config`` sets
``EngineConfig.return_routed_experts`` from who reads routes (``memory_host.route_fraction``: routing replay R3, the
router-agreement metric's sample; nothing for streaming engines), ``rollout/engine_routes.route_capture`` turns that
into vLLM's own capture on CUDA (``enable_return_routed_experts`` in ``engine_setup.llm_kwargs``) or the worker hook
elsewhere. No GPU vLLM here: the kwargs are what the engine passes to ``vllm.LLM`` on CUDA (docs/gpu_only.md). vLLM
0.32's switch is engine-wide, so an engine that captures for the agreement sample carries every route of the step in
its own process; the host plan says how much.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
READERS = {  # overrides of the tiny MoE recipe -> where its engines capture on CUDA
    (): "vllm",  # the agreement metric's sample (moe.router_agreement_fraction 0.05)
    ("moe.routing_replay=rollout",): "vllm",  # R3 reads every route
    ("moe.router_agreement=false",): "none",
    ("moe.router_agreement_fraction=0",): "none",
    ("rollout.mode=streaming", "algorithm.filter_groups=false"): "none",  # streaming engines return no routes
}


@pytest.mark.parametrize("overrides", list(READERS), ids=lambda o: "+".join(o) or "agreement-sample")
def test_engines_capture_routes_on_cuda_only_when_something_reads_them_from_the_config_to_vllms_kwargs(overrides,
                                                                                                     tmp_path):
    from da3po_megatron.config import load_config
    from da3po_megatron.rollout.engine_routes import route_capture
    from da3po_megatron.rollout.engine_setup import llm_kwargs
    from da3po_megatron.trainer.cluster.bringup import engine_config

    cfg = load_config(EXAMPLES / "tiny_cpu_moe.yaml", ["model.path=/x", f"trainer.run_dir={tmp_path}", *overrides])
    want = READERS[overrides]
    gpu = engine_config(cfg, engine_cuda=True, moe=True)
    assert route_capture(gpu, has_cuda=True) == want
    assert ("enable_return_routed_experts" in llm_kwargs(gpu, has_cuda=True)) == (want == "vllm")
    assert route_capture(gpu, has_cuda=False) == ("worker" if want == "vllm" else "none")
    assert "enable_return_routed_experts" not in llm_kwargs(gpu, has_cuda=False)  # vLLM's needs Model Runner V2
    dense = engine_config(cfg, engine_cuda=True, moe=False)
    assert route_capture(dense, has_cuda=True) == "none"
    assert "enable_return_routed_experts" not in llm_kwargs(dense, has_cuda=True)


def test_evaluation_engines_never_capture_routes():
    """``da3po eval``'s engines (eval/command.py) read no routes: no capture on CUDA either."""
    from da3po_megatron.eval.command import _engine_config
    from da3po_megatron.rollout.engine_routes import route_capture
    from da3po_megatron.rollout.engine_setup import llm_kwargs

    args = SimpleNamespace(checkpoint="/x", dtype=None, seed=0, max_model_len=None, max_tokens=64,
                           tensor_parallel_size=1, kv_cache_gib=None)
    e = _engine_config(args, engine_cuda=True)
    assert route_capture(e, has_cuda=True) == "none"
    assert "enable_return_routed_experts" not in llm_kwargs(e, has_cuda=True)


def test_the_host_plan_says_what_the_engine_wide_capture_carries_on_cuda(tmp_path):
    """The 30B recipes (agreement sample 0.05, R3 off): 0.90 GiB per step reach the driver, but on CUDA vLLM's
    engine-wide capture carries every route of the step in the engine processes, ~18 GiB -- said in the plan's line,
    with the field that turns it off; not said where every route is read (R3) or on CPU (the worker capture returns
    only the sample)."""
    from test_moe import QWEN3_30B_A3B

    from da3po_megatron.bridge.hf_config import gpt_arch
    from da3po_megatron.config import load_config
    from da3po_megatron.megatron.memory_host import route_plan_line

    arch = gpt_arch(QWEN3_30B_A3B)

    def line(*o: str, cuda: bool = True) -> str:
        cfg = load_config(EXAMPLES / "qwen3_30b_a3b_da3po.yaml", ["model.path=/x", f"trainer.run_dir={tmp_path}", *o])
        return route_plan_line(cfg, arch, engine_cuda=cuda)

    gpu = line()
    print(gpu)
    assert "up to 0.90 GiB per step (router agreement on 0.05" in gpu
    assert "engine-wide" in gpu and "up to 18.00 GiB per step" in gpu and "moe.router_agreement=false" in gpu
    assert "engine-wide" not in line(cuda=False)
    assert "engine-wide" not in line("moe.routing_replay=rollout", "model.recompute_granularity=selective")
    assert "engine-wide" not in line("moe.router_agreement=false")
