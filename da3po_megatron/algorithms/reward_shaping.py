"""Reward shaping: the accuracy reward and DAPO's soft overlong punishment (paper Eq. 8, from
DAPO, Yu et al. 2025).

    R_acc = +1 if the verifier accepts the answer, -1 otherwise
    R_len(|o|) = 0                                 if |o| <= L_max - L_cache
               = ((L_max - L_cache) - |o|) / L_cache   if L_max - L_cache < |o| <= L_max
               = -1                                if |o| > L_max
    R = R_acc + R_len

The functions accept python numbers or tensors and are exact at every boundary: R_len is 0 at |o| = L_max - L_cache and
exactly -1 at |o| = L_max (((L_max - L_cache) - L_max) / L_cache = -L_cache / L_cache). ``penalty_factor`` scales R_len
(verl's ``overlong_buffer.penalty_factor``; the paper uses 1). When generation is capped at L_max tokens (the usual
setup), the ``|o| > L_max`` branch never fires; it is kept for completeness.

Left out: DAPO's "overlong filtering" (masking truncated samples out of the loss) -- the trainer can do it with the
response mask; verification itself lives in ``da3po_megatron/rewards``.
"""

from __future__ import annotations

import torch
from torch import Tensor

Number = int | float


def _check(max_length: Number, cache_length: Number) -> None:
    if max_length <= 0:
        raise ValueError(f"max_length (L_max) must be > 0, got {max_length}")
    if not 0 <= cache_length <= max_length:
        raise ValueError(f"cache_length (L_cache) must satisfy 0 <= L_cache <= L_max={max_length}, got {cache_length}")


def overlong_penalty(
    length: Number | Tensor, max_length: Number, cache_length: Number, penalty_factor: float = 1.0
) -> float | Tensor:
    """R_len of DAPO's soft overlong punishment for a response of ``length`` tokens (see module docstring).

    Args:
        length: |o|, response length in tokens (number or tensor of any shape).
        max_length: L_max (the response-length budget).
        cache_length: L_cache (the punishment interval just below L_max); 0 turns it into a hard cut at L_max.
        penalty_factor: scale of the penalty (1.0 in the paper).

    Returns:
        A float for a number input, else a float32 (or wider) tensor of ``length``'s shape, values in
        [-penalty_factor, 0].
    """
    _check(max_length, cache_length)
    start = max_length - cache_length
    if isinstance(length, Tensor):
        lf = length.to(torch.promote_types(length.dtype, torch.float32))
        if cache_length > 0:
            ramp = (start - lf) / cache_length
        else:
            ramp = torch.zeros_like(lf)
        out = torch.where(lf <= start, torch.zeros_like(lf), torch.where(lf <= max_length, ramp, -torch.ones_like(lf)))
        return out * penalty_factor
    if length <= start:
        return 0.0
    if length <= max_length:
        return penalty_factor * (start - length) / cache_length
    return -1.0 * penalty_factor


def accuracy_reward(correct: bool | Tensor) -> float | Tensor:
    """R_acc: +1 for a correct response, -1 otherwise (float, or float32 tensor for a bool tensor)."""
    if isinstance(correct, Tensor):
        return torch.where(correct.to(torch.bool), 1.0, -1.0).to(torch.float32)
    return 1.0 if correct else -1.0


def shaped_reward(
    acc: Number | Tensor,
    length: Number | Tensor,
    *,
    max_length: Number,
    cache_length: Number,
    overlong_shaping: bool = True,
    penalty_factor: float = 1.0,
) -> float | Tensor:
    """R = R_acc + R_len (R_len only when ``overlong_shaping``; GRPO/GSPO baselines run without it).

    ``acc`` is R_acc (+1/-1, see ``accuracy_reward``); ``length`` the response length |o| in tokens.
    """
    if not overlong_shaping:
        _check(max_length, cache_length)
        return acc.to(torch.promote_types(acc.dtype, torch.float32)) if isinstance(acc, Tensor) else float(acc)
    pen = overlong_penalty(length, max_length, cache_length, penalty_factor)
    if isinstance(acc, Tensor) or isinstance(pen, Tensor):
        a = acc if isinstance(acc, Tensor) else torch.tensor(float(acc))
        p = pen if isinstance(pen, Tensor) else torch.tensor(float(pen))
        if a.shape != p.shape and a.dim() > 0 and p.dim() > 0:
            raise ValueError(f"acc {tuple(a.shape)} and length {tuple(p.shape)} must have the same shape")
        return a.to(torch.promote_types(a.dtype, torch.float32)) + p
    return float(acc) + pen
