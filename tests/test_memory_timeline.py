"""The device-memory timeline of a colocated GPU (megatron/memory_timeline.py; issue 57, point 1), pure.

The shipped colocated recipe (examples/qwen3_8b_da3po_colocated.yaml: Qwen3-8B, TP 1 x DP 8, 8 engines of TP 1,
``actor.offload: grads+optimizer``, ``gpu_memory_utilization: 0.8``) at its real size, on an 8 x H200 node and on
80 GB GPUs, replayed with the trainer's call order of today and with the fixed order
(megatron/memory_timeline_calls.py). Today's order must name P1 (the engines start beside the fully resident policy:
vLLM's start-up rule refuses) and P2 (a save and a resync reload gradients and optimizer beside the awake engines' KV
cache); the fixed order fits the H200 through start-up, a resume's load and sync, generation, training, the sync,
evaluation, an asynchronous save with its HF copy and an engine's restart and resync.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from da3po_megatron.megatron.memory_timeline import (
    GPU_80GB,
    H200,
    DeviceTimeline,
    Figures,
    TimelineError,
    figures_for_config,
    pow2ceil,
)
from da3po_megatron.megatron.memory_timeline_calls import call_sequence

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "rope_theta": 1000000}
RECIPE = Path(__file__).resolve().parents[1] / "examples/qwen3_8b_da3po_colocated.yaml"
EVERYTHING = {"resume": True, "restart_at": 2, "async_save": True, "hf": True, "steps": 2, "save_steps": (2,)}


def recipe(*overrides: str) -> tuple:
    from da3po_megatron.bridge.hf_config import gpt_arch
    from da3po_megatron.config import load_config

    return load_config(RECIPE, ["model.path=/x", *overrides]), gpt_arch(QWEN3_8B)


def figures(total: int, *overrides: str) -> Figures:
    from da3po_megatron.megatron.memory import estimate_for_config

    cfg, arch = recipe(*overrides)
    return figures_for_config(cfg, arch, total, estimate_for_config(cfg, arch, device="cuda", te=True))


def named(tl: DeviceTimeline) -> set[tuple[str, str, str]]:
    return {(v.phase, v.event, v.kind) for v in tl.violations}


@pytest.mark.parametrize("total", [H200, GPU_80GB], ids=["h200", "80gb"])
def test_todays_order_names_p1_engines_start_beside_the_resident_policy_and_p2_reloads_beside_the_kv_cache(total):
    tl = DeviceTimeline(figures(total)).run(call_sequence("today", **EVERYTHING))
    print(tl.table())
    for v in tl.violations:
        print(v)
    got = named(tl)
    assert ("start-up", "engines:start", "startup") in got  # P1: vLLM's request_memory refuses
    assert ("save", "policy:reload", "overflow") in got  # P2: OffloadCycle.resident beside the awake KV cache
    assert ("resync", "policy:reload", "overflow") in got  # P2: around_sync -> engines_asleep after a restart
    assert ("resume-load", "policy:load_checkpoint", "overflow") in got  # a resume loads beside the awake engines
    p1 = next(v for v in tl.violations if v.kind == "startup")
    assert "before the engines start" in p1.fix and "rollout.gpu_memory_utilization<=" in p1.fix
    if total == H200:  # the read's numbers: ~88 GiB free against 112.3 GiB asked
        assert 87 < p1.have / 2**30 < 89 and round(p1.need / 2**30, 1) == 112.3
    with pytest.raises(TimelineError, match=r"start-up: engines:start: vLLM refuses to start.*save: policy:reload: "
                                            r"device memory exceeded.*the engines must sleep"):
        tl.refuse()


def test_the_fixed_order_fits_the_recipe_on_an_h200_through_every_phase():
    tl = DeviceTimeline(figures(H200)).run(call_sequence("fixed", **EVERYTHING))
    print(tl.table())
    assert tl.violations == []
    tl.refuse()
    phases = dict((p, peak) for p, peak, _ in tl.phases())
    assert {"start-up", "resume-load", "resume-sync", "generate", "old-logprobs", "train", "save", "sync",
            "evaluate", "resync"} <= set(phases)
    assert max(phases.values()) <= H200
    # generation beside the offloaded policy: runtime + params + the engine's util x total + its context
    assert round(phases["generate"] / 2**30, 1) == round((2 + 15.26 + 112.32 + 0.5), 1)


def test_on_80gb_gpus_the_fixed_order_names_the_fields_and_fits_once_they_change():
    tl = DeviceTimeline(figures(GPU_80GB)).run(call_sequence("fixed", **EVERYTHING))
    for v in tl.violations:
        print(v)
    fixes = {(v.phase, v.fix.split(",")[0]) for v in tl.violations}
    assert ("old-logprobs", "lower actor.max_tokens_per_microbatch") in fixes  # the 81 GiB step peak alone
    assert any(v.phase == "start-up" and "rollout.gpu_memory_utilization<=0.77" in v.fix for v in tl.violations)
    tl = DeviceTimeline(figures(GPU_80GB, "rollout.gpu_memory_utilization=0.7",
                                "actor.max_tokens_per_microbatch=6144")).run(call_sequence("fixed", **EVERYTHING))
    print(tl.table())
    assert tl.violations == []


def test_training_beside_an_awake_engine_p4_names_the_setting_that_makes_them_sleep():
    fig = figures(H200)
    tl = DeviceTimeline(fig).run(["policy:build", "policy:offload grads+optimizer", "engines:start",
                                  "phase:generate", "engines:generate", "phase:train", "policy:reload",
                                  "policy:train_step"])
    v = tl.violations[0]
    assert (v.phase, v.event) == ("train", "policy:reload")
    tl = DeviceTimeline(replace(fig, tier="none")).run(["policy:build", "phase:start-up", "engines:start"])
    assert tl.violations[0].fix.startswith("a larger actor.offload tier")
    tl = DeviceTimeline(replace(fig, engine_budget=int(0.45 * H200), util=0.45)).run(  # forward fits, the step not
        ["policy:build", "engines:start", "phase:train", "policy:forward", "policy:train_step"])
    assert [v.event for v in tl.violations] == ["policy:train_step"]
    assert "rollout.staleness=0" in tl.violations[0].fix


def test_a_forward_while_offloaded_and_an_unknown_event_are_refused():
    tl = DeviceTimeline(replace(figures(H200), tier="all")).run(["policy:build", "policy:offload", "policy:forward"])
    assert [(v.event, v.kind) for v in tl.violations] == [("policy:forward", "offloaded")]
    with pytest.raises(ValueError, match="unknown timeline event 'policy:dance'"):
        tl.apply("policy:dance")


def test_pinned_host_buffers_are_counted_as_allocated_rounded_to_powers_of_two_p6():
    assert [pow2ceil(n) for n in (0, 1, 3, 4, 5, 2**20 + 1)] == [0, 1, 4, 4, 8, 2**21]
    fig = figures(H200)
    nominal = fig.masters + fig.moments
    tl = DeviceTimeline(fig).run(call_sequence("fixed", steps=2, save_steps=(), final_save=False))
    print(f"pinned {tl.host_pinned() / 2**30:.1f} GiB per GPU for {nominal / 2**30:.1f} GiB offloaded")
    assert nominal < tl.host_pinned() < 2 * nominal  # the optimizer's storages, each rounded up
    assert set(tl.host) == {"masters", "moments"}  # grads are freed without a copy; params stay (the tier)


def test_the_host_plan_counts_the_pinned_offload_buffers_and_the_staging_as_allocated_p6():
    """P6, the host side: the async-save check (``memory_host.check_async_save_memory``, from bring-up's memory
    preflight) budgets against host memory the probe measured before any offload buffer exists. The 8B colocated
    recipe with ``trainer.async_save=true``, 8 ranks per node: staging 26.7 GiB per rank nominal (214 GiB per
    node) fits 256 GiB less the 10 % reserve (230 GiB) -- what b6cc7ac concluded -- but pinned as torch allocates it
    (powers of two) the staging is 36.5 GiB per rank and the offload buffers (grads+optimizer) take 15.7 GiB per
    rank first: 418 GiB per node, so saves fall back to synchronous; 512 GiB holds both; 128 GiB cannot hold even
    the offload buffers, refused naming actor.offload. The figures are the device timeline's host row."""
    from da3po_megatron.megatron.memory import MemoryBudgetError
    from da3po_megatron.megatron.memory_host import check_async_save_memory

    GiB = 2**30
    said: list[str] = []
    cfg, arch = recipe("trainer.async_save=true")
    kept = check_async_save_memory(cfg, arch, 8, 256 * GiB, "cuda", True, said.append)
    print("\n".join(said))
    assert not kept and not cfg.trainer.async_save and "SYNCHRONOUSLY" in said[-1]  # b6cc7ac: kept on
    assert "pinned offload buffers (actor.offload=grads+optimizer) 15.7 GiB per rank as allocated (nominal 11.4" in \
        said[0] and "125.3 GiB for the node's 8 rank(s), in 230.4 GiB" in said[0]
    assert "stage ~36.5 GiB per rank as allocated (nominal 26.7)" in said[-1] and "in 105.1 GiB" in said[-1]
    cfg, arch = recipe("trainer.async_save=true")
    assert check_async_save_memory(cfg, arch, 8, 512 * GiB, "cuda", True, said.append) and cfg.trainer.async_save
    with pytest.raises(MemoryBudgetError, match=r"more than the node's 115.2 GiB: lower actor.offload"):
        check_async_save_memory(cfg, arch, 8, 128 * GiB, "cuda", True, said.append)

    from da3po_megatron.megatron.memory_host import pinned_host_bytes

    pinned, fig = pinned_host_bytes(cfg, arch, "cuda", te=True), figures(H200, "trainer.async_save=true")
    assert pinned["offload"] == fig.pinned["masters"] + fig.pinned["moments"]
    assert pinned["staging"] == fig.pinned["staging"]
    assert pinned_host_bytes(recipe("actor.offload=none")[0], arch, "cuda", te=True)["offload"] == 0
    assert pinned_host_bytes(recipe("actor.offload=all")[0], arch, "cuda", te=True)["offload"] == \
        pinned["offload"] + fig.pinned["params"]


def test_the_memory_preflight_replays_the_trainers_order_and_refuses_today_naming_phase_and_field(monkeypatch):
    """``check_policy_memory(..., total=)`` (the probe's ``total_bytes``, passed by bring-up's memory preflight): the
    engine's share is util x total, and the timeline of the trainer's order (``memory_timeline_calls.TRAINER_ORDER``,
    "fixed" since the trainer-side fixes of P1 and P2) is printed: the recipe passes on an H200; the order before the
    fixes ("today") is refused naming P1."""
    from da3po_megatron.megatron import memory_timeline_calls
    from da3po_megatron.megatron.memory import MemoryBudgetError, check_policy_memory

    assert memory_timeline_calls.TRAINER_ORDER == "fixed"
    cfg, arch = recipe()
    kw = {"available": H200 - 2 * 2**30, "device": "cuda", "te": True, "total": H200}
    logs: list[str] = []
    assert check_policy_memory(cfg, arch, log=logs.append, **kw) == cfg.actor.max_tokens_per_microbatch
    monkeypatch.setattr(memory_timeline_calls, "TRAINER_ORDER", "today")
    with pytest.raises(MemoryBudgetError, match=r"start-up: engines:start: vLLM refuses to start"):
        check_policy_memory(cfg, arch, log=lambda m: None, **kw)
    line = next(m for m in logs if "device timeline per GPU (fixed call order" in m)
    print(line)
    assert "start-up 130.1" in line and "train 82.8" in line and "resync 132.4" in line


def test_the_preflight_budgets_training_beside_an_awake_engine_when_the_engines_do_not_sleep_p4():
    from da3po_megatron.megatron.memory import MemoryBudgetError, check_policy_memory, engines_sleep_while_training

    cfg, arch = recipe("rollout.staleness=1", "actor.offload=none")
    assert not engines_sleep_while_training(cfg) and engines_sleep_while_training(recipe()[0])
    with pytest.raises(MemoryBudgetError, match=r"colocated beside an awake engine"):
        check_policy_memory(cfg, arch, available=H200, device="cuda", te=True, total=H200, log=lambda m: None)


def test_the_report_prints_the_recipes_table_and_fails_on_todays_order(tmp_path, capsys):
    """``python -m da3po_megatron.trainer.cluster.timeline_report`` (docs/colocation.md's table): exit 0 on the fixed
    order of the 8B colocated recipe on an H200, 1 on today's, naming the violations."""
    import json

    from da3po_megatron.trainer.cluster.timeline_report import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(QWEN3_8B))
    assert main([str(RECIPE), "--hf-config", str(cfg), "--device", "h200", "--order", "fixed"]) == 0
    assert "peak per phase (GiB of 140.4): start-up 130.1" in capsys.readouterr().out
    assert main([str(RECIPE), "--hf-config", str(cfg), "--device", "h200", "--order", "today"]) == 1
    assert "VIOLATION" in capsys.readouterr().out
