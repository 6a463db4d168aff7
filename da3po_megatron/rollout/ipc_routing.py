"""Which policy rank's CUDA-IPC handles reach which engine worker: the routing of the "ipc" weight transport, as
pure functions over GPU UUID strings and the parallel layouts (unit-tested on CPU: tests/test_ipc_routing.py).

A CUDA-IPC handle maps only on the GPU that holds the memory, so vLLM keys handles by physical GPU UUID and each
worker picks its own (``vllm/distributed/weight_transfer/ipc_engine.py:216-238``); its trainer side exports one
handle per rank and all-gathers them into one ``{uuid: handle}`` dict that the sender ships
(``ipc_engine.py:326-363, 390-401``). Here the same, for Megatron's layouts:

- every policy rank holds every bucket of the whole model in turn, whatever its TP / PP / EP rank: the IPC export
  all-gathers TP shards, broadcasts each PP stage's buckets over the PP group and each EP rank's expert buckets over
  the EP group (:func:`~da3po_megatron.rollout.ipc.ipc_buckets`), the same bucket sequence on every rank;
- every engine worker needs every tensor -- with engine TP > 1 each worker receives them whole and ``load_weights``
  keeps its shard, as in the collective transport;
- so an engine worker on GPU ``u`` is served by the policy rank on ``u`` (the lowest rank if several share it); that
  rank exports its buffer, every rank takes part in the per-bucket handle all-gather, and rank 0 merges the handles
  and ships them to every engine.

Refused, with the reason and the fix: an engine GPU without a policy rank (not colocated), two workers of one engine
on one GPU. (Experts split over several GPUs, ``parallel.expert_tensor_parallel_size`` > 1 with EP > 1, are refused
by the config checks and by :func:`~da3po_megatron.rollout.ipc.ipc_buckets`.) Mapping another GPU's memory (CUDA peer
access) is not attempted: Ray gives each actor only its own GPUs (``CUDA_VISIBLE_DEVICES``), so the other GPU is not
visible in the engine's process.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

FIX = ("the IPC transport maps memory on the same GPU only; colocate the engines with the policy "
       "(rollout.colocate=true), or use rollout.weight_transfer=bytes or collective")


@dataclass(frozen=True)
class RankPlace:
    """Where one policy rank runs: its global rank, its GPU's UUID and its TP / PP / DP (and CP) ranks."""

    rank: int
    uuid: str
    tp: int
    pp: int
    dp: int
    cp: int = 0

    @classmethod
    def of(cls, item: RankPlace | Mapping[str, Any]) -> RankPlace:
        if isinstance(item, RankPlace):
            return item
        return cls(int(item["rank"]), str(item["uuid"]), int(item["tp"]), int(item["pp"]), int(item["dp"]),
                   int(item.get("cp", 0)))


@dataclass
class IpcRoutes:
    """The plan of one layout: ``serves[rank]`` = the (engine, worker) pairs that rank's handles reach (exporters
    only), ``by_gpu`` = {GPU UUID: exporting rank}, ``shipper`` = the rank that merges the handles and ships them
    (rank 0). Every rank holds every bucket and takes part in the handle all-gather."""

    serves: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    by_gpu: dict[str, int] = field(default_factory=dict)
    shipper: int = 0

    def role(self, rank: int) -> str:
        """"ship" (merges and ships every bucket's handles; may export too), "export" or "hold" (takes part in the
        handle all-gather only)."""
        if rank == self.shipper:
            return "ship"
        return "export" if rank in self.serves else "hold"

    def exports(self, rank: int) -> bool:
        return rank in self.serves


def plan_ipc_routes(ranks: Iterable[RankPlace | Mapping[str, Any]], engines: list[list[str]]) -> IpcRoutes:
    """Route every engine worker (``engines[e][w]``: the GPU UUID of worker ``w`` of engine ``e``) to the policy rank
    on its GPU (the lowest if several). Raises ValueError naming the engine, worker and GPU when the layout cannot be
    served (see the module docstring)."""
    places = sorted((RankPlace.of(r) for r in ranks), key=lambda p: p.rank)
    if not places:
        raise ValueError("ipc weight transport: no policy ranks")
    if not engines or not all(engines):
        raise ValueError(f"ipc weight transport: every engine needs at least one worker GPU, got {engines}")
    routes = IpcRoutes(shipper=places[0].rank)
    on_gpu: dict[str, int] = {}
    for p in places:
        on_gpu.setdefault(p.uuid, p.rank)
    for e, workers in enumerate(engines):
        if len(set(workers)) != len(workers):
            raise ValueError(f"ipc weight transport: engine {e} has two workers on one GPU ({workers}); each worker "
                             "of an engine needs a GPU of its own")
        for w, uuid in enumerate(workers):
            if uuid not in on_gpu:
                raise ValueError(f"ipc weight transport: engine {e} worker {w} runs on GPU {uuid}, where no policy "
                                 "rank runs -- 'ipc' needs the engines colocated with the policy (rollout.colocate="
                                 "true, one policy rank on every engine GPU); use rollout.weight_transfer=bytes or "
                                 "collective for engines on GPUs of their own")
            rank = routes.by_gpu.setdefault(uuid, on_gpu[uuid])
            routes.serves.setdefault(rank, []).append((e, w))
    return routes


def colocated_layout(world_size: int, tp: int, pp: int, num_engines: int, cp: int = 1,
                     engine_tp: int = 1) -> tuple[list[RankPlace], list[list[str]]]:
    """The layout a colocated run will have, predicted before any actor starts: policy rank ``r`` in placement-group
    bundle ``r`` with Megatron's rank order (tp-cp-ep-dp-pp, TP fastest: ``megatron/runtime.py``), worker ``w`` of
    engine ``i`` in rank ``i x engine_tp + w``'s one-GPU bundle (``trainer/cluster/placement.py``). GPUs are named by
    bundle ("bundle r") in place of the UUIDs the actors report at the first sync."""
    if world_size % (tp * cp * pp):
        raise ValueError(f"policy world size {world_size} is not a multiple of TP x CP x PP = {tp} x {cp} x {pp}")
    dp = world_size // (tp * cp * pp)
    ranks = [RankPlace(r, f"bundle {r}", tp=r % tp, pp=r // (tp * cp * dp), dp=(r // (tp * cp)) % dp,
                       cp=(r // tp) % cp) for r in range(world_size)]
    return ranks, [[f"bundle {i * engine_tp + w}" for w in range(engine_tp)] for i in range(num_engines)]


def check_colocated_layout(world_size: int, tp: int, pp: int, num_engines: int, cp: int = 1,
                           engine_tp: int = 1) -> None:
    """The start-up refusal of a colocated layout the IPC routing cannot serve: :func:`plan_ipc_routes` -- the same
    decision the first ``ipc_sync`` takes from the actors' GPU UUIDs -- run on :func:`colocated_layout`. Raises its
    ValueError (naming engine, worker and bundle, and the fix) in milliseconds, before the run reserves or starts
    anything, instead of after start-up, a generation round and a training step."""
    plan_ipc_routes(*colocated_layout(world_size, tp, pp, num_engines, cp, engine_tp))


def merge_handles(parts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """One ``{GPU UUID: handle}`` dict from every holder's part (the all-gather's result; a holder that exports
    nothing gives ``{}``). A UUID exported twice is an error (the plan gives each GPU one exporter per stage)."""
    merged: dict[str, Any] = {}
    for part in parts:
        for uuid, handle in part.items():
            if uuid in merged:
                raise ValueError(f"ipc weight transport: two ranks exported a handle for GPU {uuid}")
            merged[uuid] = handle
    return merged


def handles_to_wire(handles: Mapping[str, Any]) -> dict[str, bytes]:
    """``{GPU UUID: reduce_tensor args}`` as ``{GPU UUID: pickled args}`` for the hop from the engine actor to vLLM's
    engine core (``rollout/engine.py`` ``ipc_load_bucket``; the inverse is :func:`handle_from_wire`, in the worker).

    An engine of TP > 1 runs its core in another process, and vLLM 0.32 msgpack-encodes a ``collective_rpc`` call's
    arguments for it (``v1/engine/core_client.py:1091-1098`` -> ``call_utility`` -> ``_send_input``'s
    ``MsgpackEncoder.encode``, ``:1001-1016``). Its ``enc_hook`` takes tensors, arrays, slices and multimodal items
    only and raises TypeError for anything else unless ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``
    (``v1/serial_utils.py:190-225``; ``envs.py:1723-1728``).
    ``reduce_tensor``'s args hold a class, a ``torch.Size`` and a ``torch.dtype`` (torch
    ``multiprocessing/reductions.py:221, 341-375``; a CPU tensor's: a class, its storage and a ``torch.Size``,
    ``:397``). Bytes cross msgpack, the mp executor's queue and Ray unchanged.

    Why bytes and not vLLM's setting: ``VLLM_ALLOW_INSECURE_SERIALIZATION`` is one process-wide switch that turns
    pickle on for every message of the engine, answers included (``serial_utils.py:211-218`` then types every
    utility answer), for the sake of one argument; and vLLM's own IPC weight transfer does the same as here when its
    handles leave the process -- it pickles them into ``ipc_handles_pickled``
    (``distributed/weight_transfer/clients.py:26-48``), though its worker unpickles them only under that switch
    (``ipc_engine.py:80-93``). The pickle comes from the trainer's own policy ranks (the same trust domain as the
    Ray call that brought it), and is unpickled only by this project's worker extension."""
    import pickle

    return {uuid: pickle.dumps(handle, protocol=pickle.HIGHEST_PROTOCOL) for uuid, handle in handles.items()}


def handle_from_wire(handle: Any) -> tuple:
    """The ``reduce_tensor`` args of one handle as :func:`handles_to_wire` sent them (bytes); a tuple or list, from a
    caller in the worker's own process (tools/gpu stand-ins, tests), is taken as it is."""
    import pickle

    return tuple(pickle.loads(handle)) if isinstance(handle, (bytes, bytearray, memoryview)) else tuple(handle)


def pick_handle(handles: Mapping[str, Any], uuid: str, where: str = "this worker") -> Any:
    """The handle for GPU ``uuid`` (a worker picks its own, as vLLM's IPC engine does, ``ipc_engine.py:222-232``);
    ValueError naming the GPUs that did get one otherwise."""
    if uuid not in handles:
        raise ValueError(f"ipc weight transport: no IPC handle for {where} on GPU {uuid}; handles came for GPUs "
                         f"{sorted(handles)} (the routing plan and the workers' GPUs disagree)")
    return handles[uuid]
