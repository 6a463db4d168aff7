"""Stand-in for the trainer in preemption/requeue tests of slurm/train.sbatch (the same contract, nothing else).

It counts steps; when SIGUSR1 arrives or ``$RUN_DIR/PREEMPT`` exists it saves the counter to
``$RUN_DIR/checkpoints/latest/state.json`` (written to a temporary directory, then renamed) and exits 0; at start it
resumes from that checkpoint when it exists. Log lines the tests parse: ``fresh start``, ``resumed from step=K``,
``preempted: saved step=K``, ``done step=N``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
    latest = run_dir / "checkpoints" / "latest"
    if (latest / "state.json").exists():
        step = int(json.loads((latest / "state.json").read_text())["step"])
        print(f"resumed from step={step} (RAY_ADDRESS={os.environ.get('RAY_ADDRESS')})", flush=True)
    else:
        step = 0
        print(f"fresh start (RAY_ADDRESS={os.environ.get('RAY_ADDRESS')})", flush=True)

    stop = {"signal": False}
    signal.signal(signal.SIGUSR1, lambda *_: stop.update(signal=True))
    while step < args.steps:
        if stop["signal"] or (run_dir / "PREEMPT").exists():
            tmp = latest.with_name("latest.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            (tmp / "state.json").write_text(json.dumps({"step": step}))
            shutil.rmtree(latest, ignore_errors=True)
            tmp.rename(latest)
            print(f"preempted: saved step={step} (SIGUSR1={stop['signal']})", flush=True)
            return 0
        time.sleep(args.sleep)
        step += 1
        print(f"step {step}", flush=True)
    print(f"done step={step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
