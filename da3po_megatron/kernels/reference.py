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
    amplify_advantages,
    check_clip,
    check_daa_args,
    clipped_surrogate,
    local_target_index,
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


def reference_daa_policy_loss(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """Ground truth: (sum_t loss_t, logp [...], entropy [...] or None, clip metrics), as `daa_policy_loss`."""
    check_clip(clip_ratio_low, clip_ratio_high)
    use_daa = check_daa_args(correct, p_hat, daa_lambda, daa_tau)
    inp = prepare_inputs(logits_shard, targets, old_logprobs, advantages, mask, correct, p_hat, daa_lambda)
    logp, entropy = reference_logprobs_2d(inp.logits, inp.targets, vocab_start, tp_group, compute_entropy)
    adv = inp.advantages
    if use_daa:
        adv = amplify_advantages(adv, inp.correct, inp.p_hat, inp.daa_lambda, daa_tau)
    loss_sum, metrics = clipped_surrogate(logp, inp.old_logprobs, adv, inp.mask, clip_ratio_low, clip_ratio_high)
    shape = inp.token_shape
    return loss_sum, logp.reshape(shape), entropy.reshape(shape) if entropy is not None else None, metrics
