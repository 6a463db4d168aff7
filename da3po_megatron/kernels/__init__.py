"""Fused DAA policy loss (DESIGN.md Eq. 5/11, 14, 9) from vocab-parallel logits or from hidden states + output weight.

Entry points:
    daa_policy_loss(logits_shard, targets, old_logprobs, advantages, mask, *, clip_ratio_low, clip_ratio_high, ...)
        -> (loss_sum, logprobs, entropy_or_None, metrics)
    vocab_parallel_logprobs(logits_shard, targets, vocab_start, tp_group, compute_entropy=False, backend="auto")
    fused_linear_daa_policy_loss(hidden, weight, targets, old_logprobs, advantages, mask, *, ...)
    triton_available() -> bool

Backends: "reference" (pure torch ground truth), "chunked" (bounded-memory torch), "triton" (fused kernels), "auto".
This package imports nothing else of the project (torch, triton and the standard library only).
"""

from .chunked import chunked_daa_policy_loss, chunked_vocab_parallel_logprobs
from .common import METRIC_KEYS, amplify_advantages
from .dispatch import BACKENDS, daa_policy_loss, resolve_backend, triton_available, vocab_parallel_logprobs
from .fused_linear import fused_linear_daa_policy_loss, fused_linear_vocab_parallel_logprobs
from .reference import reference_daa_policy_loss

__all__ = [
    "BACKENDS",
    "METRIC_KEYS",
    "amplify_advantages",
    "chunked_daa_policy_loss",
    "chunked_vocab_parallel_logprobs",
    "daa_policy_loss",
    "fused_linear_daa_policy_loss",
    "fused_linear_vocab_parallel_logprobs",
    "reference_daa_policy_loss",
    "resolve_backend",
    "triton_available",
    "vocab_parallel_logprobs",
]
