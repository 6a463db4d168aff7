"""Clipped policy-gradient losses of GRPO, DAPO, GSPO and DA3PO on padded ``[B, T]`` tensors (pure torch).

Implements
- the clipped surrogate, paper Eq. 5 / Eq. 11: per token, L = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) with
  r = pi_theta / pi_old = exp(logprobs - old_logprobs);
- GRPO's aggregation (Eq. 4): mean over each response's tokens, then mean over responses (``"seq-mean-token-mean"``),
  with a symmetric clip;
- DAPO's token-level aggregation (Eq. 9): one normaliser, the number of response tokens in the batch
  (``"token-mean"``), with clip-higher (eps_high > eps_low). DA3PO = DAPO + DAA: DAA changes only the advantages
  passed in (``advantages.apply_daa``, Eq. 14), not this loss;
- GSPO (Zheng et al. 2025): ``ratio_level="sequence"``, s_i = exp(mean_t(logp - old_logp)) over the response's tokens,
  clipped per sequence. Implemented as GSPO's token form s_i,t = sg[s_i] * pi_t / sg[pi_t] (value s_i for every token,
  gradient s_i * grad log pi_t), which with ``"seq-mean-token-mean"`` has exactly the gradient of the sequence form.

Normaliser contract (what makes a mini-batch's gradient independent of how it is split)
- ``"token-mean"``: sum of per-token losses / ``global_num_tokens`` (the response tokens of the WHOLE mini-batch,
  over all micro-batches and data-parallel ranks); without it, the local token count.
- ``"seq-mean-token-mean"``: sum over responses of (token-mean of the response) / ``global_num_seqs`` (responses with
  at least one response token in the whole mini-batch); without it, the local count.
- With the global normalisers, the SUM over micro-batches and ranks of the returned losses is the mini-batch loss.
  The caller sums micro-batch losses on each rank. Under Megatron this needs two corrections, because a 2-tuple
  ``loss_func`` output is divided by ``num_microbatches`` (``forward_step_calc_loss``, megatron-core 0.16) and
  Megatron DDP averages gradients over DP (x CP) ranks (the loss is also multiplied by the CP size there, which cancels
  the CP part): return ``loss * num_microbatches * data_parallel_size``. (verl's ``global_batch_info`` and NeMo-RL's
  ``global_valid_toks`` follow the same idea.)

Metrics (detached, over the local valid tokens; ``num_tokens`` / ``num_seqs`` are the local counts to weight them
when combining micro-batches): ``clipfrac_low`` (A < 0 and r < 1 - eps_low: the low clip binds), ``clipfrac_high``
(A > 0 and r > 1 + eps_high), ``clipfrac`` (their sum), ``approx_kl`` (Schulman's k3, (r - 1) - log r, an estimate
of KL(pi_old || pi_theta)), ``ratio_mean`` / ``ratio_min`` / ``ratio_max`` (1.0 when there is no valid token).

Which algorithm uses which ratio level, aggregation and clips is decided in one place, ``registry.py``.

Left out: dual-clip PPO (c > 1 lower bound for A < 0), KL-to-reference and entropy terms (DAPO / DA3PO use neither).
The log-ratio is clamped to [-20, 20] before exp (as verl does) so that a padded or diverged token cannot overflow.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

RatioLevel = Literal["token", "sequence"]
LossAggMode = Literal["token-mean", "seq-mean-token-mean"]
RATIO_LEVELS: tuple[str, ...] = ("token", "sequence")
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean")
LOG_RATIO_CLAMP = 20.0


def _per_token_advantages(advantages: Tensor, shape: torch.Size) -> Tensor:
    if advantages.dim() == 1 and advantages.shape[0] == shape[0]:
        return advantages.unsqueeze(1).expand(shape)
    if advantages.shape == shape:
        return advantages
    raise ValueError(f"advantages must be [B]={shape[0]} or [B, T]={tuple(shape)}, got {tuple(advantages.shape)}")


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    ratio_level: RatioLevel = "token",
    loss_agg_mode: LossAggMode = "token-mean",
    global_num_tokens: int | float | Tensor | None = None,
    global_num_seqs: int | float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate loss (Eq. 5/11) with GRPO / DAPO / GSPO aggregation; see the module docstring.

    Args:
        logprobs: ``[B, T]`` log pi_theta of the sampled tokens (carries the gradient).
        old_logprobs: ``[B, T]`` log pi_old of the same tokens (no gradient is taken through it).
        advantages: ``[B]`` per response or ``[B, T]`` per token (already DAA-scaled for DA3PO). For
            ``ratio_level="sequence"`` the per-response advantage is the mean over the response's tokens.
        mask: ``[B, T]`` 1 (or True) for response tokens, 0 for prompt / padding.
        clip_ratio_low, clip_ratio_high: eps_low, eps_high of clip(r, 1 - eps_low, 1 + eps_high).
        ratio_level: ``"token"`` (PPO / GRPO / DAPO) or ``"sequence"`` (GSPO).
        loss_agg_mode: ``"token-mean"`` (DAPO Eq. 9) or ``"seq-mean-token-mean"`` (GRPO Eq. 4).
        global_num_tokens: normaliser for ``"token-mean"`` (response tokens in the whole mini-batch).
        global_num_seqs: normaliser for ``"seq-mean-token-mean"`` (responses in the whole mini-batch).

    Returns:
        ``(loss, metrics)``: a scalar loss to minimise and a dict of detached scalar tensors.
    """
    if logprobs.dim() != 2 or old_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(
            f"policy_loss: logprobs, old_logprobs and mask must all be [B, T]; got {tuple(logprobs.shape)}, "
            f"{tuple(old_logprobs.shape)}, {tuple(mask.shape)}"
        )
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")
    if not (0.0 <= clip_ratio_low < 1.0 and clip_ratio_high >= 0.0):
        raise ValueError(
            f"need 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, got {clip_ratio_low}, {clip_ratio_high}"
        )
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    m = mask.to(dtype)
    lp = logprobs.to(dtype)
    old = old_logprobs.detach().to(dtype)
    adv = _per_token_advantages(advantages.detach().to(dtype), logprobs.shape)
    adv = torch.where(m > 0, adv, torch.zeros_like(adv))  # padding advantages may be garbage (even NaN)
    seq_len = m.sum(dim=1)  # [B]
    valid_seq = seq_len > 0
    n_tokens = m.sum()
    n_seqs = valid_seq.to(dtype).sum()

    # zero the log-ratio on non-response tokens so padding garbage (e.g. -inf) cannot reach exp or the gradient
    log_ratio = torch.where(m > 0, lp - old, torch.zeros_like(lp))
    if ratio_level == "sequence":
        seq_log_ratio = log_ratio.sum(dim=1) / seq_len.clamp_min(1)  # [B], mean over the response's tokens
        seq_adv = (adv * m).sum(dim=1) / seq_len.clamp_min(1)
        adv = seq_adv.unsqueeze(1).expand_as(lp)
        # GSPO token form: value = seq log-ratio, gradient = grad log pi_t
        log_ratio = seq_log_ratio.detach().unsqueeze(1) + (log_ratio - log_ratio.detach())
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    lo, hi = 1.0 - clip_ratio_low, 1.0 + clip_ratio_high
    surr_unclipped = -adv * ratio
    surr_clipped = -adv * ratio.clamp(lo, hi)
    per_token = torch.where(m > 0, torch.maximum(surr_unclipped, surr_clipped), torch.zeros_like(lp))

    if loss_agg_mode == "token-mean":
        denom = n_tokens if global_num_tokens is None else global_num_tokens
        loss = per_token.sum() / _as_denominator(denom, "global_num_tokens", dtype, lp.device)
    else:
        per_seq = per_token.sum(dim=1) / seq_len.clamp_min(1)
        denom = n_seqs if global_num_seqs is None else global_num_seqs
        loss = per_seq.sum() / _as_denominator(denom, "global_num_seqs", dtype, lp.device)

    with torch.no_grad():
        r = ratio.detach()
        valid = m > 0
        nt = n_tokens.clamp_min(1)
        low = (adv < 0) & (r < lo) & valid
        high = (adv > 0) & (r > hi) & valid
        lr = log_ratio.detach()
        k3 = torch.where(valid, (r - 1.0) - lr, torch.zeros_like(r))
        has_tokens = n_tokens > 0
        one = torch.ones((), dtype=dtype, device=r.device)
        inf = torch.full((), float("inf"), dtype=dtype, device=r.device)
        metrics = {
            "clipfrac_low": low.to(dtype).sum() / nt,
            "clipfrac_high": high.to(dtype).sum() / nt,
            "clipfrac": (low | high).to(dtype).sum() / nt,
            "approx_kl": k3.sum() / nt,
            "ratio_mean": torch.where(has_tokens, (r * m).sum() / nt, one),
            "ratio_min": torch.where(has_tokens, torch.where(valid, r, inf).min(), one),
            "ratio_max": torch.where(has_tokens, torch.where(valid, r, -inf).max(), one),
            "num_tokens": n_tokens.detach(),
            "num_seqs": n_seqs.detach(),
            "pg_loss": loss.detach(),
        }
    return loss, metrics


def _as_denominator(value: int | float | Tensor, name: str, dtype: torch.dtype, device: torch.device) -> Tensor:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got shape {tuple(value.shape)}")
        t = value.detach().to(device=device, dtype=dtype).reshape(())
    else:
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
        t = torch.tensor(float(value), dtype=dtype, device=device)
    # an empty mini-batch gives a zero loss, not NaN
    return t.clamp_min(1.0)
