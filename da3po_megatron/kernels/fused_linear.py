"""Fused linear + DAA policy loss: from final hidden states and the vocab-parallel output weight, no logits tensor.

Same function as `reference.py` applied to logits = hidden @ weight.T (Eq. 5/11 surrogate, Eq. 14 DAA, Eq. 9 token
sum), but the logits of the micro-batch never exist, not even in bf16: tokens are processed in chunks; the forward
computes each chunk's logits [chunk x V_local], reduces them to four per-token statistics and drops them; after the
last chunk one MAX + one SUM all-reduce over the TP group merge the statistics (`combine_vocab_stats`). The backward
recomputes each chunk's logits, forms dlogits from the saved per-token logsumexp, and accumulates
dhidden = dlogits @ weight and dweight += dlogits.T @ hidden.

This is the approach of Liger-Kernel's fused linear cross-entropy / GRPO losses and NeMo-RL's fused linear log-probs;
unlike Liger we recompute the chunk logits in backward (one extra matmul per chunk) instead of computing gradients
during forward, so that gradients may also flow from the returned per-token logp and entropy.

Tensor parallelism: `weight` is this rank's vocab shard [V_local, H] (Megatron's ColumnParallelLinear output layer);
`hidden` is replicated. Its gradient is summed over the TP group inside backward (`OutputLayer.reduce_hidden_grad`),
which is what Megatron's `copy_to_tensor_model_parallel_region` does for the output layer's input. Set it False when
the caller already wraps `hidden` in such a region (or gathers it from sequence-parallel ranks, whose backward
reduce-scatters).

Sampling temperature and vocabulary padding, for a policy that scores softmax(z / T) over the real vocabulary:
`OutputLayer.temperature` divides each chunk's logits in float32 (the backward divides dlogits by T before the
matmuls), and `OutputLayer.vocab_limit` drops the weight rows whose global index is >= the real vocabulary size before
the matmul, which is the softmax with those logits at -inf and also skips their columns of both matmuls (their dweight
rows stay 0). A rank whose whole shard is padding contributes (max = float32 min, sum-exp = 0), which the merge weights
by exp(-huge) = 0.
Targets must be real tokens (< vocab_limit).

Memory: per chunk one [chunk x V_local] logits buffer in the hidden dtype plus two float32 ones; dweight is accumulated
in float32 when the weight is bf16/fp16 ([V_local x H] fp32, independent of the token count). Left out: Triton for the
per-chunk reductions (the matmuls dominate; the torch chunk reductions are shared with `chunked.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .chunked import DEFAULT_CHUNK_BYTES, chunk_dlogits, chunk_stats
from .common import (
    LogprobInputs,
    LossInputs,
    LossOutputs,
    TokenInputs,
    combine_vocab_stats,
    logprob_grads,
    loss_from_logprobs,
    prepare_inputs,
    tp_world_size,
)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """One chunk's logits h @ weight.T / T: the matmul in the weight's dtype, the division in float32."""
    z = h @ weight.t()
    return z if temperature == 1.0 else z.float().div_(temperature)


class FusedLinearVocabParallelLogprobs(torch.autograd.Function):
    """(hidden [N, H], weight [V_local, H], targets [N]) -> (logp [N] fp32, entropy [N] fp32 or empty).

    `n_real`: the leading rows of `weight` that are real vocabulary (the rest is padding, left out of the softmax).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, hidden, weight, targets, vocab_start, group, compute_entropy, chunk_tokens, reduce_hidden_grad,
        temperature, n_real,
    ):
        n = hidden.shape[0]
        w_real = weight[:n_real]
        m = torch.full((n,), torch.finfo(torch.float32).min, dtype=torch.float32, device=hidden.device)
        s, tgt = torch.zeros_like(m), torch.zeros_like(m)
        w = torch.zeros_like(m) if compute_entropy else None
        for a in range(0, n if n_real else 0, chunk_tokens):
            b = min(n, a + chunk_tokens)
            z = _chunk_logits(hidden[a:b], w_real, temperature)
            mc, sc, wc, tc = chunk_stats(z, targets[a:b], vocab_start, compute_entropy)
            del z
            m[a:b], s[a:b], tgt[a:b] = mc, sc, tc
            if compute_entropy:
                w[a:b] = wc
        lse, entropy, tgt = combine_vocab_stats(m, s, w, tgt, group)
        ent_out = entropy if entropy is not None else lse.new_empty(0)
        ctx.save_for_backward(hidden, weight, targets, lse, ent_out)
        ctx.cfg = (vocab_start, group, compute_entropy, chunk_tokens, reduce_hidden_grad, temperature, n_real)
        return tgt - lse, ent_out

    @staticmethod
    def backward(ctx, g_logp, g_entropy):  # type: ignore[override]
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        vocab_start, group, compute_entropy, chunk_tokens, reduce_hidden_grad, temperature, n_real = ctx.cfg
        grads = logprob_grads(lse, entropy, g_logp, g_entropy, compute_entropy)
        if grads is None:
            return (None,) * 10
        n = hidden.shape[0]
        w_real = weight[:n_real]
        dhidden = torch.zeros_like(hidden)
        acc_dtype = torch.float32 if weight.dtype in (torch.bfloat16, torch.float16) else weight.dtype
        need_dweight = ctx.needs_input_grad[1]
        dweight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_dweight else None
        dw_real = dweight[:n_real] if need_dweight else None
        for a in range(0, n if n_real else 0, chunk_tokens):
            b = min(n, a + chunk_tokens)
            h = hidden[a:b]
            z = _chunk_logits(h, w_real, temperature)
            d = chunk_dlogits(z, targets[a:b], vocab_start, grads.rows(a, b))
            del z
            if temperature != 1.0:
                d.div_(temperature)  # d/dh of z / T
            d = d.to(hidden.dtype)
            dhidden[a:b] = d @ w_real
            if not need_dweight:
                continue
            if acc_dtype == weight.dtype:
                dw_real.addmm_(d.t(), h)
            else:
                dw_real.add_(d.t() @ h)
        if reduce_hidden_grad and tp_world_size(group) > 1:
            dist.all_reduce(dhidden, op=dist.ReduceOp.SUM, group=group)
        dweight = dweight.to(weight.dtype) if need_dweight else None
        return (dhidden, dweight) + (None,) * 8


@dataclass(frozen=True, eq=False)
class OutputLayer:
    """This rank's shard of the output layer, as the fused-linear path applies it to the hidden states:
    logits = hidden @ weight.T / temperature over the global vocabulary columns < vocab_limit.

    Attributes:
        weight: [V_local, H] this rank's rows of the output weight (Megatron's ColumnParallelLinear shard), in the
            hidden states' dtype and on their device; receives its gradient unless it does not require one.
        temperature: the sampling temperature T (> 0); 1.0 divides nothing.
        vocab_limit: the real vocabulary size; global columns >= it (padding) are left out of the softmax. None: all.
        reduce_hidden_grad: sum dhidden over the TP group in backward (see the module docstring); False when the
            caller's own region does it.
    """

    weight: torch.Tensor
    temperature: float = 1.0
    vocab_limit: int | None = None
    reduce_hidden_grad: bool = True


def _flat_logprobs(
    hidden: torch.Tensor, layer: OutputLayer, inputs: LogprobInputs, chunk_tokens: int | None
) -> tuple[TokenInputs, torch.Tensor, torch.Tensor | None]:
    """Checks, then the autograd function on the flattened tokens -> (flat inputs, logp [N], entropy [N] or None)."""
    flat = prepare_inputs(hidden, inputs, logits_name="hidden")
    weight, temperature, vocab_limit = layer.weight, layer.temperature, layer.vocab_limit
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be the output-layer shard [V_local, H={hidden.shape[-1]}], "
            f"got {tuple(getattr(weight, 'shape', ()))}"
        )
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(
            f"weight ({weight.dtype}, {weight.device}) and hidden ({hidden.dtype}, {hidden.device}) must match in "
            "dtype and device"
        )
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if vocab_limit is not None and vocab_limit < 1:
        raise ValueError(f"vocab_limit must be >= 1 (the real vocabulary size) or None, got {vocab_limit}")
    v_local = weight.shape[0]
    n_real = v_local if vocab_limit is None else max(0, min(v_local, vocab_limit - inputs.vocab_start))
    chunk = chunk_tokens or max(1, DEFAULT_CHUNK_BYTES // (4 * max(1, v_local)))
    logp, ent = FusedLinearVocabParallelLogprobs.apply(
        flat.logits, weight, flat.targets, inputs.vocab_start, inputs.tp_group, inputs.compute_entropy, chunk,
        layer.reduce_hidden_grad, float(temperature), n_real,
    )
    return flat, logp, ent if inputs.compute_entropy else None


def fused_linear_vocab_parallel_logprobs(
    hidden: torch.Tensor, layer: OutputLayer, inputs: LogprobInputs, *, chunk_tokens: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) of softmax(hidden @ weight.T / temperature) over the global vocabulary
    columns < vocab_limit, without materialising the logits."""
    flat, logp, ent = _flat_logprobs(hidden, layer, inputs, chunk_tokens)
    return flat.unflatten(logp), flat.unflatten(ent)


def fused_linear_daa_policy_loss(
    hidden: torch.Tensor, layer: OutputLayer, inputs: LossInputs, *, chunk_tokens: int | None = None
) -> LossOutputs:
    """DAA policy loss of logits = hidden [..., H] @ weight[V_local, H].T / temperature, global vocabulary columns
    >= vocab_limit excluded; same outputs as `daa_policy_loss` on those logits.

    chunk_tokens: tokens per chunk (default: ~128 MiB per float32 [chunk x V_local] buffer)."""
    return loss_from_logprobs(inputs, *_flat_logprobs(hidden, layer, inputs, chunk_tokens))
