"""The config tree: YAML + overrides, clear errors naming the field, and every shipped recipe loads."""

from pathlib import Path

import pytest

from da3po_megatron.config import Config, ConfigError, describe, load_config

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p for p in (ROOT / "examples").rglob("*.yaml") if p.name != "paper_base.yaml")


def _write(tmp_path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_recipe_loads_and_validates(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert cfg.rollout.n >= 2


def test_paper_recipes_carry_paper_hyperparameters():
    cfg = load_config(ROOT / "examples/qwen3_4b_da3po.yaml")
    assert (cfg.rollout.n, cfg.data.train_batch_size, cfg.optim.lr) == (16, 512, 1e-6)
    r = cfg.rollout
    assert (r.max_prompt_length, r.max_response_length, cfg.trainer.total_steps) == (2048, 4096, 200)
    assert (cfg.algorithm.clip_ratio_low, cfg.algorithm.clip_ratio_high) == (0.2, 0.28)
    assert (cfg.daa.lambda_, cfg.daa.tau, cfg.daa.enable, cfg.algorithm.filter_groups) == (2.0, 0.5, True, True)
    assert cfg.algorithm.overlong.buffer_length == 1024
    grpo = load_config(ROOT / "examples/qwen3_4b_grpo.yaml")
    assert not grpo.daa.enable and not grpo.algorithm.filter_groups
    assert grpo.algorithm.loss_agg_mode == "seq-mean-token-mean"
    for size in ("4b", "8b"):  # the lambda ablation of both models
        ablation = [load_config(p) for p in (ROOT / "examples/ablation").glob(f"qwen3_{size}_da3po_lambda*.yaml")]
        assert sorted(c.daa.lambda_ for c in ablation) == [1.0, 1.5, 2.0, 2.5]
        assert {c.model.path for c in ablation} == {f"checkpoints/Qwen3-{size.upper()}-Base"}


def test_dotted_overrides_apply_with_yaml_types(tmp_path):
    p = _write(tmp_path, "model: {path: /m}\ndata: {format: synthetic}\n")
    cfg = load_config(p, ["trainer.total_steps=10", "daa.lambda_=2.5", "eval.benchmarks=aime24,math500",
                          "daa.enable=true"])
    assert cfg.trainer.total_steps == 10 and cfg.daa.lambda_ == 2.5 and cfg.daa.enable is True
    assert cfg.eval.benchmarks == ["aime24", "math500"]


def test_misspelt_key_names_the_key_and_the_closest_valid_one(tmp_path):
    p = _write(tmp_path, "model: {path: /m}\ndata: {format: synthetic}\ndaa: {lamda_: 2}\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'daa.lamda_'.*did you mean 'daa.lambda_'"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.total_step'.*'trainer.total_steps'"):
        load_config(None, ["model.path=/m", "data.format=synthetic", "trainer.total_step=3"])


@pytest.mark.parametrize("override, field", [
    ("daa.lambda_=-1", "daa.lambda_"),
    ("daa.tau=0", "daa.tau"),
    ("daa.tau=1.5", "daa.tau"),
    ("rollout.n=1", "rollout.n"),
    ("algorithm.clip_ratio_low=1.2", "algorithm.clip_ratio_low"),
    ("actor.ppo_mini_batch_size=7", "actor.ppo_mini_batch_size"),
])
def test_out_of_range_values_are_rejected_naming_field_and_range(override, field):
    base = ["model.path=/m", "data.format=synthetic", "data.train_batch_size=8"]
    with pytest.raises(ConfigError, match=rf"{field} = .* is out of range: allowed"):
        load_config(None, [*base, override])


def test_wrong_types_and_choices_name_the_field():
    base = ["model.path=/m", "data.format=synthetic"]
    with pytest.raises(ConfigError, match=r"trainer.total_steps: expected an integer"):
        load_config(None, [*base, "trainer.total_steps=abc"])
    with pytest.raises(ConfigError, match=r"algorithm.name: 'dapoo' is not one of .*did you mean 'dapo'"):
        load_config(None, [*base, "algorithm.name=dapoo"])


def test_defaults_chain_and_missing_file_errors(tmp_path):
    (tmp_path / "base.yaml").write_text("model: {path: /base}\ndata: {format: synthetic}\ntrainer: {seed: 7}\n")
    child = tmp_path / "child.yaml"
    child.write_text("defaults: [base.yaml]\ntrainer: {total_steps: 3}\n")
    cfg = load_config(child)
    assert (cfg.model.path, cfg.trainer.seed, cfg.trainer.total_steps) == ("/base", 7, 3)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_every_field_is_documented():
    undocumented = [line for line in describe() if line.endswith(": ")]
    assert not undocumented, undocumented


def test_config_algorithm_names_are_the_loss_presets():
    """`algorithm.name` is a Literal (for --describe and validation); it must list exactly the presets of
    algorithms.losses, the one place the algorithms are defined."""
    import typing

    from da3po_megatron.algorithms import ALGORITHMS
    from da3po_megatron.config import AlgorithmConfig

    hints = typing.get_type_hints(AlgorithmConfig)
    assert typing.get_args(hints["name"]) == ALGORITHMS


def test_tis_is_off_by_default_and_its_cap_is_validated():
    base = ["model.path=/m", "data.format=synthetic"]
    cfg = load_config(None, base)
    assert (cfg.algorithm.rollout_correction, cfg.algorithm.tis_cap) == ("none", 2.0)
    cfg = load_config(None, [*base, "algorithm.rollout_correction=tis", "algorithm.tis_cap=1.5"])
    assert (cfg.algorithm.rollout_correction, cfg.algorithm.tis_cap) == ("tis", 1.5)
    with pytest.raises(ConfigError, match=r"algorithm.tis_cap = 0.0 is out of range: allowed > 0"):
        load_config(None, [*base, "algorithm.tis_cap=0"])
    assert any(line.startswith("algorithm.rollout_correction = 'none': ") for line in describe())


@pytest.mark.parametrize("override, message", [
    ("actor.use_rollout_logprobs=true", r"rollout_correction='tis' with actor.use_rollout_logprobs=true: pi_old would "
                                        r"BE pi_rollout"),
    ("algorithm.name=gspo", r"rollout_correction='tis' with algorithm.name='gspo': its ratio is per sequence"),
])
def test_tis_with_a_combination_it_cannot_correct_is_a_config_error(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model.path=/m", "data.format=synthetic", "algorithm.rollout_correction=tis", override])


def test_policy_settings_are_run_config_fields_or_derived_from_them():
    """One config tree: what the policy needs is a documented field (packing, log-prob budget, vocabulary padding) or
    derived in one place (responses per optimizer step, the schedule's horizon)."""
    cfg = load_config(ROOT / "examples/qwen3_4b_da3po.yaml")
    assert cfg.ppo_mini_batch_responses == 32 * 16  # actor.ppo_mini_batch_size counts prompts, x rollout.n
    assert cfg.optimizer_steps == 200 * (512 // 32) * 1  # total steps x mini-batches per step x ppo_epochs
    assert (cfg.actor.packing, cfg.actor.logprob_max_tokens_per_microbatch, cfg.model.make_vocab_size_divisible_by) \
        == (True, 0, 1)
    assert cfg.optim.weight_decay == 0.1 and cfg.optim.lr_schedule == "constant"
    with pytest.raises(ConfigError, match=r"optim.lr_warmup_steps = 5 is out of range: allowed < the run's 4 "):
        load_config(None, ["model.path=/m", "data.format=synthetic", "trainer.total_steps=2", "data.train_batch_size=8",
                           "actor.ppo_mini_batch_size=4", "optim.lr_warmup_steps=5"])


def test_the_megatron_package_has_no_option_classes_of_its_own():
    import da3po_megatron.megatron.actor_group as actor_group
    import da3po_megatron.megatron.model as model
    import da3po_megatron.megatron.policy as policy

    for name in ("PolicyConfig", "OptimizerOptions", "LossOptions", "BatchingOptions"):
        assert not hasattr(policy, name), name
    assert not hasattr(model, "ModelOptions")
    assert not hasattr(actor_group, "policy_config_from_run_config")
