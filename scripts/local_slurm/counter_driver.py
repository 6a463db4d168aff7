"""Stand-in for the trainer in preemption/requeue tests of slurm/train.sbatch (the same contract, nothing else).

It counts steps; when SIGUSR1 arrives or ``$RUN_DIR/PREEMPT`` exists it saves the counter the way the trainer saves
its state (``$RUN_DIR/checkpoints/step_K/state.json``, then the ``checkpoints/latest`` pointer file naming ``step_K``,
replaced atomically) and exits 0; at start it resumes from ``latest`` when it exists.
Log lines the tests parse: ``fresh start``, ``resumed from step=K``, ``preempted: saved step=K``, ``done step=N``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=40, help="total steps of the pretend run")
    ap.add_argument("--sleep", type=float, default=0.25, help="seconds per step")
    args = ap.parse_args(argv)
    run_dir = Path(os.environ["RUN_DIR"])
    ckpts = run_dir / "checkpoints"
    if (ckpts / "latest").exists():
        step = int(json.loads((ckpts / (ckpts / "latest").read_text().strip() / "state.json").read_text())["step"])
        print(f"resumed from step={step} (RAY_ADDRESS={os.environ.get('RAY_ADDRESS')})", flush=True)
    else:
        step = 0
        print(f"fresh start (RAY_ADDRESS={os.environ.get('RAY_ADDRESS')})", flush=True)

    stop = {"signal": False}
    signal.signal(signal.SIGUSR1, lambda *_: stop.update(signal=True))
    while step < args.steps:
        if stop["signal"] or (run_dir / "PREEMPT").exists():
            name = f"step_{step:06d}"
            (ckpts / name).mkdir(parents=True, exist_ok=True)
            (ckpts / name / "state.json").write_text(json.dumps({"step": step}))
            (ckpts / "latest.tmp").write_text(name + "\n")
            os.replace(ckpts / "latest.tmp", ckpts / "latest")
            print(f"preempted: saved step={step} (SIGUSR1={stop['signal']})", flush=True)
            return 0
        time.sleep(args.sleep)
        step += 1
        print(f"step {step}", flush=True)
    print(f"done step={step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
