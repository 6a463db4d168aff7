"""One entry point for the DAA policy loss (Eq. 5/11 surrogate, Eq. 14 DAA, Eq. 9 token sum) and for log-probs.

`backend` selects the implementation; all four compute the same function (tests hold them to the reference):

* "reference": pure torch, materialises float32 [tokens x V_local] tensors (ground truth; small inputs only);
* "chunked":   torch, bounded memory (token chunks, recompute in backward); the CPU path;
* "triton":    fused Triton kernels (CUDA; on CPU only with TRITON_INTERPRET=1, slow);
* "auto":      "triton" when the logits are on CUDA and a Triton kernel compiles and runs there, else "chunked".

Imports nothing of the project; Triton is imported only when the Triton path is used or probed.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .chunked import chunked_daa_policy_loss, chunked_vocab_parallel_logprobs
from .common import LogprobInputs, LossInputs, LossOutputs
from .reference import reference_daa_policy_loss, reference_logprobs_2d, reference_vocab_parallel_logprobs

BACKENDS = ("auto", "triton", "chunked", "reference")


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure (missing driver libs, ...) means "no Triton"
        return False
    return True


@functools.cache
def _cuda_triton_works() -> bool:
    """Compile and run the log-prob kernels once on a tiny CUDA input and compare them to the reference."""
    if not torch.cuda.is_available() or not _triton_importable():
        return False
    try:
        from .triton_loss import triton_vocab_parallel_logprobs

        g = torch.Generator(device="cuda").manual_seed(0)
        logits = torch.randn(4, 37, device="cuda", generator=g)
        targets = torch.tensor([0, 5, 36, 17], device="cuda")
        logp, _ = triton_vocab_parallel_logprobs(logits, targets)
        ref, _ = reference_logprobs_2d(logits, targets)
        ok = bool(torch.allclose(logp, ref, atol=1e-4))
        if not ok:
            warnings.warn("Triton log-prob kernel disagrees with the reference on CUDA (max |diff| "
                          f"{(logp - ref).abs().max().item():.3g}); backend='auto' uses the chunked torch path",
                          RuntimeWarning, stacklevel=2)
        return ok
    except Exception as e:  # noqa: BLE001 - a compile or launch failure means "fall back to chunked", said once
        warnings.warn(f"Triton kernels do not run on this GPU ({type(e).__name__}: {str(e)[:300]}); backend='auto' "
                      "uses the chunked torch path (bounded memory, slower)", RuntimeWarning, stacklevel=2)
        return False


def triton_available() -> bool:
    """Can the Triton kernels run here? True with CUDA + a working Triton compile, or when the interpreter is usable
    (TRITON_INTERPRET=1 set before triton was first imported)."""
    if not _triton_importable():
        return False
    from .triton_loss import interpreter_ready

    return interpreter_ready() or _cuda_triton_works()


def resolve_backend(backend: str, logits: torch.Tensor) -> str:
    """Map "auto" to a concrete backend for tensors on `logits.device`; validate the name."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    return "triton" if logits.is_cuda and _cuda_triton_works() else "chunked"


# the implementation options each backend's functions take (the others do not apply to it)
_OPTIONS = {"reference": (), "chunked": ("chunk_tokens", "inplace_backward"), "triton": ("block_v", "inplace_backward")}


def _implementation(backend: str, logits: torch.Tensor, loss: bool, **options: Any) -> Callable:
    """`backend`'s loss (or log-prob) function ("auto" resolved for the logits' device), with its own options bound."""
    name = resolve_backend(backend, logits)
    if name == "reference":
        fns = (reference_daa_policy_loss, reference_vocab_parallel_logprobs)
    elif name == "chunked":
        fns = (chunked_daa_policy_loss, chunked_vocab_parallel_logprobs)
    else:
        from .triton_loss import triton_daa_policy_loss, triton_vocab_parallel_logprobs

        fns = (triton_daa_policy_loss, triton_vocab_parallel_logprobs)
    return functools.partial(fns[0] if loss else fns[1], **{k: options[k] for k in _OPTIONS[name]})


def daa_policy_loss(
    logits_shard: torch.Tensor, inputs: LossInputs, *, backend: str = "auto", chunk_tokens: int | None = None,
    block_v: int | None = None, inplace_backward: bool = False,
) -> LossOutputs:
    """Token-level DAPO/DA3PO clipped surrogate on vocab-parallel logits; returns (loss_sum, logp, entropy, metrics).

    Args:
        logits_shard: [..., V_local] logits of this TP rank's vocab columns [vocab_start, vocab_start + V_local)
            (any float dtype; never upcast as a whole).
        inputs: targets, old log-probs, advantages, mask, clip ratios, DAA, vocab shard, entropy flag
            (:class:`LossInputs`).
        backend: "auto" | "triton" | "chunked" | "reference" (see the module docstring).
        chunk_tokens: tokens per chunk of the chunked path (default: ~128 MiB per float32 chunk buffer).
        block_v: vocab block width of the Triton kernels (default: next power of 2 of V_local, at most 4096).
        inplace_backward: chunked/Triton: write dlogits into the logits' storage (only for logits not used later).

    Returns:
        :class:`LossOutputs` (loss_sum, logprobs, entropy or None, metrics); divide loss_sum by the global
        valid-token count for Eq. 9's mean.
    """
    fn = _implementation(backend, logits_shard, True, chunk_tokens=chunk_tokens, block_v=block_v,
                         inplace_backward=inplace_backward)
    return fn(logits_shard, inputs)


def vocab_parallel_logprobs(
    logits_shard: torch.Tensor, inputs: LogprobInputs, *, backend: str = "auto", chunk_tokens: int | None = None,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log pi(y_t) (and entropy) from vocab-parallel logits [..., V_local]: (logp [...], entropy or None).

    The log-prob path without a loss (old-logprob recomputation, evaluation); differentiable in every backend.
    """
    fn = _implementation(backend, logits_shard, False, chunk_tokens=chunk_tokens, block_v=block_v,
                         inplace_backward=False)
    return fn(logits_shard, inputs)
