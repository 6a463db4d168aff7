"""`da3po bench {train-step,rollout,rl-step,async,weight-sync,loss,control-plane} [args]`: the benchmarks.

Each benchmark is a module of this package, run by ``da3po bench NAME [args]`` or, the same thing,
``python -m da3po_megatron.bench.MODULE [args]`` (``slurm/bench.sbatch`` runs the latter); both work from an installed
package, with no source checkout. The stand-ins some of them use are in :mod:`da3po_megatron.testing`.
"""

from __future__ import annotations

import runpy
import sys

# `da3po bench NAME` -> the module that runs it (``async`` is a Python keyword, hence ``async_rl``)
BENCHMARKS = {"train-step": "train_step", "rollout": "rollout", "rl-step": "rl_step", "async": "async_rl",
              "weight-sync": "weight_sync", "loss": "loss", "control-plane": "control_plane"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        print("usage: da3po bench {" + ",".join(BENCHMARKS) + "} [benchmark options]\n\n" + __doc__.split("\n\n")[1])
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    module = f"{__name__}.{BENCHMARKS[argv[0]]}"
    sys.argv = [module, *argv[1:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)  # as `python -m MODULE`: its __main__ block runs
    return 0
