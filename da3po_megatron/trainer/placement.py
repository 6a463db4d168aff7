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
  ``any``. Colocated (``rollout.colocate``): engine i shares policy rank i's one-GPU bundle, each taking half of it
  (Ray gives both the same GPU id), which needs engine TP = 1, at most one engine per rank and 1 GPU per rank; on
  GPUs with the IPC weight transport also a layout it can serve (:func:`check_colocated_ipc`).

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
import os
import time
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
        return self.need.gpus_per_rank / 2 if self.need.colocate and self.need.gpus_per_rank else \
            self.need.gpus_per_engine

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
        how = "colocated with policy ranks 0.." + str(n.num_engines - 1) if n.colocate else \
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
        if engine_tp != 1:
            raise PlacementError(f"rollout.colocate=true with rollout.tensor_parallel_size={engine_tp}: engine i "
                                 "shares policy rank i's one GPU, so an engine has one GPU; use "
                                 "rollout.tensor_parallel_size=1 or rollout.colocate=false")
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
    """Colocated on GPUs, ``rollout.weight_transfer`` auto or ipc syncs through CUDA IPC
    (``weight_sync.choose_transport``), which maps memory on the same GPU only: every engine's GPU must hold a policy
    rank with a full copy of every PP stage. Checked here, on the layout the plan will reserve
    (``ipc_routing.check_colocated_layout``: the routing decision of the first sync), so policy TP > 1 with engines
    on TP-rank-1 GPUs, or PP > 1, is a PlacementError in seconds rather than a failure at the first weight sync."""
    from da3po_megatron.rollout.ipc_routing import check_colocated_layout

    try:
        check_colocated_layout(need.world_size, need.tp, need.pp, need.num_engines, need.cp)
    except ValueError as e:
        raise PlacementError(f"rollout.colocate=true on GPUs syncs the weights through CUDA IPC "
                             f"(rollout.weight_transfer={need.weight_transfer}), which this layout cannot serve: "
                             f"policy TP={need.tp}, PP={need.pp}, {need.num_engines} engine(s) in policy ranks 0.."
                             f"{need.num_engines - 1}'s bundles: {e}") from None


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
        if need.num_engines > need.world_size:
            raise PlacementError(f"rollout.colocate=true with rollout.num_engines={need.num_engines} > "
                                 f"{need.world_size} policy ranks: engine i shares rank i's GPU; use at most "
                                 f"{need.world_size} engines")
        if need.gpus_per_rank not in (0, 1):
            raise PlacementError(f"rollout.colocate=true with ray.num_gpus_per_policy_rank={need.gpus_per_rank:g}: "
                                 "colocation shares one GPU between rank i and engine i; use 1")
        if need.device == "gpu" and need.gpus_per_engine != need.gpus_per_rank:
            raise PlacementError("rollout.colocate=true needs engines of one GPU (rollout.tensor_parallel_size=1)")
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
    engine_cpu_of_rank = [need.cpus_per_engine if need.colocate and r < need.num_engines else 0.0
                          for r in range(need.world_size)]
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
        engine_node = rank_node[:need.num_engines]
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
                     expert_across_nodes=ray_cfg.expert_groups_across_nodes)


# ------------------------------------------------------------------------------------------------- Ray side
def cluster_nodes() -> list[Node]:
    """The alive Ray nodes (total CPUs / GPUs), the driver's node first, then by hostname."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    nodes = [Node(n["NodeID"], n.get("NodeManagerHostname") or n["NodeManagerAddress"],
                  float(n["Resources"].get("CPU", 0)), float(n["Resources"].get("GPU", 0)))
             for n in ray.nodes() if n.get("Alive")]
    return sorted(nodes, key=lambda n: (n.node_id != here, n.host, n.node_id))


@dataclass
class Reservation:
    """The placement groups of a plan (``engines`` is None when colocated: the engines use ``policy``)."""

    plan: Plan
    policy: Any
    engines: Any

    def close(self) -> None:
        """Remove the placement groups (what ``Run.shutdown`` calls on the way out)."""
        from ray.util.placement_group import remove_placement_group

        for pg in (self.policy, self.engines):
            if pg is not None:
                try:
                    remove_placement_group(pg)
                except Exception:  # noqa: BLE001 - already gone
                    pass


def _pending_report(plan: Plan) -> str:
    import ray

    avail = {}
    try:  # free resources per node right now (who else holds them shows here)
        from ray._private.state import available_resources_per_node

        avail = available_resources_per_node()
    except Exception:  # noqa: BLE001 - only for the message
        pass
    rows = []
    for n in plan.nodes:
        a = avail.get(n.node_id, {})
        rows.append(f"{n.host}: {a.get('GPU', 0):g}/{n.gpus:g} GPU, {a.get('CPU', 0):g}/{n.cpus:g} CPU free")
    del ray
    return "; ".join(rows)


def reserve(plan: Plan, timeout_s: float, name: str = "da3po") -> Reservation:
    """Create the plan's placement groups (bundles pinned to their nodes) and wait for them, at most ``timeout_s``;
    on timeout remove them and raise PlacementError naming the pending bundles, their nodes and what is free."""
    from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group

    def make(bundles: list[dict], nodes: list[int], tag: str):
        return placement_group(bundles, strategy="PACK", name=f"{name}-{tag}-{os.getpid()}",
                               bundle_label_selector=[{NODE_ID_LABEL_KEY: plan.nodes[i].node_id} for i in nodes])

    res = Reservation(plan, make(plan.policy_bundles, plan.rank_node, "policy"), None)
    try:  # anything raising from here on (the engines' group refused, an interrupt) removes what was created
        if plan.engine_bundles:
            res.engines = make(plan.engine_bundles, plan.engine_node, "engines")
        _wait_reserved(res, timeout_s)
    except BaseException:
        res.close()
        raise
    return res


def _wait_reserved(res: Reservation, timeout_s: float) -> None:
    """Wait for the reservation's groups, at most ``timeout_s`` in all; PlacementError naming what is pending."""
    import ray

    plan = res.plan
    pending = {"policy": res.policy, **({"engines": res.engines} if res.engines is not None else {})}
    deadline = time.monotonic() + timeout_s
    for tag, pg in pending.items():
        ready, _ = ray.wait([pg.ready()], timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            report = _pending_report(plan)  # before reserve() removes the groups
            kinds = plan.rank_node if tag == "policy" else plan.engine_node
            bundles = plan.policy_bundles if tag == "policy" else plan.engine_bundles
            where = ", ".join(f"{'rank' if tag == 'policy' else 'engine'} {i}: {b} on {plan.host(kinds[i])}"
                              for i, b in enumerate(bundles))
            raise PlacementError(f"the {tag} placement group was not ready after {timeout_s:g} s "
                                 f"(ray.placement_timeout_s); still pending: {where}. Free now: {report} -- other "
                                 "jobs or leftover actors on this Ray cluster may hold them")


def _probe(kind: str, te_setting: Any) -> dict[str, Any]:
    """Run inside a task with an actor's resources: what that actor will see. Ray has set ``CUDA_VISIBLE_DEVICES`` to
    the task's GPU ids (Ray 2.60 ``_private/accelerators/nvidia_gpu.py:109-117``; ``ray.get_gpu_ids``:
    ``_private/worker.py:1185``). With CUDA (GPU-only, docs/gpu_only.md): free/total memory of its ``cuda:0`` through
    ``torch.cuda.mem_get_info`` (torch 2.13 ``cuda/memory.py:846``) and the layer spec ``megatron.model.use_te``."""
    import socket

    import ray
    import torch

    info: dict[str, Any] = {"kind": kind, "host": socket.gethostname(),
                            "node_id": ray.get_runtime_context().get_node_id(),
                            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                            "cuda": bool(torch.cuda.is_available())}
    if info["cuda"]:
        free, total = torch.cuda.mem_get_info()
        info.update(free_bytes=int(free), total_bytes=int(total),
                    memory_where=f"free memory of cuda:{torch.cuda.current_device()} on {info['host']} "
                                 f"({total / 2**30:.1f} GiB total)")
        if te_setting is not None:
            from da3po_megatron.megatron.model import use_te

            info["use_te"] = bool(use_te(te_setting))
        import psutil  # the node's host memory too: asynchronous saves stage there (megatron/memory_host.py)

        info["host_available_bytes"] = int(psutil.virtual_memory().available)
    else:
        _host_memory(info)
    return info


def _host_memory(info: dict[str, Any]) -> dict[str, Any]:
    """The answer of a process without CUDA: the host's available memory (where the memory plan's budget comes
    from) and the local layer spec."""
    import psutil

    vm = psutil.virtual_memory()
    info.update(free_bytes=int(vm.available), total_bytes=int(vm.total), use_te=False,
                memory_where=f"available host memory of {info['host']} ({vm.total / 2**30:.1f} GiB total)")
    return info


NVIDIA_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia")


def host_has_nvidia_driver() -> bool:
    """Whether this host has an NVIDIA driver (its device files or /proc entry), read from the filesystem: no CUDA
    call, so the driver process never creates a CUDA context."""
    return any(os.path.exists(f) for f in NVIDIA_DEVICE_FILES)


def answer_without_probe(kind: str, node: Node, gpus: float) -> dict[str, Any] | None:
    """What a bundle's actor will see when the resources already say it, or None (then a probe asks).

    Known without a probe: a bundle on the driver's own node that requests no GPU, on a host without an NVIDIA
    driver. Its actor cannot see CUDA (Ray 2.60 leaves ``CUDA_VISIBLE_DEVICES`` alone for a zero-GPU actor,
    ``_private/utils.py:275-305`` -- so on a GPU host it could, and a probe runs there), its memory is this host's.
    A probe costs a Ray worker process that imports torch: 2-4 s of a tiny CPU launch."""
    import socket

    import ray

    if gpus or node.node_id != ray.get_runtime_context().get_node_id() or host_has_nvidia_driver():
        return None
    info: dict[str, Any] = {"kind": kind, "host": socket.gethostname(), "node_id": node.node_id, "gpu_ids": [],
                            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "cuda": False,
                            "probed": False}
    return _host_memory(info)


def probe_devices(res: Reservation, model_options: Any = None, timeout_s: float = 300.0) -> dict[str, dict]:
    """What a policy rank and an engine will see, asked of one Ray task each in their first bundle with the same
    resources as the actor (``max_calls=1``: the task's process exits afterwards, so a CUDA context it opened is
    gone before the actors start). Returns ``{"policy": info, "engine": info}`` (see :func:`_probe`). A bundle whose
    answer the resources already give (:func:`answer_without_probe`: no GPU requested, on the driver's node, a host
    without an NVIDIA driver) is not probed; its answer says ``probed: False``."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    plan = res.plan
    probe = ray.remote(max_calls=1)(_probe)
    known = {"policy": answer_without_probe("policy", plan.nodes[plan.rank_node[0]], plan.rank_gpus)}
    refs = {}
    if known["policy"] is None:
        refs["policy"] = probe.options(num_cpus=plan.need.cpus_per_rank, num_gpus=plan.rank_gpus,
                                       scheduling_strategy=PlacementGroupSchedulingStrategy(
                                           res.policy, placement_group_bundle_index=0)).remote("policy", model_options)
    if plan.engine_node:
        known["engine"] = answer_without_probe("engine", plan.nodes[plan.engine_node[0]], plan.engine_gpus)
        if known["engine"] is None:
            pg = res.engines if res.engines is not None else res.policy
            refs["engine"] = probe.options(num_cpus=plan.need.cpus_per_engine, num_gpus=plan.engine_gpus,
                                           scheduling_strategy=PlacementGroupSchedulingStrategy(
                                               pg, placement_group_bundle_index=0)).remote("engine", None)
    ready, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    if pending:
        late = [k for k, r in refs.items() if r in pending]
        raise PlacementError(f"the device probe of the {' and '.join(late)} bundle 0 did not answer within "
                             f"{timeout_s:g} s (on {plan.host(plan.rank_node[0])})")
    out = {k: v for k, v in known.items() if v is not None}
    out.update(zip(refs, ray.get(list(refs.values()))))
    out.setdefault("engine", dict(out["policy"], kind="engine"))
    return out


def actor_location(_worker: Any = None) -> dict[str, Any]:
    """Where the calling Ray actor runs and which GPUs Ray gave it (for the placement report)."""
    import socket

    import ray

    return {"host": socket.gethostname(), "node_id": ray.get_runtime_context().get_node_id(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def placement_report(plan: Plan, policy: list[dict], engines: list[dict]) -> tuple[str, dict[str, Any]]:
    """One console line and the JSON record (``run_dir/placement.json``) of where the actors say they are; a
    mismatch with the plan (a rank or engine on another node than planned) is a PlacementError."""
    def gpus(d: dict) -> str:
        return f" GPU {','.join(d['gpu_ids'])}" if d.get("gpu_ids") else " no GPU"

    wrong = [f"policy rank {i} on {d['host']} (planned {plan.host(plan.rank_node[i])})" for i, d in enumerate(policy)
             if d.get("node_id") and d["node_id"] != plan.nodes[plan.rank_node[i]].node_id]
    wrong += [f"engine {i} on {d['host']} (planned {plan.host(plan.engine_node[i])})" for i, d in enumerate(engines)
              if d.get("node_id") and d["node_id"] != plan.nodes[plan.engine_node[i]].node_id]
    if wrong:
        raise PlacementError("actors are not where their placement-group bundles were pinned: " + "; ".join(wrong))
    line = ("placement: " + ", ".join(f"policy rank {i} on {d['host']}{gpus(d)}" for i, d in enumerate(policy)) + "; "
            + ", ".join(f"engine {i} on {d['host']}{gpus(d)}" for i, d in enumerate(engines)))
    n = plan.need
    record = {"policy": [dict(d, rank=i, tp_group=i // n.tp) for i, d in enumerate(policy)],
              "engines": [dict(d, engine=i) for i, d in enumerate(engines)],
              "tensor_model_parallel_size": n.tp, "engine_placement": n.engine_placement, "colocate": n.colocate,
              "device": n.device, "plan": plan.describe()}
    return line, record
