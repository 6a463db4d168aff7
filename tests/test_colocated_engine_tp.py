"""Colocated engines with TP > 1 (issue 49, point 2): engine i spans the placement-group bundles of policy ranks
i T .. i T + T - 1 on one node, sits in the first of them with no Ray GPU of its own, and its ``CUDA_VISIBLE_DEVICES``
names the GPU ids Ray gave those ranks (never local indices). The plan is pure (trainer/cluster/placement.py); the
seating is checked on a real local Ray with 4 logical GPUs (Ray assigns GPU ids without hardware), through the real
``RolloutClient.ray`` actor start-up, with stand-ins for the policy ranks and for the vLLM engine actor (they report
what Ray gave them: the real ones need CUDA)."""

from __future__ import annotations

import pytest

from da3po_megatron.trainer.cluster.placement import (
    Node,
    PlacementError,
    Resources,
    colocated_engine_envs,
    plan_placement,
    resolve_gpus,
)


def _nodes(*gpus: float, cpus: float = 16) -> list[Node]:
    return [Node(f"id{i}", f"node{i + 1}", cpus, g) for i, g in enumerate(gpus)]


def _colocated(world: int, tp: int, engines: int, engine_tp: int, device: str = "gpu") -> Resources:
    g = 1 if device == "gpu" else 0
    return Resources(world_size=world, tp=tp, cpus_per_rank=1, gpus_per_rank=g, num_engines=engines,
                     cpus_per_engine=1, gpus_per_engine=g, colocate=True, device=device, engine_tp=engine_tp)


def test_a_tp2_engine_spans_two_policy_bundles_takes_no_ray_gpu_and_is_refused_across_nodes() -> None:
    assert resolve_gpus("auto", None, None, engine_tp=2, cluster_gpus=4, colocate=True) == (1.0, 1.0, "gpu")
    plan = plan_placement(_colocated(4, 2, 2, 2), _nodes(4))
    assert plan.engine_node == [0, 0] and plan.engine_bundle_stride == 2
    assert (plan.rank_gpus, plan.engine_gpus) == (0.5, 0.0)
    assert [b["CPU"] for b in plan.policy_bundles] == [2.0, 1.0, 2.0, 1.0]  # engine CPUs in bundles 0 and 2
    assert "colocated with policy ranks 0..3, 2 per engine" in plan.describe()
    with pytest.raises(PlacementError, match=r"rollout.num_engines=3 x rollout.tensor_parallel_size=2 > 4 policy "
                                             r"ranks.*at most 2 engines"):
        plan_placement(_colocated(4, 1, 3, 2), _nodes(4))
    with pytest.raises(PlacementError, match=r"colocated engine 0 \(rollout.tensor_parallel_size=4\) would span "
                                             r"policy ranks 0-3 on nodes \['node1', 'node2'\]"):
        plan_placement(_colocated(4, 2, 1, 4), _nodes(2, 2))


def test_engine_devices_are_the_ray_gpu_ids_of_its_policy_ranks_in_rank_order_or_refused() -> None:
    plan = plan_placement(_colocated(4, 2, 2, 2), _nodes(4))
    locs = [{"host": "node1", "node_id": "n1", "gpu_ids": [g]} for g in ("5", "3", "0", "7")]  # Ray's ids, not 0..3
    assert colocated_engine_envs(plan, locs) == [{"CUDA_VISIBLE_DEVICES": "5,3"}, {"CUDA_VISIBLE_DEVICES": "0,7"}]
    with pytest.raises(PlacementError, match=r"colocated engine 1 .* rank 3 on node1 GPU ids \[\]"):
        colocated_engine_envs(plan, locs[:3] + [{"host": "node1", "node_id": "n1", "gpu_ids": []}])
    with pytest.raises(PlacementError, match=r"colocated engine 0 .*needs the 2 distinct GPUs"):
        colocated_engine_envs(plan, [{**locs[0], "node_id": "n2"}] + locs[1:])
    assert colocated_engine_envs(plan_placement(_colocated(4, 2, 4, 1), _nodes(4)), locs) == []  # engine TP 1
    assert colocated_engine_envs(plan_placement(_colocated(4, 2, 2, 2, "cpu"), _nodes(0)), locs) == []


@pytest.fixture(scope="module")
def ray_4_logical_gpus():
    from _ray import local_ray

    with local_ray(8, num_gpus=4) as ray:
        yield ray


def test_tp2_engines_start_on_the_gpus_ray_gave_their_policy_ranks_on_logical_gpus(ray_4_logical_gpus, tmp_path,
                                                                                   monkeypatch) -> None:
    """4 logical GPUs, policy DP 4 colocated with 2 engines of TP 2: the real reservation (one placement group, four
    pinned one-GPU bundles), four stand-in policy ranks taking half a GPU in bundles 0-3, then the real
    ``RolloutClient.ray`` start-up with :func:`~da3po_megatron.trainer.cluster.colocation.engine_slots`: engine i sits
    in bundle 2 i with no Ray GPU, and its process starts with ``CUDA_VISIBLE_DEVICES`` = the ids Ray gave ranks 2 i and
    2 i + 1."""
    import time

    ray = ray_4_logical_gpus
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from da3po_megatron.rollout import client as client_mod
    from da3po_megatron.rollout.types import EngineConfig
    from da3po_megatron.trainer.cluster.colocation import engine_slots
    from da3po_megatron.trainer.cluster.placement_ray import actor_location, cluster_nodes, reserve

    class StandInEngine:  # defined here: Ray pickles it by value (tests/ is no package)
        """Stands in for ``VLLMEngine`` in ``RolloutClient._start_actor`` (same constructor): reports where Ray put
        it and the ``CUDA_VISIBLE_DEVICES`` its process starts with (what vLLM's mp executor hands its workers)."""

        def __init__(self, config, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def health(self) -> dict:
            return {"ok": True}

        def location(self) -> dict:
            import os

            from da3po_megatron.trainer.cluster.placement_ray import actor_location

            return {**actor_location(), "env_cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    t0 = time.perf_counter()
    nodes = cluster_nodes()
    plan = plan_placement(_colocated(4, 1, 2, 2), nodes)
    res = reserve(plan, timeout_s=60)
    Rank = ray.remote(num_cpus=0)(type("StandInPolicyRank", (), {"where": lambda self: actor_location()}))
    ranks = [Rank.options(num_cpus=1, num_gpus=plan.rank_gpus,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(res.policy, i)).remote()
             for i in range(4)]

    class StandInPolicyGroup:  # PolicyGroup.run_on_all over the stand-in ranks
        def run_on_all(self, fn):
            assert fn is actor_location
            return ray.get([r.where.remote() for r in ranks], timeout=120)

    policy = StandInPolicyGroup().run_on_all(actor_location)
    monkeypatch.setattr(client_mod, "VLLMEngine", StandInEngine)
    client = client_mod.RolloutClient.ray(EngineConfig(model_path=str(tmp_path), tensor_parallel_size=2),
                                          num_engines=2, num_cpus_per_engine=1, num_gpus_per_engine=plan.engine_gpus,
                                          placement_group=res.policy, start_timeout_s=120,
                                          **engine_slots(plan, StandInPolicyGroup()))
    engines = client.call_all("location")
    print(f"policy GPU ids {[p['gpu_ids'] for p in policy]}; engines {[e['gpu_ids'] for e in engines]} with "
          f"CUDA_VISIBLE_DEVICES {[e['env_cuda_visible_devices'] for e in engines]} "
          f"({time.perf_counter() - t0:.1f} s)")
    assert sorted(g for p in policy for g in p["gpu_ids"]) == ["0", "1", "2", "3"]
    for i, e in enumerate(engines):
        assert e["gpu_ids"] == []  # no Ray GPU of its own
        assert e["env_cuda_visible_devices"] == ",".join(policy[2 * i + w]["gpu_ids"][0] for w in range(2))
        assert e["node_id"] == policy[2 * i]["node_id"]
    client.shutdown()
    for r in ranks:
        ray.kill(r)
    res.close()
