"""Atomic, resumable run checkpoints: ``run_dir/checkpoints/step_000020/`` + a ``latest`` pointer, the last K kept.

A checkpoint is written into a temporary directory (``.tmp-step_000020``), marked complete, renamed into place, and only
then is ``latest`` updated (write-then-``os.replace``, atomic on POSIX). A run killed at any moment therefore leaves
either the previous complete checkpoint as ``latest`` or the new one, never a half-written one, and a restart with the
same command resumes from it. Old checkpoints are deleted only after a newer one is complete, and never those named by
``protect()`` (the best checkpoint, :mod:`da3po_megatron.trainer.best`).

Contents: ``policy/`` (model + optimizer + scheduler + RNG of every policy rank, Megatron dist_checkpointing, written by
the policy ranks; a shared filesystem is assumed on multi-node runs, as on any Slurm cluster) and ``trainer_state.pt``
(step, data position, dynamic-sampling buffer, driver RNG, cumulative counters).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

COMPLETE = "COMPLETE"


class CheckpointManager:
    def __init__(self, run_dir: str | Path, keep_last: int = 3,
                 protect: Callable[[], Iterable[str]] = lambda: ()) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last
        self.protect = protect  # names of step directories that pruning keeps, besides the last keep_last

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        path = self.root / pointer.read_text().strip()
        if not (path / COMPLETE).exists():
            raise RuntimeError(f"{pointer} points to {path}, which is not a complete checkpoint (no {COMPLETE} file); "
                               "remove the pointer to start over or point it to a complete step directory")
        return path

    def save(self, step: int, save_policy: Callable[[Path], Any], trainer_state: dict[str, Any]) -> Path:
        """Write checkpoint ``step`` atomically; returns its final path."""
        self.root.mkdir(parents=True, exist_ok=True)
        name = f"step_{step:06d}"
        tmp = self.root / f".tmp-{name}"
        final = self.root / name
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        save_policy(tmp / "policy")
        torch.save(trainer_state, tmp / "trainer_state.pt")
        (tmp / COMPLETE).write_text(f"{step}\n")
        if final.exists():  # the same step saved again (e.g. a preemption checkpoint after a periodic one)
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = self.root / "latest.tmp"
        pointer_tmp.write_text(name + "\n")
        os.replace(pointer_tmp, self.root / "latest")
        self._prune(keep=final)
        return final

    def load_trainer_state(self, path: Path) -> dict[str, Any]:
        return torch.load(path / "trainer_state.pt", weights_only=False)

    def prune(self) -> None:
        """Delete complete checkpoints beyond the last ``keep_last`` (protected ones excepted) and stale temporaries."""
        self._prune(keep=None)

    def _prune(self, keep: Path | None) -> None:
        protected = set(self.protect())
        steps = sorted(p for p in self.root.glob("step_*") if (p / COMPLETE).exists())
        for old in steps[:-self.keep_last]:
            if old != keep and old.name not in protected:
                shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".tmp-step_*"):
            shutil.rmtree(stale, ignore_errors=True)
