"""Sequence parallelism (``parallel.sequence_parallel``, issue 46): the config field, the refusals, the memory plan,
and SP on vs off on the real megatron-core policy (torchrun + gloo, ``tests/_policy_sp.py``): dense at TP 2, MoE at
TP 2 x EP 2 with routing replay (4 ranks), with the MoE route bookkeeping's host copies counted (issue 46 M6).

The figures (max abs differences) are printed: ``pytest -s tests/test_sequence_parallel.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from da3po_megatron.config import standalone_policy_config
from da3po_megatron.config.io import ConfigError

JOB = Path(__file__).with_name("_policy_sp.py")


def _launch(nproc: int, out: Path, *args: str) -> dict:

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
           str(JOB), "--out", str(out), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=JOB.parent)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max((abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v)), default=0.0)


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


# ------------------------------------------------------------------------------------------------ config (no ranks)
def test_sequence_parallel_defaults_on_at_tp_above_one_and_explicit_values_are_kept(tmp_path):
    def sp(*overrides: str):
        return standalone_policy_config(tmp_path, list(overrides)).parallel.sequence_parallel

    assert sp() is False
    assert sp("parallel.tensor_model_parallel_size=2") is True
    assert sp("parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=false") is False
    assert sp("parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false") is False
    with pytest.raises(ConfigError, match=r"parallel\.sequence_parallel = True needs "
                                          r"parallel\.tensor_model_parallel_size > 1"):
        sp("parallel.sequence_parallel=true")


def test_moe_at_tp2_without_sequence_parallel_is_refused_at_start_naming_the_field(tmp_path):
    from da3po_megatron import tiny
    from da3po_megatron.bridge.hf_config import gpt_arch
    from da3po_megatron.megatron.policy_config import validate_config

    hf = tiny.build_moe_model(tmp_path / "moe", seed=3)
    base = ["parallel.tensor_model_parallel_size=2", "parallel.expert_tensor_parallel_size=1"]
    off = standalone_policy_config(hf, [*base, "parallel.sequence_parallel=false"])
    with pytest.raises(ValueError, match=r"parallel\.sequence_parallel.*moe_layer\.py 379-383"):
        validate_config(off, gpt_arch(hf), 2, megatron_config=False)
    validate_config(standalone_policy_config(hf, base), gpt_arch(hf), 2, megatron_config=False)


def test_memory_plan_divides_the_tp_replicated_activations_by_tp_with_sequence_parallelism(tmp_path):
    from da3po_megatron import tiny
    from da3po_megatron.bridge.hf_config import gpt_arch
    from da3po_megatron.megatron.memory import estimate_for_config, estimate_policy_memory

    arch = gpt_arch(tiny.build_model(tmp_path / "hf", family="qwen3"))
    kw = dict(max_tokens_per_microbatch=4096, max_seq_len=1024, tp=2, layer_spec="te", device="cuda",
              logprob_max_tokens_per_microbatch=4096)
    off = estimate_policy_memory(arch, **kw)
    on = estimate_policy_memory(arch, **kw, sequence_parallel=True)
    # norms, residuals, dropout: 6h per token and layer, now split over the 2 TP ranks; nothing else changes
    h, layers = arch.hidden_size, arch.num_layers
    assert off.components["activations"] - on.components["activations"] == 4096 * (6 * h - 3 * h) * layers * 4
    assert {k: v for k, v in on.components.items() if k != "activations"} == \
        {k: v for k, v in off.components.items() if k != "activations"}
    assert (on.inputs["sequence_parallel"], off.inputs["sequence_parallel"]) == (True, False)
    # the run config's resolved field reaches the plan: on by default at TP 2, off when asked
    cfg = standalone_policy_config(tmp_path / "hf", ["parallel.tensor_model_parallel_size=2"])
    assert estimate_for_config(cfg, arch, device="cpu", te=False).inputs["sequence_parallel"] is True
    cfg.parallel.sequence_parallel = False
    assert estimate_for_config(cfg, arch, device="cpu", te=False).inputs["sequence_parallel"] is False


@pytest.mark.parametrize("layout", ["thd", "packed-rows", "padded"])
def test_rows_are_padded_to_a_multiple_of_tp_and_the_padding_scores_nothing(layout):
    import numpy as np

    from da3po_megatron.megatron.batching import PolicyBatch
    from da3po_megatron.megatron.packing import build_microbatch

    prompts, responses = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [[20, 21], [22, 23, 24], [25]]
    routes = [np.full((len(p) + len(r) - 1, 1, 2), i + 1, dtype=np.uint8) for i, (p, r) in
              enumerate(zip(prompts, responses))]
    batch = PolicyBatch(prompts, responses, routed_experts=routes)
    kw = {"thd": dict(thd=True), "packed-rows": dict(row_capacity=0), "padded": dict(packing=False)}[layout]
    plain = build_microbatch(batch, [0, 1, 2], **kw)
    mb = build_microbatch(batch, [0, 1, 2], pad_to=4, **kw)
    b, s = mb.tokens.shape
    assert s % 4 == 0 and s > plain.tokens.shape[1] and b == plain.tokens.shape[0]
    # the same tokens score the same targets; the padding is pad_id with label 0, and no route is expected there
    flat, flat0 = mb.tokens.reshape(-1), plain.tokens.reshape(-1)
    assert flat[mb.token_index].tolist() == flat0[plain.token_index].tolist()
    assert mb.token_targets.tolist() == plain.token_targets.tolist()
    assert int(mb.route_mask.sum()) == int(plain.route_mask.sum()) == sum(len(r) for r in routes)
    assert mb.tokens[:, plain.tokens.shape[1]:].eq(0).all() and mb.labels[:, plain.tokens.shape[1]:].eq(0).all()
    if layout == "thd":  # the padding is one more segment of cu_seqlens, so THD attention covers every position
        assert mb.cu_seqlens.tolist() == [*plain.cu_seqlens.tolist(), s]
    else:  # a padding position attends only to itself
        pad = mb.attention_mask[0, 0, -1]
        assert (~pad).sum() == 1 and not pad[-1]


# ------------------------------------------------------------------------------------- SP on vs off, real ranks
@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> dict:
    from da3po_megatron.tiny import build_model

    d = tmp_path_factory.mktemp("sp_dense")
    return _launch(2, d / "out.json", "--hf", str(build_model(d / "hf", family="qwen3", seed=0)), "--tp", "2")


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict:
    """TP 2 x EP 2 (ETP 1, 4 ranks, DP 2) SP on and off, and the TP 1 x EP 2 (DP 2) training reference."""
    from da3po_megatron import tiny

    d = tmp_path_factory.mktemp("sp_moe")
    hf = tiny.build_moe_model(d / "hf", seed=3)
    common = ("--hf", str(hf), "--ep", "2", "--moe")
    return {"tp2": _launch(4, d / "tp2.json", *common, "--tp", "2"),
            "tp1": _launch(2, d / "tp1.json", *common, "--tp", "1")}


def test_dense_tp2_sequence_parallel_gives_the_same_logprobs_losses_and_grad_norms(dense):
    off, on = dense["sp0"], dense["sp1"]
    assert (off["config_sequence_parallel"], on["config_sequence_parallel"]) == (False, True)
    # every norm (incl. QK-norm and the final norm) is marked, so finalize_model_grads sums its grads over TP
    assert {n.rsplit(".", 1)[0].rsplit(".", 1)[-1] for n in on["sequence_parallel_params"]} == \
        {"final_layernorm", "input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm"}
    figures = {"logprobs": _max_diff(off["logprobs"], on["logprobs"]),
               "loss_rel": _rel(on["loss"], off["loss"]), "grad_norm_rel": _rel(on["grad_norm"], off["grad_norm"]),
               "logprobs_after_3_steps": _max_diff(off["logprobs_after"], on["logprobs_after"])}
    print(f"\ndense TP 2, SP on vs off, max abs / rel differences: {figures}")
    assert figures["logprobs"] < 1e-5 and figures["logprobs_after_3_steps"] < 1e-5
    assert figures["loss_rel"] < 1e-5 and figures["grad_norm_rel"] < 1e-5
    assert off["loss"][0] != off["loss"][-1]  # three real updates happened


def test_moe_tp2_ep2_sequence_parallel_replays_the_same_routes_and_trains_like_tp1(moe):
    off, on, ref = moe["tp2"]["sp0"], moe["tp2"]["sp1"], moe["tp1"]["sp0"]
    assert (off["sequence_parallel"], on["sequence_parallel"], ref["sequence_parallel"]) == (False, True, False)
    # megatron-core refuses to train it without SP (the reproduction, at the policy level)
    assert "sequence parallelism" in (off["train_refused"] or "")
    assert "decoder.layers.0.mlp.router.weight" in on["sequence_parallel_params"]
    figures = {"logprobs_sp_on_vs_off": _max_diff(off["logprobs"], on["logprobs"]),
               "logprobs_sp_on_vs_tp1": _max_diff(ref["logprobs"], on["logprobs"]),
               "loss_rel_vs_tp1": _rel(on["loss"], ref["loss"]),
               "grad_norm_rel_vs_tp1": _rel(on["grad_norm"], ref["grad_norm"]),
               "logprobs_after_3_steps_vs_tp1": _max_diff(ref["logprobs_after"], on["logprobs_after"])}
    print(f"\nMoE TP 2 x EP 2, SP on vs off (log-probs) and vs TP 1 x EP 2 (training): {figures}")
    # replayed random routes: a wrong slice of the routes per TP rank would pick other experts here
    assert figures["logprobs_sp_on_vs_off"] < 1e-5 and figures["logprobs_sp_on_vs_tp1"] < 1e-5
    assert figures["loss_rel_vs_tp1"] < 1e-5 and figures["grad_norm_rel_vs_tp1"] < 1e-5
    assert figures["logprobs_after_3_steps_vs_tp1"] < 1e-5
    # router agreement: every (position, MoE layer) pair with an engine route counted once, summed over TP ranks
    from da3po_megatron.testing.policy_selfcheck import fixed_batch

    prompts, responses = fixed_batch()
    pairs = sum(len(p) + len(r) - 1 for p, r in zip(prompts, responses))  # the tiny MoE has one MoE layer
    assert on["route_pairs"] == ref["route_pairs"] == [pairs] * 3
    assert on["router_agreement"] == [1.0] * 3  # replayed
    # the routers' own choices (float noise could flip a near-tie: at most one pair)
    assert max(abs(x - y) for x, y in zip(on["router_agreement_own"], ref["router_agreement_own"])) <= 1 / pairs


def test_route_bookkeeping_makes_no_host_copy_per_moe_layer(moe):
    """Issue 46 M6: one micro-batch's forward with engine routes (use_routes, the forward, route_counts) makes at
    most one host copy more than without routes (before: three per MoE layer: the recorded, engine and mask tensors
    moved to the CPU in ``moe.route_counts``)."""
    for run in (moe["tp2"], moe["tp1"]):
        got = run["route_copies"]
        print(f"\nhost copies of one micro-batch's forward (TP {run['tp']}): {got}")
        assert got["with_routes"] - got["without"] <= 1, got
