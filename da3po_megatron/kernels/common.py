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
from typing import NamedTuple

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


@dataclass(frozen=True, eq=False)
class LogprobInputs:
    """What a log-prob entry point scores, besides the logits: the inputs of every ``*_vocab_parallel_logprobs``.

    Attributes:
        targets: [...] token ids (global vocab ids); ids outside this rank's shard contribute 0 on this rank.
        vocab_start: global vocab index of this rank's first logit column (TP rank x V_local).
        tp_group: tensor-parallel group over which the vocab is split (None: the whole vocab is local).
        compute_entropy: also return the per-token entropy of the full (global-vocab) distribution.
    """

    targets: torch.Tensor
    vocab_start: int = 0
    tp_group: dist.ProcessGroup | None = None
    compute_entropy: bool = False


@dataclass(frozen=True, eq=False, kw_only=True)
class LossInputs(LogprobInputs):
    """Everything of the DAA policy loss except the tensor it differentiates (a logit shard, or hidden states and
    an output weight): the one inputs object of every ``*_daa_policy_loss``. Checked when built.

    Attributes (besides :class:`LogprobInputs`'), per-token tensors broadcast to ``targets``' shape:
        old_logprobs: [...] log pi_old(y_t).
        advantages: [...] A_t (Eq. 3), raw; DAA is applied inside when correct/p_hat/daa_lambda/daa_tau are given.
        mask: [...] token weights (1 = response token, 0 = padding/prompt); a token counts as valid when mask > 0.
        clip_ratio_low / clip_ratio_high: eps_low / eps_high of Eq. 11 (DAPO: 0.2 / 0.28).
        correct, p_hat, daa_lambda, daa_tau: DAA (Eq. 14): A~ = lambda A where correct and p_hat < tau; correct and
            p_hat broadcast to targets' shape ([B, 1] per response works); daa_lambda is a float (paper: 2.0) or a
            tensor broadcastable likewise (adaptive DAA). All four or none.
    """

    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    clip_ratio_low: float
    clip_ratio_high: float
    correct: torch.Tensor | None = None
    p_hat: torch.Tensor | None = None
    daa_lambda: float | torch.Tensor | None = None
    daa_tau: float | None = None

    def __post_init__(self) -> None:
        check_clip(self.clip_ratio_low, self.clip_ratio_high)
        check_daa_args(self.correct, self.p_hat, self.daa_lambda, self.daa_tau)

    @property
    def use_daa(self) -> bool:
        """DAA (Eq. 14) requested: the four DAA fields are given (checked together when built)."""
        return self.daa_tau is not None


class LossOutputs(NamedTuple):
    """What every ``*_daa_policy_loss`` returns (a tuple: ``loss_sum, logp, entropy, metrics = ...`` works).

    loss_sum: 0-dim float32, sum_t loss_t (divide by the global valid-token count for Eq. 9's mean);
    logprobs: [...] float32 log pi_theta(y_t) (differentiable); entropy: [...] float32 or None (differentiable);
    metrics: {"clip_low_count", "clip_high_count", "token_count"} 0-dim float32 tensors over valid tokens.
    """

    loss_sum: torch.Tensor
    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    metrics: dict[str, torch.Tensor]


class LogprobGrads(NamedTuple):
    """What the backward of a log-prob path needs per token, [N] float32: the saved logsumexp (and entropy) and the
    upstream gradients; d/dz_j of sum_t g_logp_t logp_t + g_entropy_t H_t = g_logp (onehot_j - p_j)
    - g_entropy p_j (log p_j + H). `entropy` and `g_entropy` are None when the entropy receives no gradient."""

    lse: torch.Tensor
    g_logp: torch.Tensor
    entropy: torch.Tensor | None
    g_entropy: torch.Tensor | None

    def rows(self, a: int, b: int) -> LogprobGrads:
        """Tokens a..b-1 (one chunk)."""
        return LogprobGrads(*(None if t is None else t[a:b] for t in self))


def logprob_grads(
    lse: torch.Tensor,
    entropy: torch.Tensor,
    g_logp: torch.Tensor | None,
    g_entropy: torch.Tensor | None,
    compute_entropy: bool,
) -> LogprobGrads | None:
    """An autograd backward's upstream gradients of (logp, entropy): None when neither receives one (the backward
    returns no gradient); a missing logp gradient is 0; the entropy's counts only when the entropy was computed."""
    if not compute_entropy:
        g_entropy = None
    if g_logp is None and g_entropy is None:
        return None
    if g_logp is None:
        g_logp = torch.zeros_like(lse)
    return LogprobGrads(lse, g_logp, entropy if g_entropy is not None else None, g_entropy)


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

    def unflatten(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A per-token [N] result in the targets' shape (None stays None)."""
        return None if t is None else t.reshape(self.token_shape)


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


def prepare_inputs(logits: torch.Tensor, inputs: LogprobInputs, logits_name: str = "logits_shard") -> TokenInputs:
    """Validate and flatten logits [..., V_local] and targets [...]; the loss tensors of a :class:`LossInputs`
    broadcast to [...] (a :class:`LogprobInputs` has none: they stay None)."""
    targets = inputs.targets
    loss = inputs if isinstance(inputs, LossInputs) else None
    if loss is not None:
        for name in ("old_logprobs", "advantages", "mask"):
            if getattr(loss, name) is None:
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

    def per_token(name: str) -> torch.Tensor | None:
        return None if loss is None else _per_token(name, getattr(loss, name), shape, logits.device)

    lam = None if loss is None else loss.daa_lambda
    return TokenInputs(
        logits=logits2d,
        targets=targets.reshape(-1).to(torch.int64).contiguous(),
        old_logprobs=per_token("old_logprobs"),
        advantages=per_token("advantages"),
        mask=per_token("mask"),
        correct=per_token("correct"),
        p_hat=per_token("p_hat"),
        daa_lambda=per_token("daa_lambda") if isinstance(lam, torch.Tensor) else lam,
        token_shape=shape,
    )


def loss_from_logprobs(
    inputs: LossInputs, flat: TokenInputs, logp: torch.Tensor, entropy: torch.Tensor | None
) -> LossOutputs:
    """The per-token tail shared by the paths that compute log-probs first (reference, chunked, fused-linear):
    DAA (Eq. 14) on the advantages, then the clipped surrogate (Eq. 5/11) summed over tokens; outputs reshaped."""
    adv = flat.advantages
    if inputs.use_daa:
        adv = amplify_advantages(adv, flat.correct, flat.p_hat, flat.daa_lambda, inputs.daa_tau)
    loss_sum, metrics = clipped_surrogate(
        logp, flat.old_logprobs, adv, flat.mask, inputs.clip_ratio_low, inputs.clip_ratio_high
    )
    return LossOutputs(loss_sum, flat.unflatten(logp), flat.unflatten(entropy), metrics)


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
