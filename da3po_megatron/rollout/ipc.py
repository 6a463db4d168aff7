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

MoE with expert parallelism (EP > 1, expert TP 1; issue 38): a rank holds every non-expert tensor but only its EP
rank's experts, and an engine worker can map only its own GPU's memory. So the experts travel in two hops, one bucket
at a time (:func:`ep_shared_buckets`): the EP ranks take turns, each packing the experts it owns into buckets of at
most ``rollout.weight_sync_bucket_mb`` and broadcasting every bucket over the policy's EP group (NCCL on GPU, gloo on
CPU: the part tested here), so every rank then holds that one bucket on its own GPU and exports it by handle like a
non-expert bucket. No rank holds more than one bucket of experts beyond its own weights, no rank gathers a layer's
experts, and every EP rank sends only the experts it owns.

GPU-only (docs/gpu_only.md, "weight sync"); the routing is pure and unit-tested on CPU. Follows vLLM's
``distributed/weight_transfer/ipc_engine.py`` (handles keyed by GPU UUID, device index rewritten on the receiver,
``ipc_collect`` after the send, 365-373) and verl's / slime's colocated refit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
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


def _ep_group(worker: Any) -> Any:
    """The policy's expert-parallel process group when this rank's model is an MoE with EP > 1, else None."""
    arch = getattr(worker, "arch", None)
    if arch is None or not getattr(arch, "is_moe", False):
        return None
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_expert_model_parallel_world_size() == 1:
        return None
    if ps.get_expert_tensor_parallel_world_size() != 1:
        raise RuntimeError("ipc weight sync: parallel.expert_tensor_parallel_size must be 1 (an expert's shards "
                           "would have to be gathered across GPUs first; use rollout.weight_transfer=bytes)")
    return ps.get_expert_model_parallel_group()


def ipc_buckets(worker: Any, bucket_bytes: int, device: torch.device, dtype: torch.dtype | None = None
                ) -> Iterator[tuple[torch.Tensor, list[list]]]:
    """The packed buckets this rank exports in an IPC sync (collective: every rank iterates to the end): its
    :func:`ipc_stream` packed as it comes, or with EP > 1 through :func:`ep_shared_buckets`."""
    from da3po_megatron.rollout.collective import iter_flat_buckets

    stream, ep_group = ipc_stream(worker), _ep_group(worker)
    if ep_group is None:
        return iter_flat_buckets(stream, bucket_bytes, device, dtype)
    return ep_shared_buckets(stream, ep_group, bucket_bytes, device, dtype)


def ipc_stream(worker: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF stream the IPC holders pack: :func:`~da3po_megatron.rollout.weight_sync.policy_hf_stream` for a dense
    model; for an MoE, every holder's non-expert tensors first, then the experts its EP rank owns (``owner_only`` is
    off: IPC needs every non-expert tensor on every GPU, not once in the world; ``experts_last``, which
    :func:`ep_shared_buckets` relies on)."""
    arch = getattr(worker, "arch", None)
    if hasattr(worker, "hf_stream") or arch is None or not getattr(arch, "is_moe", False):
        from da3po_megatron.rollout.weight_sync import policy_hf_stream

        return policy_hf_stream(worker)
    from da3po_megatron.bridge.export import export_model

    return export_model(worker.model, arch, owner_only=False, experts_last=True)


def ep_shared_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], group: Any, bucket_bytes: int,
                      device: torch.device, dtype: torch.dtype | None = None
                      ) -> Iterator[tuple[torch.Tensor, list[list]]]:
    """Collective over the EP ``group``: the same sequence of packed buckets ``(flat uint8 buffer on device, meta
    rows)`` on every EP rank, each holding the whole model's tensors once, one bucket at a time.

    ``named_tensors``: this rank's stream with every non-expert tensor first (identical on every EP rank: packed
    locally, nothing sent), then the experts this EP rank owns (:func:`ipc_stream`). The experts go round the group
    in EP-rank order: the owner packs its experts into buckets of at most ``bucket_bytes``
    (:func:`~da3po_megatron.rollout.collective.iter_flat_buckets`) and broadcasts each bucket's meta rows and
    size (``broadcast_object_list``), then its bytes (``broadcast``), ending its turn with ``None``; the other ranks
    receive into a fresh buffer of that size. Each bucket is yielded before the next is packed or received, so a
    rank holds at most one expert bucket beyond its own weights (and the owner one expert tensor of its stream),
    and every EP rank sends only the experts it owns. Every rank must iterate to the end; experts-data-parallel
    replicas (other EP groups) run the same turns concurrently with identical buckets."""
    import itertools

    import torch.distributed as dist

    from da3po_megatron.rollout.collective import chunk_key, iter_flat_buckets

    items = iter(named_tensors)
    first_expert: list[tuple[str, torch.Tensor]] = []

    def dense() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in items:
            if chunk_key(name) != -1:
                first_expert.append((name, t))
                return
            yield name, t

    yield from iter_flat_buckets(dense(), bucket_bytes, device, dtype)
    mine = itertools.chain(first_expert, items)
    me, size = dist.get_rank(group), dist.get_world_size(group)
    for owner in range(size):
        src = dist.get_global_rank(group, owner)
        if owner == me:
            for buf, meta in iter_flat_buckets(mine, bucket_bytes, device, dtype):
                for name, *_ in meta:
                    if chunk_key(name) == -1:
                        raise ValueError(f"ipc weight sync with EP: non-expert tensor {name!r} after the experts "
                                         "(the stream must give every non-expert tensor first: experts_last)")
                dist.broadcast_object_list([(meta, buf.numel())], src=src, group=group, device=device)
                dist.broadcast(buf, src=src, group=group)
                yield buf, meta
                del buf  # not held while the next bucket is packed
            dist.broadcast_object_list([None], src=src, group=group, device=device)
            continue
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=src, group=group, device=device)
            if box[0] is None:
                break
            meta, nbytes = box[0]
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            dist.broadcast(buf, src=src, group=group)
            yield buf, meta
            del buf  # not held while the next bucket is allocated


def ipc_bucket_plan(worker: Any, bucket_bytes: int, device: str = "cpu", dtype: torch.dtype | None = None) -> dict:
    """On every policy rank (``PolicyGroup.run_on_all``): the buckets this rank would export in an IPC sync, packed
    on ``device`` -- any device, so the part of the IPC transport that decides what every GPU holds (the stream and
    :func:`ep_shared_buckets` over the EP group) runs on CPU / gloo too. Returns ``{"buckets": [[names], ...],
    "nbytes": [...], "sha256": {hf_name: digest of its bytes}}``; nothing is exported or sent to an engine."""
    import hashlib

    from da3po_megatron.rollout.collective import unpack_flat

    out: dict[str, Any] = {"buckets": [], "nbytes": [], "sha256": {}}
    for buf, meta in ipc_buckets(worker, bucket_bytes, torch.device(device), dtype):
        out["buckets"].append([r[0] for r in meta])
        out["nbytes"].append(int(buf.numel()))
        for name, t in unpack_flat(buf, meta).items():
            out["sha256"][name] = hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
    return out


def _ipc_push(worker: Any, client: Any, bucket_bytes: int, dtype: torch.dtype | None, routes: Any) -> dict:
    """On every policy rank: the holders of a stage pack its buckets; per bucket the routed ranks export theirs, the
    holders all-gather the handles over their DP group (only when a stage has several holders), the stage's sender
    ships the merged handles to every engine, and all holders pass a barrier before the buffer goes."""
    import torch.distributed as dist
    from torch.multiprocessing.reductions import reduce_tensor

    from da3po_megatron.rollout.ipc_routing import merge_handles

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    role = routes.role(rank)
    stats = {"bytes": 0, "buckets": 0, "tensors": 0, "max_bucket_bytes": 0}
    if role is None:  # TP rank != 0: take part in the export's gathers, hold nothing
        for _ in ipc_stream(worker):
            pass
        return stats
    require_ipc("policy sender")
    stage = int(getattr(worker, "pp_rank", 0))
    group = getattr(worker, "dp_group", None) if len(routes.holders[stage]) > 1 else None
    uuid = gpu_uuid()
    device = _cuda_device()
    for buf, meta in ipc_buckets(worker, bucket_bytes, device, dtype):
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
             strict: bool = True, before_wake: Callable[[], Any] | None = None,
             before_kv_wake: Callable[[], Any] | None = None) -> dict:
    """Colocated step boundary: route, wake weights, IPC buckets of every stage to every engine, finish, wake the
    KV cache. A layout the routing refuses raises ValueError before any engine is touched. ``before_wake`` /
    ``before_kv_wake``: the policy's ``actor.offload`` steps (gradients + optimizer state before the weights wake,
    parameters before the KV cache wakes: ``trainer/colocation.py`` OffloadCycle)."""
    from da3po_megatron.rollout.ipc_routing import plan_ipc_routes

    require_ipc("ipc_sync")
    t0 = time.perf_counter()
    routes = plan_ipc_routes(policy_group.run_on_all(_ipc_place), client.call_all("worker_gpu_uuids"))
    if before_wake is not None:
        before_wake()
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
        if before_kv_wake is not None:
            before_kv_wake()
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
