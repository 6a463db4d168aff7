"""Where a recipe's policy ranks and engines would run on the Ray cluster of this job, and which GPU ids Ray gives
them: the trainer's own placement (trainer/cluster/placement.py: the plan, the node-pinned placement groups) with
stand-in actors (NOT the policy or vLLM: no model is built) that only report ``ray.get_gpu_ids()``,
``CUDA_VISIBLE_DEVICES`` and their node, so the paper's 2 x 8-GPU layout can be shown on the local Slurm with logical
GPUs (docs/slurm.md):

    FAKE_GPUS=8 NODE_CPUS=16 scripts/local_slurm.sh up
    CONFIG=examples/qwen3_4b_da3po.yaml DA3PO_DRIVER="python scripts/local_slurm/placement_probe.py" \\
        sbatch --nodes=2 --gpus-per-node=8 slurm/train.sbatch

The stand-in policy ranks sit in the plan's bundles with the plan's GPU request. The engines start through the
trainer's own start-up, ``RolloutClient.ray`` with ``trainer/cluster/colocation.engine_slots`` (as ``trainer/run.py``
calls it), with the ``VLLMEngine`` class swapped for a stand-in: so a colocated engine of TP > 1 (issue 49) sits in
the first of its policy ranks' bundles with no Ray GPU, and its process starts with ``CUDA_VISIBLE_DEVICES`` = the
ids Ray gave those ranks (``placement.colocated_engine_envs``), which is what vLLM's executor hands its workers.

Prints the plan and one Markdown row per actor; with ``rollout.colocate=true`` and ``rollout.tensor_parallel_size``
> 1 it then checks each engine against its ranks (same node, no Ray GPU of its own, ``CUDA_VISIBLE_DEVICES`` = the
ranks' ids in rank order, every GPU of the job used once) and prints ``COLOCATED_TP_OK`` or exits 1 with
``COLOCATED_TP_FAIL``. Exit 2 with the trainer's message when the plan is refused. Arguments: dotted config
overrides (as for ``da3po train``).
"""

from __future__ import annotations

import os
import sys
from typing import Any


class StandInEngine:
    """Stands in for ``rollout.engine.VLLMEngine`` in ``RolloutClient._start_actor`` (same constructor): reports
    where Ray put it and the ``CUDA_VISIBLE_DEVICES`` its process starts with."""

    def __init__(self, config: Any, engine_index: int = 0) -> None:
        self.engine_index = engine_index

    def health(self) -> dict:
        return {"ok": True}

    def location(self) -> dict:
        from da3po_megatron.trainer.cluster.placement_ray import actor_location

        return actor_location()


def check_colocated_tp(policy: list[dict], engines: list[dict], engine_tp: int) -> list[str]:
    """What is wrong with the seating of colocated engines of TP ``engine_tp`` (empty: right)."""
    bad = []
    for i, e in enumerate(engines):
        ranks = policy[i * engine_tp:(i + 1) * engine_tp]
        want = ",".join(g for r in ranks for g in r["gpu_ids"])
        if e["gpu_ids"]:
            bad.append(f"engine {i} holds Ray GPUs {e['gpu_ids']} of its own")
        if e["cuda_visible_devices"] != want:
            bad.append(f"engine {i} CUDA_VISIBLE_DEVICES={e['cuda_visible_devices']!r}, its ranks' ids {want!r}")
        if {r["node_id"] for r in ranks} != {e["node_id"]}:
            bad.append(f"engine {i} on {e['host']}, its ranks on {sorted({r['host'] for r in ranks})}")
    used = [(r["node_id"], g) for r in policy for g in r["gpu_ids"]]
    if len(set(used)) != len(used):
        bad.append(f"two policy ranks on one GPU: {used}")
    return bad


def main(argv: list[str]) -> int:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from da3po_megatron.config import load_config
    from da3po_megatron.rollout import client as client_mod
    from da3po_megatron.trainer.cluster.bringup import engine_config, plan_for_cluster
    from da3po_megatron.trainer.cluster.colocation import engine_slots
    from da3po_megatron.trainer.cluster.placement import PlacementError
    from da3po_megatron.trainer.cluster.placement_ray import actor_location, reserve

    cfg = load_config(os.environ["CONFIG"], ["model.path=/unused", *argv])
    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), logging_level="ERROR", log_to_driver=False)
    try:
        plan = plan_for_cluster(cfg)
    except PlacementError as e:
        print(f"placement error: {e}", file=sys.stderr)
        return 2
    print(plan.describe(), flush=True)
    res = reserve(plan, cfg.ray.placement_timeout_s)
    n = plan.need
    stand_in = ray.remote(num_cpus=0)(type("StandInPolicyRank", (), {"where": lambda self: actor_location()}))
    ranks = [stand_in.options(num_cpus=n.cpus_per_rank, num_gpus=plan.rank_gpus,
                              scheduling_strategy=PlacementGroupSchedulingStrategy(res.policy, i)).remote()
             for i in range(n.world_size)]

    class StandInPolicyGroup:  # PolicyGroup.run_on_all, what engine_slots asks of the started ranks
        def run_on_all(self, fn: Any) -> list[dict]:
            assert fn is actor_location
            return ray.get([r.where.remote() for r in ranks], timeout=300)

    policy = StandInPolicyGroup().run_on_all(actor_location)
    client_mod.VLLMEngine = StandInEngine  # the trainer's engine start-up, with the stand-in engine class
    client = client_mod.RolloutClient.ray(engine_config(cfg), num_engines=n.num_engines,
                                          num_cpus_per_engine=n.cpus_per_engine, num_gpus_per_engine=plan.engine_gpus,
                                          placement_group=res.engines or res.policy,
                                          start_timeout_s=cfg.ray.start_timeout_s,
                                          **engine_slots(plan, StandInPolicyGroup()))
    engines = client.call_all("location")
    print("| actor | node | Ray GPU id | CUDA_VISIBLE_DEVICES |\n|---|---|---|---|")
    rows = [(f"policy rank {i} (TP group {i // n.tp})", w) for i, w in enumerate(policy)]
    rows += [(f"engine {i}", w) for i, w in enumerate(engines)]
    for name, w in rows:
        print(f"| {name} | {w['host']} | {','.join(w['gpu_ids']) or '-'} | {w['cuda_visible_devices'] or '-'} |")
    rc = 0
    if n.colocate and n.engine_tp > 1 and n.device == "gpu":
        bad = check_colocated_tp(policy, engines, n.engine_tp)
        print(f"COLOCATED_TP_{'FAIL' if bad else 'OK'} engines={len(engines)} tp={n.engine_tp}"
              + "".join(f"\n  {b}" for b in bad), flush=True)
        rc = 1 if bad else 0
    client.shutdown()
    for r in ranks:
        ray.kill(r)
    res.close()
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
