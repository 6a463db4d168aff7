"""The "ipc" weight transport: colocated on CUDA, engines sleep while the policy trains and receive the new weights as
CUDA-IPC handles of packed buffers on their own GPU -- no copy leaves the GPU.

One step boundary (:func:`ipc_sync`, called by ``Run.sync_weights``; ``Run.engines_idle`` put the engines to sleep
after the step's generation so the policy could use their memory):

1. the routing (:func:`~da3po_megatron.rollout.ipc_routing.plan_ipc_routes`): every policy rank reports its GPU UUID
   and TP / PP / DP ranks, every engine the UUIDs of its workers' GPUs; each engine worker gets, per PP stage, the
   rank on its own GPU that holds that stage in full (TP rank 0 of a DP replica), or the sync is refused before
   anything is touched, naming the engine, worker, GPU and stage;
2. every policy rank returns its cached device blocks (:func:`release_cached_memory`: ``torch.cuda.empty_cache``,
   again before step 4's KV-cache wake-up), then ``wake_up(["weights"])`` -- the engines' weight memory comes back
   (vLLM sleep level 1 kept a host copy, level 2 none: the sync overwrites every weight anyway) -- and the
   layerwise-reload session opens on every engine (the same one the "bytes" and "collective" transports use);
3. every holder of a stage packs its HF-named tensors into flat CUDA buffers of at most
   ``rollout.weight_sync_bucket_mb`` (:func:`~da3po_megatron.rollout.collective.iter_flat_buckets`); per bucket the
   routed ranks export theirs (``reduce_tensor``), the stage's holders all-gather ``{GPU UUID: handle}`` over their
   DP group (vLLM's trainer side does the same over its group, ``ipc_engine.py:326-363``), the stage's sender merges
   them and calls every engine once; each worker picks the handle of its own GPU
   (:func:`~da3po_megatron.rollout.ipc_routing.pick_handle`), maps it (``rebuild_cuda_tensor`` with its own device
   index: CUDA_VISIBLE_DEVICES differ between the processes), loads the views on its RPC thread's current stream and
   synchronizes that stream before it answers; the holders then pass a barrier before freeing the buffer (vLLM's
   per-chunk barrier, ``ipc_engine.py:426-431``);
4. the session closes (tied heads refreshed, strict check, prefix caches reset) and ``wake_up(["kv_cache"])``.

Layouts: policy TP = PP = 1 with any DP (every rank holds the whole model) and any number of engines of any TP, as
long as every engine GPU runs a policy rank; policy TP > 1 or PP > 1 leaves engine GPUs without a full copy of some
stage and is refused (:mod:`~da3po_megatron.rollout.ipc_routing` says why and what to use). Engine TP > 1: each
worker maps its own GPU's handle and ``load_weights`` keeps its shard.

GPU-only (docs/gpu_only.md, "weight sync"); the routing is pure and unit-tested on CPU. Follows vLLM's
``distributed/weight_transfer/ipc_engine.py`` (handles keyed by GPU UUID, device index rewritten on the receiver,
``ipc_collect`` after the send, 365-373) and verl's / slime's colocated refit.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from da3po_megatron.rollout.types import RolloutError


def gpu_uuid(device_index: int | None = None) -> str:
    idx = torch.cuda.current_device() if device_index is None else device_index
    return str(torch.cuda.get_device_properties(idx).uuid)


def require_ipc(what: str) -> None:
    """Raise naming what is missing for the IPC transport (CUDA, torch's CUDA-IPC reductions)."""
    if not torch.cuda.is_available():
        raise RolloutError(f"{what}: rollout.weight_transfer='ipc' needs CUDA (CUDA-IPC handles); on CPU use "
                           "'bytes' or 'collective'")
    try:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor  # noqa: F401
    except ImportError as e:  # pragma: no cover - every CUDA build of torch has them
        raise RolloutError(f"{what}: torch {torch.__version__} lacks CUDA-IPC reductions: {e}") from e


class IpcReceiverMixin:
    """Worker-extension half: report this worker's GPU; open the CUDA-IPC handle of a packed bucket meant for it and
    load it into the open session."""

    def da3po_gpu_uuid(self) -> str:
        return gpu_uuid(self._da3po_cuda_index())

    def _da3po_cuda_index(self) -> int:
        device = getattr(self, "device", None)  # vLLM's Worker.device (ipc_engine.py:200 uses the same)
        return device.index if isinstance(device, torch.device) and device.index is not None else \
            torch.cuda.current_device()

    def da3po_ipc_load(self, handles: dict, meta: list[list]) -> dict:
        """Map the handle of this worker's GPU (``handles``: {GPU UUID: ``reduce_tensor`` args}), load its views on
        this thread's current stream, synchronize the device before answering (the sender frees the buffer then).
        ``rebuild_cuda_tensor`` makes the current stream wait for the producer's IPC event first
        (torch/multiprocessing/reductions.py:153-200); args[6] is the storage's device index (reductions.py:160)."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        from da3po_megatron.rollout.collective import unpack_flat
        from da3po_megatron.rollout.ipc_routing import pick_handle

        device = self._da3po_cuda_index()
        rank = getattr(getattr(getattr(self, "vllm_config", None), "parallel_config", None), "rank", 0)
        args = list(pick_handle(handles, gpu_uuid(device), where=f"engine worker {rank}"))
        args[6] = device  # reduce_tensor's device index is the sender's; this process numbers GPUs its own way
        t0 = time.perf_counter()
        buf = rebuild_cuda_tensor(*args)
        out = self.da3po_load_bucket(unpack_flat(buf, meta))
        torch.cuda.synchronize(device)
        del buf
        out["seconds"] = time.perf_counter() - t0
        return out


def release_cached_memory(_worker: Any = None) -> dict:
    """On a policy rank (``PolicyGroup.run_on_all``): return the caching allocator's unused blocks to the device
    (``torch.cuda.empty_cache``) so a colocated engine can map them -- before the engines start
    (``trainer/colocation.py``) and before they wake from sleep (:func:`ipc_sync`). Without it only the memory
    estimate bounds what the policy keeps cached (peak plus fragmentation), and a level-2 wake-up, which re-maps the
    engine's weights and KV cache, may run out of device memory. Returns the reserved bytes before and after (0 / 0
    without CUDA: nothing to release)."""
    if not torch.cuda.is_available():
        return {"reserved_before": 0, "reserved_after": 0}
    torch.cuda.synchronize()
    before = int(torch.cuda.memory_reserved())
    torch.cuda.empty_cache()
    return {"reserved_before": before, "reserved_after": int(torch.cuda.memory_reserved())}


def _cuda_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _ipc_place(worker: Any) -> dict:
    """On every policy rank: where it runs (global rank, GPU UUID, TP / PP / DP ranks) for the routing plan."""
    import torch.distributed as dist

    require_ipc("policy rank")
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return {"rank": rank, "uuid": gpu_uuid(), "tp": int(getattr(worker, "tp_rank", 0)),
            "pp": int(getattr(worker, "pp_rank", 0)), "dp": int(getattr(worker, "dp_rank", 0)),
            "cp": int(getattr(worker, "cp_rank", 0))}


def _ipc_push(worker: Any, client: Any, bucket_bytes: int, dtype: torch.dtype | None, routes: Any) -> dict:
    """On every policy rank: the holders of a stage pack its buckets; per bucket the routed ranks export theirs, the
    holders all-gather the handles over their DP group (only when a stage has several holders), the stage's sender
    ships the merged handles to every engine, and all holders pass a barrier before the buffer goes."""
    import torch.distributed as dist
    from torch.multiprocessing.reductions import reduce_tensor

    from da3po_megatron.rollout.collective import iter_flat_buckets
    from da3po_megatron.rollout.ipc_routing import merge_handles
    from da3po_megatron.rollout.weight_sync import policy_hf_stream

    stream = policy_hf_stream(worker)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    role = routes.role(rank)
    stats = {"bytes": 0, "buckets": 0, "tensors": 0, "max_bucket_bytes": 0}
    if role is None:  # TP rank != 0: take part in the export's gathers, hold nothing
        for _ in stream:
            pass
        return stats
    require_ipc("policy sender")
    stage = int(getattr(worker, "pp_rank", 0))
    group = getattr(worker, "dp_group", None) if len(routes.holders[stage]) > 1 else None
    uuid = gpu_uuid()
    device = _cuda_device()
    for buf, meta in iter_flat_buckets(stream, bucket_bytes, device, dtype):
        torch.cuda.synchronize(device)  # the packing copies are done before another process reads the buffer
        mine = {uuid: reduce_tensor(buf)[1]} if routes.exports(rank) else {}
        names = [r[0] for r in meta]
        parts = [(mine, names)]
        if group is not None:
            parts = [None] * dist.get_world_size(group)
            dist.all_gather_object(parts, (mine, names), group=group)
        if role == "ship":
            if any(p[1] != names for p in parts):
                raise RuntimeError(f"ipc weight sync: the holders of PP stage {stage} packed different bucket "
                                   f"{stats['buckets']} (tensors {[p[1][:2] for p in parts]})")
            handles = merge_handles(p[0] for p in parts)
            pending = [(i, client._call(i, "ipc_load_bucket", handles, meta)) for i in range(client.num_engines)]
            client._gather(pending, f"ipc weight sync, PP stage {stage} bucket {stats['buckets']}")
        if group is not None:
            dist.barrier(group=group)  # every engine loaded it: the holders may free their buffers
        stats["bytes"] += sum(r[4] for r in meta)
        stats["buckets"] += 1
        stats["tensors"] += len(meta)
        stats["max_bucket_bytes"] = max(stats["max_bucket_bytes"], buf.numel())
        del buf
    torch.cuda.ipc_collect()  # release the IPC-shared blocks the engines have closed (ipc_engine.py:373)
    return stats if role == "ship" else {**stats, "bytes": 0, "buckets": 0, "tensors": 0}


def ipc_sync(policy_group: Any, client: Any, bucket_mb: float = 512, dtype: torch.dtype | None = None,
             strict: bool = True) -> dict:
    """Colocated step boundary: route, wake weights, IPC buckets of every stage to every engine, finish, wake the
    KV cache. A layout the routing refuses raises ValueError before any engine is touched."""
    from da3po_megatron.rollout.ipc_routing import plan_ipc_routes

    require_ipc("ipc_sync")
    t0 = time.perf_counter()
    routes = plan_ipc_routes(policy_group.run_on_all(_ipc_place), client.call_all("worker_gpu_uuids"))
    policy_group.run_on_all(release_cached_memory)  # the training step's cached blocks go back before the wake-up
    client.wake_up(tags=["weights"])
    client.begin_weight_update()
    try:
        parts = policy_group.run_on_all(_ipc_push, client, int(bucket_mb * 2**20), dtype, routes)
        client.finish_weight_update(strict=strict)
    except BaseException:
        client.abort_weight_update()
        raise
    finally:
        policy_group.run_on_all(release_cached_memory)  # and the freed bucket buffers before the KV cache's
        client.wake_up(tags=["kv_cache"])
    sent = [p for p in parts if p["buckets"]]
    stats: dict[str, float] = {k: float(sum(p[k] for p in sent)) for k in ("bytes", "buckets", "tensors")}
    stats["max_bucket_bytes"] = float(max((p["max_bucket_bytes"] for p in sent), default=0))
    stats["pushing_ranks"] = float(len(sent))
    stats["exporting_ranks"] = float(len(routes.serves))
    stats["seconds"] = time.perf_counter() - t0
    stats["gbps"] = stats["bytes"] / max(stats["seconds"], 1e-9) / 1e9
    return stats
