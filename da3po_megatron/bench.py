"""`da3po bench {train-step,rollout,rl-step,async,weight-sync,loss,control-plane} [args]`: ``tools/``'s benchmarks.

Benchmarks live in ``tools/bench_*.py`` (scripts users also run directly and that ``slurm/bench.sbatch`` calls); this
sub-command only finds and runs them with the given arguments, from a source checkout (``pip install -e .``).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1] / "tools"
BENCHMARKS = {"train-step": "bench_train_step.py", "rollout": "bench_rollout.py", "rl-step": "bench_rl_step.py",
              "async": "bench_async.py", "weight-sync": "bench_weight_sync.py", "loss": "bench_loss.py",
              "control-plane": "bench_control_plane.py"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        print("usage: da3po bench {" + ",".join(BENCHMARKS) + "} [benchmark options]\n\n" + __doc__.split("\n\n")[1])
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    script = TOOLS / BENCHMARKS[argv[0]]
    if not script.exists():
        print(f"error: {script} not found (da3po bench needs a source checkout of da3po-megatron)", file=sys.stderr)
        return 2
    sys.argv = [str(script), *argv[1:]]
    runpy.run_path(str(script), run_name="__main__")
    return 0
