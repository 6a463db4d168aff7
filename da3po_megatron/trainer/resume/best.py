"""The best checkpoint by an evaluation metric, kept besides the last K (``trainer.keep_best_metric``).

The paper reports, per run, the best checkpoint over its 200 steps; keeping only the last K checkpoints would lose it.
When an evaluation improves on the best value so far (``trainer.keep_best_mode``: max or min), the loop saves a
checkpoint of that step (also when it is not a ``save_every`` step), and :class:`BestCheckpoint` records it in
``run_dir/checkpoints/best.json`` (``{"metric", "mode", "value", "step", "dir"}``, written with write-then-replace
after the checkpoint is complete). ``CheckpointManager`` never prunes the directory it names, so the best survives any
number of later checkpoints; the file is read back on resume, so it also survives restarts (a file written for another
metric or mode is set aside with a message, and tracking starts over). Ties keep the earlier checkpoint. The step-0
evaluation (the starting policy, not a checkpoint) is not a candidate.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from da3po_megatron.trainer.resume.checkpoint import CheckpointManager

BEST_FILE = "best.json"


class BestCheckpoint:
    def __init__(self, root: str | Path, metric: str, mode: str = "max") -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"trainer.keep_best_mode must be 'max' or 'min', got {mode!r}")
        self.root, self.metric, self.mode = Path(root), metric, mode
        self.state: dict[str, Any] | None = None
        path = self.root / BEST_FILE
        if path.exists():
            state = json.loads(path.read_text())
            if (state.get("metric"), state.get("mode")) == (metric, mode):
                self.state = state
            else:
                print(f"{path} tracks {state.get('metric')!r} ({state.get('mode')}), this run "
                      f"trainer.keep_best_metric={metric!r} ({mode}): tracking starts over; its checkpoint "
                      f"{state.get('dir')} is no longer protected", flush=True)

    @property
    def value(self) -> float | None:
        return None if self.state is None else float(self.state["value"])

    def candidate(self, step: int, metrics: Mapping[str, Any]) -> float | None:
        """The metric's value when ``metrics`` (one step's row) hold an evaluation that beats the best so far, else
        None. Rows without evaluation keys are not candidates; an evaluation without the metric is an error naming the
        field and the keys that exist."""
        if step <= 0 or not any(k.startswith("eval/") for k in metrics):
            return None
        if self.metric not in metrics:
            have = ", ".join(sorted(k for k in metrics if k.startswith("eval/")))
            raise KeyError(f"trainer.keep_best_metric={self.metric!r} is not among this step's evaluation metrics "
                           f"({have})")
        v = float(metrics[self.metric])
        if not math.isfinite(v):
            return None
        best = self.value
        if best is None or (v > best if self.mode == "max" else v < best):
            return v
        return None

    def mark(self, step: int, path: Path, value: float) -> None:
        """Record the complete checkpoint ``path`` of ``step`` as the best (atomic replace of best.json)."""
        self.state = {"metric": self.metric, "mode": self.mode, "value": value, "step": step, "dir": Path(path).name}
        tmp = self.root / (BEST_FILE + ".tmp")
        tmp.write_text(json.dumps(self.state) + "\n")
        os.replace(tmp, self.root / BEST_FILE)

    def protected(self) -> set[str]:
        """Checkpoint directory names that pruning must keep."""
        return {self.state["dir"]} if self.state else set()


def save_checkpoint(ckpt: CheckpointManager, best: BestCheckpoint | None, step: int,
                    save_policy: Callable[[Path], Any], trainer_state: dict[str, Any],
                    best_value: float | None = None) -> Path:
    """Save checkpoint ``step``; with ``best_value``, record it as the best only once it is complete, then prune the
    previous best (until that moment both are protected, so a crash never leaves best.json naming a deleted one)."""
    path = ckpt.save(step, save_policy, trainer_state)
    if best is not None and best_value is not None:
        best.mark(step, path, best_value)
        ckpt.prune()
    return path
