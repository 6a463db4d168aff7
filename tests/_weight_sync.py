"""Shared by the Megatron-policy weight-sync tests (test_weight_sync_megatron.py, test_weight_sync_collective.py): a
policy group loaded from an HF checkpoint, one train step on sampled responses, and the transformers reference."""

from __future__ import annotations

import torch


def policy_group(hf_dir: str, tp: int = 1, pp: int = 1):
    """A float32 PolicyGroup of tp x pp Ray ranks holding ``hf_dir``'s weights (loaded through the bridge)."""
    from da3po_megatron.bridge.export import load_policy_hf
    from da3po_megatron.bridge.hf_config import gpt_arch
    from da3po_megatron.config import standalone_policy_config
    from da3po_megatron.megatron.actor_group import PolicyGroup

    cfg = standalone_policy_config(hf_dir, ["model.params_dtype=float32", f"parallel.tensor_model_parallel_size={tp}",
                                            f"parallel.pipeline_model_parallel_size={pp}",
                                            "optim.lr=1e-2", "optim.weight_decay=0.0", "trainer.total_steps=10",
                                            "actor.ppo_mini_batch_size=512", "data.train_batch_size=512",
                                            "actor.loss_backend=torch", "trainer.seed=1234"])
    group = PolicyGroup(cfg, gpt_arch(hf_dir), world_size=tp * pp, num_cpus_per_rank=1, env={"OMP_NUM_THREADS": "1"})
    assert all(group.run_on_all(load_policy_hf, hf_dir))
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
                logp = torch.log_softmax(model(torch.tensor([[*c.prompt_token_ids, *c.token_ids]])).logits[0], -1)
            p = len(c.prompt_token_ids)
            ref = logp[p - 1:-1].gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    return worst
