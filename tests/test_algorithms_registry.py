"""The algorithm registry: each preset reaches the effective config (``--print-config``) from ``algorithm.name`` alone,
an explicit value wins and is reported, custom functions by import path are checked at load and used by the trainer's
advantage code, and what is not implemented (context parallelism) is refused at validation."""

import json
from pathlib import Path

import pytest
import torch

from da3po_megatron.algorithms import ALGORITHM_REGISTRY, group_advantages
from da3po_megatron.algorithms.registry import PRESET_FIELDS, load_function, preset_overrides
from da3po_megatron.config import ConfigError, load_config
from da3po_megatron.trainer import batch as B
from da3po_megatron.trainer.main import main as train_main

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ["model.path=/m", "data.format=synthetic"]  # the fields every config needs; nothing else is set
RLOO = "examples/custom/rloo_advantage.py:rloo_advantages"


def _print_config(capsys, *overrides: str) -> tuple[dict, str]:
    assert train_main(["--print-config", *REQUIRED, *overrides]) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err


# the acceptance table of issue 14: (clip low, clip high, ratio level, aggregation, filtering, overlong, DAA)
EXPECTED = {
    "gspo": (3e-4, 4e-4, "sequence", "seq-mean-token-mean", False, False, False),
    "grpo": (0.2, 0.2, "token", "seq-mean-token-mean", False, False, False),
    "dapo": (0.2, 0.28, "token", "token-mean", True, True, False),
    "da3po": (0.2, 0.28, "token", "token-mean", True, True, True),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_print_config_shows_the_presets_effective_values_from_the_name_alone(capsys, name):
    d, err = _print_config(capsys, f"algorithm.name={name}")
    a = d["algorithm"]
    got = (a["clip_ratio_low"], a["clip_ratio_high"], a["ratio_level"], a["loss_agg_mode"], a["filter_groups"],
           a["overlong"]["enable"], d["daa"]["enable"])
    assert got == EXPECTED[name]
    assert err == ""  # nothing overridden
    text = json.dumps(d)
    for word in ('"auto"', "null"):  # no preset-decided field is left undecided
        for key in ("clip_ratio_low", "clip_ratio_high", "ratio_level", "loss_agg_mode", "filter_groups"):
            assert f'"{key}": {word}' not in text


def test_an_explicit_value_overrides_the_preset_and_is_reported(capsys):
    d, err = _print_config(capsys, "algorithm.name=gspo", "algorithm.clip_ratio_high=0.3")
    assert d["algorithm"]["clip_ratio_high"] == 0.3 and d["algorithm"]["clip_ratio_low"] == 3e-4
    assert "algorithm.clip_ratio_high=0.3 overrides the gspo preset (0.0004)" in err
    cfg = load_config(None, [*REQUIRED, "algorithm.name=grpo", "daa.enable=true", "algorithm.overlong.enable=true"])
    assert cfg.daa.enable and cfg.algorithm.overlong.enable and not cfg.algorithm.filter_groups
    assert sorted(preset_overrides(cfg)) == ["algorithm.overlong.enable=True overrides the grpo preset (False)",
                                             "daa.enable=True overrides the grpo preset (False)"]
    # an explicit value equal to the preset is no override
    assert preset_overrides(load_config(None, [*REQUIRED, "algorithm.name=dapo", "algorithm.clip_ratio_high=0.28"])) \
        == []


def test_every_preset_decides_every_preset_field_and_nothing_else_knows_them():
    for alg in ALGORITHM_REGISTRY.values():
        cfg = load_config(None, [*REQUIRED, f"algorithm.name={alg.name}"])
        for attr, path in PRESET_FIELDS.items():
            obj = cfg
            for part in path.split("."):
                obj = getattr(obj, part)
            assert obj == getattr(alg, attr), (alg.name, path)


def test_shipped_recipes_rely_on_presets():
    """The example recipes set algorithm.name and leave the preset-decided fields to the registry."""
    import yaml

    for p in sorted((ROOT / "examples").rglob("*.yaml")):
        raw = yaml.safe_load(p.read_text()) or {}
        alg = raw.get("algorithm", {}) or {}
        pinned = {k for k in ("clip_ratio_low", "clip_ratio_high", "ratio_level", "loss_agg_mode", "filter_groups")
                  if k in alg} | ({"overlong.enable"} if "enable" in (alg.get("overlong") or {}) else set())
        assert not pinned, f"{p.relative_to(ROOT)} pins preset values {sorted(pinned)}"


def test_context_parallelism_is_refused_at_validation():
    with pytest.raises(ConfigError, match=r"context_parallel_size = 2: context parallelism is not supported yet.*"
                                          r"pi_old would come out multiplied"):
        load_config(None, [*REQUIRED, "parallel.context_parallel_size=2"])


def test_custom_advantage_fn_is_resolved_at_load_and_used_by_the_trainers_advantage_code(monkeypatch):
    """The worked example of docs/algorithms.md: RLOO advantages by file path, then DAA on top (trainer/batch.py)."""
    monkeypatch.chdir(ROOT)
    cfg = load_config(None, [*REQUIRED, f"algorithm.advantage_fn={RLOO}"])
    assert cfg.algorithm.advantage_fn == f"{ROOT / 'examples/custom/rloo_advantage.py'}:rloo_advantages"  # absolute
    from test_trainer_batch import _groups

    gs = _groups([[1, -1, -1, -1], [1, 1, -1, -1]])
    B.compute_advantages(gs, cfg.algorithm.advantage_eps, cfg.daa.enable, cfg.daa.lambda_, cfg.daa.tau,
                         advantage_fn=cfg.algorithm.advantage_fn)
    got = [a for g in gs for a in g.advantages]
    # group 1 (p_hat 0.25 < tau): R = [1,-1,-1,-1]; leave-one-out baselines [-1, -1/3, -1/3, -1/3]; DAA x2 on the
    # correct one. Group 2 (p_hat 0.5, not < tau): baselines [-1/3, -1/3, 1/3, 1/3]
    assert got == pytest.approx([4.0, -2 / 3, -2 / 3, -2 / 3, 4 / 3, 4 / 3, -4 / 3, -4 / 3])
    rewards = torch.tensor([r for g in gs for r in g.rewards], dtype=torch.float64)
    assert got[1:4] != pytest.approx(group_advantages(rewards, 4)[1:4].tolist())  # not Eq. 3


def test_custom_functions_are_checked_at_load_with_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    bad = tmp_path / "bad.py"
    bad.write_text("def adv(rewards):\n    return rewards\n\n"
                   "def loss(logprobs, old_logprobs, advantages, mask, **kw):\n    return logprobs.sum(), {}\n")
    with pytest.raises(ConfigError, match=r"algorithm.advantage_fn=.*adv\(rewards\) cannot be called as "
                                          r"adv\(rewards=\.\.\., group_size=\.\.\., eps=\.\.\.\)"):
        load_config(None, [*REQUIRED, f"algorithm.advantage_fn={bad}:adv"])
    with pytest.raises(ConfigError, match=r"algorithm.policy_loss_fn='nope_pkg.mod:f': cannot import 'nope_pkg.mod'"):
        load_config(None, [*REQUIRED, "algorithm.policy_loss_fn=nope_pkg.mod:f"])
    with pytest.raises(ConfigError, match=r"expected 'package.module:function'"):
        load_config(None, [*REQUIRED, "algorithm.policy_loss_fn=just_a_name"])
    with pytest.raises(ConfigError, match=r"has no callable 'missing'"):
        load_config(None, [*REQUIRED, f"algorithm.policy_loss_fn={bad}:missing"])
    cfg = load_config(None, [*REQUIRED, f"algorithm.policy_loss_fn={bad}:loss"])  # **kw takes the keywords
    assert cfg.algorithm.policy_loss_fn.endswith("bad.py:loss")
    # a module path works too (the package's own loss, by import path)
    fn = load_function("da3po_megatron.algorithms.losses:policy_loss",
                       ("logprobs", "old_logprobs", "advantages", "mask", "clip_ratio_low", "clip_ratio_high",
                        "ratio_level", "loss_agg_mode", "global_num_tokens", "global_num_seqs"))
    assert fn.__name__ == "policy_loss"


def test_the_baseline_of_an_algorithm_is_the_registered_one_with_the_same_preset_but_no_daa():
    from da3po_megatron.algorithms.registry import baseline_of
    from da3po_megatron.studies.compare.grid import parse_method

    assert baseline_of("da3po") == "dapo"
    assert [baseline_of(n) for n in ("grpo", "dapo", "gspo")] == ["grpo", "dapo", "gspo"]
    assert parse_method("da3po:1.5").baseline == "dapo" and parse_method("grpo:2").baseline == "grpo"
