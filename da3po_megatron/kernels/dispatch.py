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

import torch
import torch.distributed as dist

from .chunked import chunked_daa_policy_loss, chunked_vocab_parallel_logprobs
from .common import prepare_inputs
from .reference import reference_daa_policy_loss, reference_logprobs_2d

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


def daa_policy_loss(
    logits_shard: torch.Tensor,
    targets: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    vocab_start: int = 0,
    tp_group: dist.ProcessGroup | None = None,
    correct: torch.Tensor | None = None,
    p_hat: torch.Tensor | None = None,
    daa_lambda: float | torch.Tensor | None = None,
    daa_tau: float | None = None,
    compute_entropy: bool = False,
    backend: str = "auto",
    chunk_tokens: int | None = None,
    block_v: int | None = None,
    inplace_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """Token-level DAPO/DA3PO clipped surrogate on vocab-parallel logits; returns (loss_sum, logp, entropy, metrics).

    Args:
        logits_shard: [..., V_local] logits of this TP rank's vocab columns [vocab_start, vocab_start + V_local)
            (any float dtype; never upcast as a whole).
        targets: [...] token ids (global vocab ids); ids outside the local shard contribute 0 on this rank.
        old_logprobs: [...] log pi_old(y_t) (float; broadcast to targets' shape, like the next three).
        advantages: [...] A_t (Eq. 3), raw; DAA is applied inside when correct/p_hat/daa_lambda/daa_tau are given.
        mask: [...] token weights (1 = response token, 0 = padding/prompt); a token counts as valid when mask > 0.
        clip_ratio_low / clip_ratio_high: eps_low / eps_high of Eq. 11 (DAPO: 0.2 / 0.28).
        tp_group: tensor-parallel group over which the vocab is split (None: the whole vocab is local).
        correct, p_hat, daa_lambda, daa_tau: DAA (Eq. 14): A~ = lambda A where correct and p_hat < tau; correct and
            p_hat broadcast to targets' shape ([B, 1] per response works); daa_lambda is a float (paper: 2.0) or a
            tensor broadcastable likewise (adaptive DAA).
        compute_entropy: also return the per-token entropy of the full (global-vocab) distribution.
        backend: "auto" | "triton" | "chunked" | "reference" (see the module docstring).
        chunk_tokens: tokens per chunk of the chunked path (default: ~128 MiB per float32 chunk buffer).
        block_v: vocab block width of the Triton kernels (default: next power of 2 of V_local, at most 4096).
        inplace_backward: chunked/Triton: write dlogits into the logits' storage (only for logits not used later).

    Returns:
        loss_sum: 0-dim float32, sum_t loss_t (divide by the global valid-token count for Eq. 9's mean);
        logp: [...] float32 log pi_theta(y_t) (differentiable); entropy: [...] float32 or None (differentiable);
        metrics: {"clip_low_count", "clip_high_count", "token_count"} 0-dim float32 tensors over valid tokens.
    """
    name = resolve_backend(backend, logits_shard)
    kw = dict(
        clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, vocab_start=vocab_start, tp_group=tp_group,
        correct=correct, p_hat=p_hat, daa_lambda=daa_lambda, daa_tau=daa_tau, compute_entropy=compute_entropy,
    )
    args = (logits_shard, targets, old_logprobs, advantages, mask)
    if name == "reference":
        return reference_daa_policy_loss(*args, **kw)
    if name == "chunked":
        return chunked_daa_policy_loss(*args, **kw, chunk_tokens=chunk_tokens, inplace_backward=inplace_backward)
    from .triton_loss import triton_daa_policy_loss

    return triton_daa_policy_loss(*args, **kw, block_v=block_v, inplace_backward=inplace_backward)


def vocab_parallel_logprobs(
    logits_shard: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int = 0,
    tp_group: dist.ProcessGroup | None = None,
    compute_entropy: bool = False,
    backend: str = "auto",
    chunk_tokens: int | None = None,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log pi(y_t) (and entropy) from vocab-parallel logits [..., V_local]: (logp [...], entropy or None).

    The log-prob path without a loss (old-logprob recomputation, evaluation); differentiable in every backend.
    """
    name = resolve_backend(backend, logits_shard)
    if name == "reference":
        inp = prepare_inputs(logits_shard, targets, need_loss_inputs=False)
        logp, ent = reference_logprobs_2d(inp.logits, inp.targets, vocab_start, tp_group, compute_entropy)
        shape = inp.token_shape
        return logp.reshape(shape), ent.reshape(shape) if ent is not None else None
    if name == "chunked":
        return chunked_vocab_parallel_logprobs(
            logits_shard, targets, vocab_start, tp_group, compute_entropy, chunk_tokens
        )
    from .triton_loss import triton_vocab_parallel_logprobs

    return triton_vocab_parallel_logprobs(logits_shard, targets, vocab_start, tp_group, compute_entropy, block_v)
