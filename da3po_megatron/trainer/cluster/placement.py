"""Where every policy rank and vLLM engine runs: resources resolved from the config and the Ray cluster, checked and
planned in the driver before any actor starts, then reserved as placement groups whose bundles are pinned to nodes.

Pure functions first (tested without Ray, ``tests/test_placement.py``):

- :func:`resolve_gpus`: GPUs per policy rank and per engine. ``ray.num_gpus_per_policy_rank`` / ``num_gpus_per_engine``
  unset (None) = 1 per rank and ``rollout.tensor_parallel_size`` per engine when the cluster has GPUs, 0 without.
  A cluster with GPUs whose actors would get none is refused unless ``ray.device=cpu`` says so: a 0-GPU Ray actor
  beside GPU actors keeps ``CUDA_VISIBLE_DEVICES`` unset (measured, Ray 2.60 on logical GPUs) and sees every GPU of
  its node, so all such ranks would pick ``cuda:0``.
- :func:`plan_placement`: the whole layout or a :class:`PlacementError` naming the numbers and the setting to change.
  The policy's ranks are placed in blocks of :func:`node_block` consecutive ranks, each block whole on one node,
  first fit over the nodes in order (the driver's node first). For a dense model a block is a TP group
  (``tensor_model_parallel_size`` consecutive ranks: Megatron's rank order is TP fastest), so a TP group never
  straddles nodes (its all-reduces run every layer); PP stages and DP replicas may. With experts (MoE) a block is
  lcm(TP, EP x ETP) ranks, so the expert groups stay inside a node too (the dispatcher's all-to-alls run twice per
  MoE layer), unless ``ray.expert_groups_across_nodes`` says otherwise. ``ray.spread_policy_nodes`` puts each block
  on a node of its own. Engines follow ``rollout.engine_placement``: ``other_nodes`` (only nodes without
  policy ranks: the paper's layout, engines on the second node), ``same_nodes`` (only nodes with policy ranks), or
  ``any``. Colocated (``rollout.colocate``): an engine of TP 1 shares policy rank i's one-GPU bundle, each taking
  half of it (Ray gives both the same GPU id); an engine of TP T > 1 (issue 49) spans the bundles of ranks
  i T .. i T + T - 1, which must lie on one node: its actor sits in bundle i T with no Ray GPU of its own, and its
  ``CUDA_VISIBLE_DEVICES`` is set to the GPU ids Ray gave those policy ranks (:func:`colocated_engine_envs`; never
  local indices: the engines would land on the wrong GPUs), so vLLM's mp executor runs its T workers on the GPUs of
  the ranks they share. At most world_size / T engines, 1 GPU per rank; on GPUs with the IPC weight transport also
  a layout it can serve (:func:`check_colocated_ipc`).

Then the Ray side (:func:`cluster_nodes`, :func:`reserve`): one placement group for the policy (bundle i = rank i) and
one for the engines (bundle i = engine i; none when colocated), each bundle pinned to its planned node with the node-id
label (``bundle_label_selector``, Ray 2.60 ``ray/util/placement_group.py:128-216``; ``NODE_ID_LABEL_KEY`` line 22).
Waiting for them has a timeout (``ray.placement_timeout_s``) whose error names the pending bundles and their nodes.

Device decisions (:func:`probe_devices`): one Ray task in policy bundle 0 and one in engine bundle 0, with the same
GPU request as the actor that will run there, report what that actor will see (CUDA, its GPU ids, device memory,
the layer spec). The KV-cache size, the sleep mode, the collective backend, the transport and the memory preflight
are taken from those answers; the driver itself never initialises CUDA.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

ENGINE_PLACEMENTS = ("any", "same_nodes", "other_nodes")
DEVICES = ("auto", "gpu", "cpu")


class PlacementError(ValueError):
    """The run cannot be placed on this Ray cluster (the message names the numbers and the setting to change)."""


@dataclass(frozen=True)
class Node:
    """One Ray node's total resources."""

    node_id: str
    host: str
    cpus: float
    gpus: float


@dataclass(frozen=True)
class Resources:
    """What the run asks for, per actor (resolved: no None)."""

    world_size: int
    tp: int
    cpus_per_rank: float
    gpus_per_rank: float
    num_engines: int
    cpus_per_engine: float
    gpus_per_engine: float
    engine_placement: str = "any"
    colocate: bool = False
    spread_policy: bool = False
    device: str = "cpu"  # what resolve_gpus decided: "gpu" or "cpu"
    pp: int = 1  # parallel.pipeline_model_parallel_size, context_parallel_size: the colocated IPC check
    cp: int = 1
    weight_transfer: str = "auto"  # rollout.weight_transfer
    ep: int = 1  # parallel.expert_model_parallel_size, expert_tensor_parallel_size (None = TP): the node blocks
    etp: int | None = None
    expert_across_nodes: bool = False  # ray.expert_groups_across_nodes: blocks of TP ranks only
    engine_tp: int = 1  # rollout.tensor_parallel_size: a colocated engine spans that many policy ranks' bundles

    @property
    def block(self) -> int:
        """Consecutive policy ranks placed whole on one node (:func:`node_block`)."""
        return node_block(self.tp, self.ep, self.etp, self.expert_across_nodes)

    @property
    def total_gpus(self) -> float:
        return self.world_size * self.gpus_per_rank + (0 if self.colocate else self.num_engines * self.gpus_per_engine)

    @property
    def total_cpus(self) -> float:
        return self.world_size * self.cpus_per_rank + self.num_engines * self.cpus_per_engine


@dataclass
class Plan:
    """The layout: node index of every rank and engine, the bundles to reserve and each actor's own request."""

    nodes: list[Node]
    need: Resources
    rank_node: list[int]
    engine_node: list[int]
    policy_bundles: list[dict[str, float]] = field(default_factory=list)
    engine_bundles: list[dict[str, float]] = field(default_factory=list)  # empty when colocated

    @property
    def rank_gpus(self) -> float:
        """GPUs each policy actor requests (half of its bundle's one GPU when colocated)."""
        n = self.need
        return n.gpus_per_rank / 2 if n.colocate and n.gpus_per_rank else n.gpus_per_rank

    @property
    def engine_gpus(self) -> float:
        """Ray GPUs each engine actor requests: half its rank's GPU when colocated at engine TP 1, none at TP > 1
        (its ``CUDA_VISIBLE_DEVICES`` names its ranks' GPUs: :func:`colocated_engine_envs`)."""
        n = self.need
        if n.colocate and n.gpus_per_rank:
            return n.gpus_per_rank / 2 if n.engine_tp == 1 else 0.0
        return n.gpus_per_engine

    @property
    def engine_bundle_stride(self) -> int:
        """Engine i sits in bundle ``i x stride`` of its placement group (colocated: rank i x engine TP's)."""
        return self.need.engine_tp if self.need.colocate else 1

    def host(self, node_index: int) -> str:
        return self.nodes[node_index].host

    def describe(self) -> str:
        def runs(kind: str, nodes: list[int]) -> str:
            parts, start = [], 0
            for i in range(1, len(nodes) + 1):
                if i == len(nodes) or nodes[i] != nodes[start]:
                    ids = f"{kind} {start}" if i - 1 == start else f"{kind}s {start}-{i - 1}"
                    parts.append(f"{ids} on {self.host(nodes[start])}")
                    start = i
            return ", ".join(parts)

        n = self.need
        how = f"colocated with policy ranks 0..{n.num_engines * n.engine_tp - 1}" + (
            f", {n.engine_tp} per engine" if n.engine_tp > 1 else "") if n.colocate else \
            f"rollout.engine_placement={n.engine_placement}"
        blocks = f"TP groups of {n.tp}" if n.block == n.tp else \
            f"blocks of {n.block} ranks (TP {n.tp}, EP {n.ep} x ETP {n.tp if n.etp is None else n.etp})"
        return (f"plan: {runs('policy rank', self.rank_node)} ({self.rank_gpus:g} GPU, {n.cpus_per_rank:g} CPU each, "
                f"{blocks} on one node); {runs('engine', self.engine_node)} ({self.engine_gpus:g} GPU, "
                f"{n.cpus_per_engine:g} CPU each, {how})")


# ------------------------------------------------------------------------------------------------- pure decisions
def node_block(tp: int, ep: int = 1, etp: int | None = None, expert_across_nodes: bool = False) -> int:
    """How many consecutive policy ranks must share a node: lcm(TP, EP x ETP) (ETP None = TP).

    Megatron-core 0.16.1 numbers ranks in the order ``tp-cp-ep-dp-pp`` (``initialize_model_parallel``'s default,
    ``megatron/core/parallel_state.py:562``), TP fastest: a TP group is TP consecutive ranks. The experts get their
    own rank generator over the same world with ``tp`` = ETP, ``ep`` = EP and ``dp`` = the expert-data-parallel size
    in that order (``parallel_state.py:798-806``; groups cut by ``RankGenerator.get_ranks``, 506-520), so rank =
    etp + ETP x (ep + EP x (edp + EDP x pp)): an EP group (fixed ETP rank, expert-DP rank and stage) and the ETP
    groups beside it lie in EP x ETP consecutive ranks starting at a multiple of EP x ETP. Blocks of lcm(TP, EP x
    ETP) ranks from rank 0 therefore hold whole TP groups and whole EP / ETP groups. For a dense model (EP = 1,
    ETP = TP) the block is the TP group. ``expert_across_nodes`` (``ray.expert_groups_across_nodes``): blocks of TP
    ranks only, the expert groups may straddle nodes (their all-to-alls then cross the network)."""
    etp = tp if etp is None else etp
    if expert_across_nodes or ep * etp <= 1:
        return tp
    return math.lcm(tp, ep * etp)


def resolve_gpus(device: str, gpus_per_rank: float | None, gpus_per_engine: float | None, engine_tp: int,
                 cluster_gpus: float, colocate: bool = False) -> tuple[float, float, str]:
    """(GPUs per policy rank, GPUs per engine, "gpu" | "cpu") for the ``ray`` section's settings on a cluster with
    ``cluster_gpus`` GPUs. ``device``: ``ray.device`` (auto = gpu when the cluster has GPUs)."""
    if device not in DEVICES:
        raise PlacementError(f"ray.device must be one of {DEVICES}, got {device!r}")
    use = ("gpu" if cluster_gpus > 0 else "cpu") if device == "auto" else device
    if use == "gpu" and cluster_gpus <= 0:
        raise PlacementError("ray.device=gpu but the Ray cluster has no GPUs: request them from Slurm (sbatch "
                             "--gpus-per-node=N; slurm/ray_on_slurm.sh gives Ray what the allocation has) or set "
                             "ray.device=cpu")
    if use == "cpu":
        given = [f"ray.{k}={v:g}" for k, v in (("num_gpus_per_policy_rank", gpus_per_rank),
                                                ("num_gpus_per_engine", gpus_per_engine)) if v]
        if given:
            raise PlacementError(f"ray.device=cpu with {', '.join(given)}: contradictory; leave them unset for CPU "
                                 "actors, or set ray.device=gpu (or auto on a cluster with GPUs)")
        return 0.0, 0.0, "cpu"
    rank = 1.0 if gpus_per_rank is None else float(gpus_per_rank)
    if colocate:
        if gpus_per_engine is not None and float(gpus_per_engine) != rank:
            raise PlacementError(f"ray.num_gpus_per_engine={gpus_per_engine:g} with rollout.colocate=true: a colocated "
                                 "engine shares its policy rank's one GPU (half each); leave ray.num_gpus_per_engine "
                                 "unset")
        engine = rank
    else:
        engine = float(engine_tp) if gpus_per_engine is None else float(gpus_per_engine)
    for name, v in (("num_gpus_per_policy_rank", rank), ("num_gpus_per_engine", engine)):
        if v <= 0:
            who = "policy ranks" if name.endswith("rank") else "engines"
            raise PlacementError(
                f"the Ray cluster has {cluster_gpus:g} GPUs but ray.{name}={v:g} gives the {who} none: they would "
                "compute on CPU, or (Ray leaves CUDA_VISIBLE_DEVICES unset for a 0-GPU actor) see every GPU of their "
                f"node and all use cuda:0. Leave ray.{name} unset (auto: "
                f"{'1' if who == 'policy ranks' else 'rollout.tensor_parallel_size'}), or set ray.device=cpu to run "
                "on CPU on purpose")
    return rank, engine, "gpu"


def _fmt_nodes(nodes: Sequence[Node], what: str) -> str:
    return ", ".join(f"{n.host} {getattr(n, what):g}" for n in nodes)


def check_totals(need: Resources, nodes: Sequence[Node]) -> None:
    """PlacementError when the whole cluster has fewer GPUs or CPUs than the run asks for."""
    for res, total, attr in (("GPU", need.total_gpus, "gpus"), ("CPU", need.total_cpus, "cpus")):
        have = sum(getattr(n, attr) for n in nodes)
        if total <= have + 1e-9:
            continue
        if res == "GPU":
            parts = f"policy {need.world_size} ranks x {need.gpus_per_rank:g} (ray.num_gpus_per_policy_rank)"
            if not need.colocate:
                parts += (f" + engines {need.num_engines} x {need.gpus_per_engine:g} (ray.num_gpus_per_engine, "
                          "default rollout.tensor_parallel_size)")
            fix = ("request more GPUs (sbatch --nodes / --gpus-per-node) or lower parallel.data_parallel_size, "
                   "parallel.tensor_model_parallel_size or rollout.num_engines")
        else:
            parts = (f"policy {need.world_size} ranks x {need.cpus_per_rank:g} (ray.num_cpus_per_policy_rank) + "
                     f"engines {need.num_engines} x {need.cpus_per_engine:g} (rollout.num_cpus_per_engine)")
            fix = "request more CPUs per node or lower ray.num_cpus_per_policy_rank / rollout.num_cpus_per_engine"
        raise PlacementError(f"the run needs {total:g} {res}s ({parts}) but the Ray cluster has {have:g} "
                             f"({len(nodes)} node(s): {_fmt_nodes(nodes, attr)}); {fix}")


def check_colocated_ipc(need: Resources) -> None:
    """The one gate of the colocated IPC layout rule. ``rollout.weight_transfer`` ipc (or auto, colocated on GPUs)
    syncs through CUDA IPC (``weight_sync.choose_transport``), which maps memory on the same GPU only: every engine
    GPU must hold a policy rank (``ipc_routing.check_colocated_layout``: the routing decision of the first sync, on
    the layout the plan will reserve). Called before Ray starts for an explicit 'ipc' (``bringup.preflight``, with
    :func:`ipc_layout`) and at planning for auto on GPUs (:func:`plan_placement`): a PlacementError (exit 2) in
    seconds rather than a failure at the first weight sync. (Until issue 56 the explicit case was a second gate in
    the config checks, which made the config layer import rollout.)"""
    from da3po_megatron.rollout.ipc_routing import check_colocated_layout

    try:
        check_colocated_layout(need.world_size, need.tp, need.pp, need.num_engines, need.cp, need.engine_tp)
    except ValueError as e:
        raise PlacementError(f"rollout.weight_transfer={need.weight_transfer} with rollout.colocate=true syncs the "
                             f"weights through CUDA IPC, which this layout cannot serve: {need.world_size} policy "
                             f"ranks (TP={need.tp}, PP={need.pp}), {need.num_engines} engine(s) of TP "
                             f"{need.engine_tp} in policy ranks 0..{need.num_engines * need.engine_tp - 1}'s "
                             f"bundles: {e}") from None


def ipc_layout(cfg: Any) -> Resources:
    """The layout of a run config as :func:`check_colocated_ipc` reads it, before any cluster is known (one GPU per
    rank and engine worker, as colocation places them; nothing else of the resources is resolved)."""
    r, p = cfg.rollout, cfg.parallel
    return Resources(world_size=cfg.policy_world_size, tp=p.tensor_model_parallel_size, cpus_per_rank=0.0,
                     gpus_per_rank=1.0, num_engines=r.num_engines, cpus_per_engine=0.0, gpus_per_engine=1.0,
                     colocate=r.colocate, device="gpu", pp=p.pipeline_model_parallel_size,
                     cp=p.context_parallel_size, weight_transfer=r.weight_transfer, engine_tp=r.tensor_parallel_size)


def plan_placement(need: Resources, nodes: Sequence[Node]) -> Plan:
    """Place every TP group on one node and every engine on a node its placement allows (first fit, nodes in the
    given order), or raise PlacementError naming what did not fit and where."""
    nodes = list(nodes)
    if not nodes:
        raise PlacementError("the Ray cluster has no alive node")
    if need.world_size % need.tp:
        raise PlacementError(f"policy world size {need.world_size} is not a multiple of "
                             f"parallel.tensor_model_parallel_size={need.tp}")
    if need.engine_placement not in ENGINE_PLACEMENTS:
        raise PlacementError(f"rollout.engine_placement must be one of {ENGINE_PLACEMENTS}, got "
                             f"{need.engine_placement!r}")
    if need.colocate:
        if need.engine_placement == "other_nodes":
            raise PlacementError("rollout.colocate=true with rollout.engine_placement=other_nodes: colocated engines "
                                 "share the policy's GPUs; set rollout.engine_placement=any or same_nodes")
        if need.num_engines * need.engine_tp > need.world_size:
            raise PlacementError(f"rollout.colocate=true with rollout.num_engines={need.num_engines} x "
                                 f"rollout.tensor_parallel_size={need.engine_tp} > {need.world_size} policy ranks: "
                                 "each engine worker shares one policy rank's GPU; use at most "
                                 f"{need.world_size // need.engine_tp} engines")
        if need.gpus_per_rank not in (0, 1):
            raise PlacementError(f"rollout.colocate=true with ray.num_gpus_per_policy_rank={need.gpus_per_rank:g}: "
                                 "colocation shares one GPU between rank i and engine i; use 1")
        if need.device == "gpu" and need.gpus_per_engine != need.gpus_per_rank:
            raise PlacementError("rollout.colocate=true: each engine worker shares one policy rank's GPU; leave "
                                 "ray.num_gpus_per_engine unset")
        if need.device == "gpu" and need.weight_transfer in ("auto", "ipc"):
            check_colocated_ipc(need)
    check_totals(need, nodes)
    free_cpu = [n.cpus for n in nodes]
    free_gpu = [n.gpus for n in nodes]
    eps = 1e-9
    rank_node: list[int] = []
    block = need.block  # TP, or lcm(TP, EP x ETP) with experts (node_block)
    etp = need.tp if need.etp is None else need.etp
    if need.world_size % block:
        raise PlacementError(f"policy world size {need.world_size} is not a multiple of lcm(parallel.tensor_model_"
                             f"parallel_size={need.tp}, parallel.expert_model_parallel_size={need.ep} x "
                             f"parallel.expert_tensor_parallel_size={etp}) = {block}")
    kind = "TP group" if block == need.tp else "rank block"
    engine_cpu_of_rank = [need.cpus_per_engine if need.colocate and r < need.num_engines * need.engine_tp
                          and r % need.engine_tp == 0 else 0.0 for r in range(need.world_size)]
    used_for_policy: list[int] = []
    for g in range(need.world_size // block):
        ranks = range(g * block, (g + 1) * block)
        cpu = sum(need.cpus_per_rank + engine_cpu_of_rank[r] for r in ranks)
        gpu = block * need.gpus_per_rank
        order = list(range(len(nodes)))
        if need.spread_policy:
            order = [i for i in order if i not in used_for_policy]
        fit = next((i for i in order if free_cpu[i] + eps >= cpu and free_gpu[i] + eps >= gpu), None)
        if fit is None:
            where = (f"a node without another {kind} (ray.spread_policy_nodes=true)" if need.spread_policy
                     else "a node")
            free = ", ".join(f"{n.host} {free_gpu[i]:g} GPU {free_cpu[i]:g} CPU" for i, n in enumerate(nodes))
            if block == need.tp:
                raise PlacementError(
                    f"policy TP group {g} (ranks {ranks.start}-{ranks.stop - 1}: {gpu:g} GPUs, {cpu:g} CPUs on one "
                    f"node, parallel.tensor_model_parallel_size={need.tp}) does not fit on {where}; free after the "
                    f"groups before it: {free}. A TP group must not straddle nodes: use a TP size that divides the "
                    "GPUs per node, or more nodes")
            raise PlacementError(
                f"policy rank block {g} (ranks {ranks.start}-{ranks.stop - 1}: {gpu:g} GPUs, {cpu:g} CPUs on one "
                f"node) does not fit on {where}; free after the blocks before it: {free}. The block holds whole TP "
                f"groups (parallel.tensor_model_parallel_size={need.tp}) and whole expert groups (parallel."
                f"expert_model_parallel_size={need.ep} x parallel.expert_tensor_parallel_size={etp}): lcm = {block} "
                "consecutive ranks in Megatron's rank order, kept on one node so that the MoE dispatcher's "
                "all-to-alls stay off the network. Use an EP x ETP whose lcm with TP divides the GPUs per node, "
                "or set ray.expert_groups_across_nodes=true to let the expert groups straddle nodes (docs/moe.md)")
        free_cpu[fit] -= cpu
        free_gpu[fit] -= gpu
        used_for_policy.append(fit)
        rank_node += [fit] * block
    engine_node: list[int] = []
    if need.colocate:
        for e in range(need.num_engines):
            on = sorted({rank_node[r] for r in range(e * need.engine_tp, (e + 1) * need.engine_tp)})
            if len(on) > 1:
                raise PlacementError(
                    f"colocated engine {e} (rollout.tensor_parallel_size={need.engine_tp}) would span policy ranks "
                    f"{e * need.engine_tp}-{(e + 1) * need.engine_tp - 1} on nodes "
                    f"{[nodes[i].host for i in on]}: an engine's workers run on one node; use an engine TP that "
                    "divides the policy's ranks per node")
            engine_node.append(on[0])
    else:
        policy_nodes = set(rank_node)
        allowed = [i for i in range(len(nodes)) if
                   need.engine_placement == "any"
                   or (need.engine_placement == "other_nodes") == (i not in policy_nodes)]
        for e in range(need.num_engines):
            fit = next((i for i in allowed if free_cpu[i] + eps >= need.cpus_per_engine
                        and free_gpu[i] + eps >= need.gpus_per_engine), None)
            if fit is None:
                names = [nodes[i].host for i in allowed] or "none"
                raise PlacementError(
                    f"engine {e} ({need.gpus_per_engine:g} GPUs, {need.cpus_per_engine:g} CPUs on one node) does not "
                    f"fit: rollout.engine_placement={need.engine_placement} allows nodes {names}; free there after "
                    f"the policy and engines 0-{e - 1}: "
                    f"{', '.join(f'{nodes[i].host} {free_gpu[i]:g} GPU {free_cpu[i]:g} CPU' for i in allowed) or '-'}"
                    f" (policy on {sorted({nodes[i].host for i in policy_nodes})}). Request more nodes/GPUs, lower "
                    "rollout.num_engines, or change rollout.engine_placement")
            free_cpu[fit] -= need.cpus_per_engine
            free_gpu[fit] -= need.gpus_per_engine
            engine_node.append(fit)

    def bundle(cpu: float, gpu: float) -> dict[str, float]:
        return {"CPU": float(cpu), **({"GPU": float(gpu)} if gpu else {})}

    policy_bundles = [bundle(need.cpus_per_rank + engine_cpu_of_rank[r], need.gpus_per_rank)
                      for r in range(need.world_size)]
    engine_bundles = [] if need.colocate else [bundle(need.cpus_per_engine, need.gpus_per_engine)
                                               for _ in range(need.num_engines)]
    return Plan(nodes, need, rank_node, engine_node, policy_bundles, engine_bundles)


def resources_for_config(cfg: Any, cluster_gpus: float) -> Resources:
    """The :class:`Resources` of a run config on a cluster with ``cluster_gpus`` GPUs (see :func:`resolve_gpus`)."""
    r, ray_cfg = cfg.rollout, cfg.ray
    rank_gpus, engine_gpus, device = resolve_gpus(ray_cfg.device, ray_cfg.num_gpus_per_policy_rank,
                                                  ray_cfg.num_gpus_per_engine, r.tensor_parallel_size, cluster_gpus,
                                                  colocate=r.colocate)
    return Resources(world_size=cfg.policy_world_size, tp=cfg.parallel.tensor_model_parallel_size,
                     cpus_per_rank=float(ray_cfg.num_cpus_per_policy_rank), gpus_per_rank=rank_gpus,
                     num_engines=r.num_engines, cpus_per_engine=float(r.num_cpus_per_engine),
                     gpus_per_engine=engine_gpus, engine_placement=r.engine_placement, colocate=r.colocate,
                     spread_policy=ray_cfg.spread_policy_nodes, device=device,
                     pp=cfg.parallel.pipeline_model_parallel_size, cp=cfg.parallel.context_parallel_size,
                     weight_transfer=r.weight_transfer, ep=cfg.parallel.expert_model_parallel_size,
                     etp=cfg.parallel.expert_tensor_parallel_size,
                     expert_across_nodes=ray_cfg.expert_groups_across_nodes, engine_tp=r.tensor_parallel_size)


def colocated_engine_envs(plan: Plan, rank_locations: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """Per colocated engine of TP T > 1, the environment that puts its workers on its policy ranks' GPUs:
    ``CUDA_VISIBLE_DEVICES`` = the GPU ids Ray gave ranks i T .. i T + T - 1 (``rank_locations``: each rank's
    :func:`~da3po_megatron.trainer.cluster.placement_ray.actor_location`, in rank order), in rank order -- Ray's ids,
    the ones Ray itself writes into a GPU actor's ``CUDA_VISIBLE_DEVICES``, never local indices (vime PR #144: engines
    on the wrong GPUs). ``[]`` where nothing is to set (not colocated, engine TP 1, CPU actors). PlacementError when
    a rank does not hold exactly one GPU id, the ranks of one engine are on different nodes, or share a GPU."""
    n = plan.need
    if not n.colocate or n.engine_tp == 1 or n.device != "gpu":
        return []
    envs = []
    for e in range(n.num_engines):
        ranks = range(e * n.engine_tp, (e + 1) * n.engine_tp)
        locs = [rank_locations[r] for r in ranks]
        ids = [loc.get("gpu_ids") or [] for loc in locs]
        where = ", ".join(f"rank {r} on {loc.get('host')} GPU ids {i}" for r, loc, i in zip(ranks, locs, ids))
        if any(len(i) != 1 for i in ids) or len({loc.get("node_id") for loc in locs}) != 1 or \
                len({i[0] for i in ids}) != n.engine_tp:
            raise PlacementError(f"colocated engine {e} (rollout.tensor_parallel_size={n.engine_tp}) needs the "
                                 f"{n.engine_tp} distinct GPUs of its policy ranks on one node, one each; Ray "
                                 f"reports {where}")
        envs.append({"CUDA_VISIBLE_DEVICES": ",".join(i[0] for i in ids)})
    return envs
