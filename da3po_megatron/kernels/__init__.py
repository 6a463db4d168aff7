"""Fused DAA policy loss (DESIGN.md Eq. 5/11, 14, 9) from vocab-parallel logits or from hidden states + output weight.

Every entry point takes the tensor it differentiates and ONE inputs object:

    inputs = LossInputs(targets, old_logprobs=..., advantages=..., mask=..., clip_ratio_low=0.2, clip_ratio_high=0.28,
                        vocab_start=0, tp_group=None, compute_entropy=False,   # + correct, p_hat, daa_lambda, daa_tau
                        )
    daa_policy_loss(logits_shard, inputs, backend="auto") -> LossOutputs(loss_sum, logprobs, entropy, metrics)
    vocab_parallel_logprobs(logits_shard, LogprobInputs(targets, vocab_start, tp_group, compute_entropy))
    fused_linear_daa_policy_loss(hidden, OutputLayer(weight, temperature, vocab_limit), inputs)
    triton_available() -> bool

Backends: "reference" (pure torch ground truth), "chunked" (bounded-memory torch), "triton" (fused kernels), "auto".
Implementation options (chunk_tokens, block_v, inplace_backward) are keywords of the function they apply to.
This package imports nothing else of the project (torch, triton and the standard library only).
"""

from .chunked import chunked_daa_policy_loss, chunked_vocab_parallel_logprobs
from .common import METRIC_KEYS, LogprobInputs, LossInputs, LossOutputs, amplify_advantages
from .dispatch import BACKENDS, daa_policy_loss, resolve_backend, triton_available, vocab_parallel_logprobs
from .fused_linear import OutputLayer, fused_linear_daa_policy_loss, fused_linear_vocab_parallel_logprobs
from .reference import reference_daa_policy_loss, reference_vocab_parallel_logprobs

__all__ = [
    "BACKENDS",
    "METRIC_KEYS",
    "LogprobInputs",
    "LossInputs",
    "LossOutputs",
    "OutputLayer",
    "amplify_advantages",
    "chunked_daa_policy_loss",
    "chunked_vocab_parallel_logprobs",
    "daa_policy_loss",
    "fused_linear_daa_policy_loss",
    "fused_linear_vocab_parallel_logprobs",
    "reference_daa_policy_loss",
    "reference_vocab_parallel_logprobs",
    "resolve_backend",
    "triton_available",
    "vocab_parallel_logprobs",
]
