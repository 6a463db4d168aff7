"""Truncated importance sampling (TIS) for the rollout / training log-prob mismatch.

The engines (vLLM: bf16, its own kernels) and the Megatron policy give slightly different probabilities for the same
weights, so the responses are sampled from pi_rollout while the clipped surrogate (Eq. 5/11) takes its ratio against
pi_old recomputed by Megatron. TIS (Yao, Liu et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy
RL Training", fengyao.notion.site; verl ``rollout_is``, slime ``--use-tis``) corrects the sampling distribution with
a detached, truncated per-token importance weight

    w_t = min(pi_old(y_t) / pi_rollout(y_t), C)

and multiplies each token's surrogate term by it. Since w_t > 0,
w min(r A, clip(r) A) = min(r (w A), clip(r) (w A)), so scaling the token's advantage by w_t is the same thing: the
policy applies it that way, which works for every loss backend and leaves the clip metrics unchanged.

Left out: the sequence-level variants (a product or geometric mean of the token ratios, needed for GSPO's sequence
ratio) and masking instead of truncating (MIS): only the token-level truncated weight is implemented.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0  # as in losses.py: a diverged token cannot overflow exp


def tis_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, cap: float) -> tuple[Tensor, dict[str, float]]:
    """Per-token TIS weights w_t = min(exp(log pi_old - log pi_rollout), cap) and their logging statistics.

    Args:
        old_logprobs: log pi_old of the sampled tokens (recomputed by the training policy), any shape; every element
            is a token (flatten the responses first).
        rollout_logprobs: log pi_rollout of the same tokens (what the engine sampled them with), same shape.
        cap: C, the truncation threshold (> 0; verl / slime use 2.0).

    The log-ratio is clamped to [-20, 20] before exp (as the loss does), so an infinite log-prob on either side gives
    a finite weight (the cap, or ~2e-9) instead of inf or 0. A NaN log-prob is an error: it has no meaningful weight.

    Returns:
        ``(weights, stats)``: float32-or-wider weights of the input's shape (detached), and ``tis/weight_mean`` (mean
        weight), ``tis/capped_frac`` (fraction of tokens whose ratio reached the cap) and ``tis/ratio_max`` (largest
        ratio before truncation). Without tokens: 1.0, 0.0 and 1.0.
    """
    if old_logprobs.shape != rollout_logprobs.shape:
        raise ValueError(f"tis_weights: old_logprobs {tuple(old_logprobs.shape)} and rollout_logprobs "
                         f"{tuple(rollout_logprobs.shape)} must have the same shape")
    if not cap > 0:
        raise ValueError(f"tis_weights: cap must be > 0, got {cap}")
    dtype = torch.promote_types(old_logprobs.dtype, torch.float32)
    log_ratio = old_logprobs.detach().to(dtype) - rollout_logprobs.detach().to(dtype)
    # inf - inf (both -inf) is NaN too: a token neither side could have produced
    n_nan = int(torch.isnan(log_ratio).sum())
    if n_nan:
        raise ValueError(f"tis_weights: {n_nan} of {log_ratio.numel()} tokens have a NaN log-prob ratio")
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    capped = log_ratio >= math.log(cap)
    weights = torch.where(capped, torch.full_like(ratio, cap), ratio)
    n = ratio.numel()
    stats = {
        "tis/weight_mean": float(weights.double().mean()) if n else 1.0,
        "tis/capped_frac": float(capped.double().mean()) if n else 0.0,
        "tis/ratio_max": float(ratio.max()) if n else 1.0,
    }
    return weights, stats
