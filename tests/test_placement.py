"""Placement of the policy ranks and engines (trainer/cluster/placement.py): the pure decisions (GPUs per actor, the
resource check, TP groups on one node, engine placement, colocation) and, on a real local Ray with logical GPUs (Ray
assigns GPU ids and CUDA_VISIBLE_DEVICES without hardware; torch sees no CUDA), the node-pinned placement groups, the
device probe and the driver's device decisions -- with the driver's CUDA entry points made to raise.

The multi-node proof with the real trainer (real policy ranks and vLLM engines on the local 3-node Slurm) is in
tests/test_slurm_cluster.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from da3po_megatron.config import load_config
from da3po_megatron.trainer.cluster.placement import (
    Node,
    PlacementError,
    Resources,
    plan_placement,
    resolve_gpus,
    resources_for_config,
)

REPO = Path(__file__).resolve().parents[1]


def _nodes(*gpus: float, cpus: float = 64) -> list[Node]:
    return [Node(f"id{i}", f"node{i + 1}", cpus, g) for i, g in enumerate(gpus)]


def _need(**kw) -> Resources:
    base = dict(world_size=8, tp=2, cpus_per_rank=1, gpus_per_rank=1, num_engines=8, cpus_per_engine=1,
                gpus_per_engine=1, engine_placement="any", device="gpu")
    return Resources(**{**base, **kw})


def test_gpu_defaults_are_one_per_rank_and_tp_per_engine_on_a_gpu_cluster_and_zero_on_cpu() -> None:
    assert resolve_gpus("auto", None, None, engine_tp=2, cluster_gpus=16) == (1.0, 2.0, "gpu")
    assert resolve_gpus("auto", None, None, engine_tp=2, cluster_gpus=0) == (0.0, 0.0, "cpu")
    assert resolve_gpus("cpu", None, None, engine_tp=1, cluster_gpus=16) == (0.0, 0.0, "cpu")  # CPU asked for
    cfg = load_config(REPO / "examples/tiny_cpu_da3po.yaml", ["model.path=/x"])
    assert cfg.ray.num_gpus_per_policy_rank is None and cfg.ray.num_gpus_per_engine is None
    assert cfg.ray.device == "auto" and cfg.rollout.engine_placement == "any"


def test_actors_without_gpus_on_a_gpu_cluster_are_refused_unless_cpu_is_asked_for() -> None:
    with pytest.raises(PlacementError, match=r"has 4 GPUs but ray.num_gpus_per_policy_rank=0 gives the policy ranks "
                                             r"none.*ray.device=cpu"):
        resolve_gpus("auto", 0, None, engine_tp=1, cluster_gpus=4)
    with pytest.raises(PlacementError, match=r"ray.num_gpus_per_engine=0 gives the engines none"):
        resolve_gpus("auto", None, 0, engine_tp=1, cluster_gpus=4)
    with pytest.raises(PlacementError, match=r"ray.device=gpu but the Ray cluster has no GPUs.*--gpus-per-node"):
        resolve_gpus("gpu", None, None, engine_tp=1, cluster_gpus=0)
    with pytest.raises(PlacementError, match=r"ray.device=cpu with ray.num_gpus_per_policy_rank=1: contradictory"):
        resolve_gpus("cpu", 1, None, engine_tp=1, cluster_gpus=4)


def test_paper_layout_puts_the_policy_on_the_first_8_gpu_node_and_the_engines_on_the_second() -> None:
    cfg = load_config(REPO / "examples/qwen3_4b_da3po.yaml", ["model.path=/x"])
    assert cfg.rollout.engine_placement == "other_nodes"
    plan = plan_placement(resources_for_config(cfg, cluster_gpus=16), _nodes(8, 8))
    assert plan.rank_node == [0] * 8 and plan.engine_node == [1] * 8
    assert plan.policy_bundles == [{"CPU": 1.0, "GPU": 1.0}] * 8 and plan.engine_bundles == [{"CPU": 1.0,
                                                                                              "GPU": 1.0}] * 8
    assert "policy ranks 0-7 on node1" in plan.describe() and "engines 0-7 on node2" in plan.describe()


def test_a_tp_group_never_straddles_two_nodes() -> None:
    # 3 GPUs per node, TP=2: first fit rank by rank would put ranks 2-3 on node1 + node2; groups go whole to a node
    plan = plan_placement(_need(world_size=4, tp=2, num_engines=1, engine_placement="any"), _nodes(3, 3))
    assert plan.rank_node == [0, 0, 1, 1]
    assert plan.engine_node == [0]  # the free GPU left on node1
    with pytest.raises(PlacementError, match=r"policy TP group 0 \(ranks 0-3: 4 GPUs.*does not fit on a node.*"
                                             r"must not straddle nodes"):
        plan_placement(_need(world_size=4, tp=4, num_engines=1), _nodes(2, 2, 2))
    spread = plan_placement(_need(world_size=2, tp=1, num_engines=1, spread_policy=True,
                                  engine_placement="other_nodes"), _nodes(2, 2, 2))
    assert spread.rank_node == [0, 1] and spread.engine_node == [2]


def _megatron_expert_groups(world: int, tp: int, pp: int, ep: int, etp: int) -> tuple[list, list]:
    """(TP groups, EP groups) exactly as megatron-core 0.16.1 builds them (``RankGenerator`` of
    ``parallel_state.py``, its default order tp-cp-ep-dp-pp): the reference the node blocks must respect."""
    from megatron.core.parallel_state import RankGenerator

    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    return dense.get_ranks("tp"), expert.get_ranks("ep")


def test_expert_groups_stay_inside_a_node_unless_told_otherwise() -> None:
    """MoE: blocks of lcm(TP, EP x ETP) consecutive ranks go whole to a node, so every TP group and every EP group
    (megatron-core's own rank generator is the reference) is on one node; a block larger than a node is refused
    naming the fields; ray.expert_groups_across_nodes=true packs TP groups only."""
    from da3po_megatron.trainer.cluster.placement import node_block

    assert node_block(2, 1) == node_block(2, 1, 2) == 2  # dense: the TP group
    assert node_block(2, 8, 1) == 8 and node_block(4, 2, 1) == 4 and node_block(2, 2, 2) == 4
    assert node_block(4, 8, 1, expert_across_nodes=True) == 4
    # the Qwen3-30B-A3B recipe's layout: 16 ranks TP 2 x PP 2 x DP 4, EP 8, on 2 nodes x 8 GPUs
    moe = dict(world_size=16, tp=2, pp=2, ep=8, etp=1, num_engines=0)
    plan = plan_placement(_need(**moe), _nodes(8, 8))
    assert plan.rank_node == [0] * 8 + [1] * 8 and "blocks of 8 ranks (TP 2, EP 8 x ETP 1)" in plan.describe()
    # 3 nodes of 6 GPUs, TP 2 x DP 6 (one stage), EP 4: TP groups alone would fill node1 with ranks 0-5 and
    # split EP group 1 (ranks 4-7) over two nodes; blocks of 4 leave 2 GPUs free on each node instead
    layouts = [(dict(world_size=12, tp=2, pp=1, ep=4, etp=1), (6, 6, 6)),
               (dict(world_size=16, tp=2, pp=2, ep=2, etp=2), (4, 4, 4, 4)),
               (dict(world_size=16, tp=4, pp=1, ep=2, etp=1), (4, 4, 4, 4)),
               (dict(world_size=32, tp=2, pp=2, ep=8, etp=1), (8, 8, 8, 8))]
    for layout, gpus in layouts:
        plan = plan_placement(_need(num_engines=0, **layout), _nodes(*gpus))
        tp_groups, ep_groups = _megatron_expert_groups(layout["world_size"], layout["tp"], layout["pp"],
                                                       layout["ep"], layout["etp"])
        for grp in tp_groups + ep_groups:
            assert len({plan.rank_node[r] for r in grp}) == 1, (layout, grp, plan.rank_node)
    loose = plan_placement(_need(num_engines=0, expert_across_nodes=True, **layouts[0][0]), _nodes(6, 6, 6))
    assert loose.rank_node == [0] * 6 + [1] * 6  # TP groups only: EP group 1 (ranks 4-7) straddles node1/node2
    # a block larger than a node: refused naming the fields and the opt-out
    with pytest.raises(PlacementError, match=r"policy rank block 0 \(ranks 0-7: 8 GPUs.*does not fit on a node.*"
                                             r"parallel.tensor_model_parallel_size=2.*parallel.expert_model_parallel_"
                                             r"size=8 x parallel.expert_tensor_parallel_size=1\): lcm = 8.*"
                                             r"ray.expert_groups_across_nodes=true"):
        plan_placement(_need(**moe), _nodes(4, 4, 4, 4))
    plan = plan_placement(_need(expert_across_nodes=True, **moe), _nodes(4, 4, 4, 4))
    assert plan.rank_node == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    # from the run config: the parallel sizes and the ray setting reach the plan
    over = ["model.path=/x", "rollout.colocate=false", "rollout.tensor_parallel_size=1", "rollout.num_engines=1",
            "ray.num_cpus_per_policy_rank=1", "rollout.num_cpus_per_engine=1"]
    cfg = load_config(REPO / "examples/qwen3_30b_a3b_da3po.yaml", over)
    need = resources_for_config(cfg, cluster_gpus=9)
    assert (need.ep, need.etp, need.block) == (4, 1, 4)  # the recipe: TP 4 x EP 4 -> blocks of 4 ranks
    assert plan_placement(need, _nodes(4, 4, 1)).rank_node == [0] * 4 + [1] * 4
    with pytest.raises(PlacementError, match=r"ranks 0-3: 4 GPUs.*does not fit on a node"):  # block = the TP group
        plan_placement(need, _nodes(3, 3, 3))
    cfg = load_config(REPO / "examples/qwen3_30b_a3b_da3po.yaml", [*over, "ray.expert_groups_across_nodes=true"])
    assert resources_for_config(cfg, cluster_gpus=9).block == 4  # the TP group (4) still stays on one node


def test_the_30b_moe_recipes_place_on_two_8_gpu_nodes_policy_on_one_engines_on_the_other() -> None:
    """examples/qwen3_30b_a3b_{da3po,dapo}.yaml as written: the 8 policy ranks (TP 4 x PP 2, EP 4) on node 0, the
    two TP-4 engines on node 1 (they once set rollout.colocate with engine TP 4, which placement refuses)."""
    for name in ("da3po", "dapo"):
        cfg = load_config(REPO / f"examples/qwen3_30b_a3b_{name}.yaml", ["model.path=/x"])
        plan = plan_placement(resources_for_config(cfg, cluster_gpus=16), _nodes(8, 8))
        assert plan.rank_node == [0] * 8 and plan.engine_node == [1, 1], name


def test_more_gpus_than_the_cluster_has_is_refused_naming_the_numbers_and_the_settings() -> None:
    with pytest.raises(PlacementError, match=r"the run needs 16 GPUs \(policy 8 ranks x 1 \(ray.num_gpus_per_policy_"
                                             r"rank\) \+ engines 8 x 1 \(ray.num_gpus_per_engine.*\) but the Ray "
                                             r"cluster has 8 \(2 node\(s\): node1 4, node2 4\); request more GPUs "
                                             r"\(sbatch --nodes / --gpus-per-node\)"):
        plan_placement(_need(), _nodes(4, 4))
    with pytest.raises(PlacementError, match=r"needs 10 CPUs .* has 4 "):
        plan_placement(_need(world_size=2, tp=1, num_engines=2, cpus_per_engine=4, gpus_per_rank=0,
                             gpus_per_engine=0, device="cpu"), _nodes(0, 0, cpus=2))


def test_engine_placement_is_enforced_per_node() -> None:
    need = _need(world_size=2, tp=2, num_engines=2)
    assert plan_placement(_need(world_size=2, tp=2, num_engines=2, engine_placement="other_nodes"),
                          _nodes(4, 2)).engine_node == [1, 1]
    assert plan_placement(need, _nodes(4, 2)).engine_node == [0, 0]  # any: first fit
    assert plan_placement(_need(world_size=2, tp=2, num_engines=2, engine_placement="same_nodes"),
                          _nodes(4, 2)).engine_node == [0, 0]
    with pytest.raises(PlacementError, match=r"engine 0 .*rollout.engine_placement=other_nodes allows nodes none"):
        plan_placement(_need(world_size=2, tp=1, num_engines=1, engine_placement="other_nodes"), _nodes(3))
    with pytest.raises(PlacementError, match=r"engine 1 .*same_nodes allows nodes \['node1'\]; free there after "
                                             r"the policy and engines 0-0: node1 0 GPU"):
        plan_placement(_need(world_size=2, tp=2, num_engines=2, engine_placement="same_nodes"), _nodes(3, 4))


def test_colocated_engine_i_shares_policy_rank_is_one_gpu_bundle_or_is_refused() -> None:
    rank, engine, _ = resolve_gpus("auto", None, None, engine_tp=1, cluster_gpus=2, colocate=True)
    plan = plan_placement(_need(world_size=2, tp=1, num_engines=2, gpus_per_rank=rank, gpus_per_engine=engine,
                                colocate=True), _nodes(2, cpus=4))
    assert plan.engine_node == plan.rank_node == [0, 0] and plan.engine_bundles == []
    assert plan.policy_bundles == [{"CPU": 2.0, "GPU": 1.0}] * 2  # rank + engine CPUs, one GPU
    assert plan.rank_gpus == plan.engine_gpus == 0.5
    # engine TP > 1 colocated (spanning several ranks' bundles) is placed since issue 49: test_colocated_engine_tp.py
    with pytest.raises(PlacementError, match=r"rollout.num_engines=3 x rollout.tensor_parallel_size=1 > 2 policy "
                                             r"ranks"):
        plan_placement(_need(world_size=2, tp=1, num_engines=3, colocate=True), _nodes(4))
    with pytest.raises(PlacementError, match=r"colocate=true with rollout.engine_placement=other_nodes"):
        plan_placement(_need(world_size=2, tp=1, num_engines=2, colocate=True, engine_placement="other_nodes"),
                       _nodes(4))


@pytest.fixture(scope="module")
def ray_with_logical_gpus():
    from _ray import local_ray

    with local_ray(4, num_gpus=3) as ray:
        yield ray


def test_pinned_bundles_give_distinct_gpus_colocated_pairs_one_and_the_driver_no_cuda_with_stand_in_actors(
        ray_with_logical_gpus, monkeypatch, tmp_path) -> None:
    """Real Ray (3 logical GPUs, one node), real placement groups and device probe; the policy ranks and engines are
    stand-in actors that report what Ray gave them (the real ones: the Slurm tests). In the driver every CUDA entry
    point raises: the decisions (memory preflight, KV cache, transport) must come from the probe."""
    import torch

    ray = ray_with_logical_gpus
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from da3po_megatron.bridge.hf_config import gpt_arch
    from da3po_megatron.rollout.weight_sync import choose_transport
    from da3po_megatron.tiny import build_model
    from da3po_megatron.trainer.cluster.bringup import engine_config, memory_preflight, plan_for_cluster
    from da3po_megatron.trainer.cluster.placement_ray import actor_location, placement_report, probe_devices, reserve

    def no_cuda(*a, **k):
        raise AssertionError("the driver touched CUDA")

    for name in ("is_available", "init", "_lazy_init", "device_count", "mem_get_info", "current_device"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    hf = build_model(tmp_path / "hf", "qwen3", seed=0)
    Where = ray.remote(num_cpus=0)(type("StandInActor", (), {"where": lambda self: actor_location()}))

    def start(res, plan, colocate):
        actors = []
        for i in range(plan.need.world_size):
            actors.append(Where.options(num_cpus=plan.need.cpus_per_rank, num_gpus=plan.rank_gpus,
                                        scheduling_strategy=PlacementGroupSchedulingStrategy(res.policy, i)).remote())
        for i in range(plan.need.num_engines):
            pg = res.policy if colocate else res.engines
            actors.append(Where.options(num_cpus=plan.need.cpus_per_engine, num_gpus=plan.engine_gpus,
                                        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i)).remote())
        got = ray.get([a.where.remote() for a in actors], timeout=120)
        for a in actors:
            ray.kill(a)
        return got[:plan.need.world_size], got[plan.need.world_size:]

    base = [f"model.path={hf}", "ray.num_cpus_per_policy_rank=1", "rollout.num_cpus_per_engine=1"]
    # TP=2 policy + one engine: 3 distinct GPUs
    cfg = load_config(REPO / "examples/tiny_cpu_da3po.yaml", [*base, "parallel.tensor_model_parallel_size=2"])
    plan = plan_for_cluster(cfg)
    assert (plan.rank_gpus, plan.engine_gpus) == (1.0, 1.0)
    res = reserve(plan, timeout_s=60)
    seen = probe_devices(res, cfg.model)
    assert seen["policy"]["cuda"] is False and len(seen["policy"]["gpu_ids"]) == 1  # a GPU id, no CUDA in torch
    assert seen["policy"]["cuda_visible_devices"] == seen["policy"]["gpu_ids"][0]
    assert engine_config(cfg, seen["engine"]["cuda"]).kv_cache_memory_bytes == cfg.rollout.kv_cache_memory_bytes
    assert memory_preflight(cfg, gpt_arch(hf), seen["policy"], plan) == cfg.actor.max_tokens_per_microbatch
    policy, engines = start(res, plan, colocate=False)
    ids = [d["gpu_ids"] for d in policy + engines]
    assert sorted(i for g in ids for i in g) == ["0", "1", "2"] and all(len(g) == 1 for g in ids), ids
    line, record = placement_report(plan, policy, engines)
    assert record["policy"][0]["tp_group"] == record["policy"][1]["tp_group"] == 0
    assert "policy rank 0 on " in line and " GPU " in line
    assert choose_transport("auto", has_cuda=seen["policy"]["cuda"], colocate=False,
                            policy_hosts=[d["host"] for d in policy], engine_hosts=[d["host"] for d in engines]) == \
        "bytes"
    res.close()

    # colocated: engine i in rank i's bundle, both on the same GPU id; no sleep mode without CUDA in the engine
    cfg = load_config(REPO / "examples/tiny_cpu_da3po.yaml",
                      [*base, "parallel.data_parallel_size=2", "rollout.num_engines=2", "rollout.colocate=true"])
    plan = plan_for_cluster(cfg)
    res = reserve(plan, timeout_s=60)
    seen = probe_devices(res, cfg.model)
    assert engine_config(cfg, seen["engine"]["cuda"]).enable_sleep_mode is False
    policy, engines = start(res, plan, colocate=True)
    assert [d["gpu_ids"] for d in policy] == [d["gpu_ids"] for d in engines], (policy, engines)
    assert len({d["gpu_ids"][0] for d in policy}) == 2  # the two ranks on different GPUs
    res.close()

    # more GPUs than the cluster has: refused before anything is reserved
    cfg = load_config(REPO / "examples/tiny_cpu_da3po.yaml", [*base, "parallel.data_parallel_size=4"])
    with pytest.raises(PlacementError, match=r"needs 5 GPUs .* has 3 "):
        plan_for_cluster(cfg)


def test_a_placement_group_that_cannot_be_placed_times_out_naming_what_is_pending_where(ray_with_logical_gpus) -> None:
    from ray.util.placement_group import placement_group, remove_placement_group

    from da3po_megatron.trainer.cluster.placement_ray import cluster_nodes, reserve

    ray = ray_with_logical_gpus
    hog = placement_group([{"GPU": 3}])  # another job holding every GPU
    assert ray.wait([hog.ready()], timeout=30)[0]
    try:
        plan = plan_placement(_need(world_size=1, tp=1, num_engines=1), cluster_nodes())
        with pytest.raises(PlacementError, match=r"the policy placement group was not ready after 2 s "
                                                 r"\(ray.placement_timeout_s\); still pending: rank 0: \{'CPU': 1.0, "
                                                 r"'GPU': 1.0\} on \S+\. Free now: \S+: 0/3 GPU"):
            reserve(plan, timeout_s=2)
    finally:
        remove_placement_group(hog)


def test_zero_gpu_bundles_on_the_drivers_host_without_an_nvidia_driver_are_answered_without_a_probe(
        ray_with_logical_gpus, monkeypatch, tmp_path) -> None:
    """The tiny CPU launch's two device probes (a Ray worker importing torch each, 2-4 s) are skipped where the
    resources already give the answer; a GPU bundle, another node or a host with an NVIDIA driver is still probed."""
    import dataclasses

    from da3po_megatron.trainer.cluster import placement_ray as PR  # the Ray side: the probe and the driver-file check
    from da3po_megatron.trainer.cluster.bringup import plan_for_cluster

    cfg = load_config(REPO / "examples/tiny_cpu_da3po.yaml", ["model.path=/x", "ray.device=cpu"])
    plan = plan_for_cluster(cfg)
    assert (plan.rank_gpus, plan.engine_gpus) == (0, 0)
    res = PR.reserve(plan, timeout_s=60)
    try:
        def no_probe(kind, _opts):
            raise AssertionError(f"the {kind} bundle was probed")
        monkeypatch.setattr(PR, "_probe", no_probe)
        seen = PR.probe_devices(res, cfg.model)
    finally:
        res.close()
    assert seen["policy"]["probed"] is False and seen["engine"]["probed"] is False
    assert seen["policy"]["cuda"] is False and seen["policy"]["use_te"] is False
    assert seen["policy"]["free_bytes"] > 0 and "available host memory of" in seen["policy"]["memory_where"]
    node = plan.nodes[plan.rank_node[0]]
    assert PR.answer_without_probe("policy", node, 1.0) is None  # a GPU bundle
    assert PR.answer_without_probe("policy", dataclasses.replace(node, node_id="0" * 56), 0) is None  # another node
    monkeypatch.setattr(PR, "NVIDIA_DEVICE_FILES", (str(tmp_path),))  # a host with an NVIDIA driver
    assert PR.answer_without_probe("policy", node, 0) is None


def test_a_reservation_that_fails_half_way_leaves_no_placement_group_behind(ray_with_logical_gpus) -> None:
    """The policy's group is created, then the engines' is refused (here an empty bundle: Ray's ValueError): reserve()
    removes the policy's group before the error propagates, as it does on a timeout, so a Run.__init__ failing there
    (which closes its reservation only once it holds one, issue 35) leaves nothing reserved. On 27dab78 the policy's
    group stayed until the driver exited."""
    from ray.util import placement_group_table

    from da3po_megatron.trainer.cluster.placement_ray import cluster_nodes, reserve

    plan = plan_placement(_need(world_size=1, tp=1, num_engines=1, gpus_per_rank=0, gpus_per_engine=0,
                                device="cpu"), cluster_nodes())
    plan.engine_bundles = [{}]
    with pytest.raises(ValueError):
        reserve(plan, timeout_s=30, name="halfway")
    left = [(t["name"], t["state"]) for t in placement_group_table().values()
            if t["name"].startswith("halfway") and t["state"] != "REMOVED"]
    print(f"placement groups left after the failed reservation: {left}")
    assert left == []


def test_engine_memory_and_sleep_mode_follow_what_the_engine_sees() -> None:
    from da3po_megatron.trainer.cluster.bringup import engine_config

    cfg = load_config(REPO / "examples/tiny_cpu_da3po.yaml", ["model.path=/x", "rollout.colocate=true"])
    gpu, cpu = engine_config(cfg, engine_cuda=True), engine_config(cfg, engine_cuda=False)
    assert gpu.kv_cache_memory_bytes is None and gpu.enable_sleep_mode  # vLLM sizes it by gpu_memory_utilization
    assert cpu.kv_cache_memory_bytes == cfg.rollout.kv_cache_memory_bytes and not cpu.enable_sleep_mode


def test_colocated_ipc_layouts_are_served_at_any_policy_tp_pp_and_what_stays_refused_is_refused_at_start_up() -> None:
    """Colocated on GPUs the weights go through CUDA IPC (rollout.weight_transfer auto / ipc). On 2b6e185 policy
    TP > 1 with an engine on TP rank 1's GPU, or PP > 1, was refused here (only TP rank 0 of a stage held its full
    tensors); since issue 49 every policy rank holds every bucket (test_ipc_layouts.py), so they are placed. What
    stays refused, before anything is reserved: an engine GPU without a policy rank (``ipc_routing.plan_ipc_routes``
    on the planned layout)."""
    import time

    from da3po_megatron.trainer.cluster.placement import check_colocated_ipc, ipc_layout

    t0 = time.perf_counter()
    colo = dict(colocate=True, gpus_per_rank=1, gpus_per_engine=1, device="gpu")
    plan_placement(_need(world_size=2, tp=2, num_engines=2, **colo), _nodes(2))  # refused on 2b6e185
    plan_placement(_need(world_size=2, tp=1, pp=2, num_engines=1, **colo), _nodes(2))  # refused on 2b6e185
    plan_placement(_need(world_size=4, tp=2, pp=2, num_engines=4, **colo), _nodes(4))
    plan_placement(_need(world_size=4, tp=1, num_engines=4, **colo), _nodes(4))
    plan_placement(_need(world_size=2, tp=1, pp=2, num_engines=2, colocate=True, gpus_per_rank=0, gpus_per_engine=0,
                         device="cpu"), _nodes(0))
    over = ["model.path=/x", "rollout.colocate=true", "parallel.tensor_model_parallel_size=2", "rollout.num_engines=2"]
    cfg = load_config(REPO / "examples/tiny_cpu_da3po.yaml", over)
    plan_placement(resources_for_config(cfg, cluster_gpus=2), _nodes(2))
    check_colocated_ipc(ipc_layout(load_config(REPO / "examples/tiny_cpu_da3po.yaml",
                                               [*over, "rollout.weight_transfer=ipc"])))
    # still refused: an explicit 'ipc' whose engines need more GPUs than the policy has ranks on -- by the one gate,
    # cluster/placement.py (bring-up's preflight calls it before Ray starts); the config itself loads (issue 56)
    bad = load_config(REPO / "examples/tiny_cpu_da3po.yaml", [*over, "rollout.weight_transfer=ipc",
                                                             "rollout.tensor_parallel_size=2"])
    with pytest.raises(PlacementError, match=r"rollout.weight_transfer=ipc with rollout.colocate=true .* 2 policy "
                                             r"ranks .* 2 engine\(s\) of TP 2 .*engine 1 worker 0 runs on GPU "
                                             r"bundle 2, where no policy rank runs"):
        check_colocated_ipc(ipc_layout(bad))
    seconds = time.perf_counter() - t0
    print(f"colocated IPC layouts checked in {seconds:.3f} s")
    assert seconds < 5
