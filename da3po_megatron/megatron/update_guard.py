"""The update guard: one optimizer update is applied only if its loss, its gradient and its SIZE are sane, decided
the same way on every rank, without a temporary the size of a parameter or gradient buffer.

:func:`guarded_step` replaces ``optimizer.step()`` of megatron-core's ``ChainedOptimizer`` (0.16.1,
``megatron/core/optimizer/optimizer.py`` ``ChainedOptimizer.step`` ~1308-1340: ``prepare_grads`` -> ``get_grad_norm`` ->
``clip_grad_by_total_norm_fp32`` -> ``step_with_ready_grads``) with the same calls in the same order, and between
them the decisions:

1. **non-finite** -- the mini-batch loss of the ranks that hold one (last pipeline stage) and the gradient: megatron
   computes the global gradient norm anyway (``get_grad_norm_fp32``: per-tensor norms, squared, summed over the
   grad-stats group -- the model-parallel group, or the whole distributed-optimizer instance); a NaN or inf anywhere
   makes it non-finite, so the norm is the signal (no ``isfinite`` over buffers, no bool tensor of their size). A
   finite gradient whose norm overflows fp32 (>= 1.8e19) counts as non-finite too (megatron's clipping would have
   scaled it to zero). megatron-core offers no such skip for fp32 / bf16 training without a loss scaler (its
   ``step()`` always applies the update; ``check_for_nan_in_grad`` raises from inside the DDP reduction);
   Megatron-LM's trainer checks for NaN too and raises.
2. **too large** -- the relative update ||delta theta|| / ||theta|| of this step, computed BEFORE it is applied from
   the inner Adam's own state and the clipped gradient (:func:`update_norms`): Adam/AdamW as torch 2.13 implements it
   (``torch/optim/adam.py`` ``_single_tensor_adam``) and as Transformer-Engine's ``FusedAdam`` does (v2.9-v2.11
   ``transformer_engine/common/multi_tensor/adam.cu`` ~129-141: ``m/bc1 / (sqrt(v/bc2) + eps) (+ wd * p)``, times lr).
   Above ``max_update_ratio`` the update is refused -- exactly like a non-finite one: nothing applied (weights and
   optimizer state unchanged), so nothing needs rolling back. A learning rate orders of magnitude too large, a
   gradient spike, a loss-scale bug: each shows as a ratio far above any healthy RL step (docs/reliability.md gives
   the measured values).

The sums run in chunks of :data:`CHUNK` elements per parameter (a few chunk-sized temporaries, never a buffer-sized
one) and stay on the device until one reduction: squared sums of this rank's parameters that the grad norm counts
(not TP duplicates, not shared copies -- megatron's ``get_main_grads_for_grad_norm`` filter), all-reduced (SUM) over
the optimizer's grad-stats group. With the distributed optimizer each DP rank holds a disjoint shard of the fp32 main
parameters and its grad-stats group is the whole instance, so the shards add up to the model once.
Every decision is then all-reduced (MAX) over the world: every rank skips, or none.

:func:`check_finite_weights` is the belt to those braces: after an applied update the weights must be finite (one
sum per parameter buffer: NaN / inf propagate into it), else the run stops before they are synced or saved.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

KINDS = ("loss", "grad", "update_ratio")
CHUNK = 1 << 20  # elements per chunk of the update-norm computation (4 MiB per fp32 temporary)


@dataclass
class UpdateResult:
    """What :func:`guarded_step` did: ``applied``, or the ``refused`` reasons (sub-list of :data:`KINDS`, or
    ``["loss_scale"]`` for megatron's fp16 found-inf); the global gradient norm (before clipping) and the relative
    update size ||delta theta|| / ||theta|| of the update (applied or refused; NaN where not computed)."""

    applied: bool
    refused: list[str] = field(default_factory=list)
    grad_norm: float = math.nan
    update_ratio: float = math.nan


def _world_max(values: Sequence[float | torch.Tensor], device: torch.device | str) -> list[float]:
    t = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=device).reshape(()) for v in values])
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the default group: every rank of the world
    return t.tolist()


def _chained(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _adam_mode(inner) -> str | None:
    """'adamw' (decoupled weight decay), 'adam' (L2 into the gradient), or None when the update cannot be predicted
    (another optimizer, amsgrad / maximize, TE master weights or scaled fp16/fp8 states)."""
    name = type(inner).__name__
    if isinstance(inner, torch.optim.Adam):  # torch's Adam and AdamW (AdamW subclasses Adam in torch 2.13)
        g = inner.param_groups[0] if inner.param_groups else {}
        if g.get("amsgrad") or g.get("maximize"):
            return None
        return "adamw" if g.get("decoupled_weight_decay", isinstance(inner, torch.optim.AdamW)) else "adam"
    if name == "FusedAdam" and not getattr(inner, "master_weights", False):  # Transformer-Engine / Apex
        if any(getattr(inner, a, torch.float32) not in (torch.float32, torch.bfloat16)
               for a in ("exp_avg_dtype", "exp_avg_sq_dtype")):
            return None
        return "adamw" if getattr(inner, "adam_w_mode", 1) else "adam"
    return None


def _counted(param: torch.Tensor, tp_group) -> bool:
    """megatron's filter of ``get_main_grads_for_grad_norm``: not shared, not a tensor-parallel duplicate."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    return param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param, tp_group)


@torch.no_grad()
def _adam_sums(inner, mode: str, tp_group, acc: torch.Tensor) -> None:
    """Add this rank's sum of (delta theta)^2 and theta^2 into ``acc`` (float64 [2]), chunk by chunk."""
    for group in inner.param_groups:
        lr, wd, eps = float(group["lr"]), float(group.get("weight_decay", 0.0)), float(group["eps"])
        b1, b2 = (float(b) for b in group["betas"])
        for p in group["params"]:
            if p.grad is None or not _counted(p, tp_group):
                continue
            state = inner.state.get(p, {})
            done = state.get("step", group.get("step", 0))
            t = int(done.item() if isinstance(done, torch.Tensor) else done) + 1
            bc1, bc2 = 1.0 - b1 ** t, 1.0 - b2 ** t
            flat = [x.detach().view(-1) if x is not None else None
                    for x in (p, p.grad, state.get("exp_avg"), state.get("exp_avg_sq"))]
            for s in range(0, flat[0].numel(), CHUNK):
                pc, gc, mc, vc = (x[s:s + CHUNK] if x is not None else None for x in flat)
                g = gc.float()
                if mode == "adam" and wd:  # L2: the decay goes into the gradient before the moments
                    g = g.add(pc, alpha=wd)
                m = g.mul(1.0 - b1)
                if mc is not None:
                    m.add_(mc, alpha=b1)
                v = g.mul(g).mul_(1.0 - b2)
                if vc is not None:
                    v.add_(vc, alpha=b2)
                d = m.div_(bc1).div_(v.div_(bc2).sqrt_().add_(eps))  # the Adam direction, in place
                if mode == "adamw" and wd:
                    d.add_(pc, alpha=wd)
                d.mul_(lr)
                acc[0] += torch.dot(d, d).double()
                pf = pc.float()
                acc[1] += torch.dot(pf, pf).double()


def update_norms(optimizer) -> tuple[float, float] | None:
    """(||delta theta||, ||theta||) of the update ``optimizer`` is about to apply, over the whole model (collective
    over each chained optimizer's grad-stats group); None when its inner optimizer is not an Adam this module can
    predict. Call after the gradients are ready and clipped, before ``step_with_ready_grads``."""
    total = [0.0, 0.0]
    for opt in _chained(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None or getattr(opt, "is_stub_optimizer", False):
            continue
        mode = _adam_mode(inner)
        if mode is None:
            return None
        params = [p for g in inner.param_groups for p in g["params"]]
        device = params[0].device if params else torch.device("cpu")
        acc = torch.zeros(2, dtype=torch.float64, device=device)
        _adam_sums(inner, mode, getattr(opt, "tp_group", None), acc)
        group = opt.get_grad_stats_parallel_group()
        if dist.is_initialized():
            dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=group)
        dsq, psq = acc.tolist()
        total = [total[0] + dsq, total[1] + psq]
    return math.sqrt(total[0]), math.sqrt(total[1])


@torch.no_grad()
def guarded_step(optimizer, losses: Sequence[torch.Tensor], max_update_ratio: float,
                 device: torch.device | str = "cpu") -> UpdateResult:
    """One optimizer update through the guard (collective: all ranks, same order). ``losses``: this rank's loss
    tensors of the mini-batch (empty on ranks that compute none); ``max_update_ratio``: refuse an update whose
    ||delta theta|| / ||theta|| exceeds it (0 = measure only)."""
    chained = _chained(optimizer)
    if optimizer.prepare_grads():  # fp16 loss scaler found an inf (megatron's own skip; reduced over the MP group)
        return UpdateResult(False, ["loss_scale"])
    grad_norm = float(optimizer.get_grad_norm())
    loss_sum = torch.stack([x.detach().float().reshape(()) for x in losses]).sum() if losses else torch.tensor(0.0)
    bad_loss, bad_grad = _world_max([(~torch.isfinite(loss_sum)).float(), float(not math.isfinite(grad_norm))],
                                    device)
    refused = [k for k, bad in zip(KINDS, (bad_loss, bad_grad)) if bad]
    if refused:
        return UpdateResult(False, refused, grad_norm)
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for opt in chained:  # as ChainedOptimizer.step: clip every optimizer's grads by the one global norm
        params = opt.get_parameters() if not getattr(opt, "is_stub_optimizer", False) else []
        if params and opt.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
                                         use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    norms = update_norms(optimizer)
    ratio = math.nan if norms is None else (norms[0] / norms[1] if norms[1] > 0 else math.inf)
    ratio = _world_max([ratio if not math.isnan(ratio) else -1.0], device)[0]
    ratio = math.nan if ratio < 0 else ratio
    if max_update_ratio > 0 and not (ratio <= max_update_ratio) and not math.isnan(ratio):
        return UpdateResult(False, ["update_ratio"], grad_norm, ratio)
    optimizer.step_with_ready_grads()
    return UpdateResult(True, [], grad_norm, ratio)


def _param_buffers(ddp_model: torch.nn.Module) -> Iterable[torch.Tensor]:
    # Megatron DDP's lists of _ParamAndGradBuffer (a plain nn.Module's ``buffers`` is a method: not those)
    bufs = [b for name in ("buffers", "expert_parallel_buffers")
            if isinstance(getattr(ddp_model, name, None), list) for b in getattr(ddp_model, name)]
    if bufs and all(getattr(b, "param_data", None) is not None for b in bufs):
        return [b.param_data for b in bufs]
    return [p.data for p in ddp_model.parameters()]


def weights_finite(ddp_model: torch.nn.Module) -> torch.Tensor:
    """1.0 if every weight of this rank is finite, else 0.0 (a device scalar; no host sync). One ``sum`` per buffer:
    a NaN or inf anywhere makes it non-finite (no bool tensor of the buffer's size)."""
    sums = [t.sum() for t in _param_buffers(ddp_model) if t.numel()]
    if not sums:
        return torch.tensor(1.0)
    return torch.isfinite(torch.stack([s.float() for s in sums]).sum()).float()


def check_finite_weights(ddp_model: torch.nn.Module, update: int | str, device: torch.device | str = "cpu") -> None:
    """Raise on every rank if any rank's weights are non-finite after optimizer update ``update`` (a label such as
    ``"3.2"``: RL step 3, its 2nd applied update; collective)."""
    if _world_max([1.0 - weights_finite(ddp_model)], device)[0]:
        raise FloatingPointError(
            f"the policy weights became non-finite in optimizer update {update} (RL step.update) although its loss "
            "and gradients were finite and its size within trainer.max_update_ratio; stopping before they are "
            "synced to the engines or saved")
