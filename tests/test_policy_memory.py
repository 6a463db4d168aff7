"""The policy memory estimate (da3po_megatron/megatron/memory.py): a pure function of shapes, and the train-time check
that prints it and refuses / lowers the micro-batch budget. Its accuracy against measured peaks is in
docs/real_model.md (tools/measure/policy_memory.py)."""

from __future__ import annotations

import pytest

from da3po_megatron.bridge.hf_config import gpt_arch
from da3po_megatron.config import load_config
from da3po_megatron.megatron.memory import (
    GiB,
    MemoryBudgetError,
    check_policy_memory,
    estimate_policy_memory,
    fit_microbatch_tokens,
)

SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
           "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30, "head_dim": 64,
           "vocab_size": 49152, "tie_word_embeddings": True, "rope_theta": 100000.0}
ARCH = gpt_arch(SMOLLM2)  # what the memory estimate reads: the model in Megatron terms


def est(**kw):
    args = dict(max_tokens_per_microbatch=1024, max_seq_len=384)
    args.update(kw)
    return estimate_policy_memory(ARCH, **args)


def test_static_memory_is_weights_grads_and_adam_of_the_rank_shard():
    e = est()
    params = 134_515_008  # SmolLM2-135M, tied: the embedding counted once at PP=1
    assert e.components["weights+grads+optimizer"] == pytest.approx(params * 16, rel=0.01)  # fp32: 4 + 4 + 8 bytes
    tp3 = est(tp=3).components["weights+grads+optimizer"]
    assert tp3 < e.components["weights+grads+optimizer"] / 2.5  # norms are replicated, the rest split
    # bf16 with the distributed optimizer over 4 DP ranks: 2 (weight) + 4 (fp32 grad) + 12 / 4 (master + Adam)
    assert est(params_dtype="bfloat16", dp=4).components["weights+grads+optimizer"] == pytest.approx(params * 9,
                                                                                                      rel=0.01)


def test_activation_and_logit_memory_grow_with_the_token_budget_and_shrink_with_the_levers():
    small, big = est(max_tokens_per_microbatch=1024), est(max_tokens_per_microbatch=4096)
    assert big.total > small.total and big.components["activations"] == pytest.approx(
        4 * small.components["activations"], rel=0.05)
    assert est(recompute_granularity="selective").components["activations"] < small.components["activations"]
    assert est(recompute_granularity="full").components["activations"] < \
        est(recompute_granularity="selective").components["activations"]
    assert est(layer_spec="te").components["activations"] < small.components["activations"]  # no S^2 scores
    assert est(loss_backend="fused_linear").components["logits"] == 0
    assert 0 < est(loss_backend="kernel").components["logits"] < est(loss_backend="torch").components["logits"]
    # PP=2: the first stage holds two micro-batches of half the layers, the last stage the logits
    assert est(pp=2).total < small.total


def test_fit_finds_the_largest_budget_under_the_limit():
    def at(t):
        return est(max_tokens_per_microbatch=t)

    limit = est(max_tokens_per_microbatch=2000).total
    t = fit_microbatch_tokens(at, limit, 8192, 384)
    assert 1900 <= t <= 2000 and at(t).total <= limit
    assert fit_microbatch_tokens(at, 1, 8192, 384) is None
    assert fit_microbatch_tokens(at, 10**15, 8192, 384) == 8192


def _cfg(tmp_path, *overrides):
    import json

    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(SMOLLM2))
    return load_config(None, [f"model.path={d}", "rollout.max_prompt_length=128", "rollout.max_response_length=256",
                              "actor.max_tokens_per_microbatch=4096", "algorithm.overlong.buffer_length=64",
                              "data.format=synthetic",
                              *overrides])


def test_train_check_prints_refuses_or_lowers_the_budget(tmp_path):
    lines = []
    cfg = _cfg(tmp_path)
    need = est(max_tokens_per_microbatch=4096, loss_backend="kernel").total
    assert check_policy_memory(cfg, ARCH, available=need * 4, where="test", log=lines.append) == 4096
    assert lines[0].startswith("memory: policy peak memory per rank ~")
    with pytest.raises(MemoryBudgetError, match=r"actor.max_tokens_per_microbatch<=\d+ .*actor.memory_check=fit"):
        check_policy_memory(cfg, ARCH, available=6 * GiB, where="test", log=lines.append)
    cfg.actor.memory_check = "fit"
    t = check_policy_memory(cfg, ARCH, available=6 * GiB, where="test", log=lines.append)
    assert 384 <= t < 4096 and "lowering actor.max_tokens_per_microbatch 4096 -> " in lines[-1]
    cfg.actor.memory_check = "warn"
    assert check_policy_memory(cfg, ARCH, available=GiB, where="test", log=lines.append) == 4096
    cfg.actor.memory_check = "refuse"
    with pytest.raises(MemoryBudgetError, match="no micro-batch of one longest sequence fits"):
        check_policy_memory(cfg, ARCH, available=GiB, where="test", log=lines.append)


def test_train_preflight_rejects_parallel_sizes_that_do_not_divide_the_model(tmp_path):
    from da3po_megatron.trainer.cluster.bringup import preflight

    cfg = _cfg(tmp_path, "parallel.tensor_model_parallel_size=2", f"trainer.run_dir={tmp_path / 'run'}")
    with pytest.raises(ValueError, match=r"parallel: num_attention_heads \(9\) is not divisible by "
                                         r"tensor_model_parallel_size \(2\); sizes that divide this model: \[1, 3\]"):
        preflight(cfg)
    assert not (tmp_path / "run").exists()
