"""Generic loading of a typed dataclass tree: YAML files with ``defaults`` chains, dotted command-line overrides,
values checked against the annotations with errors naming the field. The project's tree and its checks are in
:mod:`da3po_megatron.config` (``tree.py``, ``checks.py``); this module knows nothing of them."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A configuration problem; the message names the field (and the file when known)."""


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Check/convert a YAML value to the annotated type; ConfigError naming ``where`` otherwise."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: invalid value {value!r}")
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: {value!r} is not one of {list(args)}{hint}")
        return value
    if origin is list:
        if not isinstance(value, list):
            if isinstance(value, str):  # "a,b" on the command line
                value = [v for v in value.split(",") if v]
            else:
                raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)] if args else value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            if isinstance(value, str):  # yaml reads 1e-6 as a string
                try:
                    return float(value)
                except ValueError:
                    pass
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return build(tp, value, where)
    return value


def build(cls: type, data: dict[str, Any], where: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
            hint = f"; did you mean '{(where + '.') if where else ''}{close[0]}'?" if close else \
                f"; valid keys: {', '.join(names)}"
            raise ConfigError(f"unknown config key '{path}'{hint}")
        kwargs[key] = coerce(value, hints[key], path)
    return cls(**kwargs)


def deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: circular 'defaults'")
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    merged: dict[str, Any] = {}
    defaults = data.pop("defaults", [])
    for d in [defaults] if isinstance(defaults, str) else defaults:
        merged = deep_merge(merged, read_yaml(path.parent / d, (*seen, path)))
    return deep_merge(merged, data)


def parse_override(item: str) -> tuple[list[str], Any]:
    """'a.b.c=value' -> (['a', 'b', 'c'], yaml-parsed value)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def nest(keys: list[str], value: Any) -> dict[str, Any]:
    """``["a", "b"], 1`` -> ``{"a": {"b": 1}}`` (one dotted override as a tree)."""
    out: Any = value
    for k in reversed(keys):
        out = {k: out}
    return out


def check_finite(obj: Any, prefix: str = "") -> None:
    """Every float field of a dataclass tree must be a finite number: ``nan`` passes every range check written as a
    comparison the wrong way round, and YAML reads ``.inf`` / ``.nan`` as floats."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            check_finite(value, f"{prefix}{f.name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{prefix}{f.name} = {value!r} is not a finite number")


def doc(default: Any, help_: str, **kw: Any) -> Any:
    """A dataclass field with its documentation attached (shown by ``da3po train --describe``)."""
    if isinstance(default, list | dict):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help_}, **kw)
    return field(default=default, metadata={"help": help_}, **kw)
