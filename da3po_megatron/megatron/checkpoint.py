"""Megatron ``dist_checkpointing`` checkpoints of the policy: model (resharding-safe), optimizer, scheduler, RNG.

On-disk layout (a contract with the bridge's converter, which writes the same ``model/`` part)::

    DIR/model/          dist_checkpointing.save(gpt_model.sharded_state_dict(), DIR/"model")   (torch_dist format)
    DIR/optimizer/      the distributed optimizer's sharded state ("dp_reshardable": same TP x PP, any DP)
    DIR/rng/rank_R.pt   python / numpy / torch / Megatron-tracker RNG states of global rank R
    DIR/meta.json       format, parallel layout, step, scheduler state, sharding type (+ the policy's "arch")
    DIR/hf/             the HF config + tokenizer files of the model (for Megatron -> HF conversion)

The model part uses Megatron's sharded state dict, whose keys are global (layer numbers offset by the pipeline stage,
tensor-parallel shards described as slices of the full tensor), so a checkpoint saved at one TP x PP layout loads at
any other (the approach of Megatron-LM's ``dist_checkpointing``). The optimizer state is saved in the
``dp_reshardable`` format: each rank writes its own buffer shards with no communication, which reloads at the same
TP x PP (DP may change); at another layout :func:`load_policy` loads the model and skips the optimizer (says so).
Facts (megatron-core 0.16.1): the ``dp_reshardable`` load must run under ``torch.no_grad()``; ``fully_reshardable``
fails with KeyError 'step'; ``psutil`` must be installed (the torch_dist writer subprocess needs it); a script that
saves needs an ``if __name__ == "__main__":`` guard (the writer spawns a Manager).

Asynchronous save (``save_policy(..., async_save=True)``): megatron-core's own mechanism -- ``dist_checkpointing.save(
..., async_sharded_save=True)`` returns an ``AsyncRequest`` (0.16.1 ``dist_checkpointing/serialization.py`` 314-437:
the plan, the common part and the sharded objects are written at once; the shards are written by the request, and
``metadata.json`` only by its finalize functions), scheduled on an ``AsyncCallsQueue``
(``dist_checkpointing/strategies/async_utils.py`` 530-624, non-persistent: ``TemporalAsyncCaller`` forks one writer
process per request after staging GPU tensors to host memory, 178-255). The model and optimizer requests of one
checkpoint are merged into ONE request (:func:`_merge_async_requests`): torch_dist's writers report their results
through one process-wide queue (``filesystem_async.py`` 48-56, ``retrieve_write_results`` 424), so two requests in
flight at once could read each other's results; one writer process writing both, in order, keeps them apart. On CPU
the fork is the snapshot (copy-on-write: the next step's updates do not reach the child; ``preload_tensors`` copies
nothing there). :func:`finalize_async_save` -- collective, it all-reduces "done" over the world and gathers the write
results -- writes the torch_dist ``.metadata`` and ``metadata.json``; only then is the checkpoint loadable. Works on
CPU / gloo (tests/test_operations.py). At most one asynchronous save per process is in flight (checked).

Every function here is collective: call it on all ranks of the world.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

FORMAT = "da3po-megatron/1"
OPTIMIZER_SHARDING = "dp_reshardable"
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _strategies(fully_parallel: bool, checkpoint_dir: Path | None = None):
    """(save or load) sharded strategy: the default one, optionally wrapped to spread the work over DP ranks."""
    if not fully_parallel:
        return None
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import (
        get_default_load_sharded_strategy,
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )

    group = ps.get_data_parallel_group(with_context_parallel=True)
    if checkpoint_dir is None:
        return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), group)
    return FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(str(checkpoint_dir)), group)


def _fresh_dir(path: Path) -> None:
    """Create an empty directory on rank 0 (dist_checkpointing needs it to exist), then barrier."""
    if _rank() == 0:
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
    _barrier()


def prewarm_writer(directory: str | Path) -> float:
    """Do once, ahead, what makes a process's first checkpoint slow: megatron-core's writer imports its strategies,
    starts a "spawn" multiprocessing Manager for its writer processes' results and unpickles its first save plans --
    1.5-3 s on 2 CPU cores, paid by the first checkpoint of every run (later saves of the tiny model: 0.13 s). A save
    of one replicated scalar into ``directory`` (the checkpoint root, shared by the ranks; removed afterwards) runs
    that path once; the trainer calls this on every rank while the engines start. Collective; returns seconds."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    t0 = time.perf_counter()
    directory = Path(directory)
    if _rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
    _barrier()
    state = {"prewarm": ShardedTensor.from_rank_offsets("prewarm", torch.zeros(1), replica_id=_rank())}
    dist_checkpointing.save(state, str(directory))
    _barrier()
    if _rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
    return time.perf_counter() - t0


def save_model(model: torch.nn.Module, directory: str | Path, fully_parallel: bool = False,
               async_save: bool = False) -> Any:
    """Save a (bare, not DDP-wrapped) GPTModel's sharded state dict to ``directory`` (collective). With
    ``async_save`` the shards are not written yet: the returned ``AsyncRequest`` writes them (module docstring)."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    _fresh_dir(directory)
    return dist_checkpointing.save(model.sharded_state_dict(), str(directory),
                                   sharded_strategy=_strategies(fully_parallel), async_sharded_save=async_save)


# ------------------------------------------------------------------------------------------------ asynchronous save
_ASYNC: dict[str, Any] = {"queue": None, "started": 0.0}


def _async_queue():
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    if _ASYNC["queue"] is None:
        _ASYNC["queue"] = AsyncCallsQueue(persistent=False)  # a forked writer per request (TemporalAsyncCaller)
    return _ASYNC["queue"]


def async_save_in_flight() -> bool:
    """Whether this process has scheduled an asynchronous save that is not finalized yet (not collective)."""
    q = _ASYNC["queue"]
    return q is not None and q.get_num_unfinalized_calls() > 0


def _run_writes(writes: list[tuple[Any, tuple, dict]]) -> None:
    """In the forked writer process: each request's write function, in order (model, then optimizer)."""
    for fn, args, kwargs in writes:
        if fn is not None:
            fn(*args, **kwargs)


def _merge_async_requests(requests: list[Any]) -> Any:
    """One ``AsyncRequest`` doing the writes of ``requests`` in order, then all their finalize functions in order.

    Each request's ``preload_fn`` (GPU -> host staging) runs here, in the training process and before the fork, as
    ``TemporalAsyncCaller.schedule_async_call`` would run it (async_utils.py 198-206): its result replaces the write
    buckets argument (index 1) exactly as there."""
    from functools import partial

    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    writes, finalize = [], []
    for r in requests:
        args = list(r.async_fn_args)
        if r.preload_fn is not None and r.async_fn is not None:
            args[1] = r.preload_fn()
        writes.append((r.async_fn, tuple(args), dict(r.async_fn_kwargs)))
        finalize += list(r.finalize_fns)
    fn = partial(_run_writes, writes) if any(w[0] is not None for w in writes) else None
    return AsyncRequest(fn, (), finalize)


def finalize_async_save(blocking: bool = False) -> bool:
    """Finish the asynchronous save in flight if its writer is done on every rank (``blocking``: wait for it).

    Collective (megatron's ``maybe_finalize_async_calls`` all-reduces "done" over the world, then the finalize
    functions gather the write results and write ``.metadata`` / ``metadata.json``). Returns True when nothing is in
    flight any more (the same on every rank). A writer's failure raises megatron's ``CheckpointException`` on every
    rank."""
    q = _ASYNC["queue"]
    if q is None or q.get_num_unfinalized_calls() == 0:
        return True
    q.maybe_finalize_async_calls(blocking=blocking)
    done = q.get_num_unfinalized_calls() == 0
    if done:
        log.info("asynchronous checkpoint finalized %.2f s after it was scheduled", time.perf_counter()
                 - _ASYNC["started"])
    return done


def load_model(model: torch.nn.Module, directory: str | Path, fully_parallel: bool = False) -> None:
    """Load a model checkpoint saved at any TP x PP (x EP x ETP) layout, with either layer spec, into this rank's
    GPTModel stage (collective). A MoE norm saved under the other spelling is read under it
    (:func:`checkpoint_keys.accept_norm_aliases`: checkpoints of the local spec written before issue 46)."""
    from megatron.core import dist_checkpointing

    from da3po_megatron.megatron.checkpoint_keys import accept_norm_aliases, saved_tensor_keys

    directory = Path(directory)
    if not (directory / "metadata.json").exists():
        raise FileNotFoundError(f"no Megatron dist checkpoint at {directory} (metadata.json missing)")
    sharded = model.sharded_state_dict()
    renamed = accept_norm_aliases(sharded, saved_tensor_keys(str(directory)))
    if renamed and _rank() == 0:
        log.warning("%s: %d MoE norm tensors read under the other layer spec's name (e.g. %s <- %s)", directory,
                    len(renamed), *renamed[0])
    state = dist_checkpointing.load(sharded, str(directory), sharded_strategy=_strategies(fully_parallel, directory))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise KeyError(f"checkpoint {directory} lacks model tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        log.warning("checkpoint %s has tensors this model does not use: %s", directory, unexpected[:8])


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)


# What the distributed optimizer's ``dp_reshardable`` state depends on besides DP (megatron-core 0.16.1
# ``optimizer/distrib_optimizer.py`` 1539-1600: one ShardedTensor per gradient-buffer bucket, the buffers' parameter
# order and sizes): the model-parallel split (TP, PP, CP), the expert split (EP, ETP: the expert buffers hold E / EP
# experts of 1 / ETP each, over the expert-data-parallel group), the layer spec (TE fuses the norms into its linears:
# another parameter order in the same-sized buffer, so a mismatch would load moments into the wrong parameters
# silently), the parameter dtype and whether the optimizer is distributed at all. The state loads only when every one
# of them matches; DP (and the expert DP and world size it implies) is the one dimension the format reshards.
OPTIMIZER_LAYOUT = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                    "expert_model_parallel_size", "expert_tensor_parallel_size", "layer_spec", "params_dtype",
                    "distributed_optimizer")


def _layout(model: torch.nn.Module | None = None, optimizer: Any = None) -> dict[str, Any]:
    """The parallel layout of this process (and, given them, the model's layer spec and dtype and the optimizer's
    kind): what ``meta.json`` records and :func:`optimizer_layout_changes` compares."""
    from megatron.core import parallel_state as ps

    out: dict[str, Any] = {
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "context_parallel_size": ps.get_context_parallel_world_size(),
        "data_parallel_size": ps.get_data_parallel_world_size(),
        "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
        "expert_tensor_parallel_size": ps.get_expert_tensor_parallel_world_size(),
        "expert_data_parallel_size": ps.get_expert_data_parallel_world_size(),
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
    }
    if model is not None:
        from da3po_megatron.megatron.checkpoint_keys import layer_spec_name

        bare = _unwrap(model)
        out["layer_spec"] = layer_spec_name(bare)
        out["params_dtype"] = str(getattr(getattr(bare, "config", None), "params_dtype", "")).replace("torch.", "")
    if optimizer is not None:
        chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
        out["distributed_optimizer"] = any(type(o).__name__ == "DistributedOptimizer" for o in chained)
    return out


def optimizer_layout_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The :data:`OPTIMIZER_LAYOUT` fields that differ between a checkpoint's layout and this one, as
    "field: saved -> now". A field a checkpoint of an older version did not record counts as its old default (EP 1,
    ETP = TP) or, for what could not be told then (layer spec, dtype, optimizer kind), as unchanged."""
    defaults = {"expert_model_parallel_size": 1,
                "expert_tensor_parallel_size": saved.get("tensor_model_parallel_size")}
    out = []
    for k in OPTIMIZER_LAYOUT:
        old = saved.get(k, defaults.get(k))
        if old is None or k not in now:
            continue
        if old != now[k]:
            out.append(f"{k}: {old} -> {now[k]}")
    return out


def save_policy(path: str | Path, model: torch.nn.Module, optimizer, scheduler, *, step: int,
                hf_dir: str | Path | None = None, extra: dict[str, Any] | None = None,
                fully_parallel: bool = False, async_save: bool = False) -> None:
    """Save model + optimizer + scheduler + RNG of every rank to ``path`` (collective; layout in module docstring).

    ``async_save``: the model and optimizer shards are written by a background process; RNG, ``meta.json`` and the
    HF side files are written now; the checkpoint is loadable after :func:`finalize_async_save` returned True."""
    from megatron.core import dist_checkpointing

    from da3po_megatron.megatron.runtime import rng_state

    if async_save and async_save_in_flight():
        raise RuntimeError("an asynchronous checkpoint save is still in flight: finalize it first "
                           "(finalize_async_save(blocking=True)); at most one is written at a time")
    t0 = time.perf_counter()
    path = Path(path)
    if _rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    _barrier()
    bare = _unwrap(model)
    requests = [save_model(bare, path / "model", fully_parallel=fully_parallel, async_save=async_save)]
    _fresh_dir(path / "optimizer")
    model_sd = bare.sharded_state_dict()
    opt_sd = optimizer.sharded_state_dict(model_sd, is_loading=False,
                                          metadata={"distrib_optim_sharding_type": OPTIMIZER_SHARDING})
    requests.append(dist_checkpointing.save(opt_sd, str(path / "optimizer"),
                                            sharded_strategy=_strategies(fully_parallel),
                                            async_sharded_save=async_save))
    if async_save:
        _ASYNC["started"] = t0
        _async_queue().schedule_async_request(_merge_async_requests(requests))
    if _rank() == 0:
        (path / "rng").mkdir(exist_ok=True)
    _barrier()
    torch.save(rng_state(), path / "rng" / f"rank_{_rank()}.pt")
    if _rank() == 0:
        meta = {
            "format": FORMAT,
            "step": int(step),
            "layout": _layout(model, optimizer),
            "optimizer_sharding_type": OPTIMIZER_SHARDING,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            **(extra or {}),
        }
        (path / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        if hf_dir is not None:
            (path / "hf").mkdir(exist_ok=True)
            for name in HF_FILES:
                src = Path(hf_dir) / name
                if src.exists():
                    shutil.copy2(src, path / "hf" / name)
    _barrier()


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


def _prime_optimizer_state(optimizer) -> None:
    """Give a fresh torch Adam/AdamW (never stepped, e.g. a resumed process) the per-parameter state a stepped one has.

    Only torch's optimizers need it, and only their own keys are added (:func:`torch_adam_state_template`).
    megatron-core 0.16.1 uses torch's Adam/AdamW only when neither Transformer-Engine nor Apex imports
    (``megatron/core/optimizer/__init__.py`` lines 12-34, ``USING_PYTORCH_OPTIMIZER``); then
    ``DistributedOptimizer.state_dict()`` -- called by ``sharded_state_dict(..., is_loading=True)``, i.e. while
    building the state dict to load INTO (``distrib_optimizer.py`` 1264-1267) -- reads one common ``step`` from every
    parameter's state (640-643): a fresh optimizer has none (AssertionError), and Megatron's ``init_state_fn``
    (``optimizer/__init__.py`` 391-399) adds moments but no ``step``. Zeros and step 0 are placeholders: the load
    overwrites the moments, :func:`_restore_adam_step` the step.

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


def _restore_adam_step(optimizer, state) -> None:
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


ALLOW_PICKLE_ENV = "DA3PO_ALLOW_PICKLE_CHECKPOINTS"


def safe_load(path: str | Path) -> Any:
    """``torch.load(path, weights_only=True)``: tensors and plain Python values only, so loading a checkpoint never
    runs code from it. Files of older versions that pickled Python objects load only with the explicit opt-in
    ``DA3PO_ALLOW_PICKLE_CHECKPOINTS=1`` (for checkpoints you trust)."""
    import os
    import pickle

    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        if os.environ.get(ALLOW_PICKLE_ENV) == "1":
            log.warning("%s: loading pickled Python objects (%s=1)", path, ALLOW_PICKLE_ENV)
            return torch.load(path, weights_only=False, map_location="cpu")
        raise pickle.UnpicklingError(
            f"{path} holds pickled Python objects (a checkpoint of an older version, or not ours), and loading them "
            f"could run code from the file; if you trust it, set {ALLOW_PICKLE_ENV}=1 to load it once (the next "
            f"checkpoint is written in the safe format). Detail: {str(e).splitlines()[0]}") from None


def read_meta(path: str | Path) -> dict[str, Any]:
    p = Path(path) / "meta.json"
    if not p.exists():
        raise FileNotFoundError(f"{p} not found: not a da3po-megatron checkpoint")
    return json.loads(p.read_text())


def load_policy(path: str | Path, model: torch.nn.Module, optimizer, scheduler, *,
                load_optimizer: bool | None = None, fully_parallel: bool = False) -> dict[str, Any]:
    """Load what :func:`save_policy` wrote (collective). Returns the meta dict plus what was loaded.

    ``load_optimizer``: None = when every field the optimizer state depends on matches (:data:`OPTIMIZER_LAYOUT`:
    TP, PP, CP, EP, ETP, layer spec, dtype, distributed optimizer -- DP may differ, the one dimension
    ``dp_reshardable`` reshards), else the model only, with a warning naming the fields; True = required
    (ValueError naming them at another layout); False = model only. RNG states are restored when the whole layout
    is unchanged. After a model-only load the optimizer's fp32 main weights are refreshed from the model. (A
    trainer resume refuses such a change before Ray starts: ``trainer/resume/config_drift.check_checkpoint_layout``.)
    """
    from megatron.core import dist_checkpointing

    from da3po_megatron.megatron.runtime import set_rng_state

    path = Path(path)
    meta = read_meta(path)
    now = _layout(model, optimizer)
    saved = meta["layout"]
    changed = optimizer_layout_changes(saved, now)
    if load_optimizer and changed:
        raise ValueError(
            f"the optimizer state in {path} was saved at another layout ({'; '.join(changed)}) and loads only at the "
            f"same one (megatron's dp_reshardable buckets; DP may differ); load with load_optimizer=False for the "
            f"model only")
    do_opt = not changed if load_optimizer is None else load_optimizer
    bare = _unwrap(model)
    load_model(bare, path / "model", fully_parallel=fully_parallel)
    if do_opt and optimizer is not None:
        _prime_optimizer_state(optimizer)
        model_sd = bare.sharded_state_dict()
        with torch.no_grad():  # dp_reshardable load writes into parameters' buffers
            opt_sd = optimizer.sharded_state_dict(model_sd, is_loading=True,
                                                  metadata={"distrib_optim_sharding_type": OPTIMIZER_SHARDING})
            state = dist_checkpointing.load(opt_sd, str(path / "optimizer"),
                                            sharded_strategy=_strategies(fully_parallel, path / "optimizer"))
            optimizer.load_state_dict(state)
            _restore_adam_step(optimizer, state)
    elif optimizer is not None:
        if _rank() == 0:
            log.warning("loading the MODEL ONLY from %s: its optimizer state (Adam moments) was saved at another "
                        "layout (%s) and starts fresh", path, "; ".join(changed) or "load_optimizer=False")
        optimizer.reload_model_params()
    if scheduler is not None and meta.get("scheduler"):
        scheduler.num_steps = 0  # OptimizerParamScheduler.load_state_dict ADDS the saved step count to the current
        scheduler.load_state_dict(meta["scheduler"])
    rng_file = path / "rng" / f"rank_{_rank()}.pt"
    restored_rng = all(saved.get(k, v) == v for k, v in now.items()) and rng_file.exists()
    if restored_rng:
        set_rng_state(safe_load(rng_file))
    _barrier()
    return {**meta, "loaded_optimizer": bool(do_opt and optimizer is not None), "restored_rng": restored_rng}
