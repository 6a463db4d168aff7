"""A custom advantage estimator plugged in by import path (the worked example of docs/algorithms.md).

RLOO (REINFORCE Leave-One-Out; Kool et al. 2019, Ahmadian et al. 2024): each response's baseline is the mean reward of
the OTHER G - 1 responses of its prompt, A_i = R_i - mean_{j != i} R_j, with no division by the group's std. It
replaces Eq. 3; DAA (Eq. 14) still amplifies its output when enabled. Use it with

    algorithm.advantage_fn: examples/custom/rloo_advantage.py:rloo_advantages

(a path relative to the working directory, made absolute at load; or ``package.module:function`` for an installed
module). The contract (``da3po_megatron.algorithms.registry.ADVANTAGE_FN_ARGS``): ``fn(rewards, group_size, *, eps)``
with ``rewards`` a ``[N]`` float tensor, ``group_size`` adjacent responses per prompt, returning ``[N]`` advantages.
"""

from __future__ import annotations

import torch


def rloo_advantages(rewards: torch.Tensor, group_size: int, *, eps: float = 1e-6) -> torch.Tensor:
    """A_i = R_i - (sum_j R_j - R_i) / (G - 1) within each group of ``group_size`` (``eps`` unused: no std)."""
    if group_size < 2:
        raise ValueError("RLOO needs at least two responses per prompt")
    r = rewards.reshape(-1, group_size)
    baseline = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    return (r - baseline).reshape(-1)
