"""Tiered trainer offload (``actor.offload``, megatron/offload.py; issue 49 points 3-4).

- The driver's order against the engines' sleep and wake (trainer/cluster/colocation.py OffloadCycle): recorded and
  asserted with recording stand-ins for the policy group and the engines (named so), for the "ipc" path (the hooks
  inside ``ipc_sync``) and the CPU path (``actor.offload_without_sleep``, hooks around the push).
- The real policy (megatron-core 0.16.1 on gloo, 2 ranks) trained twice from the same state, plain and with an
  offload / reload cycle around every generation phase (tests/_offload_job.py): bit-identical losses, gradient
  norms, pushed bytes, parameters and Adam state at DP 2 with the distributed optimizer, at TP 2 and at EP 2; every
  covered storage has size 0 while offloaded; the same tensor objects are valid after the reload; a forward and a
  train step while offloaded are refused naming actor.offload; the host buffers are allocated once (same pointers
  every cycle, host bytes = covered bytes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from da3po_megatron.megatron.offload import tier_parts
from da3po_megatron.trainer.cluster.colocation import OffloadCycle

JOB = Path(__file__).with_name("_offload_job.py")


def test_tiers_include_the_ones_before_them_and_name_the_field():
    assert tier_parts("none") == () and tier_parts("grads") == ("grads",)
    assert tier_parts("grads+optimizer") == ("grads", "optimizer")
    assert tier_parts("all") == ("grads", "optimizer", "params")
    with pytest.raises(ValueError, match="actor.offload='optim'"):
        tier_parts("optim")


class RecordingPolicyStandin:
    """Stands in for the PolicyGroup: records the offload calls (and ``run_on_all``'s function) into the shared log."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def call_all(self, method: str, *args):
        self.log.append(f"policy.{method}{'(' + '+'.join(args[0]) + ')' if args else ''}")
        return []

    def run_on_all(self, fn, *args):
        self.log.append(f"policy.{fn.__name__}")
        return []


class RecordingEnginesStandin:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def sleep(self, level: int) -> None:
        self.log.append(f"engines.sleep({level})")

    def wake_up(self, tags: list[str]) -> None:
        self.log.append(f"engines.wake_up({tags[0]})")


def _cycle(log: list[str], tier: str, ipc: bool) -> tuple[OffloadCycle, RecordingEnginesStandin]:
    """A cycle as bring-up makes it (``Cluster.start``): the tier offloaded before the engines start."""
    from da3po_megatron.trainer.cluster.colocation import start_engines_after_policy

    engines = RecordingEnginesStandin(log)
    cycle = OffloadCycle(RecordingPolicyStandin(log), tier, engines_sleep=ipc, without_sleep=not ipc)
    start_engines_after_policy(cycle.policy, lambda: None, lambda: log.append("engines.start") or engines,
                               cycle.offload_before_start)
    cycle.engines = engines
    cycle.engines_started()
    return cycle, engines


def _push(engines: RecordingEnginesStandin, log: list[str], ipc: bool):
    def push(before_wake=None, before_kv_wake=None):  # ipc_sync's order (rollout/ipc.py)
        if ipc:
            before_wake()
            engines.wake_up(["weights"])
        log.append("push")
        if ipc:
            before_kv_wake()
            engines.wake_up(["kv_cache"])
        return {}
    return push


def _step(cycle: OffloadCycle, engines: RecordingEnginesStandin, log: list[str], ipc: bool) -> None:
    """One step of the loop's calls as trainer/run.py makes them: generate, engines_idle, train, sync_weights."""
    log.append("generate")
    if ipc:
        engines.sleep(2)
    cycle.engines_asleep(slept=ipc)
    log.append("policy.train_step")
    cycle.around_sync(_push(engines, log, ipc), inside=ipc)


@pytest.mark.parametrize("ipc", [True, False], ids=["ipc-sleeping-engines", "cpu-offload-without-sleep"])
def test_offload_cycle_order_against_engine_sleep_and_wake(ipc):
    """Issue 57 P1: the tier leaves the device before the engines start; then the NeMo-RL cycle per step."""
    log: list[str] = []
    cycle, engines = _cycle(log, "all", ipc)
    for _ in range(2):
        _step(cycle, engines, log, ipc)
    start = ["policy.offload_state(grads+optimizer+params)", "policy.release_cached_memory", "engines.start"]
    off1, off2 = "policy.offload_state(grads+optimizer)", "policy.offload_state(params)"
    if ipc:
        one = ["generate", "engines.sleep(2)", "policy.reload_offloaded", "policy.train_step", off1,
               "engines.wake_up(weights)", "push", off2, "engines.wake_up(kv_cache)"]
    else:
        one = ["generate", "policy.reload_offloaded", "policy.train_step", off1, "push", off2]
    assert log == start + one + one  # the first step reloads what the start-up offloaded
    sync = ["policy:offload grads+optimizer", "policy:release_cached", "engines:wake weights", "sync:push",
            "policy:offload params", "policy:release_cached", "engines:wake kv_cache"]
    assert [e for e in cycle.calls if not e.startswith("phase:")] == [
        "policy:offload grads+optimizer+params", "engines:start"] + (["engines:sleep 2", "policy:reload"] + sync) * 2
    assert cycle.calls[-12:] == ["engines:sleep 2", "policy:reload", "phase:train", "phase:sync", *sync,
                                 "phase:generate"]


def _no_reload_beside_the_kv_cache(log: list[str]) -> None:
    """Issue 57 P2's invariant: no ``policy.reload_offloaded`` between an ``engines.wake_up(kv_cache)`` (or the
    engines' start) and the next ``engines.sleep``."""
    awake = False
    for i, ev in enumerate(log):
        if ev in ("engines.wake_up(kv_cache)", "engines.start"):
            awake = True
        elif ev.startswith("engines.sleep"):
            awake = False
        elif ev.startswith("policy.reload_offloaded"):
            assert not awake, f"{ev} beside the awake engines' KV cache (call {i}): {log}"


@pytest.mark.parametrize("tier", ["grads+optimizer", "all"])
def test_a_save_and_a_resync_reload_nothing_beside_the_awake_kv_cache(tier):
    """Issue 57 P2. A checkpoint after the sync (the engines awake, the policy offloaded) runs inside
    ``OffloadCycle.resident``: the engines sleep at level 1 first, the policy reloads, saves, offloads its tier and
    releases its cached blocks, then the engines wake weights and KV cache. A resync after an engine restart reloads
    the parameters only, and only at tier ``all`` (with the engines asleep first); at ``grads+optimizer`` nothing."""
    log: list[str] = []
    cycle, engines = _cycle(log, tier, ipc=True)
    _step(cycle, engines, log, ipc=True)
    mark = len(log)
    with cycle.resident():
        log.append("policy.save")
    parts = tier.replace("all", "grads+optimizer+params")
    assert log[mark:] == ["engines.sleep(1)", "policy.reload_offloaded", "policy.save",
                          f"policy.offload_state({parts})", "policy.release_cached_memory",
                          "engines.wake_up(weights)", "engines.wake_up(kv_cache)"]
    mark = len(log)
    log.append("engines.restart")
    cycle.around_sync(_push(engines, log, True), inside=True)  # the client's resync
    head = ["engines.sleep(1)", "policy.reload_offloaded(params)"] if tier == "all" else []
    assert log[mark + 1:] == head + ["policy.offload_state(grads+optimizer)", "engines.wake_up(weights)", "push",
                                     "policy.offload_state(params)", "engines.wake_up(kv_cache)"]
    _step(cycle, engines, log, ipc=True)
    with cycle.resident():  # the engines asleep and everything resident (not reached by the loop): nothing moves
        pass
    _no_reload_beside_the_kv_cache(log)
    print(cycle.calls)


def test_the_recorded_cycle_replays_the_timelines_fixed_order_at_the_8b_size():
    """The cycle's own record (``OffloadCycle.calls``, in the timeline's vocabulary), made by the real cycle driven
    in the loop's order with stand-ins, equals ``memory_timeline_calls.call_sequence("fixed")`` less what the cycle
    does not see (phases, the policy's build / loads / forward / train step, the engines' generate and restart),
    and replayed with those through the 8B colocated recipe's H200 figures it fits."""
    from da3po_megatron.megatron.memory_timeline import H200, DeviceTimeline, figures_for_config
    from da3po_megatron.megatron.memory_timeline_calls import TRAINER_ORDER, call_sequence

    log: list[str] = []
    cycle, engines = _cycle(log, "grads+optimizer", ipc=True)
    cycle.around_sync(_push(engines, log, True), inside=True)  # a resume's sync
    for step in (1, 2):
        if step == 2:  # an engine restarted during generation: the client's resync
            cycle.around_sync(_push(engines, log, True), inside=True)
        _step(cycle, engines, log, ipc=True)
        if step == 2:
            with cycle.resident():
                cycle.record("policy:save async")
                cycle.record("policy:save_hf")
    unseen = ("phase:", "policy:build", "policy:load", "policy:forward", "policy:train_step", "engines:generate",
              "engines:restart")
    written = call_sequence(TRAINER_ORDER, "grads+optimizer", steps=2, save_steps=(2,), eval_steps=(2,),
                            resume=True, restart_at=2, async_save=True, hf=True)
    cycle_calls = [e for e in cycle.calls if not e.startswith(("policy:release_cached", "engines:start", "phase:"))]
    assert [e for e in written if not e.startswith(unseen + ("policy:release_cached", "engines:start"))] == \
        cycle_calls
    assert cycle.calls[:2] == ["policy:offload grads+optimizer", "engines:start"]

    from dataclasses import replace

    from da3po_megatron.bridge.hf_config import gpt_arch
    from da3po_megatron.config import load_config
    from da3po_megatron.megatron.memory import estimate_for_config

    recipe = Path(__file__).resolve().parents[1] / "examples/qwen3_8b_da3po_colocated.yaml"
    cfg, arch = load_config(recipe, ["model.path=/x"]), gpt_arch(QWEN3_8B)
    fig = figures_for_config(cfg, arch, H200, estimate_for_config(cfg, arch, device="cuda", te=True))
    tl = DeviceTimeline(fig).run(written)
    assert tl.violations == [], [str(v) for v in tl.violations]
    tl = DeviceTimeline(replace(fig)).run(call_sequence("today", "grads+optimizer", steps=2, save_steps=(2,),
                                                        resume=True, restart_at=2, async_save=True, hf=True))
    assert {v.phase for v in tl.violations} >= {"start-up", "save", "resync"}


def test_the_cycle_also_records_the_loops_generation_rounds_forwards_train_steps_and_restarts():
    """``OffloadCycle.watch`` (bring-up calls it once the engines exist): the ``on_call`` hooks of the real
    ``RolloutClient`` (a generation round; a restart) and of the policy group (``PolicyGroup._call_sharded``: the
    old log-probs' forward, the training step) add the timeline's ``engines:generate``, ``engines:restart``,
    ``policy:forward`` and ``policy:train_step`` to the run's record -- at b6cc7ac the record had none of them, so a
    replayed run missed its training peaks. Local client with a stand-in engine; the policy side is the hook the
    group calls (its dispatch needs Ray: tests/test_colocated_offload_run.py runs it whole)."""
    from da3po_megatron.rollout import EngineConfig, RolloutClient, SamplingConfig
    from da3po_megatron.rollout.types import Completion

    class Engine:
        def generate(self, prompts, indices, sampling, max_tokens=None):
            return [Completion(prompt_index=i, sample_index=0, prompt_token_ids=[1], token_ids=[2], text="x",
                               logprobs=[-1.0], finish_reason="stop", num_tokens=1) for i in indices]

    log: list[str] = []
    cycle = OffloadCycle(RecordingPolicyStandin(log), "grads+optimizer", engines_sleep=False, without_sleep=True)
    client = RolloutClient(EngineConfig(model_path="stand-in"), [Engine()], mode="local")
    policy = RecordingPolicyStandin(log)
    cycle.watch(policy, client)
    client.generate(["a", "b"], SamplingConfig(n=1, max_tokens=1, apply_chat_template=False))
    policy.on_call("compute_logprobs")
    policy.on_call("train_step")
    policy.on_call("save")  # not a timeline event of its own (RunState records its saves)
    client.on_call("restart")
    assert cycle.calls == ["engines:generate", "policy:forward", "policy:train_step", "engines:restart"]
    assert client.__getstate__()["on_call"] is None  # a copy sent to a policy actor records nothing


def test_offload_is_inert_unless_the_engines_sleep_or_the_cpu_setting_asks():
    log: list[str] = []
    for cycle in (OffloadCycle(RecordingPolicyStandin(log), "all", engines_sleep=False),
                  OffloadCycle(RecordingPolicyStandin(log), "none", engines_sleep=True),
                  OffloadCycle(RecordingPolicyStandin(log), "all", engines_sleep=True, staleness=1)):
        cycle.around_sync(lambda *a: {}, inside=False)
        cycle.engines_asleep()
        assert not cycle.effective
    assert log == []


# ---------------------------------------------------------------------------------------------- the real policy
@pytest.fixture(scope="module")
def moe_hf(tmp_path_factory) -> Path:
    from da3po_megatron import tiny

    return tiny.build_moe_model(tmp_path_factory.mktemp("offload_moe"), seed=3)


@pytest.fixture(scope="module")
def dense_hf(tmp_path_factory) -> Path:
    from da3po_megatron.tiny import build_model

    return build_model(tmp_path_factory.mktemp("offload_dense") / "hf", family="qwen3", seed=0)


def _launch(layout: str, hf: Path, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(JOB), "--hf", str(hf), "--layout", layout, "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=JOB.parent)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.mark.parametrize("layout", ["dp2", "tp2", "ep2"])
def test_offload_cycle_is_bit_identical_and_frees_every_covered_storage(layout, dense_hf, moe_hf, tmp_path):
    res = _launch(layout, moe_hf if layout == "ep2" else dense_hf, tmp_path / "out.json")
    info = res["info"]
    assert (info["tp"], info["dp"]) == ((2, 1) if layout == "tp2" else (1, 2))
    assert res["distributed_optimizer"]
    for rank in res["ranks"]:
        plain, off = rank["plain"], rank["offload"]
        # bit-identical: losses and grad norms as float.hex, the pushed bytes, every parameter and Adam tensor
        for key in ("loss", "grad_norm", "push"):
            assert off[key] == plain[key], key
        assert off["state"] == plain["state"] and off["state"]["adam"], "parameters / Adam state differ"
        assert len(off["loss"]) == 3
        # the first cycle comes before the first step: Adam's state does not exist yet (torch creates it lazily)
        for i, (sizes, freed) in enumerate(zip(off["offloaded_sizes"], off["freed"])):
            assert sizes["grads"] and sizes["params"] and (sizes["optimizer"] or i == 0)
            assert all(v == 0 for part in sizes.values() for v in part), sizes  # every covered storage released
            assert freed["grads"] > 0 and freed["params"] > 0 and (freed["optimizer"] > 0 or i == 0)
        assert all(off["same_objects"])  # the same parameter / state / bucket objects, valid after the reload
        for refused in off["refused"]:
            assert refused[0].startswith("forward: a forward of the policy while the policy's params")
            assert refused[1].startswith("train: train_step while the policy's grads, optimizer, params")
            assert all("actor.offload='all'" in r for r in refused)
        # host memory peaks once: one host buffer per covered storage, allocated at its first offload and reused
        # after (same pointers); the second cycle adds Adam's state, created by the first step, and nothing later
        ptrs = off["host_pointers"]
        assert set(ptrs[0]) < set(ptrs[1]) and all(p == ptrs[1] for p in ptrs[1:])
        assert off["host_bytes"] == off["covered_bytes"] and len(set(off["host_bytes"][1:])) == 1
        assert off["calls"] == ["offload:grads", "offload:optimizer", "offload:params",
                                "reload:params", "reload:optimizer", "reload:grads"] * 3


QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "rope_theta": 1000000}


def test_colocated_plan_names_the_tier_the_qwen3_8b_recipe_needs():
    """The time-multiplexed plan (megatron/offload.py colocated_plan) for examples/qwen3_8b_da3po_colocated.yaml on
    an H200 with ~122 GiB free: training beside the sleeping engine fits; generation needs 'grads+optimizer' at
    gpu_memory_utilization 0.8, only 'grads' at 0.6 -- and memory.check_policy_memory refuses the recipe without
    offload, naming the tier."""
    from da3po_megatron.bridge.hf_config import gpt_arch
    from da3po_megatron.config import load_config
    from da3po_megatron.megatron.memory import GiB, MemoryBudgetError, check_policy_memory, estimate_for_config
    from da3po_megatron.megatron.offload import colocated_plan

    recipe = Path(__file__).resolve().parents[1] / "examples/qwen3_8b_da3po_colocated.yaml"
    cfg, arch, free = load_config(recipe), gpt_arch(QWEN3_8B), int(122 * GiB)
    est = estimate_for_config(cfg, arch, device="cuda", te=True)
    assert set(est.static) == {"params", "grads", "optimizer"} and est.static["grads"] == 2 * est.static["params"]
    plan = colocated_plan(est.static, est.components["runtime"], est.total, free, int(0.8 * free), "none")
    assert plan["train_fits"] and not plan["fits"] and plan["needed"] == cfg.actor.offload == "grads+optimizer"
    assert plan["resident"]["none"] > plan["resident"]["grads"] > plan["resident"]["grads+optimizer"] > \
        plan["resident"]["all"]
    assert colocated_plan(est.static, est.components["runtime"], est.total, free, int(0.6 * free), "none")[
        "needed"] == "grads"
    logs: list[str] = []
    assert check_policy_memory(cfg, arch, available=free, device="cuda", te=True, log=logs.append)
    assert any("needs actor.offload='grads+optimizer' (configured 'grads+optimizer')" in m for m in logs)
    from dataclasses import replace

    with pytest.raises(MemoryBudgetError, match=r"set actor.offload='grads\+optimizer'"):
        check_policy_memory(replace(cfg, actor=replace(cfg.actor, offload="none")), arch, available=free,
                            device="cuda", te=True, log=logs.append)


def test_the_colocated_recipe_places_policy_and_engines_on_one_8_gpu_node() -> None:
    """examples/qwen3_8b_da3po_colocated.yaml as written: 8 policy ranks and 8 engines on ONE 8-GPU node, engine i in
    policy rank i's GPU bundle, and the IPC routing of the first sync (ipc_routing.check_colocated_layout) serves it."""
    from da3po_megatron.config import load_config
    from da3po_megatron.trainer.cluster.placement import Node, plan_placement, resources_for_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "examples/qwen3_8b_da3po_colocated.yaml",
                      ["model.path=/x"])
    plan = plan_placement(resources_for_config(cfg, cluster_gpus=8), [Node("id0", "node1", 64, 8)])
    assert plan.rank_node == [0] * 8 and not plan.engine_bundles
