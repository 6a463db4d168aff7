"""The non-finite guard of the policy update: an optimizer step whose loss or gradients are not finite on ANY rank is
skipped on ALL ranks, so a NaN never reaches the weights (and from there the engines or a checkpoint).

Megatron-LM's trainer checks the loss and gradients for NaN too (``check_for_nan_in_loss_and_grad``; it raises) and
megatron-core's ``MixedPrecisionOptimizer.step`` skips a step when its fp16 loss scaler finds an inf (``found_inf``),
but megatron-core 0.16.1 offers no skip for fp32 or bf16 training without a loss scaler (``step()`` then always
applies the update, ``DistributedDataParallelConfig.check_for_nan_in_grad`` raises from inside the gradient
reduction). So this module checks, after the backward pass and before ``optimizer.step()``:

- the mini-batch loss of the ranks that hold one (last pipeline stage), and
- every rank's gradient buffer (Megatron DDP's contiguous ``grad_data``, already reduced over DP: one
  ``isfinite`` per buffer),

and all-reduces one flag per kind (MAX) over the whole world, so every rank takes the same decision. The caller
skips ``optimizer.step()`` when :func:`nonfinite_update` returns a non-empty list. :func:`check_finite_weights` is
the belt to those braces: after an applied update the weights must still be finite (an absurd but finite learning
rate can overflow them), else the run stops before they are synced or saved.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

KINDS = ("loss", "grad")


def _buffers(ddp_model: torch.nn.Module, attr: str) -> Iterable[torch.Tensor]:
    # Megatron DDP's lists of _ParamAndGradBuffer (a plain nn.Module's ``buffers`` is a method: not those)
    bufs = [b for name in ("buffers", "expert_parallel_buffers")
            if isinstance(getattr(ddp_model, name, None), list) for b in getattr(ddp_model, name)]
    if bufs and all(getattr(b, attr, None) is not None for b in bufs):
        return [getattr(b, attr) for b in bufs]
    params = list(ddp_model.parameters())
    if attr == "grad_data":
        return [g for p in params for g in (getattr(p, "main_grad", None), p.grad) if g is not None]
    return [p.data for p in params]


def _all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.numel())


def _reduce_flags(flags: Sequence[bool], device: torch.device | str) -> list[bool]:
    t = torch.tensor([float(f) for f in flags], dtype=torch.float32, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the default group: every rank of the world
    return [bool(v) for v in t.tolist()]


def nonfinite_update(losses: Sequence[torch.Tensor], ddp_model: torch.nn.Module,
                     device: torch.device | str = "cpu") -> list[str]:
    """What is non-finite in this update on any rank: a sub-list of ``["loss", "grad"]`` (empty = step as usual).

    Collective (all ranks, same order). ``losses``: this rank's loss tensors of the mini-batch (empty on ranks that
    compute none)."""
    local = [not _all_finite(losses), not _all_finite(_buffers(ddp_model, "grad_data"))]
    return [kind for kind, bad in zip(KINDS, _reduce_flags(local, device)) if bad]


def check_finite_weights(ddp_model: torch.nn.Module, update: int | str, device: torch.device | str = "cpu") -> None:
    """Raise on every rank if any rank's weights are non-finite after optimizer update ``update`` (a label such as
    ``"3.2"``: RL step 3, its 2nd applied update; collective)."""
    if _reduce_flags([not _all_finite(_buffers(ddp_model, "param_data"))], device)[0]:
        raise FloatingPointError(
            f"the policy weights became non-finite in optimizer update {update} (RL step.update) although its loss "
            "and gradients were finite (a learning rate far too large?); stopping before they are synced to the "
            "engines or saved")
