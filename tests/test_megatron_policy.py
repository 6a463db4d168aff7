"""The megatron-core policy on CPU (gloo): parallel layouts agree, training learns, checkpoints reshard and resume.

Real megatron-core 0.16.1, real torch.distributed (torchrun, 1-2 processes), real Ray (2 actors), a tiny random Qwen3.
Three torchrun launches of ``tests/_policy_selfcheck.py`` (TP1 / TP2 / PP2, shared by all tests through a
module fixture) write JSON + exported tensors; the Ray test runs a DP=2 PolicyGroup from the same starting weights.
The TP1 launch loads the HF weights through the bridge and writes the common starting checkpoint. The PP=2 launch
uses the fused-kernel loss backend (chunked), the others the torch backend, so the two backends are also compared.
"""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _policy_job import ADVANTAGES, small_policy_config
from _policy_selfcheck import fixed_batch, perturbed
from _ray import local_ray

from da3po_megatron.bridge.hf_config import gpt_arch
from da3po_megatron.megatron.batching import PolicyBatch
from da3po_megatron.megatron.policy import PolicyWorker, validate_config
from da3po_megatron.megatron.runtime import free_port

SELFCHECK = Path(__file__).with_name("_policy_selfcheck.py")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples/tiny_cpu_da3po.yaml"


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max((abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v)), default=0.0)


def _launch(nproc: int, out: Path, *args: str, script: Path | None = None) -> dict:
    """torchrun ``nproc`` processes of the selfcheck (or of ``script``) writing JSON to ``out``; returns it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    target = [str(script or SELFCHECK)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), *target, "--out", str(out), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


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
        PolicyWorker().init(_cfg(tiny_hf, tp, pp), gpt_arch(tiny_hf), rank=0, world_size=world, master_port=free_port())
    assert not dist.is_initialized()


# ---------------------------------------------------------------------------------------------- token weights (TIS)
@pytest.fixture(scope="module")
def token_weight_runs(tiny_hf, tmp_path_factory) -> dict:
    """tests/_policy_token_weights.py at DP=2: one train step per batch variant and loss path, from one checkpoint."""
    d = tmp_path_factory.mktemp("token_weights")
    return _launch(2, d / "out.json", "--hf", str(tiny_hf), "--ckpt", str(d / "ckpt"),
                   script=Path(__file__).with_name("_policy_token_weights.py"))


PATHS = ["da3po/torch", "da3po/kernel", "grpo/torch"]


def _same_step(a: dict, b: dict, rel: float) -> None:
    for key in ("loss", "grad_norm", "approx_kl", "clipfrac_low", "clipfrac_high", "response_tokens"):
        assert b["metrics"][key] == pytest.approx(a["metrics"][key], rel=rel, abs=1e-9), key
    assert _max_diff(a["logprobs_after"], b["logprobs_after"]) < 1e-6


@pytest.mark.parametrize("path", PATHS)
def test_token_weights_of_one_change_nothing(token_weight_runs, path):
    r = token_weight_runs["paths"][path]
    _same_step(r["plain"], r["ones"], rel=1e-7)


@pytest.mark.parametrize("path", PATHS)
def test_token_weights_equal_advantages_scaled_by_the_same_factors(token_weight_runs, path):
    r = token_weight_runs["paths"][path]
    _same_step(r["scaled_advantages"], r["per_response"], rel=1e-6)
    assert r["per_response"]["metrics"]["loss"] != pytest.approx(r["plain"]["metrics"]["loss"], rel=1e-3)
    # w > 0 keeps every advantage's sign: which tokens the clip binds on does not change
    for key in ("clipfrac_low", "clipfrac_high"):
        assert r["per_response"]["metrics"][key] == r["plain"]["metrics"][key]


@pytest.mark.parametrize("path", PATHS)
def test_per_token_weights_give_the_loss_of_per_token_scaled_advantages(token_weight_runs, path):
    """Weights that differ within a response must reach exactly their own token, over DP ranks and micro-batches: the
    step's loss equals ``policy_loss`` on the whole batch with advantages A_i * w_t."""
    from da3po_megatron.algorithms import ALGORITHM_REGISTRY, policy_loss

    r = token_weight_runs
    algorithm = path.split("/")[0]
    p = vars(ALGORITHM_REGISTRY[algorithm])
    assert r["world_size"] == 2

    def pad(rows: list[list[float]]) -> torch.Tensor:
        out = torch.zeros(len(rows), max(len(x) for x in rows), dtype=torch.float64)
        for i, x in enumerate(rows):
            out[i, :len(x)] = torch.tensor(x, dtype=torch.float64)
        return out

    mask = pad([[1.0] * len(x) for x in r["logprobs"]])
    adv = torch.tensor(r["advantages"], dtype=torch.float64).unsqueeze(1) * pad(r["per_token_weights"])
    ref, _ = policy_loss(pad(r["logprobs"]), pad(r["old_logprobs"]), adv, mask, clip_ratio_low=p["clip_ratio_low"],
                         clip_ratio_high=p["clip_ratio_high"], ratio_level=p["ratio_level"],
                         loss_agg_mode=p["loss_agg_mode"])
    got = r["paths"][path]["per_token"]["metrics"]["loss"]
    assert got == pytest.approx(ref.item(), rel=1e-5)
    assert got != pytest.approx(r["paths"][path]["plain"]["metrics"]["loss"], rel=1e-3)


def test_token_weights_with_a_sequence_level_ratio_are_refused(token_weight_runs):
    assert "the gspo loss has one ratio per sequence" in token_weight_runs["gspo_error"]


@pytest.mark.parametrize("backend", ["torch", "kernel"])
def test_a_custom_policy_loss_by_import_path_trains_the_real_policy(token_weight_runs, backend):
    """algorithm.policy_loss_fn (tests/_custom_loss.py: half the built-in loss) is what the policy's train step calls,
    with the torch backend and with a kernel backend (log-probs from the kernel, the loss from the custom function):
    the step's loss and gradient norm are half those of the built-in da3po loss at DP=2."""
    got = token_weight_runs["custom_loss"][backend]
    plain = token_weight_runs["paths"]["da3po/torch"]["plain"]["metrics"]
    assert got["name"] == ("torch" if backend == "torch" else "kernel:chunked")
    assert got["metrics"]["loss"] == pytest.approx(0.5 * plain["loss"], rel=1e-5)
    assert got["metrics"]["grad_norm"] == pytest.approx(0.5 * plain["grad_norm"], rel=1e-5)
    assert got["metrics"]["clipfrac_high"] == pytest.approx(plain["clipfrac_high"], rel=1e-6, abs=1e-9)


# ---------------------------------------------------------------------------------------------- sampling temperature
@pytest.fixture(scope="module")
def temperature_runs(tiny_hf, tmp_path_factory) -> dict:
    """tests/_policy_temperature.py at TP=2 with a padded vocabulary: log-probs and one train step per loss path."""
    d = tmp_path_factory.mktemp("temperature")
    return _launch(2, d / "out.json", "--hf", str(tiny_hf), script=Path(__file__).with_name("_policy_temperature.py"))


def _transformers_at(hf: Path, temperature: float) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """The HF model and its response-token logits / T (out of place, differentiable), one [len(r), V] per response."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    prompts, responses = fixed_batch()
    logits = [model(torch.tensor([p + r])).logits[0, len(p) - 1:len(p) - 1 + len(r)] / temperature
              for p, r in zip(prompts, responses)]
    return model, logits


def _token_logprobs(logits: list[torch.Tensor]) -> list[torch.Tensor]:
    _, responses = fixed_batch()
    return [z.log_softmax(-1).gather(-1, torch.tensor(r, dtype=torch.long)[:, None])[:, 0]
            for z, r in zip(logits, responses)]


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("backend", ["torch", "kernel"])
def test_logprobs_and_entropy_at_temperature_equal_transformers_on_tempered_logits(temperature_runs, tiny_hf,
                                                                                   temperature, backend):
    run = temperature_runs["runs"][str(temperature)]
    assert temperature_runs["info"]["padded_vocab_size"] == 192 and temperature_runs["info"]["tp"] == 2
    with torch.no_grad():
        _, logits = _transformers_at(tiny_hf, temperature)
        ref_lp = [x.tolist() for x in _token_logprobs(logits)]
        ref_ent = [(-(z.softmax(-1) * z.log_softmax(-1)).sum(-1)).tolist() for z in logits]
        _, plain = _transformers_at(tiny_hf, 1.0)
        untempered = [x.tolist() for x in _token_logprobs(plain)]
    assert _max_diff(run["logprobs"][backend], ref_lp) < 1e-4
    assert _max_diff(run["entropy"][backend], ref_ent) < 1e-4
    if temperature != 1.0:  # the comparison can tell the temperature apart
        assert _max_diff(run["logprobs"][backend], untempered) > 0.05


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("path", ["da3po/torch", "da3po/kernel", "grpo/kernel"])
def test_train_step_at_temperature_has_the_loss_and_gradient_of_tempered_logits(temperature_runs, tiny_hf,
                                                                               temperature, path):
    """The loss and global gradient norm of one step equal those of ``policy_loss`` on transformers' logits / T with
    autograd: the in-place division of the policy's logits back-propagates exactly, on every loss path."""
    from da3po_megatron.algorithms import ALGORITHM_REGISTRY, policy_loss

    run = temperature_runs["runs"][str(temperature)]
    got = run["steps"][path]
    p = vars(ALGORITHM_REGISTRY[path.split("/")[0]])
    model, logits = _transformers_at(tiny_hf, temperature)
    lps = _token_logprobs(logits)
    width = max(len(x) for x in lps)

    def pad(rows) -> torch.Tensor:
        return torch.stack([torch.cat([torch.as_tensor(x, dtype=torch.float32), torch.zeros(width - len(x))])
                            for x in rows])

    mask = pad([[1.0] * len(x) for x in lps])
    loss, _ = policy_loss(pad(lps), pad(run["old_logprobs"]), torch.tensor(temperature_runs["advantages"]), mask,
                          clip_ratio_low=p["clip_ratio_low"], clip_ratio_high=p["clip_ratio_high"],
                          ratio_level=p["ratio_level"], loss_agg_mode=p["loss_agg_mode"])
    loss.backward()
    grad_norm = torch.sqrt(sum((q.grad.double() ** 2).sum() for q in model.parameters() if q.grad is not None))
    assert math.isfinite(got["loss"])
    assert got["loss"] == pytest.approx(loss.item(), rel=1e-4, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-4)
    assert got["clipfrac_low"] + got["clipfrac_high"] > 0  # the perturbed old log-probs make the clip bind


# ---------------------------------------------------------------------------------------------- fused_linear backend
@pytest.fixture(scope="module", params=[(1, 1, False), (2, 1, True), (1, 2, True)],
                ids=["tp1", "tp2-tied", "pp2-tied"])
def fused_linear_run(request, tiny_hf, tmp_path_factory) -> dict:
    """tests/_policy_fused_linear.py with a padded vocabulary: TP=1 untied; TP=2 with tied output weights (the
    vocabulary-parallel embedding shard is the output weight; covers TP and tying together, so CI starts no separate
    TP=2-untied and TP=1-tied jobs; TP=2 runs with sequence parallelism, the default); PP=2 tied (the last stage's
    copy of the embedding is the output weight there)."""
    from da3po_megatron.tiny import build_model

    tp, pp, tied = request.param
    d = tmp_path_factory.mktemp(f"fused_linear_tp{tp}_pp{pp}{'_tied' if tied else ''}")
    hf = build_model(d / "hf", family="qwen3", tie_word_embeddings=True) if tied else tiny_hf
    res = _launch(tp * pp, d / "out.json", "--hf", str(hf), "--ckpt", str(d / "ckpt"), "--pp", str(pp),
                  script=Path(__file__).with_name("_policy_fused_linear.py"))
    assert (res["info"]["tp"], res["info"]["pp"], res["tied"]) == (tp, pp, tied)
    # sequence parallelism is on by default at TP 2: fused_linear gathers the hidden states as the output layer does
    assert res["info"]["sequence_parallel"] == (tp > 1)
    assert res["info"]["padded_vocab_size"] > res["info"]["vocab_size"]
    return res


def test_fused_linear_logprobs_and_entropy_equal_the_kernel_backend_without_any_logits(fused_linear_run):
    r = fused_linear_run
    assert r["backend_names"] == {"kernel": "kernel:chunked", "fused_linear": "fused_linear"}
    assert r["output_layer_calls"]["fused_linear"] == 0 < r["output_layer_calls"]["kernel"]
    for t, run in r["runs"].items():
        assert _max_diff(run["logprobs"]["kernel"], run["logprobs"]["fused_linear"]) < 1e-5, t
        assert _max_diff(run["entropy"]["kernel"], run["entropy"]["fused_linear"]) < 1e-5, t


@pytest.mark.parametrize("algorithm", ["da3po", "grpo"])
def test_fused_linear_train_step_equals_the_kernel_backend(fused_linear_run, algorithm):
    for t, run in fused_linear_run["runs"].items():
        want, got = run["steps"][f"{algorithm}/kernel"], run["steps"][f"{algorithm}/fused_linear"]
        # the step says what computed its loss ("auto" resolved; PP stages gathered): the chunked kernel on CPU
        assert (want["metrics"]["loss_backend"], got["metrics"]["loss_backend"]) == ("kernel:chunked", "fused_linear")
        for key in ("loss", "grad_norm", "entropy", "approx_kl", "clipfrac_low", "clipfrac_high", "response_tokens"):
            assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5, abs=1e-9), f"{key} T={t}"
        # after one Adam step at lr 1e-4 (measured: <= 4e-6)
        assert _max_diff(want["logprobs_after"], got["logprobs_after"]) < 1e-5, f"T={t}"


def test_actor_loss_backend_fused_linear_reaches_the_policy():
    from da3po_megatron.config import load_config
    from da3po_megatron.megatron.policy import loss_setup

    loss = loss_setup(load_config(EXAMPLE, ["actor.loss_backend=fused_linear"]))
    assert (loss["backend"], loss["kernel_backend"]) == ("fused_linear", "auto")
    loss = loss_setup(load_config(EXAMPLE, ["actor.loss_backend=chunked"]))
    assert (loss["backend"], loss["kernel_backend"]) == ("kernel", "chunked")
    gspo = loss_setup(load_config(EXAMPLE, ["algorithm.name=gspo"]))  # the preset reaches the policy's loss
    assert (gspo["clip_ratio_low"], gspo["clip_ratio_high"], gspo["ratio_level"]) == (3e-4, 4e-4, "sequence")


def test_loss_backends_are_registered_by_name_and_a_new_one_is_chosen_without_editing_the_policy():
    from dataclasses import replace

    from da3po_megatron.config import load_config
    from da3po_megatron.megatron.loss_backends import (
        LOSS_BACKENDS,
        TorchLossBackend,
        VocabShard,
        make_loss_backend,
        register_loss_backend,
    )
    from da3po_megatron.megatron.policy import loss_setup

    assert {"torch", "kernel", "fused_linear"} <= set(LOSS_BACKENDS)
    shard = VocabShard(tp_rank=1, tp_size=2, tp_group=None, vocab=90, padded_vocab=96)
    assert (shard.v_local, shard.vocab_start) == (48, 48)
    with pytest.raises(ValueError, match="loss backend must be one of"):
        make_loss_backend("nope", torch.nn.Linear(1, 1), shard, 1.0)

    @register_loss_backend("torch_copy_for_test")
    class Copy(TorchLossBackend):
        pass

    try:
        cfg = load_config(EXAMPLE)
        cfg = replace(cfg, actor=replace(cfg.actor, loss_backend="torch_copy_for_test"))
        assert loss_setup(cfg)["backend"] == "torch_copy_for_test"
        assert isinstance(make_loss_backend("torch_copy_for_test", torch.nn.Linear(1, 1), shard, 0.7), Copy)
        with pytest.raises(ValueError, match="actor.loss_backend='nope' is not one of .*torch_copy_for_test"):
            loss_setup(replace(cfg, actor=replace(cfg.actor, loss_backend="nope")))
    finally:
        del LOSS_BACKENDS["torch_copy_for_test"]


def test_the_drivers_check_of_the_policy_config_does_not_import_megatron_core(tiny_hf):
    """The driver validates the policy config before any actor starts, without megatron-core: importing it cost every
    launch ~14 CPU-seconds next to the starting actors. A fresh interpreter, so nothing imported it before."""
    code = ("import sys; from da3po_megatron.config import load_config; from da3po_megatron.bridge.hf_config import "
            "gpt_arch; from da3po_megatron.megatron.policy import validate_config; "
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
