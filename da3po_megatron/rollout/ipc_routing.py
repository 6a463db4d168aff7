"""Which policy rank's CUDA-IPC handles reach which engine worker: the routing of the "ipc" weight transport, as
pure functions over GPU UUID strings and the parallel layouts (unit-tested on CPU: tests/test_ipc_routing.py).

A CUDA-IPC handle maps only on the GPU that holds the memory, so vLLM keys handles by physical GPU UUID and each
worker picks its own (``vllm/distributed/weight_transfer/ipc_engine.py:216-238``); its trainer side exports one
handle per rank and all-gathers them into one ``{uuid: handle}`` dict that the sender ships
(``ipc_engine.py:326-363, 390-401``). Here the same, for Megatron's layouts:

- every engine worker needs every PP stage's full tensors -- with engine TP > 1 each worker receives them whole and
  ``load_weights`` keeps its shard, as in the collective transport;
- the bridge's export gathers a stage's TP shards on **TP rank 0 of every DP replica**
  (:func:`~da3po_megatron.bridge.export.export_policy`), so the ranks that hold stage ``s`` in full are its
  TP-rank-0 ranks (one per DP replica);
- so an engine worker on GPU ``u`` is served, for each stage ``s``, by a holder of ``s`` that runs on ``u`` (the
  lowest DP rank if several); that rank exports its buffers, the other holders of ``s`` only take part in the
  per-bucket handle all-gather; the stage's sender (TP rank 0 of DP replica 0,
  :func:`~da3po_megatron.rollout.weight_sync.sender_stage`) merges the handles and ships them to every engine.

Refused, with the reason and the fix: an engine GPU without a policy rank (not colocated), an engine GPU whose
policy rank holds no full copy of some stage (policy TP > 1 puts TP ranks != 0 on engine GPUs, PP > 1 puts one stage
per GPU -- both need ``rollout.weight_transfer=bytes`` or policy TP = PP = 1 with data parallelism only), two workers
of one engine on one GPU. Mapping another GPU's memory (CUDA peer access) is not attempted: Ray gives each actor
only its own GPUs (``CUDA_VISIBLE_DEVICES``), so the other GPU is not visible in the engine's process.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

FIX = ("the IPC transport maps memory on the same GPU only; run the policy with tensor_model_parallel_size = "
       "pipeline_model_parallel_size = 1 (data parallelism only) for rollout.weight_transfer=ipc, or use "
       "rollout.weight_transfer=bytes")


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
    only), ``by_stage[s]`` = {GPU UUID: exporting rank}, ``shippers[s]`` = the rank that merges and ships stage s,
    ``holders[s]`` = every rank holding stage s in full (the all-gather group: the TP-rank-0 ranks of stage s)."""

    serves: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    by_stage: dict[int, dict[str, int]] = field(default_factory=dict)
    shippers: dict[int, int] = field(default_factory=dict)
    holders: dict[int, list[int]] = field(default_factory=dict)

    def role(self, rank: int) -> str | None:
        """"ship" (merges and ships its stage's handles; may export too), "export", "hold" (takes part in the
        gather only) or None (holds no full tensors: only iterates the export)."""
        if rank in self.shippers.values():
            return "ship"
        if rank in self.serves:
            return "export"
        if any(rank in h for h in self.holders.values()):
            return "hold"
        return None

    def exports(self, rank: int) -> bool:
        return rank in self.serves


def plan_ipc_routes(ranks: Iterable[RankPlace | Mapping[str, Any]], engines: list[list[str]]) -> IpcRoutes:
    """Route every engine worker (``engines[e][w]``: the GPU UUID of worker ``w`` of engine ``e``) to, per PP
    stage, the policy rank on its GPU that holds the stage in full. Raises ValueError naming the engine, worker, GPU,
    stage and ranks when the layout cannot be served (see the module docstring)."""
    places = sorted((RankPlace.of(r) for r in ranks), key=lambda p: p.rank)
    if not places:
        raise ValueError("ipc weight transport: no policy ranks")
    if not engines or not all(engines):
        raise ValueError(f"ipc weight transport: every engine needs at least one worker GPU, got {engines}")
    stages = sorted({p.pp for p in places})
    if stages != list(range(len(stages))):
        raise ValueError(f"ipc weight transport: policy ranks report PP stages {stages}, expected 0..{len(stages) - 1}")
    routes = IpcRoutes()
    for s in stages:
        holders = [p for p in places if p.pp == s and p.tp == 0 and p.cp == 0]
        shipper = [p for p in holders if p.dp == 0]
        if len(shipper) != 1:
            raise ValueError(f"ipc weight transport: PP stage {s} needs exactly one rank with TP rank 0 and DP rank 0 "
                             f"(its sender), got ranks {[p.rank for p in shipper]}")
        routes.shippers[s] = shipper[0].rank
        routes.holders[s] = [p.rank for p in holders]
        routes.by_stage[s] = {}
    on_gpu: dict[str, list[RankPlace]] = {}
    for p in places:
        on_gpu.setdefault(p.uuid, []).append(p)
    for e, workers in enumerate(engines):
        if len(set(workers)) != len(workers):
            raise ValueError(f"ipc weight transport: engine {e} has two workers on one GPU ({workers}); each worker "
                             "of an engine needs a GPU of its own")
        for w, uuid in enumerate(workers):
            here = on_gpu.get(uuid, [])
            if not here:
                raise ValueError(f"ipc weight transport: engine {e} worker {w} runs on GPU {uuid}, where no policy "
                                 "rank runs -- 'ipc' needs the engines colocated with the policy (rollout.colocate="
                                 "true, one policy rank on every engine GPU); use rollout.weight_transfer=bytes or "
                                 "collective for engines on GPUs of their own")
            for s in stages:
                full = sorted((p for p in here if p.pp == s and p.tp == 0 and p.cp == 0), key=lambda p: p.dp)
                if not full:
                    have = ", ".join(f"rank {p.rank} (TP rank {p.tp}, PP stage {p.pp})" for p in here)
                    raise ValueError(f"ipc weight transport: engine {e} worker {w} on GPU {uuid} needs PP stage {s}'s "
                                     f"full tensors, but the policy rank(s) on that GPU -- {have} -- hold none (only "
                                     f"TP rank 0 of a stage gathers it in full); {FIX}")
                rank = routes.by_stage[s].setdefault(uuid, full[0].rank)
                routes.serves.setdefault(rank, []).append((e, w))
    return routes


def colocated_layout(world_size: int, tp: int, pp: int, num_engines: int,
                     cp: int = 1) -> tuple[list[RankPlace], list[list[str]]]:
    """The layout a colocated run will have, predicted before any actor starts: policy rank ``r`` in placement-group
    bundle ``r`` with Megatron's rank order (tp-cp-ep-dp-pp, TP fastest: ``megatron/runtime.py``), engine ``i`` in
    rank ``i``'s one-GPU bundle (``trainer/placement.py``: colocated engines have TP = 1). GPUs are named by bundle
    ("bundle r") in place of the UUIDs the actors report at the first sync."""
    if world_size % (tp * cp * pp):
        raise ValueError(f"policy world size {world_size} is not a multiple of TP x CP x PP = {tp} x {cp} x {pp}")
    dp = world_size // (tp * cp * pp)
    ranks = [RankPlace(r, f"bundle {r}", tp=r % tp, pp=r // (tp * cp * dp), dp=(r // (tp * cp)) % dp,
                       cp=(r // tp) % cp) for r in range(world_size)]
    return ranks, [[f"bundle {i}"] for i in range(num_engines)]


def check_colocated_layout(world_size: int, tp: int, pp: int, num_engines: int, cp: int = 1) -> None:
    """The start-up refusal of a colocated layout the IPC routing cannot serve: :func:`plan_ipc_routes` -- the same
    decision the first ``ipc_sync`` takes from the actors' GPU UUIDs -- run on :func:`colocated_layout`. Raises its
    ValueError (naming engine, bundle, stage and ranks, and the fix) in milliseconds, before the run reserves or
    starts anything, instead of after start-up, a generation round and a training step."""
    plan_ipc_routes(*colocated_layout(world_size, tp, pp, num_engines, cp))


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


def pick_handle(handles: Mapping[str, Any], uuid: str, where: str = "this worker") -> Any:
    """The handle for GPU ``uuid`` (a worker picks its own, as vLLM's IPC engine does, ``ipc_engine.py:222-232``);
    ValueError naming the GPUs that did get one otherwise."""
    if uuid not in handles:
        raise ValueError(f"ipc weight transport: no IPC handle for {where} on GPU {uuid}; handles came for GPUs "
                         f"{sorted(handles)} (the routing plan and the workers' GPUs disagree)")
    return handles[uuid]
