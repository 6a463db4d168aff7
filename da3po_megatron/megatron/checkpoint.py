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

Asynchronous save (``save_policy(..., async_save=True)``): the model and optimizer shards are written by one forked
writer process and the checkpoint is loadable only after :func:`checkpoint_async.finalize_async_save` (megatron-core's
mechanism and its facts: :mod:`da3po_megatron.megatron.checkpoint_async`). Torch Adam's state across a load:
:mod:`da3po_megatron.megatron.checkpoint_adam`.

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
    HF side files are written now; the checkpoint is loadable after :func:`checkpoint_async.finalize_async_save`
    returned True."""
    from megatron.core import dist_checkpointing

    from da3po_megatron.megatron.checkpoint_async import async_save_in_flight, schedule_async_save
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
        schedule_async_save(requests, t0)
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

    from da3po_megatron.megatron.checkpoint_adam import prime_optimizer_state, restore_adam_step
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
        prime_optimizer_state(optimizer)
        model_sd = bare.sharded_state_dict()
        with torch.no_grad():  # dp_reshardable load writes into parameters' buffers
            opt_sd = optimizer.sharded_state_dict(model_sd, is_loading=True,
                                                  metadata={"distrib_optim_sharding_type": OPTIMIZER_SHARDING})
            state = dist_checkpointing.load(opt_sd, str(path / "optimizer"),
                                            sharded_strategy=_strategies(fully_parallel, path / "optimizer"))
            optimizer.load_state_dict(state)
            restore_adam_step(optimizer, state)
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
