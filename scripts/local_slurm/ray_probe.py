"""Smoke driver for slurm/train.sbatch on a Slurm allocation: one Ray actor per node, each reports where it runs.

Run as the sbatch driver (``DA3PO_DRIVER="python scripts/local_slurm/ray_probe.py"``). It connects with a plain
``ray.init()`` (the address comes from RAY_ADDRESS, exported by slurm/ray_on_slurm.sh), reserves one CPU on every
alive node with a STRICT_SPREAD placement group, and prints one line per actor plus a final ``RAY_PROBE_OK`` line.
"""

from __future__ import annotations

import os
import socket
import sys
import time

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@ray.remote(num_cpus=1)
class Where:
    def where(self) -> tuple[str, str, str]:
        return socket.gethostname(), os.environ.get("SLURMD_NODENAME", "?"), ray.get_runtime_context().get_node_id()


def main() -> int:
    t0 = time.time()
    ray.init(log_to_driver=False)
    nodes = [n for n in ray.nodes() if n["Alive"]]
    res = ray.cluster_resources()
    print(f"connected to {os.environ.get('RAY_ADDRESS')}: {len(nodes)} alive nodes, "
          f"cluster CPUs={res.get('CPU', 0):g} GPUs={res.get('GPU', 0):g}", flush=True)
    pg = placement_group([{"CPU": 1}] * len(nodes), strategy="STRICT_SPREAD")
    ray.get(pg.ready(), timeout=120)
    actors = [
        Where.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)).remote()
        for i in range(len(nodes))
    ]
    places = ray.get([a.where.remote() for a in actors], timeout=120)
    for i, (host, slurm_node, node_id) in enumerate(places):
        print(f"actor {i}: hostname={host} SLURMD_NODENAME={slurm_node} ray_node={node_id[:8]}", flush=True)
    hosts = sorted({p[0] for p in places})
    ok = len(hosts) == len(nodes)
    print(f"RAY_PROBE_{'OK' if ok else 'FAIL'} nodes={len(nodes)} hosts={','.join(hosts)} in {time.time() - t0:.1f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
