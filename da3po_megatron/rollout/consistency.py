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

from da3po_megatron.rollout.types import Completion, RolloutError


def logprob_diff_metrics(rollout_logprobs: Sequence[Sequence[float]], policy_logprobs: Sequence[Sequence[float]],
                         prefix: str = "rollout/logprob_diff") -> dict[str, float]:
    """Mean (over tokens) and max absolute difference of two aligned per-response log-prob lists.

    Raises ValueError naming the response whose lengths disagree. Empty input gives NaN mean and max 0.
    """
    if len(rollout_logprobs) != len(policy_logprobs):
        raise ValueError(f"{len(rollout_logprobs)} rollout responses vs {len(policy_logprobs)} policy responses")
    total, count, worst = 0.0, 0, 0.0
    for i, (a, b) in enumerate(zip(rollout_logprobs, policy_logprobs)):
        if len(a) != len(b):
            raise ValueError(f"response {i}: {len(a)} rollout log-probs vs {len(b)} policy log-probs")
        for x, y in zip(a, b):
            d = abs(float(x) - float(y))
            total += d
            count += 1
            worst = max(worst, d)
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
