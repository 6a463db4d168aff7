"""Pure-torch ground truth of the fused DAA policy loss (DESIGN.md Eq. 5/11 surrogate, Eq. 14 DAA, Eq. 9 token sum).

Simple on purpose: it upcasts the whole logit shard to float32 and materialises the float32 log-softmax (TP = 1: exactly
`torch.log_softmax`; TP > 1: exp(z - max) of the local shard, combined over the group), and lets autograd do the
backward. Memory is several float32 [tokens x V_local] tensors, which is what the chunked, Triton and fused-linear paths
avoid; they are tested against this function.

Under tensor parallelism every rank computes the same (replicated) loss. The all-reduces of the per-rank partial sums
therefore have an identity backward (Megatron-LM's `reduce_from_tensor_model_parallel_region`), and each rank receives
the gradient of its own logit columns only, as in Megatron's vocab-parallel cross-entropy.

Left out: nothing of the math; sequence-level ratios (GSPO) and per-sample aggregation (GRPO, Eq. 4) belong to
`da3po_megatron.algorithms.losses`, not to this token-level kernel family.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .common import (
    SHIFTED_LOGIT_FLOOR,
    LogprobInputs,
    LossInputs,
    LossOutputs,
    TokenInputs,
    local_target_index,
    loss_from_logprobs,
    prepare_inputs,
    tp_world_size,
)


class _AllReduceSumReplicated(torch.autograd.Function):
    """Sum over the TP group; backward is the identity because the consumer is replicated on every rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def reference_logprobs_2d(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int = 0,
    tp_group: dist.ProcessGroup | None = None,
    compute_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [N, V_local] (any float dtype), targets [N] -> (logp [N] fp32, entropy [N] fp32 or None)."""
    z = logits.float()
    v_local = z.shape[-1]
    idx, in_shard = local_target_index(targets, vocab_start, v_local)
    if tp_world_size(tp_group) == 1:
        logsm = torch.log_softmax(z, dim=-1)  # the materialised float32 [N, V] log-softmax
        # a target outside the vocabulary (e.g. a padding id) gathers the logit 0, as in the TP case: logp = -lse
        logp = torch.where(in_shard, logsm.gather(1, idx[:, None]).squeeze(1), -torch.logsumexp(z, dim=-1))
        entropy = -(logsm.exp() * logsm.clamp(min=SHIFTED_LOGIT_FLOOR)).sum(-1) if compute_entropy else None
        return logp, entropy
    m = z.detach().max(dim=-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    e = torch.exp(z - m[:, None])
    s = _AllReduceSumReplicated.apply(e.sum(-1), tp_group)
    tgt_local = torch.where(in_shard, z.gather(1, idx[:, None]).squeeze(1), torch.zeros_like(m))
    tgt = _AllReduceSumReplicated.apply(tgt_local, tp_group)
    lse = m + torch.log(s)
    logp = tgt - lse
    entropy = None
    if compute_entropy:
        w = _AllReduceSumReplicated.apply((e * (z - m[:, None]).clamp(min=SHIFTED_LOGIT_FLOOR)).sum(-1), tp_group)
        entropy = torch.log(s) - w / s  # = lse - sum_j p_j z_j
    return logp, entropy


def _flat_logprobs(
    logits_shard: torch.Tensor, inputs: LogprobInputs
) -> tuple[TokenInputs, torch.Tensor, torch.Tensor | None]:
    flat = prepare_inputs(logits_shard, inputs)
    logp, entropy = reference_logprobs_2d(
        flat.logits, flat.targets, inputs.vocab_start, inputs.tp_group, inputs.compute_entropy
    )
    return flat, logp, entropy


def reference_vocab_parallel_logprobs(
    logits_shard: torch.Tensor, inputs: LogprobInputs
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Ground truth of the log-prob path: (logp [...], entropy [...] or None), as `vocab_parallel_logprobs`."""
    flat, logp, entropy = _flat_logprobs(logits_shard, inputs)
    return flat.unflatten(logp), flat.unflatten(entropy)


def reference_daa_policy_loss(logits_shard: torch.Tensor, inputs: LossInputs) -> LossOutputs:
    """Ground truth: (sum_t loss_t, logp [...], entropy [...] or None, clip metrics), as `daa_policy_loss`."""
    return loss_from_logprobs(inputs, *_flat_logprobs(logits_shard, inputs))
