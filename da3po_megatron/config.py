"""The typed configuration tree: YAML files + dotted command-line overrides, validated with clear messages.

    cfg = load_config("examples/qwen3_4b_da3po.yaml", ["trainer.total_steps=10", "daa.lambda_=2.5"])

Every field is documented where it is defined (``doc(...)`` below), with its unit and the paper equation it comes from.
Names follow Megatron for parallelism/model fields and verl/DAPO for RL fields; DA3PO's own fields live under ``daa``.

A YAML file may start with ``defaults: [other.yaml, ...]`` (paths relative to the file): those are loaded first and
this file's keys override theirs, so the paper's recipes share one base. Unknown keys are errors naming the key and
the closest valid one; values are type-checked (the generic machinery: :mod:`da3po_megatron.config_io`); ranges are
checked in :func:`validate` with the allowed range named. Fields an algorithm's preset decides are resolved once, in
:func:`resolve` (from ``algorithms/registry.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from da3po_megatron.algorithms.registry import (
    ADVANTAGE_FN_ARGS,
    POLICY_LOSS_FN_ARGS,
    load_function,
    preset_overrides,
    resolve_presets,
)
from da3po_megatron.config_checks import validate
from da3po_megatron.config_io import ConfigError, build, doc, nest, parse_override, read_yaml
from da3po_megatron.config_policy import ActorConfig, ModelConfig, MoEConfig, OptimConfig, ParallelConfig
from da3po_megatron.config_rollout import RolloutConfig
from da3po_megatron.config_run import (
    AlgorithmConfig,
    DAAConfig,
    DataConfig,
    EvalConfig,
    OverlongConfig,
    ProfileConfig,
    RayConfig,
    RewardConfig,
    SyntheticTaskConfig,
    TrainerConfig,
)

__all__ = ["ActorConfig", "AlgorithmConfig", "Config", "ConfigError", "DAAConfig", "DataConfig", "EvalConfig",
           "ModelConfig", "MoEConfig", "OptimConfig", "OverlongConfig", "ParallelConfig", "ProfileConfig", "RayConfig",
           "RewardConfig", "RolloutConfig", "SyntheticTaskConfig", "TrainerConfig", "algorithm_config", "describe",
           "doc", "load_config", "resolve", "standalone_policy_config", "to_dict", "validate"]
# The sections live in config_policy.py (model, parallel, moe, optim, actor), config_rollout.py (rollout) and
# config_run.py (algorithm, daa, data, reward, eval, ray, trainer); this module assembles and loads them.

log = logging.getLogger(__name__)



@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    daa: DAAConfig = field(default_factory=DAAConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    # ---- derived values
    @property
    def ppo_mini_batch_responses(self) -> int:
        """Responses per optimizer step: actor.ppo_mini_batch_size prompts x rollout.n."""
        return self.actor.ppo_mini_batch_size * self.rollout.n

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps of the whole run, the LR schedule's horizon: trainer.total_steps x (data.train_batch_size
        / actor.ppo_mini_batch_size) x actor.ppo_epochs."""
        per_step = max(1, self.data.train_batch_size // max(1, self.actor.ppo_mini_batch_size))
        return self.trainer.total_steps * per_step * self.actor.ppo_epochs

    @property
    def policy_world_size(self) -> int:
        p = self.parallel
        return p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size * \
            p.data_parallel_size


# ----------------------------------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """YAML file (with ``defaults``) + dotted overrides -> validated :class:`Config`."""
    data: dict[str, Any] = read_yaml(Path(path)) if path else {}
    for item in overrides or []:
        keys, value = parse_override(item)
        try:  # a wrong key or value on the command line is reported as the command line's, not the YAML file's
            build(Config, nest(keys, value))
        except ConfigError as e:
            if "unknown config key" in str(e) or "is not a section" in str(e) or "expected a mapping" in str(e) \
                    or str(e).startswith(".".join(keys)):  # the value's own error, e.g. daa.lambda_=abc
                raise ConfigError(f"command line override {item!r}: {e}") from None
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: '{k}' is not a section")
        node[keys[-1]] = value
    try:
        cfg = build(Config, data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path else str(e)) from None
    resolve(cfg)
    validate(cfg)
    for line in preset_overrides(cfg):
        log.info("%s", line)
    return cfg


def resolve(cfg: Config) -> Config:
    """Fill, in place, every field the algorithm's preset decides and that is unset (None) -- the ONE place presets
    reach the config (``algorithms/registry.py``) -- and check custom functions given by import path (imported and
    signature-checked; a relative ``file.py`` path is made absolute so that workers with another working directory
    find it). Called by :func:`load_config`; call it on a :class:`Config` built in code. Returns ``cfg``."""
    resolve_presets(cfg)
    p = cfg.parallel
    if p.sequence_parallel is None:  # megatron-core's recipes: SP whenever TP > 1 (config_policy.py)
        p.sequence_parallel = p.tensor_model_parallel_size > 1
    a = cfg.algorithm
    for name, args in (("policy_loss_fn", POLICY_LOSS_FN_ARGS), ("advantage_fn", ADVANTAGE_FN_ARGS)):
        spec = getattr(a, name)
        if not spec:
            continue
        try:
            load_function(spec, args, where=f"algorithm.{name}")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        module, _, fn = spec.partition(":")
        if module.endswith(".py"):
            setattr(a, name, f"{Path(module).resolve()}:{fn}")
    return cfg


def algorithm_config(name: str, **explicit: Any) -> AlgorithmConfig:
    """A resolved ``algorithm`` section for ``name``, explicit fields winning over the preset: for code that switches
    a live policy between algorithms (ablations, tests) without loading a whole run config."""
    cfg = Config(algorithm=AlgorithmConfig(name=name, **explicit))
    resolve(cfg)
    return cfg.algorithm


def standalone_policy_config(model_path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """A resolved, validated run config for a policy used without the RL loop (torchrun jobs, tests, benchmarks,
    self-checks): the synthetic data format (no files) and rollout lengths of a few tokens so that any micro-batch
    budget validates, then ``overrides`` as on the command line (e.g. ``parallel.tensor_model_parallel_size=2``,
    ``actor.loss_backend=torch``). Every other value is the run config's own default."""
    base = [f"model.path={model_path}", "data.format=synthetic", "rollout.max_prompt_length=1",
            "rollout.max_response_length=2", "algorithm.overlong.buffer_length=1"]
    return load_config(None, [*base, *overrides])


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain data (for logs, checkpoints and ``--print-config``)."""
    return dataclasses.asdict(cfg)


def describe(cls: type = Config, prefix: str = "") -> list[str]:
    """One line per field: dotted name, default, documentation."""
    lines = []
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            lines += describe(tp, name + ".")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        lines.append(f"{name} = {default!r}: {f.metadata.get('help', '')}")
    return lines
