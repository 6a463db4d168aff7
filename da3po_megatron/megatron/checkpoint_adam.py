"""Torch Adam/AdamW state across a ``dist_checkpointing`` load of the distributed optimizer: the two gaps megatron-core
0.16.1 leaves when it falls back to torch's optimizers (no Transformer-Engine, no Apex: e.g. on CPU).

- :func:`prime_optimizer_state`: a fresh optimizer (a resumed process, never stepped) gets the per-parameter state a
  stepped one has, so megatron can build the state dict to load into;
- :func:`restore_adam_step`: the saved step goes back into each parameter's state, where torch's Adam reads it.

Fused optimizers (TE's / Apex's ``FusedAdam``) need neither and are left alone. Called by
:func:`checkpoint.load_policy`; megatron-core line numbers are cited where each function relies on them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)


TORCH_ADAM_CLASSES = (torch.optim.Adam, torch.optim.AdamW)


def torch_adam_state_template(inner: torch.optim.Optimizer, group: dict[str, Any], param: torch.Tensor
                              ) -> dict[str, torch.Tensor]:
    """The per-parameter state that ``inner``'s own ``step()`` creates, as a one-element example.

    Found by stepping a twin of ``inner`` (same class, ``group``'s hyperparameters) once on a one-element probe with
    ``param``'s dtype and device and a zero gradient -- so the keys, dtypes and devices are the optimizer's own (torch
    2.13 Adam/AdamW: ``step``, a float32 scalar on the CPU unless capturable/fused, ``exp_avg``, ``exp_avg_sq``, and
    ``max_exp_avg_sq`` with amsgrad), never a list of ours. :func:`_state_like` turns it into a parameter's state.
    """
    probe = torch.nn.Parameter(torch.zeros(1, dtype=param.dtype, device=param.device))
    twin = type(inner)([{**{k: v for k, v in group.items() if k != "params"}, "params": [probe]}])
    probe.grad = torch.zeros_like(probe)
    twin.step()
    return dict(twin.state[probe])


def _state_like(template: dict[str, Any], param: torch.Tensor) -> dict[str, Any]:
    """Zero state for ``param`` from a one-element template: tensors shaped like the probe become ``param``-shaped."""
    out: dict[str, Any] = {}
    for name, value in template.items():
        if torch.is_tensor(value) and value.dim() == 1 and value.numel() == 1:
            out[name] = torch.zeros_like(param.data, dtype=value.dtype)
        else:
            out[name] = torch.zeros_like(value) if torch.is_tensor(value) else value
    return out


def prime_optimizer_state(optimizer) -> None:
    """Give a fresh torch Adam/AdamW (never stepped, e.g. a resumed process) the per-parameter state a stepped one has.

    Only torch's optimizers need it, and only their own keys are added (:func:`torch_adam_state_template`).
    megatron-core 0.16.1 uses torch's Adam/AdamW only when neither Transformer-Engine nor Apex imports
    (``megatron/core/optimizer/__init__.py`` lines 12-34, ``USING_PYTORCH_OPTIMIZER``); then
    ``DistributedOptimizer.state_dict()`` -- called by ``sharded_state_dict(..., is_loading=True)``, i.e. while
    building the state dict to load INTO (``distrib_optimizer.py`` 1264-1267) -- reads one common ``step`` from every
    parameter's state (640-643): a fresh optimizer has none (AssertionError), and Megatron's ``init_state_fn``
    (``optimizer/__init__.py`` 391-399) adds moments but no ``step``. Zeros and step 0 are placeholders: the load
    overwrites the moments, :func:`restore_adam_step` the step.

    A fused optimizer (TE's or Apex's ``FusedAdam``, what megatron-core picks whenever TE imports) is left alone:
    megatron reads its step from ``param_groups`` (``distrib_optimizer.py`` 654-665) and allocates its moments itself
    when its state is empty (``load_state_dict``, 766-811); and TE's ``FusedAdam.state_dict`` looks every state key
    up in ``name_to_dtype_map`` = {exp_avg, exp_avg_sq, master_param} (TransformerEngine v2.11
    ``transformer_engine/pytorch/optimizers/fused_adam.py`` 192-196, 295-304, 421-441; the same in v2.9 / v2.10), so
    a foreign ``step`` key made every resume on GPU fail with ``KeyError: 'step'``.
    """
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        if type(inner) not in TORCH_ADAM_CLASSES:
            if inner is not None:
                log.debug("optimizer state not primed for %s (not torch Adam/AdamW)", type(inner).__name__)
            continue
        for group in inner.param_groups:
            templates: dict[tuple[torch.dtype, torch.device], dict[str, Any]] = {}
            for p in group["params"]:
                st = inner.state[p]
                key = (p.dtype, p.device)
                if key not in templates:
                    templates[key] = torch_adam_state_template(inner, group, p)
                for name, value in _state_like(templates[key], p).items():
                    st.setdefault(name, value)


def restore_adam_step(optimizer, state) -> None:
    """Put the saved Adam step back into torch Adam's per-parameter state.

    megatron-core 0.16.1's ``dp_reshardable`` load keeps each parameter's ``step`` as a local non-persistent object
    (the value live at load time), expecting the step to come from ``param_groups`` -- which is true for TE / Apex
    FusedAdam, but torch's Adam (the fallback without them, e.g. on CPU) reads ``state[p]["step"]``, so the bias
    correction would continue from the pre-load step. Harmless where the step already matches.
    """
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    states = state if isinstance(state, list) else [state]
    for opt, st in zip(chained, states):
        groups = (st or {}).get("optimizer", {}).get("param_groups", [])
        steps = {g["step"] for g in groups if g.get("step") is not None}
        if len(steps) != 1:
            continue
        step = float(steps.pop())
        inner = getattr(opt, "optimizer", None)
        for pstate in getattr(inner, "state", {}).values():
            if "step" in pstate and torch.is_tensor(pstate["step"]):
                pstate["step"] = torch.tensor(step, dtype=pstate["step"].dtype, device=pstate["step"].device)

