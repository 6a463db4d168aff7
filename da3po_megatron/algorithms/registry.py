"""The algorithm registry: GRPO, DAPO, GSPO and DA3PO, each defined ONCE with everything that distinguishes it.

An :class:`Algorithm` fixes the six choices that make the four methods differ (paper equations as in DESIGN.md):

==========  ===========  ===================  =================  =========  ========  =====
name        ratio level  loss aggregation     clip eps_l / eps_h  filtering  overlong  DAA
==========  ===========  ===================  =================  =========  ========  =====
grpo        token        seq-mean-token-mean  0.2 / 0.2           off*       off*      off
dapo        token        token-mean (Eq. 9)   0.2 / 0.28          on         on        off
gspo        sequence     seq-mean-token-mean  3e-4 / 4e-4         off*       off*      off
da3po       token        token-mean (Eq. 9)   0.2 / 0.28          on         on        on (Eq. 14)
==========  ===========  ===================  =================  =========  ========  =====

``*`` marks OUR choices for the baselines, not the papers': dynamic sampling and overlong shaping are DAPO's additions,
not part of GRPO (Shao et al. 2024) or GSPO (Zheng et al. 2025) as published, and the DA3PO paper does not say how it
configured its baselines; we run GRPO and GSPO without both so that each baseline is its own method alone. The clip
ratios are the published defaults (GRPO/PPO 0.2 symmetric; DAPO's clip-higher 0.2 / 0.28, which DA3PO inherits;
GSPO's 3e-4 / 4e-4 for its length-normalised sequence ratio). DA3PO = DAPO + DAA (the paper's Algorithm 1).

The run config (``da3po_megatron.config``) leaves every field a preset decides unset (None) and fills it ONCE at
load from :func:`get_algorithm`; an explicit value wins and is reported as an override (:func:`preset_overrides`).
After loading, code reads plain resolved values; nothing else in the project knows what a preset contains.

Extension points by import path (slime's ``custom_*_function_path`` idea, done here as plain functions): a custom
policy loss (``algorithm.policy_loss_fn``) or advantage estimator (``algorithm.advantage_fn``), given as
``"package.module:function"`` or ``"path/to/file.py:function"``, resolved and signature-checked when the config is
loaded (:func:`load_function`). Their contracts: :data:`POLICY_LOSS_FN_ARGS` and :data:`ADVANTAGE_FN_ARGS`.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Algorithm:
    """One algorithm's preset.

    Attributes:
        name: ``algorithm.name``.
        ratio_level: "token" (PPO / GRPO / DAPO, Eq. 5/11 per token) or "sequence" (GSPO's length-normalised ratio).
        loss_agg_mode: "token-mean" (DAPO Eq. 9, one normaliser over the batch's tokens) or "seq-mean-token-mean"
            (GRPO Eq. 4, per-response mean then mean over responses).
        clip_ratio_low / clip_ratio_high: eps_low / eps_high of clip(r, 1 - eps_low, 1 + eps_high) (Eq. 11).
        filter_groups: dynamic sampling (keep groups with 0 < p_hat < 1, over-sample until the batch is full).
        overlong_shaping: DAPO's overlong reward shaping R_len (Eq. 8).
        daa: Direct Advantage Amplification (Eq. 14).
        note: where the choices come from (shown by ``da3po train --describe``-style listings).
    """

    name: str
    ratio_level: str
    loss_agg_mode: str
    clip_ratio_low: float
    clip_ratio_high: float
    filter_groups: bool
    overlong_shaping: bool
    daa: bool
    note: str = ""


ALGORITHM_REGISTRY: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("grpo", "token", "seq-mean-token-mean", 0.2, 0.2, filter_groups=False, overlong_shaping=False,
              daa=False, note="GRPO (Shao et al. 2024): symmetric clip, Eq. 4 aggregation; no filtering and no "
                              "overlong shaping are OUR baseline choices"),
    Algorithm("dapo", "token", "token-mean", 0.2, 0.28, filter_groups=True, overlong_shaping=True, daa=False,
              note="DAPO (Yu et al. 2025): clip-higher, token-level loss (Eq. 9), dynamic sampling, overlong "
                   "shaping (Eq. 8)"),
    Algorithm("gspo", "sequence", "seq-mean-token-mean", 3e-4, 4e-4, filter_groups=False, overlong_shaping=False,
              daa=False, note="GSPO (Zheng et al. 2025): sequence-level ratio with its published clips; no "
                              "filtering and no overlong shaping are OUR baseline choices"),
    Algorithm("da3po", "token", "token-mean", 0.2, 0.28, filter_groups=True, overlong_shaping=True, daa=True,
              note="DA3PO: DAPO + Direct Advantage Amplification (Eq. 14)"),
)}
ALGORITHMS: tuple[str, ...] = tuple(ALGORITHM_REGISTRY)  # the names ``algorithm.name`` accepts

# preset attribute -> dotted run-config field it fills (the only place that knows where a preset lands)
PRESET_FIELDS: dict[str, str] = {
    "ratio_level": "algorithm.ratio_level",
    "loss_agg_mode": "algorithm.loss_agg_mode",
    "clip_ratio_low": "algorithm.clip_ratio_low",
    "clip_ratio_high": "algorithm.clip_ratio_high",
    "filter_groups": "algorithm.filter_groups",
    "overlong_shaping": "algorithm.overlong.enable",
    "daa": "daa.enable",
}
assert set(PRESET_FIELDS) == {f.name for f in fields(Algorithm)} - {"name", "note"}


def get_algorithm(name: str) -> Algorithm:
    """The preset of ``name``; ValueError listing the known names otherwise."""
    try:
        return ALGORITHM_REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; known: {list(ALGORITHMS)}") from None


def baseline_of(name: str) -> str:
    """The registered algorithm that is ``name`` without DAA: the one whose preset equals ``name``'s in every field but
    ``daa`` (da3po -> dapo); ``name`` itself when it has no DAA or no such algorithm is registered."""
    a = get_algorithm(name)
    if not a.daa:
        return name
    same = [b.name for b in ALGORITHM_REGISTRY.values()
            if not b.daa and all(getattr(b, f) == getattr(a, f) for f in PRESET_FIELDS if f != "daa")]
    return same[0] if same else name


def preset_values(name: str) -> dict[str, Any]:
    """``{dotted config field: value}`` of every field the preset of ``name`` decides."""
    a = get_algorithm(name)
    return {path: getattr(a, attr) for attr, path in PRESET_FIELDS.items()}


def preset_override_args(name: str) -> list[str]:
    """The whole preset as dotted overrides (``algorithm.name=gspo``, ``algorithm.clip_ratio_low=0.0003``, ...):
    what a runner passes so that no value of a base recipe can leak into another algorithm's run."""
    def text(v: Any) -> str:
        return str(v).lower() if isinstance(v, bool) else repr(v) if isinstance(v, float) else str(v)

    return [f"algorithm.name={name}"] + [f"{k}={text(v)}" for k, v in preset_values(name).items()]


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _set(obj: Any, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        obj = getattr(obj, part)
    setattr(obj, last, value)


def resolve_presets(cfg: Any) -> None:
    """Fill every preset-decided field of the run config that is unset (None) from ``cfg.algorithm.name``'s preset,
    in place. Explicit values are kept."""
    for path, value in preset_values(cfg.algorithm.name).items():
        if _get(cfg, path) is None:
            _set(cfg, path, value)


def preset_overrides(cfg: Any) -> list[str]:
    """One line per preset-decided field whose (resolved) value differs from the preset, e.g.
    ``algorithm.clip_ratio_high=0.3 overrides the gspo preset (0.0004)``."""
    name = cfg.algorithm.name
    return [f"{path}={_get(cfg, path)!r} overrides the {name} preset ({value!r})"
            for path, value in preset_values(name).items() if _get(cfg, path) != value]


# ----------------------------------------------------------------------------------------------------------------------
# Custom functions by import path

POLICY_LOSS_FN_ARGS: tuple[str, ...] = ("logprobs", "old_logprobs", "advantages", "mask", "clip_ratio_low",
                                        "clip_ratio_high", "ratio_level", "loss_agg_mode", "global_num_tokens",
                                        "global_num_seqs")
"""A custom policy loss is called exactly like :func:`da3po_megatron.algorithms.losses.policy_loss`:
``fn(logprobs, old_logprobs, advantages, mask, *, clip_ratio_low, clip_ratio_high, ratio_level, loss_agg_mode,
global_num_tokens, global_num_seqs) -> (loss, metrics)`` on padded ``[B, T]`` tensors (advantages ``[B]``, or
``[B, T]`` when per-token TIS weights are folded in), with the same normaliser
contract (the sum over micro-batches and ranks of the returned losses is the mini-batch loss). ``metrics`` may hold
``clipfrac_low`` / ``clipfrac_high`` (fractions of the local tokens) for logging; missing keys log 0."""

ADVANTAGE_FN_ARGS: tuple[str, ...] = ("rewards", "group_size", "eps")
"""A custom advantage estimator replaces Eq. 3: ``fn(rewards, group_size, *, eps) -> advantages``, ``rewards`` a
``[N]`` float tensor laid out group-major (``group_size`` adjacent responses per prompt), result ``[N]``. DAA (Eq. 14)
is applied to its output when enabled, exactly as to Eq. 3's."""


def load_function(spec: str, required_args: tuple[str, ...] = (), where: str = "function") -> Callable[..., Any]:
    """Import ``"package.module:function"`` or ``"path/to/file.py:function"`` and check that it can be called with
    ``required_args`` as keywords. Raises ValueError naming ``where`` and what is wrong."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{where}={spec!r}: expected 'package.module:function' or 'path/to/file.py:function'")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).resolve()
            if not path.is_file():
                raise ValueError(f"{where}={spec!r}: file {path} does not exist")
            mod_id = f"_da3po_custom_{abs(hash(str(path)))}"
            module = sys.modules.get(mod_id)
            if module is None:
                s = importlib.util.spec_from_file_location(mod_id, path)
                module = importlib.util.module_from_spec(s)  # type: ignore[arg-type]
                sys.modules[mod_id] = module
                s.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(module_name)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - any import failure is the user's module's, report it as such
        raise ValueError(f"{where}={spec!r}: cannot import {module_name!r}: {type(e).__name__}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{where}={spec!r}: {module_name!r} has no callable {attr!r}")
    try:
        inspect.signature(fn).bind(**{a: None for a in required_args})
    except TypeError as e:
        raise ValueError(f"{where}={spec!r}: {attr}{inspect.signature(fn)} cannot be called as "
                         f"{attr}({', '.join(f'{a}=...' for a in required_args)}): {e}") from None
    return fn
