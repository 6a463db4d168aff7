"""Shared pieces of the DAA-loss paths: input checks, DAA (Eq. 14), the TP combine of per-token softmax statistics.

Every path (reference, chunked, Triton, fused-linear) computes, per token t with target y_t and a vocab-parallel logit
row z_t split over the tensor-parallel (TP) group (rank k holds columns [vocab_start_k, vocab_start_k + V_local)):

    logp_t = z_t[y_t] - logsumexp(z_t)                   (the gathered logit is 0 on ranks not holding y_t)
    r_t    = exp(logp_t - old_logp_t)                     (token-level importance ratio, Eq. 5/11)
    A~_t   = lambda * A_t if correct_t and p_hat_t < tau else A_t           (DAA, Eq. 14)
    loss_t = -min(r_t A~_t, clip(r_t, 1 - eps_low, 1 + eps_high) A~_t) * mask_t   (DAPO clip-higher, Eq. 11)

and returns sum_t loss_t (the caller divides by the global token count: DAPO's token-level normaliser, Eq. 9).

This module holds the parts that are not the vocabulary reduction itself: argument validation with messages that name
the tensor, DAA, and `combine_vocab_stats`, which merges per-rank (max, sum-exp, sum exp*z, target logit) statistics
into the global log-sum-exp and entropy with one MAX and one SUM all-reduce (the online-softmax merge of Milakov &
Gimelshein 2018, used the same way by Megatron-LM's vocab-parallel cross-entropy). Imports nothing of the project.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

METRIC_KEYS = ("clip_low_count", "clip_high_count", "token_count")
# floor for shifted logits (z - max, z - lse) in the entropy terms: exp() is exactly 0 in float32 far above it, so it
# changes no value, but a -inf logit (a masked vocab entry) then gives 0 * finite instead of 0 * inf = NaN
SHIFTED_LOGIT_FLOOR = -1e4
# log-ratio clamp before exp (verl; same constant as da3po_megatron.algorithms.losses.LOG_RATIO_CLAMP)
LOG_RATIO_CLAMP = 20.0


def tp_world_size(group: dist.ProcessGroup | None) -> int:
    """1 when there is no tensor-parallel group (or torch.distributed is not initialised), else the group size."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


@dataclass
class TokenInputs:
    """Flattened per-token inputs: N tokens, every tensor 1-D and contiguous, loss inputs in float32."""

    logits: torch.Tensor  # [N, V_local], last dim contiguous, original dtype
    targets: torch.Tensor  # [N] int64
    old_logprobs: torch.Tensor | None  # [N] float32
    advantages: torch.Tensor | None  # [N] float32 (raw, before DAA)
    mask: torch.Tensor | None  # [N] float32
    correct: torch.Tensor | None  # [N] float32 (1.0 = correct response, R_acc > 0)
    p_hat: torch.Tensor | None  # [N] float32
    daa_lambda: float | torch.Tensor | None  # a float, or [N] float32 (adaptive DAA: one lambda per response)
    token_shape: torch.Size  # shape of `targets` as given; per-token outputs are reshaped to it


def _per_token(name: str, t: torch.Tensor | None, shape: torch.Size, device: torch.device) -> torch.Tensor | None:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, not on the logits' device {device}")
    try:
        t = torch.broadcast_to(t, shape)
    except RuntimeError as e:
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}, which does not broadcast to the targets' {tuple(shape)}"
        ) from e
    return t.reshape(-1).to(torch.float32).contiguous()


def check_daa_args(
    correct: torch.Tensor | None,
    p_hat: torch.Tensor | None,
    daa_lambda: float | torch.Tensor | None,
    daa_tau: float | None,
) -> bool:
    """True when DAA is requested; all four of correct, p_hat, daa_lambda, daa_tau must then be given."""
    given = {"correct": correct is not None, "p_hat": p_hat is not None, "daa_lambda": daa_lambda is not None,
             "daa_tau": daa_tau is not None}
    if any(given.values()) and not all(given.values()):
        missing = [k for k, v in given.items() if not v]
        raise ValueError(f"DAA (Eq. 14) needs correct, p_hat, daa_lambda and daa_tau together; missing: {missing}")
    return all(given.values())


def prepare_inputs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    old_logprobs: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    correct: torch.Tensor | None = None,
    p_hat: torch.Tensor | None = None,
    daa_lambda: float | torch.Tensor | None = None,
    *,
    need_loss_inputs: bool = True,
    logits_name: str = "logits_shard",
) -> TokenInputs:
    """Validate and flatten logits [..., V_local] and targets [...]; other per-token tensors broadcast to [...]."""
    if need_loss_inputs:
        for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages), ("mask", mask)):
            if t is None:
                raise ValueError(f"{name} is required for the policy loss (Eq. 11), got None")
    if not isinstance(logits, torch.Tensor) or logits.dim() < 2:
        raise ValueError(
            f"{logits_name} must be a tensor [..., D] with at least 2 dims, got {getattr(logits, 'shape', logits)}"
        )
    if not logits.is_floating_point():
        raise TypeError(f"{logits_name} must be floating point, got {logits.dtype}")
    if not isinstance(targets, torch.Tensor) or targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets must have the leading shape of {logits_name} {tuple(logits.shape[:-1])}, "
            f"got {tuple(getattr(targets, 'shape', ()))}"
        )
    if targets.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"targets must be an integer tensor (token ids), got {targets.dtype}")
    if targets.device != logits.device:
        raise ValueError(f"targets is on {targets.device} but {logits_name} is on {logits.device}")
    shape = targets.shape
    v_local = logits.shape[-1]
    logits2d = logits.reshape(-1, v_local)
    if logits2d.stride(-1) != 1:
        logits2d = logits2d.contiguous()
    return TokenInputs(
        logits=logits2d,
        targets=targets.reshape(-1).to(torch.int64).contiguous(),
        old_logprobs=_per_token("old_logprobs", old_logprobs, shape, logits.device),
        advantages=_per_token("advantages", advantages, shape, logits.device),
        mask=_per_token("mask", mask, shape, logits.device),
        correct=_per_token("correct", correct, shape, logits.device),
        p_hat=_per_token("p_hat", p_hat, shape, logits.device),
        daa_lambda=_per_token("daa_lambda", daa_lambda, shape, logits.device)
        if isinstance(daa_lambda, torch.Tensor)
        else daa_lambda,
        token_shape=shape,
    )


def check_clip(clip_ratio_low: float, clip_ratio_high: float) -> None:
    if not (0.0 <= clip_ratio_low < 1.0):
        raise ValueError(f"clip_ratio_low must be in [0, 1) (eps_low of Eq. 11), got {clip_ratio_low}")
    if clip_ratio_high < 0.0:
        raise ValueError(f"clip_ratio_high must be >= 0 (eps_high of Eq. 11), got {clip_ratio_high}")


def amplify_advantages(
    advantages: torch.Tensor,
    correct: torch.Tensor,
    p_hat: torch.Tensor,
    daa_lambda: float | torch.Tensor,
    daa_tau: float,
) -> torch.Tensor:
    """DAA, Eq. 14: A~ = lambda * A where the response is correct (R_acc > 0) and p_hat < tau, else A.

    `daa_lambda` is a float (paper: 2.0) or a tensor broadcastable to the advantages (adaptive lambda per response).
    """
    hard_and_correct = (correct > 0.5) & (p_hat < daa_tau)
    return torch.where(hard_and_correct, advantages * daa_lambda, advantages)


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level clipped surrogate (Eq. 5/11) on [N] tensors: (sum_t loss_t, clip metrics); differentiable in logp.

    A token counts as low-clipped when the lower bound is the active branch of the min (A~ < 0 and r < 1 - eps_low),
    and as high-clipped when A~ > 0 and r > 1 + eps_high; in both cases its gradient is zero. Only mask > 0 counts.
    Tokens with mask <= 0 contribute exactly 0 (their advantages and old log-probs may be garbage), and the log-ratio
    is clamped to [-20, 20] before exp, as in `da3po_megatron.algorithms.losses` (and verl).
    """
    valid = mask > 0
    log_ratio = torch.where(valid, logprobs - old_logprobs, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    adv = torch.where(valid, adv, 0.0)
    clipped = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_tok = torch.where(valid, -torch.minimum(ratio * adv, clipped * adv) * mask, 0.0)
    with torch.no_grad():
        r = ratio.detach()
        metrics = {
            "clip_low_count": ((adv < 0) & (r < 1.0 - clip_ratio_low) & valid).sum().to(torch.float32),
            "clip_high_count": ((adv > 0) & (r > 1.0 + clip_ratio_high) & valid).sum().to(torch.float32),
            "token_count": valid.sum().to(torch.float32),
        }
    return loss_tok.sum(), metrics


def combine_vocab_stats(
    local_max: torch.Tensor,
    sum_exp: torch.Tensor,
    sum_exp_z: torch.Tensor | None,
    target_logit: torch.Tensor,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Merge per-rank softmax statistics over the TP group: -> (logsumexp, entropy or None, target logit), all [N] fp32.

    Inputs per token (float32, [N]), over the local shard: m = max_j z_j, s = sum_j exp(z_j - m),
    w = sum_j exp(z_j - m) (z_j - m) (only for the entropy; kept shifted by m for precision), and the target logit
    (0 where the target is not local). With M = max_k m_k and c_k = exp(m_k - M):
    S = sum_k c_k s_k, W = sum_k c_k (w_k + (m_k - M) s_k), lse = M + log S, entropy = log S - W / S.
    One MAX and one SUM all-reduce when the group has more than one rank; none otherwise.
    """
    if tp_world_size(group) > 1:
        global_max = local_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        scale = torch.exp(local_max - global_max)
        parts = [sum_exp * scale, target_logit]
        if sum_exp_z is not None:
            parts.append((sum_exp_z + (local_max - global_max) * sum_exp) * scale)
        stacked = torch.stack(parts)
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=group)
        sum_exp, target_logit = stacked[0], stacked[1]
        sum_exp_z = stacked[2] if sum_exp_z is not None else None
        local_max = global_max
    log_s = torch.log(sum_exp)
    lse = local_max + log_s
    entropy = log_s - sum_exp_z / sum_exp if sum_exp_z is not None else None
    return lse, entropy, target_logit


def local_target_index(targets: torch.Tensor, vocab_start: int, v_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index into the local shard, clamped to be safe for gather; bool: the target lives on this shard)."""
    idx = targets - vocab_start
    in_shard = (idx >= 0) & (idx < v_local)
    return idx.clamp(0, v_local - 1), in_shard
