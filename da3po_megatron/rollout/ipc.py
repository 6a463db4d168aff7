"""The "ipc" weight transport: colocated on CUDA, engines sleep while the policy trains and receive the new weights as
CUDA-IPC handles of the sending rank's packed buffers -- no copy leaves the GPU.

One step boundary (:func:`ipc_sync`, called by ``Run.sync_weights``; ``Run.engines_sleep`` put the engines to sleep
after the step's generation so the policy could use their memory):

1. ``wake_up(["weights"])`` -- the engines' weight memory comes back (vLLM sleep level 1 kept a host copy, level 2
   none: the sync overwrites every weight anyway);
2. the layerwise-reload session opens on every engine (the same one the "bytes" and "collective" transports use);
3. each PP stage's sender (TP rank 0 of DP replica 0, :func:`~da3po_megatron.rollout.weight_sync.sender_stage`)
   packs its HF-named tensors into a flat CUDA buffer of at most ``rollout.weight_sync_bucket_mb``
   (:func:`~da3po_megatron.rollout.collective.iter_flat_buckets`), exports it with ``torch.multiprocessing``'s
   ``reduce_tensor`` and calls every engine with the handle; each worker opens it (``rebuild_cuda_tensor`` with its own
   device index: CUDA_VISIBLE_DEVICES differ between the processes), loads the views and drops the mapping; the sender
   frees the buffer once every engine answered;
4. the session closes (tied heads refreshed, strict check, prefix caches reset) and ``wake_up(["kv_cache"])``.

Capability check: a worker only opens a handle of its own physical GPU (compared by UUID, as vLLM's IPC engine does);
a worker on another GPU raises naming both GPUs -- use the "collective" transport there. Engines and policy must be
colocated with one policy sending rank per engine GPU; with engine TP > 1 the workers on other GPUs cannot map the
sender's buffer, so "ipc" needs engine TP = 1 on the sender's GPU (vLLM's own IPC engine gathers one handle per GPU
from every trainer rank instead; not done here).

Follows vLLM's ``distributed/weight_transfer/ipc_engine.py`` (handles keyed by GPU UUID, device index rewritten on
the receiver) and verl's / slime's colocated refit. Not run on this project's CPU machines (no CUDA); listed as
unexercised in docs/rollout.md.
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
    """Worker-extension half: open a CUDA-IPC handle of a packed bucket and load it into the open session."""

    def da3po_ipc_load(self, handle_args: tuple, sender_uuid: str, meta: list[list]) -> dict:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        from da3po_megatron.rollout.collective import unpack_flat

        device = torch.cuda.current_device()
        mine = gpu_uuid(device)
        if mine != sender_uuid:
            raise RuntimeError(f"ipc weight transport: this worker runs on GPU {mine}, the sender's buffer lives on "
                               f"GPU {sender_uuid}; IPC handles only map on the same GPU (use "
                               "rollout.weight_transfer=collective for engines on other GPUs)")
        args = list(handle_args)
        args[6] = device  # reduce_tensor's device index is the sender's; this process numbers GPUs its own way
        t0 = time.perf_counter()
        buf = rebuild_cuda_tensor(*args)
        out = self.da3po_load_bucket(unpack_flat(buf, meta))
        torch.cuda.synchronize(device)
        del buf
        out["seconds"] = time.perf_counter() - t0
        return out


def _ipc_push(worker: Any, client: Any, bucket_bytes: int, dtype: torch.dtype | None) -> dict:
    """On every policy rank: senders pack CUDA buckets and hand their IPC handles to every engine, one bucket at a
    time (the buffer is released only after every engine loaded it)."""
    from torch.multiprocessing.reductions import reduce_tensor

    from da3po_megatron.rollout.collective import iter_flat_buckets
    from da3po_megatron.rollout.weight_sync import policy_hf_stream, sender_stage

    stream = policy_hf_stream(worker)
    if sender_stage(worker) is None:
        for _ in stream:
            pass
        return {"bytes": 0, "buckets": 0, "tensors": 0, "max_bucket_bytes": 0}
    require_ipc("policy sender")
    uuid = gpu_uuid()
    stats = {"bytes": 0, "buckets": 0, "tensors": 0, "max_bucket_bytes": 0}
    device = torch.device("cuda", torch.cuda.current_device())
    for buf, meta in iter_flat_buckets(stream, bucket_bytes, device, dtype):
        torch.cuda.synchronize(device)  # the packing copies are done before another process reads the buffer
        _, args = reduce_tensor(buf)
        pending = [(i, client._call(i, "ipc_load_bucket", args, uuid, meta)) for i in range(client.num_engines)]
        client._gather(pending, f"ipc weight sync bucket {stats['buckets']}")
        stats["bytes"] += sum(r[4] for r in meta)
        stats["buckets"] += 1
        stats["tensors"] += len(meta)
        stats["max_bucket_bytes"] = max(stats["max_bucket_bytes"], buf.numel())
        del buf
    return stats


def ipc_sync(policy_group: Any, client: Any, bucket_mb: float = 512, dtype: torch.dtype | None = None,
             strict: bool = True) -> dict:
    """Colocated step boundary: wake weights, IPC buckets from every stage's sender, finish, wake the KV cache."""
    require_ipc("ipc_sync")
    t0 = time.perf_counter()
    client.wake_up(tags=["weights"])
    client.begin_weight_update()
    try:
        parts = policy_group.run_on_all(_ipc_push, client, int(bucket_mb * 2**20), dtype)
        client.finish_weight_update(strict=strict)
    except BaseException:
        client.abort_weight_update()
        raise
    finally:
        client.wake_up(tags=["kv_cache"])
    sent = [p for p in parts if p["buckets"]]
    stats: dict[str, float] = {k: float(sum(p[k] for p in sent)) for k in ("bytes", "buckets", "tensors")}
    stats["max_bucket_bytes"] = float(max((p["max_bucket_bytes"] for p in sent), default=0))
    stats["pushing_ranks"] = float(len(sent))
    stats["seconds"] = time.perf_counter() - t0
    stats["gbps"] = stats["bytes"] / max(stats["seconds"], 1e-9) / 1e9
    return stats
