"""Rewards: the math verifier, the worker pool that runs it with time limits, and R = R_acc + R_len.

* :mod:`.math_verify` -- final-answer extraction (``\\boxed{}`` / DAPO ``Answer:`` line) + math-verify equivalence
  -> R_acc in {+1, -1} (DAPO Eq. 7 convention).
* :mod:`.pool` -- :class:`RewardPool`: process pool with a per-item time limit; timeouts and errors score -1 and are
  counted.
* :func:`compute_rewards` -- R = R_acc + R_len with DAPO's overlong shaping (Eq. 8), delegated to
  :func:`da3po_megatron.algorithms.reward_shaping.shaped_reward`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from da3po_megatron.rewards.math_verify import answers_equivalent, extract_answer, score_math
from da3po_megatron.rewards.pool import BUILTIN_KINDS, RewardPool, RewardPoolError, ScoreResult, default_num_workers

__all__ = [
    "BUILTIN_KINDS",
    "RewardPool",
    "RewardPoolError",
    "ScoreResult",
    "answers_equivalent",
    "compute_rewards",
    "default_num_workers",
    "extract_answer",
    "score_math",
]


def _cfg_get(cfg: Any, name: str, default: Any) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def compute_rewards(acc: Sequence[float], lengths: Sequence[int], overlong_cfg: Any | None) -> list[float]:
    """R = R_acc + R_len per response (DAPO Eq. 8 overlong shaping; R_len = 0 when ``overlong_cfg`` is None/disabled).

    ``overlong_cfg`` is a mapping or object with verl/DAPO field names: ``enable`` (default True), ``max_length``
    (L_max, tokens), ``cache_length`` (L_cache, tokens; verl calls it ``len``), ``penalty_factor`` (default 1.0).
    """
    if len(acc) != len(lengths):
        raise ValueError(f"compute_rewards: {len(acc)} accuracy rewards but {len(lengths)} lengths")
    if overlong_cfg is None or not _cfg_get(overlong_cfg, "enable", True):
        return [float(a) for a in acc]
    from da3po_megatron.algorithms.reward_shaping import shaped_reward

    max_length = _cfg_get(overlong_cfg, "max_length", None)
    cache_length = _cfg_get(overlong_cfg, "cache_length", _cfg_get(overlong_cfg, "len", None))
    if max_length is None or cache_length is None:
        raise ValueError("compute_rewards: overlong_cfg needs max_length (L_max) and cache_length (L_cache)")
    factor = float(_cfg_get(overlong_cfg, "penalty_factor", 1.0))
    return [
        float(shaped_reward(float(a), int(n), max_length=max_length, cache_length=cache_length, penalty_factor=factor))
        for a, n in zip(acc, lengths)
    ]
