"""Bounded-memory torch path of the DAA policy loss: vocab-parallel log-probs computed over token chunks.

Implements the same function as `reference.py` (Eq. 5/11 clipped surrogate, Eq. 14 DAA, Eq. 9 token-level sum) for
machines where Triton cannot compile (CPU) and as a readable second implementation of the kernel's algorithm:

* forward: for each chunk of tokens, upcast only that chunk to float32 and reduce it to four per-token statistics
  (local max, sum-exp, sum-exp * shifted logit for the entropy, gathered target logit); after the last chunk one MAX and
  one SUM all-reduce over the TP group merge them (`combine_vocab_stats`). Saved for backward: the per-token
  logsumexp (and entropy), never a float32 [tokens x vocab] tensor for the whole batch;
* backward: recompute softmax chunk by chunk from the saved logsumexp and write dlogits in the logits' dtype
  (grad of logp_t: onehot(y_t) - p_t; grad of entropy_t: -p_t (log p_t + H_t)).

Peak extra memory is the dlogits buffer (logits' dtype) plus two float32 [chunk x V_local] buffers. The recompute-in-
backward scheme follows Megatron-LM's vocab-parallel cross-entropy and verl / NeMo-RL chunked log-prob computation.
The per-token surrogate runs in plain torch on [N] vectors (cheap) via `common.clipped_surrogate`.
Left out: fusing the matmul that produces the logits (see `fused_linear.py`).
"""

from __future__ import annotations

import torch

from .common import (
    SHIFTED_LOGIT_FLOOR,
    LogprobGrads,
    LogprobInputs,
    LossInputs,
    LossOutputs,
    TokenInputs,
    combine_vocab_stats,
    local_target_index,
    logprob_grads,
    loss_from_logprobs,
    prepare_inputs,
)

DEFAULT_CHUNK_BYTES = 128 * 2**20  # one float32 [chunk x V_local] buffer; two such buffers live at a time


def default_chunk_tokens(v_local: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk so that one float32 [chunk x V_local] buffer takes about `chunk_bytes`."""
    return max(1, chunk_bytes // (4 * max(1, v_local)))


def chunk_stats(
    z: torch.Tensor, targets: torch.Tensor, vocab_start: int, compute_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Local statistics of one chunk of logits z [n, V_local] (any float dtype) -> (m, s, w or None, target logit)."""
    v_local = z.shape[-1]
    idx, in_shard = local_target_index(targets, vocab_start, v_local)
    tgt = torch.where(in_shard, z.gather(1, idx[:, None]).squeeze(1).float(), 0.0)
    zf = z.to(torch.float32, copy=True)
    m = zf.max(dim=-1).values
    zf.sub_(m[:, None]).clamp_(min=SHIFTED_LOGIT_FLOOR)  # z - m, in place (floor: -inf logits, see common)
    e = torch.exp(zf)
    s = e.sum(-1)
    w = e.mul_(zf).sum(-1) if compute_entropy else None
    return m, s, w, tgt


def chunk_dlogits(z: torch.Tensor, targets: torch.Tensor, vocab_start: int, grads: LogprobGrads) -> torch.Tensor:
    """d/dz of sum_t g_logp_t logp_t + g_entropy_t H_t for one chunk, float32 [n, V_local]."""
    v_local = z.shape[-1]
    lse, g_logp, entropy, g_entropy = grads
    logp_all = z.to(torch.float32, copy=True).sub_(lse[:, None]).clamp_(min=SHIFTED_LOGIT_FLOOR)  # log p_j
    d = torch.exp(logp_all)  # p_j
    if g_entropy is not None:
        coef = logp_all.add_(entropy[:, None]).mul_(g_entropy[:, None]).add_(g_logp[:, None])
        d.mul_(coef).neg_()  # -p_j (g + gH (log p_j + H))
    else:
        d.mul_(g_logp[:, None]).neg_()
    idx, in_shard = local_target_index(targets, vocab_start, v_local)
    d.scatter_add_(1, idx[:, None], torch.where(in_shard, g_logp, 0.0)[:, None])
    return d


def _chunk(chunk_tokens: int | None, v_local: int) -> int:
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return chunk_tokens or default_chunk_tokens(v_local)


class ChunkedVocabParallelLogprobs(torch.autograd.Function):
    """(logits [N, V_local], targets [N]) -> (logp [N] fp32, entropy [N] fp32 or empty); recomputes in backward."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group, compute_entropy, chunk_tokens, inplace_backward=False):  # type: ignore[override]
        n = logits.shape[0]
        dev = logits.device
        m = torch.empty(n, dtype=torch.float32, device=dev)
        s = torch.empty_like(m)
        w = torch.empty_like(m) if compute_entropy else None
        tgt = torch.empty_like(m)
        for a in range(0, n, chunk_tokens):
            b = min(n, a + chunk_tokens)
            mc, sc, wc, tc = chunk_stats(logits[a:b], targets[a:b], vocab_start, compute_entropy)
            m[a:b], s[a:b], tgt[a:b] = mc, sc, tc
            if compute_entropy:
                w[a:b] = wc
        lse, entropy, tgt = combine_vocab_stats(m, s, w, tgt, group)
        logp = tgt - lse
        ctx.save_for_backward(logits, targets, lse, entropy if entropy is not None else lse.new_empty(0))
        ctx.vocab_start, ctx.chunk_tokens, ctx.compute_entropy = vocab_start, chunk_tokens, compute_entropy
        ctx.inplace_backward = inplace_backward
        return logp, entropy if entropy is not None else logp.new_empty(0)

    @staticmethod
    def backward(ctx, g_logp, g_entropy):  # type: ignore[override]
        logits, targets, lse, entropy = ctx.saved_tensors
        grads = logprob_grads(lse, entropy, g_logp, g_entropy, ctx.compute_entropy)
        if grads is None:
            return (None,) * 7
        dlogits = logits if ctx.inplace_backward else torch.empty_like(logits)  # inplace: chunk read before written
        n = logits.shape[0]
        for a in range(0, n, ctx.chunk_tokens):
            b = min(n, a + ctx.chunk_tokens)
            dlogits[a:b] = chunk_dlogits(logits[a:b], targets[a:b], ctx.vocab_start, grads.rows(a, b))
        return (dlogits,) + (None,) * 6


def _flat_logprobs(
    logits_shard: torch.Tensor, inputs: LogprobInputs, chunk_tokens: int | None, inplace_backward: bool
) -> tuple[TokenInputs, torch.Tensor, torch.Tensor | None]:
    flat = prepare_inputs(logits_shard, inputs)
    chunk = _chunk(chunk_tokens, flat.logits.shape[-1])
    logp, ent = ChunkedVocabParallelLogprobs.apply(
        flat.logits, flat.targets, inputs.vocab_start, inputs.tp_group, inputs.compute_entropy, chunk,
        inplace_backward,
    )
    return flat, logp, ent if inputs.compute_entropy else None


def chunked_vocab_parallel_logprobs(
    logits_shard: torch.Tensor, inputs: LogprobInputs, *, chunk_tokens: int | None = None,
    inplace_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) from vocab-parallel logits [..., V_local]; differentiable, bounded memory."""
    flat, logp, ent = _flat_logprobs(logits_shard, inputs, chunk_tokens, inplace_backward)
    return flat.unflatten(logp), flat.unflatten(ent)


def chunked_daa_policy_loss(
    logits_shard: torch.Tensor, inputs: LossInputs, *, chunk_tokens: int | None = None,
    inplace_backward: bool = False,
) -> LossOutputs:
    """Chunked torch path; same contract as `daa_policy_loss`. `inplace_backward=True` overwrites the logits' storage
    with their gradient (only for logits not used after the loss, e.g. the output layer's)."""
    return loss_from_logprobs(inputs, *_flat_logprobs(logits_shard, inputs, chunk_tokens, inplace_backward))
