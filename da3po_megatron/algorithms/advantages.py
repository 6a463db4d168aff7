"""Group-relative advantages (paper Eq. 3) and Direct Advantage Amplification, DAA (paper Eq. 14).

Implements
- ``group_advantages``: Eq. 3, A_i = (R_i - mean(R)) / (std(R) + eps) over the G adjacent responses of one prompt.
- ``group_p_hat``: p_hat, the fraction of a group's responses with R_acc > 0 (the dynamic-sampling statistic).
- ``apply_daa``: Eq. 14, A~_i = lambda * A_i if R_acc,i > 0 and p_hat < tau, else A_i.
- ``adaptive_daa_lambda``: the paper's stated open direction (a lambda derived from gamma(p_hat, G) of Thm 3.1 instead
  of a constant), see its docstring for the exact choice.
- ``broadcast_to_tokens`` and ``daa_stats`` (logging).

Conventions (deliberate choices, each documented where it is made)
- Responses are laid out group-major: responses ``[k*G, (k+1)*G)`` belong to prompt ``k`` (this is how vLLM returns
  ``n`` samples per prompt and how verl / NeMo-RL lay out GRPO batches).
- Std: the unbiased (Bessel, ``ddof=1``) group std by default, as in verl (``torch.std``) and TRL's GRPOTrainer, which
  produced the DAPO reference numbers; ``std_mode="population"`` (``ddof=0``) and ``"none"`` (no division, Dr. GRPO,
  Liu et al. 2025) are available. For binary rewards the two std conventions differ by the constant factor
  sqrt(G / (G-1)) (1.03 at G=16), i.e. an effective learning-rate change; the ratios of Thm 3.1 are unaffected.
- Epsilon is added to the std (verl's ``std + eps``, eps = 1e-6), never under the square root.
- A group whose rewards are all equal gets advantages that are EXACTLY zero (computed with ``torch.where``, not left
  to floating-point cancellation: ``mean([0.1, 0.1, 0.1]) != 0.1`` in float arithmetic).

Left out: the KL penalty of the original GRPO (DAPO and DA3PO drop it) and any cross-group (batch) normalisation.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

StdMode = Literal["unbiased", "population", "none"]
STD_MODES: tuple[str, ...] = ("unbiased", "population", "none")


def _check_groups(n: int, group_size: int, what: str) -> int:
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if n % group_size != 0:
        raise ValueError(
            f"{what} has {n} entries, which is not a multiple of group_size={group_size} "
            "(responses must be laid out group-major: G adjacent responses per prompt)"
        )
    return n // group_size


def group_advantages(
    rewards: Tensor, group_size: int, eps: float = 1e-6, std_mode: StdMode = "unbiased"
) -> Tensor:
    """Eq. 3: z-score each reward within its group of ``group_size`` adjacent responses.

    Args:
        rewards: ``[N]`` scalar reward per response (R = R_acc + R_len), ``N = num_prompts * group_size``.
        group_size: G, responses per prompt.
        eps: added to the std (``(R - mean) / (std + eps)``); ignored for ``std_mode="none"``.
        std_mode: ``"unbiased"`` (default; ddof=1, verl/TRL), ``"population"`` (ddof=0) or ``"none"``
            (mean-centering only, Dr. GRPO). See the module docstring for why.

    Returns:
        ``[N]`` float tensor (float32 at least) of advantages; exactly 0 for every response of a group whose rewards
        are all equal.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if std_mode not in STD_MODES:
        raise ValueError(f"std_mode must be one of {STD_MODES}, got {std_mode!r}")
    num_groups = _check_groups(rewards.numel(), group_size, "rewards")
    if std_mode == "unbiased" and group_size < 2:
        raise ValueError("std_mode='unbiased' needs group_size >= 2 (the std of one sample is undefined)")
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    r = rewards.to(dtype).view(num_groups, group_size)
    mean = r.mean(dim=1, keepdim=True)
    centered = r - mean
    if std_mode == "none":
        adv = centered
    else:
        std = r.std(dim=1, keepdim=True, correction=1 if std_mode == "unbiased" else 0)
        adv = centered / (std + eps)
    uniform = (r == r[:, :1]).all(dim=1, keepdim=True)
    adv = torch.where(uniform, torch.zeros_like(adv), adv)
    return adv.reshape(-1)


def group_p_hat(correct: Tensor, group_size: int) -> Tensor:
    """p_hat per response: the fraction of its group's responses that are correct (R_acc > 0).

    Args:
        correct: ``[N]`` bool (or 0/1) tensor, group-major.
        group_size: G.

    Returns:
        ``[N]`` float32 tensor; entry i is the p_hat of the group that response i belongs to.
    """
    if correct.dim() != 1:
        raise ValueError(f"correct must be 1-D [N], got shape {tuple(correct.shape)}")
    num_groups = _check_groups(correct.numel(), group_size, "correct")
    c = correct.to(torch.float32).view(num_groups, group_size)
    return c.mean(dim=1, keepdim=True).expand(num_groups, group_size).reshape(-1).clone()


def daa_mask(correct: Tensor, p_hat: Tensor, tau: float) -> Tensor:
    """Where Eq. 14 amplifies: R_acc > 0 AND p_hat < tau (strict; p_hat == tau is NOT amplified). ``[N]`` bool."""
    if correct.shape != p_hat.shape:
        raise ValueError(f"correct {tuple(correct.shape)} and p_hat {tuple(p_hat.shape)} must have the same shape")
    return correct.to(torch.bool) & (p_hat < tau)


def apply_daa(
    advantages: Tensor, correct: Tensor, p_hat: Tensor, lambda_: float | Tensor, tau: float
) -> Tensor:
    """Eq. 14 (Direct Advantage Amplification): A~_i = lambda * A_i if R_acc,i > 0 and p_hat_i < tau, else A_i.

    The paper's Eq. 14 writes the condition on R_i; Algorithm 1 and the text gate it on correctness, R_acc > 0, which
    is what we use (with overlong shaping, R_i can be <= 0 for a correct but long response; it is still amplified).

    Args:
        advantages: ``[N]`` or ``[N, T]`` (per token); not modified in place.
        correct: ``[N]`` bool, R_acc > 0.
        p_hat: ``[N]`` per-response group accuracy (``group_p_hat``).
        lambda_: amplification factor, a float (paper: 2.0) or an ``[N]`` tensor (``adaptive_daa_lambda``).
        tau: difficulty threshold (paper: 0.5); strict inequality.

    Returns:
        A new tensor shaped like ``advantages``.
    """
    n = advantages.shape[0] if advantages.dim() > 0 else -1
    if advantages.dim() not in (1, 2) or correct.shape != (n,) or p_hat.shape != (n,):
        raise ValueError(
            f"apply_daa: advantages must be [N] or [N, T] with correct and p_hat [N]; got advantages "
            f"{tuple(advantages.shape)}, correct {tuple(correct.shape)}, p_hat {tuple(p_hat.shape)}"
        )
    mask = daa_mask(correct, p_hat, tau)
    if isinstance(lambda_, Tensor):
        if lambda_.dim() == 0:
            lam = lambda_.to(advantages.dtype).expand(n)
        elif lambda_.shape == (n,):
            lam = lambda_.to(advantages.dtype)
        else:
            raise ValueError(f"lambda_ tensor must be a scalar or [N]={n}, got shape {tuple(lambda_.shape)}")
        scale = torch.where(mask, lam, torch.ones_like(lam))
    else:
        scale = torch.where(mask, float(lambda_), 1.0).to(advantages.dtype)
    if advantages.dim() == 2:
        scale = scale.unsqueeze(1)
    return advantages * scale


def adaptive_daa_lambda(
    p_hat: Tensor, group_size: int, lambda_min: float = 1.0, lambda_max: float = 4.0
) -> Tensor:
    """A per-response DAA factor from the estimated imbalance of Thm 3.1 (the paper's open direction, Sec. 6).

    Choice: lambda = 1 / gamma(p_hat, G) = alpha-(p_hat, G) / alpha+(p_hat, G)
    = (1 - p_hat^(G-1)) / (1 - (1 - p_hat)^(G-1)), clipped to [lambda_min, lambda_max]. After dynamic sampling the
    expected advantages of correct / incorrect responses are scaled by alpha+ / alpha- (Thm 3.1); multiplying the
    correct ones by 1/gamma makes both scalings equal, i.e. it undoes exactly the imbalance that DAA targets, with a
    factor that grows as the prompt gets harder instead of a constant. 1/gamma > 1 iff p_hat < 1/2, so with
    ``lambda_min = 1`` only hard groups are amplified, the same gate as the paper's tau = 0.5. p_hat is plugged in for
    the unknown p (a plug-in estimate from G samples; noisy for small G).

    Degenerate cases: p_hat = 0 gives 1/gamma = +inf -> ``lambda_max`` (such a group has no correct response, so the
    value is never used); p_hat = 1 gives 0 -> ``lambda_min`` (no incorrect response; dynamic sampling drops both).
    For G = 2 the formula gives (1 - p) / p.

    Returns:
        ``[N]`` float32 tensor in [lambda_min, lambda_max]; pass it as ``lambda_`` to ``apply_daa`` (with tau = 1.0 to
        let the factor alone decide, or tau = 0.5 to keep the paper's gate).
    """
    if group_size < 2:
        raise ValueError(f"adaptive_daa_lambda needs group_size >= 2, got {group_size}")
    if not 0 < lambda_min <= lambda_max:
        raise ValueError(f"need 0 < lambda_min <= lambda_max, got lambda_min={lambda_min}, lambda_max={lambda_max}")
    p = p_hat.to(torch.float64)
    if bool(((p < 0) | (p > 1)).any()):
        raise ValueError("p_hat must lie in [0, 1]")
    k = group_size - 1
    num = 1.0 - p.pow(k)
    den = 1.0 - (1.0 - p).pow(k)
    inv_gamma = torch.where(den > 0, num / den.clamp_min(1e-300), torch.full_like(p, float("inf")))
    return inv_gamma.clamp(lambda_min, lambda_max).to(torch.float32)


def broadcast_to_tokens(per_response: Tensor, response_mask: Tensor) -> Tensor:
    """Copy a per-response value to every response token: ``[N]`` x ``[N, T]`` mask -> ``[N, T]``, 0 where mask is 0."""
    if per_response.dim() != 1 or response_mask.dim() != 2 or response_mask.shape[0] != per_response.shape[0]:
        raise ValueError(
            f"broadcast_to_tokens: need per_response [N] and response_mask [N, T]; got {tuple(per_response.shape)} "
            f"and {tuple(response_mask.shape)}"
        )
    dtype = per_response.dtype if per_response.is_floating_point() else torch.float32
    return per_response.to(dtype).unsqueeze(1) * response_mask.to(dtype)


def daa_stats(correct: Tensor, p_hat: Tensor, tau: float, lambda_: float | Tensor | None = None) -> dict[str, float]:
    """Logging numbers for Eq. 14: how many responses DAA amplified in this batch.

    Keys: ``daa/active_frac`` (amplified / all responses), ``daa/active_frac_of_correct`` (amplified / correct
    responses; 0 if none is correct), ``daa/num_active``, ``daa/num_responses`` and, when ``lambda_`` is given,
    ``daa/lambda_mean`` (mean factor over the amplified responses; 0 if none).
    """
    mask = daa_mask(correct, p_hat, tau)
    n = mask.numel()
    n_active = int(mask.sum())
    n_correct = int(correct.to(torch.bool).sum())
    out = {
        "daa/active_frac": n_active / n if n else 0.0,
        "daa/active_frac_of_correct": n_active / n_correct if n_correct else 0.0,
        "daa/num_active": float(n_active),
        "daa/num_responses": float(n),
    }
    if lambda_ is not None:
        if isinstance(lambda_, Tensor) and lambda_.dim() > 0:
            out["daa/lambda_mean"] = float(lambda_[mask].double().mean()) if n_active else 0.0
        else:
            out["daa/lambda_mean"] = float(lambda_) if n_active else 0.0
    return out
