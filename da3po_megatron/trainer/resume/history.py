"""A run directory's history is never deleted by a launch: ``trainer.resume=false`` moves the previous run aside.

A run directory holds one run: its checkpoints, ``metrics.jsonl``, the run record ``config.yaml``, the config changes
of its resumes, its logs. ``trainer.resume=true`` (the default) continues it; ``trainer.resume=false`` starts a new
run. Before issue 35 a fresh start in a used directory emptied ``metrics.jsonl`` and kept the checkpoints, so the
next plain relaunch resumed the old run's last checkpoint and appended its steps after the fresh run's rows: two runs
in one log, and the old run's steps gone. Now the fresh start first moves every file of the previous run into
``run_dir/previous-<time>/`` (one ``rename`` per entry: no copy, instant on any filesystem, nothing deleted) and
says so; delete that directory yourself once you do not need it. The lock (``LOCK``, held by the new launch) and
earlier ``previous-*`` directories stay where they are; files that are not the trainer's (anything a user put in the
directory) are not touched.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# what a run writes into its directory (trainer/run.py, metrics.py, checkpoint.py, config_drift.py, console.py)
RUN_ENTRIES = ("checkpoints", "metrics.jsonl", "metrics.dropped.jsonl", "config.yaml", "config_changes.jsonl", "tb",
               "logs", "placement.json", "data_stats.json", "PREEMPT", "wandb")
# what makes a directory "used": a run's history, not only the logs of a launch that failed at start-up
HISTORY = ("checkpoints", "metrics.jsonl", "config.yaml", "config_changes.jsonl")


def _has_content(p: Path) -> bool:
    if p.is_dir():
        return any(p.iterdir())
    return p.exists() and p.stat().st_size > 0


def previous_run(run_dir: str | Path) -> list[Path]:
    """The entries of a previous run in ``run_dir`` (empty when it holds no run's history)."""
    d = Path(run_dir)
    if not any(_has_content(d / name) for name in HISTORY):
        return []
    return [d / name for name in RUN_ENTRIES if (d / name).exists()]


def move_previous_run_aside(run_dir: str | Path, log=print) -> Path | None:
    """For ``trainer.resume=false``: move the previous run of ``run_dir`` into ``run_dir/previous-<time>/`` and say
    so; returns that directory (None when there was no previous run)."""
    entries = previous_run(run_dir)
    if not entries:
        return None
    d = Path(run_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest, k = d / f"previous-{stamp}", 1
    while dest.exists():
        dest, k = d / f"previous-{stamp}.{k}", k + 1
    dest.mkdir()
    for p in entries:
        os.replace(p, dest / p.name)
    ckpts = sorted(x.name for x in (dest / "checkpoints").glob("step_*")) if (dest / "checkpoints").is_dir() else []
    log(f"trainer.resume=false: {d} held a previous run ({', '.join(p.name for p in entries)}"
        + (f"; checkpoints {ckpts[0]}..{ckpts[-1]}" if ckpts else "") + f"); moved it aside to {dest} (nothing "
        "deleted: remove it yourself when it is no longer needed, or set trainer.resume=true to continue it instead)")
    return dest
