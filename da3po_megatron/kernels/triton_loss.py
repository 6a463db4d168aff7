"""Triton fused DAA policy loss: vocab-parallel logits -> per-token logp, clipped surrogate with DAA, clip metrics.

Implements DESIGN.md Eq. 5/11 (token-level clipped surrogate with DAPO clip-higher), Eq. 14 (DAA amplification of the
advantage, computed inside the loss kernel when `correct`/`p_hat`/`daa_lambda`/`daa_tau` are given) and returns the
token-level sum of Eq. 9 (the caller divides by the global token count). Never materialises a float32
[tokens x vocab] tensor:

1. stats pass (`stats_kernel`): one program per token streams its local logit row in BLOCK_V blocks with an online
   max / sum-exp (and sum-exp * shifted logit for the entropy) and gathers the target logit if it is local;
2. TP combine (`common.combine_vocab_stats`): one MAX + one SUM all-reduce of [N]-vectors over the TP group;
3. loss pass (`loss_kernel`): per token, logp, ratio, DAA, surrogate, d loss/d logp and clip flags; the token sum and
   the counts are deterministic torch sums of [N] vectors (no float atomics);
4. backward (`dlogits_kernel`): recomputes p blockwise from the saved logsumexp and writes dlogits in the logits' dtype,
   optionally into the logits' own storage (`inplace_backward`, Liger-Kernel's trick) so that the backward needs no
   extra [tokens x vocab] buffer at all.

On CPU, Triton runs only with `TRITON_INTERPRET=1` (slow; tests use tiny shapes). Kernels are `triton.jit`-decorated
on first use (see `_triton_kernels.py`). Left out: a split-vocab 2-D grid for very few tokens (one program per row
under-fills a GPU below a few thousand tokens) and fusing the logits matmul (see `fused_linear.py`).
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

from .common import (
    LOG_RATIO_CLAMP,
    SHIFTED_LOGIT_FLOOR,
    LogprobGrads,
    LogprobInputs,
    LossInputs,
    LossOutputs,
    combine_vocab_stats,
    logprob_grads,
    prepare_inputs,
)

LOSS_BLOCK_N = 1024


def interpret_mode() -> bool:
    """True when Triton runs its interpreter (TRITON_INTERPRET=1): kernels then run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def interpreter_ready() -> bool:
    """True when Triton's interpreter can run our kernels: TRITON_INTERPRET=1 was set BEFORE triton was first imported.

    Triton decorates its own standard library (tl.max, tl.sum, ...) at import time; if that happened without the
    interpreter, interpreted kernels fail with "Cannot call @triton.jit'd outside of the scope of a kernel".
    """
    if not interpret_mode():
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.max, InterpretedFunction)


@functools.cache
def _build(interpret: bool) -> SimpleNamespace:
    import triton

    from . import _triton_kernels as raw

    return SimpleNamespace(
        stats=triton.jit(raw.stats_kernel),
        loss=triton.jit(raw.loss_kernel),
        dlogits=triton.jit(raw.dlogits_kernel),
    )


def _kernels() -> SimpleNamespace:
    return _build(interpret_mode())


def default_block_v(v_local: int) -> int:
    """Vocab block width: the next power of two of V_local, capped at 4096 (Liger uses up to 32K with more warps)."""
    return min(4096, 1 << max(4, (v_local - 1).bit_length()))


def _num_warps(block_v: int) -> int:
    return 8 if block_v >= 2048 else 4


def _check_device(logits: torch.Tensor) -> None:
    if logits.is_cuda:
        return
    if not interpret_mode():
        raise RuntimeError(
            "backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors (interpreter, slow); "
            f"logits are on {logits.device}. Use backend='chunked' on CPU."
        )
    if not interpreter_ready():
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after `import triton`: Triton's standard library was compiled for a GPU "
            "driver. Set TRITON_INTERPRET=1 in the environment before triton is first imported."
        )


def triton_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    group: dist.ProcessGroup | None,
    compute_entropy: bool,
    block_v: int,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Stats pass + TP combine -> (lse [N], entropy [N] or None, target logit [N]), float32."""
    k = _kernels()
    n, v_local = logits.shape
    m = torch.empty(n, dtype=torch.float32, device=logits.device)
    s, tgt = torch.empty_like(m), torch.empty_like(m)
    w = torch.empty_like(m) if compute_entropy else m  # dummy pointer when unused
    if n > 0:
        k.stats[(n,)](
            logits, logits.stride(0), targets, m, s, w, tgt, vocab_start, v_local,
            BLOCK_V=block_v, COMPUTE_ENTROPY=compute_entropy, SHIFTED_LOGIT_FLOOR=SHIFTED_LOGIT_FLOOR,
            num_warps=_num_warps(block_v),
        )
    return combine_vocab_stats(m, s, w if compute_entropy else None, tgt, group)


def triton_dlogits(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, grads: LogprobGrads, block_v: int, inplace: bool
) -> torch.Tensor:
    """dlogits of sum_t g_logp_t logp_t + g_entropy_t H_t, in the logits' dtype (written into `logits` if inplace)."""
    k = _kernels()
    lse, g_logp, entropy, g_entropy = grads
    n, v_local = logits.shape
    out = logits if inplace else torch.empty_like(logits)
    has_ent = g_entropy is not None
    g_logp = g_logp.to(torch.float32).contiguous()
    ent = entropy.contiguous() if has_ent else lse
    g_ent = g_entropy.to(torch.float32).contiguous() if has_ent else lse
    if n > 0:
        k.dlogits[(n,)](
            logits, logits.stride(0), out, out.stride(0), targets, lse, g_logp, ent, g_ent, vocab_start, v_local,
            BLOCK_V=block_v, HAS_ENT_GRAD=has_ent, SHIFTED_LOGIT_FLOOR=SHIFTED_LOGIT_FLOOR,
            num_warps=_num_warps(block_v),
        )
    return out


class TritonVocabParallelLogprobs(torch.autograd.Function):
    """(logits [N, V_local], targets [N]) -> (logp [N] fp32, entropy [N] fp32 or empty)."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group, compute_entropy, block_v, inplace_backward):  # type: ignore[override]
        lse, entropy, tgt = triton_stats(logits, targets, vocab_start, group, compute_entropy, block_v)
        ctx.save_for_backward(logits, targets, lse, entropy if entropy is not None else lse.new_empty(0))
        ctx.cfg = (vocab_start, compute_entropy, block_v, inplace_backward)
        return tgt - lse, entropy if entropy is not None else lse.new_empty(0)

    @staticmethod
    def backward(ctx, g_logp, g_entropy):  # type: ignore[override]
        logits, targets, lse, entropy = ctx.saved_tensors
        vocab_start, compute_entropy, block_v, inplace = ctx.cfg
        grads = logprob_grads(lse, entropy, g_logp, g_entropy, compute_entropy)
        if grads is None:
            return (None,) * 7
        d = triton_dlogits(logits, targets, vocab_start, grads, block_v, inplace)
        return (d,) + (None,) * 6


class TritonDAAPolicyLoss(torch.autograd.Function):
    """Fused forward/backward; outputs (loss_sum, logp, entropy or empty, clip_low_count, clip_high_count)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, logits, targets, old, adv, mask, correct, p_hat, daa_lambda, daa_tau,
        clip_ratio_low, clip_ratio_high, vocab_start, group, compute_entropy, block_v, inplace_backward,
    ):
        k = _kernels()
        n = logits.shape[0]
        lse, entropy, tgt = triton_stats(logits, targets, vocab_start, group, compute_entropy, block_v)
        logp, loss_tok, coef = torch.empty_like(lse), torch.empty_like(lse), torch.empty_like(lse)
        clip_low, clip_high = torch.empty_like(lse), torch.empty_like(lse)
        has_daa = correct is not None
        lambda_per_token = isinstance(daa_lambda, torch.Tensor)
        if n > 0:
            k.loss[(triton_cdiv(n, LOSS_BLOCK_N),)](
                tgt, lse, old, adv, mask, correct if has_daa else old, p_hat if has_daa else old,
                daa_lambda if lambda_per_token else old,
                logp, loss_tok, coef, clip_low, clip_high, n,
                1.0 - clip_ratio_low, 1.0 + clip_ratio_high,
                float(daa_lambda) if has_daa and not lambda_per_token else 1.0, float(daa_tau) if has_daa else 0.0,
                LOG_RATIO_CLAMP=LOG_RATIO_CLAMP, BLOCK_N=LOSS_BLOCK_N, HAS_DAA=has_daa,
                LAMBDA_PER_TOKEN=lambda_per_token,
            )
        ent_out = entropy if entropy is not None else lse.new_empty(0)
        ctx.save_for_backward(logits, targets, lse, ent_out, coef)
        ctx.cfg = (vocab_start, compute_entropy, block_v, inplace_backward)
        low_count, high_count = clip_low.sum(), clip_high.sum()
        ctx.mark_non_differentiable(low_count, high_count)
        return loss_tok.sum(), logp, ent_out, low_count, high_count

    @staticmethod
    def backward(ctx, g_loss, g_logp, g_entropy, _g_low, _g_high):  # type: ignore[override]
        logits, targets, lse, entropy, coef = ctx.saved_tensors
        vocab_start, compute_entropy, block_v, inplace = ctx.cfg
        if not compute_entropy:
            g_entropy = None
        if g_loss is None and g_logp is None and g_entropy is None:
            return (None,) * 16
        g = torch.zeros_like(lse)
        if g_loss is not None:
            g = g + coef * g_loss
        if g_logp is not None:
            g = g + g_logp
        grads = LogprobGrads(lse, g, entropy if g_entropy is not None else None, g_entropy)
        d = triton_dlogits(logits, targets, vocab_start, grads, block_v, inplace)
        return (d,) + (None,) * 15


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def triton_vocab_parallel_logprobs(
    logits_shard: torch.Tensor, inputs: LogprobInputs, *, block_v: int | None = None, inplace_backward: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) from vocab-parallel logits [..., V_local] with the Triton kernels."""
    flat = prepare_inputs(logits_shard, inputs)
    _check_device(flat.logits)
    bv = block_v or default_block_v(flat.logits.shape[-1])
    logp, ent = TritonVocabParallelLogprobs.apply(
        flat.logits, flat.targets, inputs.vocab_start, inputs.tp_group, inputs.compute_entropy, bv, inplace_backward
    )
    return flat.unflatten(logp), flat.unflatten(ent) if inputs.compute_entropy else None


def triton_daa_policy_loss(
    logits_shard: torch.Tensor, inputs: LossInputs, *, block_v: int | None = None, inplace_backward: bool = False
) -> LossOutputs:
    """Triton path; same contract as `daa_policy_loss`. `inplace_backward=True` overwrites the logits with dlogits."""
    flat = prepare_inputs(logits_shard, inputs)
    _check_device(flat.logits)
    bv = block_v or default_block_v(flat.logits.shape[-1])
    daa = inputs.use_daa
    loss_sum, logp, ent, low, high = TritonDAAPolicyLoss.apply(
        flat.logits, flat.targets, flat.old_logprobs, flat.advantages, flat.mask,
        flat.correct if daa else None, flat.p_hat if daa else None, flat.daa_lambda, inputs.daa_tau,
        inputs.clip_ratio_low, inputs.clip_ratio_high, inputs.vocab_start, inputs.tp_group, inputs.compute_entropy,
        bv, inplace_backward,
    )
    metrics = {"clip_low_count": low, "clip_high_count": high, "token_count": (flat.mask > 0).sum().to(torch.float32)}
    ent = ent if inputs.compute_entropy else None
    return LossOutputs(loss_sum, flat.unflatten(logp), flat.unflatten(ent), metrics)
