"""Rollout / policy log-prob consistency: does the engine sample from the policy the trainer is optimising?

After a weight sync, the engine's log-prob of each sampled token, log pi_vllm(o_t | q, o_<t), must equal the
policy's recomputed log pi_theta(o_t | q, o_<t) up to numerics (float32: ~1e-5; bf16: ~0.1). A larger gap means a
broken sync (wrong mapping, stale prefix cache, a missed bucket) and silently biases the importance ratio
r = pi_theta / pi_old of Eq. 5/11 whenever rollout log-probs serve as pi_old. The trainer runs this every step on a
configurable fraction of the sampled responses and logs the mean and max absolute difference (verl logs the same
quantity as ``training/rollout_probs_diff_*``).

This module only measures the mismatch; the truncated importance-sampling correction (TIS,
``algorithm.rollout_correction=tis``) is :mod:`da3po_megatron.algorithms.rollout_correction`, applied by the trainer.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from da3po_megatron.rollout.types import Completion, RolloutError


def logprob_diff_metrics(rollout_logprobs: Sequence[Sequence[float]], policy_logprobs: Sequence[Sequence[float]],
                         prefix: str = "rollout/logprob_diff") -> dict[str, float]:
    """Mean (over tokens) and max absolute difference of two aligned per-response log-prob lists.

    Raises ValueError naming the response whose lengths disagree. Empty input gives NaN mean and max 0.
    """
    if len(rollout_logprobs) != len(policy_logprobs):
        raise ValueError(f"{len(rollout_logprobs)} rollout responses vs {len(policy_logprobs)} policy responses")
    for i, (a, b) in enumerate(zip(rollout_logprobs, policy_logprobs)):
        if len(a) != len(b):
            raise ValueError(f"response {i}: {len(a)} rollout log-probs vs {len(b)} policy log-probs")
    def flat(rows: Any) -> np.ndarray:  # a Ragged (batching.py) is one array already
        if hasattr(rows, "values") and hasattr(rows, "offsets") and getattr(rows, "rows", None) is None:
            return rows.values
        return np.concatenate([np.asarray(r, dtype=np.float64) for r in rows]) if len(rows) else np.zeros(0)

    d = np.subtract(flat(rollout_logprobs), flat(policy_logprobs), dtype=np.float64)  # exact for float32 inputs
    np.abs(d, out=d)
    count = len(d)
    worst = max(0.0, float(np.fmax.reduce(d))) if count else 0.0  # NaNs ignored, as the loop's max() did
    # the left-to-right sum in float64 (np.add.accumulate is sequential): the same value the per-token loop gave
    total = float(np.add.accumulate(d, out=d)[-1]) if count else 0.0
    return {f"{prefix}_mean": total / count if count else math.nan, f"{prefix}_max": worst,
            f"{prefix}_tokens": float(count), f"{prefix}_responses": float(len(rollout_logprobs))}


def select(completions: Sequence[Completion], fraction: float, seed: int = 0, max_responses: int | None = None
           ) -> list[Completion]:
    """A reproducible random subset: ceil(fraction x N) responses with at least one token (at most ``max_responses``).
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"consistency fraction must be in [0, 1], got {fraction}")
    pool = [c for c in completions if c.num_tokens > 0]
    k = min(len(pool), math.ceil(fraction * len(pool)))
    if max_responses is not None:
        k = min(k, max_responses)
    return random.Random(seed).sample(pool, k) if k < len(pool) else pool


def check_consistency(completions: Sequence[Completion] | Sequence[Sequence[Completion]],
                      compute_logprobs: Callable[[Any], Any] | Any, fraction: float = 0.1, seed: int = 0,
                      max_responses: int | None = None, prefix: str = "rollout/logprob_diff") -> dict[str, float]:
    """Recompute the log-probs of a sampled fraction of responses with the policy and compare with the rollout's.

    ``compute_logprobs``: the policy's ``compute_logprobs`` (a PolicyWorker / PolicyGroup method, or any object with
    that method) taking a :class:`~da3po_megatron.megatron.batching.PolicyBatch` and returning per-response lists.
    ``completions``: flat, or per prompt as returned by ``RolloutClient.generate``. Returns
    ``{prefix_mean, prefix_max, prefix_tokens, prefix_responses}``; zero responses selected -> NaN mean.
    """
    flat: list[Completion] = []
    for item in completions:
        if isinstance(item, Completion):
            flat.append(item)
        else:
            flat.extend(item)
    chosen = select(flat, fraction, seed, max_responses)
    for c in chosen:
        if len(c.logprobs) != c.num_tokens:
            raise RolloutError(f"prompt {c.prompt_index} sample {c.sample_index}: {len(c.logprobs)} rollout log-probs "
                               f"for {c.num_tokens} tokens (generate with SamplingConfig(logprobs=True))")
    if not chosen:
        return logprob_diff_metrics([], [], prefix)
    from da3po_megatron.megatron.batching import PolicyBatch

    batch = PolicyBatch(prompt_ids=[list(c.prompt_token_ids) for c in chosen],
                        response_ids=[list(c.token_ids) for c in chosen])
    fn = getattr(compute_logprobs, "compute_logprobs", compute_logprobs)
    policy = fn(batch)
    return logprob_diff_metrics([c.logprobs for c in chosen], policy, prefix)


# The mismatch of a correct, fresh sync is numerics only (see the module docstring); below these floors a ratio to the
# baseline is noise. float32: measured 1e-6..1e-5 mean on the tiny models and SmolLM2-135M; bf16: ~1e-2.
DRIFT_FLOOR = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}


class DriftMonitor:
    """Alert when the rollout/policy log-prob mismatch grows past what a fresh sync gives.

    The first measured mismatch of a process is taken right after the engines were loaded from the same weights as
    the policy: that is the baseline ("fresh-sync level"). Every later step's mean mismatch is compared with
    ``factor x max(baseline, floor)``; above it the step is flagged (a warning and ``rollout/logprob_drift_alert`` = 1;
    ``rollout/logprob_drift_ratio`` = mean / max(baseline, floor) is always logged). A correct synchronous loop stays
    near ratio 1 every step, because every step samples from freshly synced weights; a sync that misses a layer
    (the tied-head bug: 1e-5 -> 1.5e-4 -> 2.4e-4 over three steps of SmolLM2) grows it step after step.
    ``factor <= 0`` turns the alert off (the ratio is still logged).
    """

    def __init__(self, factor: float = 10.0, floor: float = DRIFT_FLOOR["float32"]) -> None:
        self.factor, self.floor = float(factor), float(floor)
        self.baseline: float | None = None

    def update(self, step: int, metrics: dict[str, float], prefix: str = "rollout/logprob_diff") -> dict[str, float]:
        """Metrics to log for this step's mismatch ``metrics`` (as from :func:`logprob_diff_metrics`); warns on drift.
        """
        import warnings

        mean = metrics.get(f"{prefix}_mean", math.nan)
        if not math.isfinite(mean):
            return {}
        if self.baseline is None:
            self.baseline = mean
        ratio = mean / max(self.baseline, self.floor)
        alert = self.factor > 0 and ratio > self.factor
        if alert:
            warnings.warn(f"step {step}: rollout/policy log-prob mismatch {mean:.3g} (mean over tokens) is "
                          f"{ratio:.1f}x the fresh-sync level {max(self.baseline, self.floor):.3g}: the engines may "
                          "not sample from the policy being trained (a weight-sync problem?)", RuntimeWarning,
                          stacklevel=2)
        return {"rollout/logprob_drift_ratio": ratio, "rollout/logprob_drift_alert": float(alert)}
