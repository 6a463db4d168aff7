"""The megatron-core policy on CPU (gloo): parallel layouts agree, training learns, checkpoints reshard and resume.

Real megatron-core 0.16.1, real torch.distributed (torchrun, 1-2 processes), real Ray (2 actors), a tiny random Qwen3.
Three torchrun launches of ``da3po_megatron/testing/policy_selfcheck.py`` (TP1 / TP2 / PP2, shared by all tests through
a module fixture) write JSON + exported tensors; the Ray test runs a DP=2 PolicyGroup from the same starting weights.
The TP1 launch loads the HF weights through the bridge and writes the common starting checkpoint. The PP=2 launch uses
the fused-kernel loss backend (chunked), the others the torch backend, so the two backends are also compared.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _ray import local_ray

from da3po_megatron.bridge.hf_config import gpt_arch
from da3po_megatron.megatron.batching import PolicyBatch
from da3po_megatron.megatron.policy import PolicyWorker
from da3po_megatron.megatron.policy_config import validate_config
from da3po_megatron.testing.policy_job import ADVANTAGES, small_policy_config
from da3po_megatron.testing.policy_job import launch as _launch
from da3po_megatron.testing.policy_job import max_diff as _max_diff
from da3po_megatron.testing.policy_selfcheck import fixed_batch, perturbed

SELFCHECK = Path(__file__).with_name("_policy_selfcheck.py")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples/tiny_cpu_da3po.yaml"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from da3po_megatron.tiny import build_model

    d = tmp_path_factory.mktemp("policy")
    hf = build_model(d / "hf", family="qwen3", seed=0)
    base = d / "base"
    common = ["--hf", str(hf), "--base", str(base)]
    res = {"dir": d, "hf": hf, "base": base}
    res["tp1"] = _launch(1, d / "tp1.json", *common, "--init-base", "--load-hf", "--export", str(d / "ex_tp1"),
                         "--decrease-steps", "4")
    res["tp2"] = _launch(2, d / "tp2.json", *common, "--tp", "2", "--export", str(d / "ex_tp2"),
                         "--save-ckpt", str(d / "ck_tp2"), "--resume-check")
    res["pp2"] = _launch(2, d / "pp2.json", *common, "--pp", "2", "--export", str(d / "ex_pp2"),
                         "--save-ckpt", str(d / "ck_pp2"), "--resume-check", "--loss-backend", "kernel")
    return res


def _export(d: Path, tag: str, when: str) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(str(d / f"ex_{tag}_{when}_pp*.pt"))):
        sd.update(torch.load(f))
    assert sd, f"no export files for {tag} {when}"
    return sd


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_logprobs_and_entropy_of_parallel_layout_equal_single_rank(runs, layout):
    ref, got = runs["tp1"], runs[layout]
    assert got["info"]["tp"] * got["info"]["pp"] == 2
    assert _max_diff(ref["logprobs"], got["logprobs"]) < 1e-5
    assert _max_diff(ref["entropy"], got["entropy"]) < 1e-5
    assert len(got["logprobs"][3]) == 0  # the empty response has no log-probs
    assert all(v < 0 for row in got["logprobs"] for v in row)


@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2"])
def test_packed_and_padded_microbatches_give_the_same_logprobs(runs, layout):
    assert _max_diff(runs[layout]["logprobs"], runs[layout]["logprobs_padded"]) < 1e-5


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_train_step_of_parallel_layout_equals_single_rank(runs, layout):
    ref, got = runs["tp1"]["step1"], runs[layout]["step1"]
    for key in ("loss", "grad_norm", "approx_kl", "entropy"):
        assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), key
    for key in ("clipfrac_low", "clipfrac_high", "response_tokens", "num_updates"):
        assert got[key] == ref[key], key
    assert ref["clipfrac_low"] + ref["clipfrac_high"] > 0  # the perturbed old log-probs make the clip bind
    assert ref["num_microbatches"] > 1  # the 24-token budget splits the batch
    assert _max_diff(runs["tp1"]["logprobs_after_step1"], runs[layout]["logprobs_after_step1"]) < 1e-5
    a, b = _export(runs["dir"], "tp1", "after"), _export(runs["dir"], layout, "after")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-6, rtol=0), name


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
@pytest.mark.parametrize("algorithm", ["grpo", "gspo"])
def test_sequence_normalised_losses_of_parallel_layout_equal_single_rank(runs, layout, algorithm):
    ref, got = runs["tp1"]["algorithms"][algorithm], runs[layout]["algorithms"][algorithm]
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert got["loss"] != pytest.approx(runs["tp1"]["step1"]["loss"], rel=1e-3)  # not the token-mean loss


def test_hf_export_is_independent_of_layout(runs):
    a = _export(runs["dir"], "tp1", "before")
    for layout in ("tp2", "pp2"):
        b = _export(runs["dir"], layout, "before")
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), (layout, name)
    assert "model.layers.1.mlp.gate_proj.weight" in a  # layer 1 lives on PP stage 1: renamed to its global number
    assert a["model.embed_tokens.weight"].shape == (128, 64)
    assert a["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 32, 64)


def test_policy_from_hf_weights_matches_transformers_and_exports_the_same_weights(runs):
    from transformers import AutoModelForCausalLM

    assert runs["tp1"]["hf_loaded"]
    model = AutoModelForCausalLM.from_pretrained(str(runs["hf"]), dtype=torch.float32).eval()
    prompts, responses = fixed_batch()
    worst = 0.0
    for p, r, lp in zip(prompts, responses, runs["tp1"]["logprobs"]):
        with torch.no_grad():
            logp = model(torch.tensor([p + r])).logits.log_softmax(-1)[0]
        ref = [logp[len(p) - 1 + j, t].item() for j, t in enumerate(r)]
        worst = max([worst] + [abs(a - b) for a, b in zip(ref, lp)])
    assert worst < 1e-4
    hf_sd = model.state_dict()
    exported = _export(runs["dir"], "tp1", "before")
    assert exported.keys() == hf_sd.keys()
    for hf_name, t in exported.items():
        assert torch.equal(t, hf_sd[hf_name]), hf_name


def test_training_moves_the_weights(runs):
    before, after = _export(runs["dir"], "tp1", "before"), _export(runs["dir"], "tp1", "after")
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 1e-5


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_resume_from_full_checkpoint_reproduces_the_next_step(runs, layout):
    r = runs[layout]
    assert r["resume_load"]["loaded_optimizer"] and r["resume_load"]["restored_rng"]
    assert r["resume_load"]["step"] == 1
    assert r["step2_resumed"]["loss"] == pytest.approx(r["step2"]["loss"], abs=1e-7)
    assert r["step2_resumed"]["grad_norm"] == pytest.approx(r["step2"]["grad_norm"], rel=1e-6)
    assert r["resume_logprob_max_diff"] < 1e-6  # same Adam moments, step and LR schedule after the load


def test_checkpoint_layout_on_disk(runs):
    ck = runs["dir"] / "ck_tp2"
    assert (ck / "model" / "metadata.json").exists() and (ck / "optimizer" / "metadata.json").exists()
    assert sorted(p.name for p in (ck / "rng").iterdir()) == ["rank_0.pt", "rank_1.pt"]
    meta = json.loads((ck / "meta.json").read_text())
    assert meta["layout"]["tensor_model_parallel_size"] == 2 and meta["step"] == 1
    assert (ck / "hf" / "config.json").exists()


def test_a_few_train_steps_on_a_fixed_batch_decrease_the_loss(runs):
    losses = runs["tp1"]["decrease_losses"]
    assert len(losses) == 4
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


def test_ray_policy_group_dp2_matches_single_rank_and_loads_other_layouts(runs, tmp_path):
    from da3po_megatron.config import algorithm_config
    from da3po_megatron.megatron.actor_group import PolicyGroup, PolicyGroupError

    with local_ray(num_cpus=2):
        cfg = small_policy_config(str(runs["hf"]), world_size=2, padded_vocab=False)
        group = PolicyGroup(cfg, gpt_arch(runs["hf"]), 2, num_cpus_per_rank=1, placement="pack")
        assert [i["dp_rank"] for i in group.info()] == [0, 1]
        group.load_model(str(runs["base"]))
        prompts, responses = fixed_batch()
        lp = group.compute_logprobs(PolicyBatch(prompts, responses))
        assert _max_diff(lp, runs["tp1"]["logprobs"]) < 1e-5
        metrics = group.train_step(PolicyBatch(prompts, responses, perturbed(lp), ADVANTAGES))
        ref = runs["tp1"]["step1"]
        # global token normaliser: DP=2 gives the loss and gradient of the whole mini-batch
        assert metrics["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert metrics["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        # GRPO's per-response normaliser counted over both DP ranks (global_num_seqs)
        group.call_all("set_loss", algorithm_config("grpo"))
        group.load_model(str(runs["base"]))
        grpo_dp2 = group.train_step(PolicyBatch(prompts, responses, perturbed(lp), ADVANTAGES))
        assert grpo_dp2["loss"] == pytest.approx(runs["tp1"]["algorithms"]["grpo"]["loss"], rel=1e-5)
        assert grpo_dp2["grad_norm"] == pytest.approx(runs["tp1"]["algorithms"]["grpo"]["grad_norm"], rel=1e-5)
        flats = group.run_on_all(lambda w: torch.cat([p.detach().reshape(-1) for p in w._bare.parameters()]))
        assert torch.equal(flats[0], flats[1])  # DP replicas stay identical
        for layout in ("tp2", "pp2"):  # saved at TP=2 / PP=2, loaded at TP=1 PP=1
            info = group.load(str(runs["dir"] / f"ck_{layout}"))
            assert not info["loaded_optimizer"]  # other TP x PP: model only
            got = group.compute_logprobs(PolicyBatch(prompts, responses))
            assert _max_diff(got, runs[layout]["logprobs_after_step1"]) < 1e-5

        # a full checkpoint written and read with the DP-parallel (fully_parallel) strategies, same layout
        group.save(str(tmp_path / "fp"), fully_parallel=True)
        before = group.compute_logprobs(PolicyBatch(prompts, responses))
        group.train_step(PolicyBatch(prompts, responses, perturbed(before), ADVANTAGES))
        info = group.load(str(tmp_path / "fp"), fully_parallel=True)
        assert info["loaded_optimizer"] and info["restored_rng"]
        assert _max_diff(group.compute_logprobs(PolicyBatch(prompts, responses)), before) == 0.0

        def die(worker):
            if worker.info()["rank"] == 1:
                os._exit(1)

        with pytest.raises(PolicyGroupError, match="policy rank 1 died"):
            group.run_on_all(die)
        assert group.actors == []


# ---------------------------------------------------------------------------------------------- start-up errors
def _cfg(hf: Path, tp: int = 1, pp: int = 1, dp: int = 1, overrides: tuple[str, ...] = ()):
    from da3po_megatron.config import standalone_policy_config

    return standalone_policy_config(hf, [f"parallel.tensor_model_parallel_size={tp}",
                                         f"parallel.pipeline_model_parallel_size={pp}",
                                         f"parallel.data_parallel_size={dp}", *overrides])


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    from da3po_megatron.tiny import build_model

    return build_model(tmp_path_factory.mktemp("tiny_hf") / "m", family="qwen3")


@pytest.mark.parametrize(
    "world,tp,pp,message",
    [
        (3, 2, 1, r"world size 3 is not divisible by tensor_model_parallel_size \(2\) x pipeline_model_parallel_size "
                  r"\(1\)"),
        (8, 8, 1, r"num_attention_heads \(4\) is not divisible by tensor_model_parallel_size \(8\)"),
        (4, 4, 1, r"num_query_groups \(2\) is not divisible by tensor_model_parallel_size \(4\)"),
        (3, 1, 3, r"num_layers \(2\) is not divisible by pipeline_model_parallel_size \(3\)"),
    ],
)
def test_wrong_parallel_settings_fail_at_start_naming_the_numbers(tiny_hf, world, tp, pp, message):
    import torch.distributed as dist

    for megatron_config in (True, False):  # the ranks' check and the driver's (without megatron-core)
        with pytest.raises(ValueError, match=message):
            validate_config(_cfg(tiny_hf, tp, pp), gpt_arch(tiny_hf), world, megatron_config=megatron_config)
    with pytest.raises(ValueError, match=message):  # the worker checks before joining any process group
        PolicyWorker().init(_cfg(tiny_hf, tp, pp), gpt_arch(tiny_hf), rank=0, world_size=world, master_port=1)
    assert not dist.is_initialized()


def test_the_drivers_check_of_the_policy_config_does_not_import_megatron_core(tiny_hf):
    """The driver validates the policy config before any actor starts, without megatron-core: importing it cost every
    launch ~14 CPU-seconds next to the starting actors. A fresh interpreter, so nothing imported it before."""
    code = ("import sys; from da3po_megatron.config import load_config; from da3po_megatron.bridge.hf_config import "
            "gpt_arch; from da3po_megatron.megatron.policy_config import validate_config; "
            f"cfg = load_config({str(EXAMPLE)!r}, ['model.path={tiny_hf}']); "
            f"validate_config(cfg, gpt_arch({str(tiny_hf)!r}), 1, megatron_config=False); "
            "print(sorted(m for m in sys.modules if m.startswith(('megatron', 'vllm'))))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == "[]"


def test_the_policy_world_must_be_the_configured_one(tiny_hf):
    with pytest.raises(ValueError, match=r"world size 2 != .*data_parallel_size \(1\) = 1"):
        validate_config(_cfg(tiny_hf), gpt_arch(tiny_hf), 2)
    validate_config(_cfg(tiny_hf, dp=2), gpt_arch(tiny_hf), 2)
