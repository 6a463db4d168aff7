"""Where a recipe's policy ranks and engines would run on the Ray cluster of this job, and which GPU ids Ray gives
them: the trainer's own placement (trainer/placement.py: the plan, the node-pinned placement groups) with stand-in
actors in the bundles that only report ``ray.get_gpu_ids()``, ``CUDA_VISIBLE_DEVICES`` and their node -- no model is
built, so the paper's 2 x 8-GPU layout can be shown on the local Slurm with logical GPUs (docs/slurm.md):

    FAKE_GPUS=8 NODE_CPUS=16 scripts/local_slurm.sh up
    CONFIG=examples/qwen3_4b_da3po.yaml DA3PO_DRIVER="python scripts/local_slurm/placement_probe.py" \\
        sbatch --nodes=2 --gpus-per-node=8 slurm/train.sbatch

Prints the plan and one Markdown row per actor. Arguments: dotted config overrides (as for ``da3po train``).
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from da3po_megatron.config import load_config
    from da3po_megatron.trainer.placement import PlacementError, actor_location, reserve
    from da3po_megatron.trainer.prepare import plan_for_cluster

    cfg = load_config(os.environ["CONFIG"], ["model.path=/unused", *argv])
    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), logging_level="ERROR", log_to_driver=False)
    try:
        plan = plan_for_cluster(cfg)
    except PlacementError as e:
        print(f"placement error: {e}", file=sys.stderr)
        return 2
    print(plan.describe(), flush=True)
    res = reserve(plan, cfg.ray.placement_timeout_s)
    stand_in = ray.remote(num_cpus=0)(type("StandIn", (), {"where": lambda self: actor_location()}))

    def start(pg, index: int, cpus: float, gpus: float):
        return stand_in.options(num_cpus=cpus, num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=index)).remote()

    n = plan.need
    actors = [(f"policy rank {i} (TP group {i // n.tp})", start(res.policy, i, n.cpus_per_rank, plan.rank_gpus))
              for i in range(n.world_size)]
    actors += [(f"engine {i}", start(res.engines if res.engines is not None else res.policy, i, n.cpus_per_engine,
                                     plan.engine_gpus)) for i in range(n.num_engines)]
    rows = ray.get([a.where.remote() for _, a in actors], timeout=300)
    print("| actor | node | Ray GPU id | CUDA_VISIBLE_DEVICES |\n|---|---|---|---|")
    for (name, _), w in zip(actors, rows):
        print(f"| {name} | {w['host']} | {','.join(w['gpu_ids']) or '-'} | {w['cuda_visible_devices'] or '-'} |")
    res.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
