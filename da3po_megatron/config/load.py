"""Loading the typed configuration tree (:class:`~da3po_megatron.config.tree.Config`): YAML files + dotted
command-line overrides, presets resolved, validated with clear messages.

    cfg = load_config("examples/qwen3_4b_da3po.yaml", ["trainer.total_steps=10", "daa.lambda_=2.5"])

Every field is documented where it is defined (``doc(...)`` in the section modules), with its unit and the paper
equation it comes from. Names follow Megatron for parallelism/model fields and verl/DAPO for RL fields; DA3PO's own
fields live under ``daa``.

A YAML file may start with ``defaults: [other.yaml, ...]`` (paths relative to the file): those are loaded first and
this file's keys override theirs, so the paper's recipes share one base. Unknown keys are errors naming the key and
the closest valid one; values are type-checked (the generic machinery: :mod:`da3po_megatron.config.io`); ranges are
checked in :func:`~da3po_megatron.config.checks.validate` with the allowed range named. Fields an algorithm's preset
decides are resolved once, in :func:`resolve` (from ``algorithms/registry.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from pathlib import Path
from typing import Any

from da3po_megatron.algorithms.registry import (
    ADVANTAGE_FN_ARGS,
    POLICY_LOSS_FN_ARGS,
    load_function,
    preset_overrides,
    resolve_presets,
)
from da3po_megatron.config.checks import validate
from da3po_megatron.config.io import ConfigError, build, nest, parse_override, read_yaml
from da3po_megatron.config.run import AlgorithmConfig
from da3po_megatron.config.tree import Config

log = logging.getLogger(__name__)


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
    if p.sequence_parallel is None:  # megatron-core's recipes: SP whenever TP > 1 (config/policy.py)
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
