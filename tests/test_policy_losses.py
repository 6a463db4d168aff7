"""The policy's loss paths on CPU (gloo), split from test_megatron_policy.py: per-token weights (TIS) equal scaled
advantages, the sampling temperature divides the logits before every log-softmax, and the fused_linear backend equals
the kernel backend without materialising logits; plus the loss-backend registry and the driver-side config check.

Real megatron-core 0.16.1 and torch.distributed (torchrun, 1-2 processes) on a tiny random Qwen3: each fixture is one
torchrun launch of a job script under tests/, shared by the tests that read it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from da3po_megatron.testing.policy_job import launch as _launch
from da3po_megatron.testing.policy_job import max_diff as _max_diff
from da3po_megatron.testing.policy_selfcheck import fixed_batch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples/tiny_cpu_da3po.yaml"


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    from da3po_megatron.tiny import build_model

    return build_model(tmp_path_factory.mktemp("tiny_hf") / "m", family="qwen3")


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
    from da3po_megatron.megatron.policy_config import loss_setup

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
    from da3po_megatron.megatron.policy_config import loss_setup

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
