"""Every shipped recipe in ``examples/`` at its real size through the device-memory timeline (issue 57, point 2).

For each recipe that names a real model (Qwen3-4B, Qwen3-8B, Qwen3-30B-A3B; ``paper_base.yaml`` is the 4B recipes'
layout; the CPU recipes name tiny models and are left out) on the GPU its header names, an H200 (140.4 GiB): the
plan's own figures at the real size (``memory.estimate_for_config`` on CUDA with the TE spec,
``memory_timeline.figures_for_config``), replayed with the run's calls (a resume, an engine restart and resync, an
asynchronous save with its HF copy included). The colocated recipe replays the trainer's colocated order
(``call_sequence("fixed")``; tests/test_memory_timeline.py has its 80 GB and before-the-fix cases). A split layout
is two kinds of GPU, each checked (``split_sequences``): a policy GPU (the heaviest pipeline stage's rank: build,
a resume's load, old log-probs, training step, the sync's sender side, saves) and an engine GPU (vLLM's start-up
rules -- free >= util x total after its own context, a KV cache that holds one request of max_model_len -- then
generation, the collective sync's receive pool beside the awake KV cache, a restart and resync, evaluation). The
table printed is the one docs/colocation.md quotes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_memory_timeline import QWEN3_8B
from test_moe import QWEN3_30B_A3B

from da3po_megatron.megatron.memory_timeline import H200, DeviceTimeline, figures_for_config
from da3po_megatron.megatron.memory_timeline_calls import call_sequence, split_sequences

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
QWEN3_4B = {**QWEN3_8B, "hidden_size": 2560, "intermediate_size": 9728, "tie_word_embeddings": True}
MODELS = {"Qwen3-4B": QWEN3_4B, "Qwen3-8B": QWEN3_8B, "Qwen3-30B-A3B": QWEN3_30B_A3B}
RUN = {"resume": True, "restart_at": 2, "async_save": True, "hf": True, "steps": 2, "save_steps": (2,)}
GiB = 2**30


def _real(recipe: Path) -> str | None:
    """The real model a recipe names (the 4B layout for paper_base.yaml), None for the CPU recipes."""
    from da3po_megatron.config import load_config

    try:
        path = Path(str(load_config(recipe).model.path)).name
    except ValueError as e:  # a base file of defaults names no model: the recipes built on it do
        assert "model.path is empty" in str(e) and recipe.name == "paper_base.yaml", e
        return "Qwen3-4B"  # its layout is the 4B recipes' (tests/test_shipped_layouts.py)
    return next((n for n in sorted(MODELS, key=len, reverse=True) if path.startswith(n)), None)


ALL_RECIPES = [p.relative_to(EXAMPLES).as_posix() for p in sorted(EXAMPLES.rglob("*.yaml"))]
RECIPES = [r for r in ALL_RECIPES if _real(EXAMPLES / r) is not None]  # collected, not skipped: the CPU recipes below


def test_the_recipes_left_out_are_the_cpu_recipes_of_tiny_models():
    left_out = sorted(set(ALL_RECIPES) - set(RECIPES))
    assert left_out and all("cpu" in r for r in left_out), left_out
    assert len(RECIPES) >= 20, RECIPES


def _figures(recipe: str):
    from da3po_megatron.bridge.hf_config import gpt_arch
    from da3po_megatron.config import load_config
    from da3po_megatron.megatron.memory import estimate_for_config

    name = _real(EXAMPLES / recipe)
    cfg = load_config(EXAMPLES / recipe, ["model.path=/x"])
    arch = gpt_arch(MODELS[name])
    return cfg, figures_for_config(cfg, arch, H200, estimate_for_config(cfg, arch, device="cuda", te=True)), name


def _peaks(tl: DeviceTimeline) -> str:
    return ", ".join(f"{p} {peak / GiB:.1f}" for p, peak, _ in tl.phases())


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_shipped_layout_fits_its_gpus_at_real_size_through_every_phase(recipe):
    cfg, fig, name = _figures(recipe)
    r = cfg.rollout
    if r.colocate:
        tl = DeviceTimeline(fig).run(call_sequence("fixed", cfg.actor.offload, **RUN))
        print(f"{recipe} ({name}, colocated GPU, H200): {_peaks(tl)}")
        assert tl.violations == [], [str(v) for v in tl.violations]
        return
    seqs = split_sequences(**RUN)
    policy = DeviceTimeline(fig).run(seqs["policy"])
    engine = DeviceTimeline(fig).run(seqs["engine"])
    print(f"{recipe} ({name}; policy TP {cfg.parallel.tensor_model_parallel_size} x PP "
          f"{cfg.parallel.pipeline_model_parallel_size}, engine TP {r.tensor_parallel_size}, util "
          f"{r.gpu_memory_utilization}, H200)\n  policy GPU: {_peaks(policy)}\n  engine GPU: {_peaks(engine)}; "
          f"KV {fig.engine_kv / GiB:.1f} GiB (one request of {r.max_prompt_length + r.max_response_length} tokens: "
          f"{fig.kv_min / GiB:.2f}), receive pool {fig.receive_extra / GiB:.1f}")
    assert policy.violations == [] and engine.violations == [], \
        [str(v) for v in policy.violations + engine.violations]
    assert engine.policy_bytes() == 0 and policy.engine_bytes() == 0  # each GPU holds one side only
    assert max(p for _, p, _ in engine.phases()) == fig.engine_context + fig.engine_budget + fig.receive_extra
    assert fig.receive_extra > 0  # the collective transport ("auto" picks it for engines on other nodes)


def test_an_engine_gpu_whose_kv_cache_cannot_hold_one_request_is_refused_naming_the_fields():
    """vLLM refuses an engine whose KV cache (util x total less weights and graph pool) cannot hold one request of
    max_model_len (``vllm/v1/core/kv_cache_utils.py:1003-1040``): the 30B recipe's engines at TP 1 (its 61 GB of
    weights on one GPU) and util 0.41 leave no KV cache at all."""
    from da3po_megatron.bridge.hf_config import gpt_arch
    from da3po_megatron.config import load_config
    from da3po_megatron.megatron.memory import estimate_for_config

    cfg = load_config(EXAMPLES / "qwen3_30b_a3b_da3po.yaml", ["model.path=/x", "rollout.tensor_parallel_size=1",
                                                               "rollout.gpu_memory_utilization=0.41"])
    arch = gpt_arch(QWEN3_30B_A3B)
    fig = figures_for_config(cfg, arch, H200, estimate_for_config(cfg, arch, device="cuda", te=True))
    tl = DeviceTimeline(fig).run(split_sequences()["engine"])
    v = tl.violations[0]
    assert (v.phase, v.event, v.kind) == ("start-up", "engines:start", "kv")
    assert "rollout.gpu_memory_utilization" in v.fix and "rollout.tensor_parallel_size" in v.fix
    print(v)
