"""The Ray side of the placement (split from ``cluster/placement.py``, which keeps the pure decisions; callers
import these names from here -- no re-export): the alive nodes (:func:`cluster_nodes`), the node-pinned placement
groups and their wait with a timeout (:func:`reserve`), the device probes that tell the driver what a rank and an
engine will see (:func:`probe_devices`), and where the actors say they are (:func:`actor_location`,
:func:`placement_report`). See ``placement.py``'s docstring for the whole design."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from da3po_megatron.trainer.cluster.placement import Node, PlacementError, Plan


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
    # a colocated engine of TP > 1 takes no Ray GPU but sees its policy ranks' GPUs (placement.colocated_engine_envs):
    # it sees what rank 0 sees (the default below), so it is not probed
    if plan.engine_node and not (plan.need.colocate and plan.engine_gpus == 0 and plan.rank_gpus > 0):
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
