"""Metrics sinks and console progress: JSONL always, TensorBoard and Weights & Biases when configured.

``run_dir/metrics.jsonl`` holds one JSON object per step (``{"step": 3, "reward/mean": ..., ...}``); it is the source
of ``tools/plot_curves.py`` and of the algorithm comparison. On resume the rows after the checkpoint's step (steps the
resumed run redoes, or the record of a failed step) leave the file, so a resumed run's log equals an uninterrupted
one; they are appended to ``run_dir/metrics.dropped.jsonl`` (each with ``"dropped_at"``), never deleted. A fresh
start (``trainer.resume=false``) in a used directory moves the previous run aside first (``trainer/resume/history.py``),
so rows of two runs never meet in one file.

``before_write`` (``trainer/resume/lock.py``'s guard) runs before every row: a trainer whose run-directory lock was
taken over stops before it writes.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

_WALL_CLOCK_KEYS = ("train/time_s", "train/tokens_per_s", "sync/seconds", "sync/gbps")


def is_wall_clock(key: str) -> bool:
    """Whether a logged metric is a wall-clock measurement (or a rate from one): the keys in which two runs that are
    otherwise bit-identical -- an uninterrupted run and a resumed one -- may differ. ``time/*`` phases, ``perf/*``,
    the trainer's and the weight sync's seconds and rates (``sync/*_s``)."""
    return key.startswith(("time/", "perf/")) or key in _WALL_CLOCK_KEYS or (
        key.startswith("sync/") and key.endswith("_s"))


def _clean(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsLogger:
    """Writes step metrics to JSONL (+ TensorBoard, + W&B) and prints a progress line with ETA."""

    def __init__(self, run_dir: str | Path, total_steps: int, start_step: int = 0, tensorboard: bool = True,
                 wandb_project: str = "", run_name: str = "", config: dict | None = None,
                 stream=sys.stdout, before_write=lambda: None) -> None:
        self.run_dir = Path(run_dir)
        self.before_write = before_write
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.total_steps = total_steps
        self.start_step = start_step
        self.stream = stream
        self._t0 = time.perf_counter()
        self._truncate_after(start_step)
        self._jsonl = self.path.open("a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=start_step + 1)
        self._wandb = None
        if wandb_project:
            import wandb

            self._wandb = wandb.init(project=wandb_project, name=run_name or self.run_dir.name, config=config,
                                     resume="allow")

    def _truncate_after(self, step: int) -> None:
        """Keep only records with step <= ``step`` (resume from a checkpoint taken at ``step``; 0: none); the others
        go to ``metrics.dropped.jsonl`` first (a crash in between leaves a row in both files, never in neither)."""
        if not self.path.exists():
            return
        kept, dropped = [], []
        for line in self.path.read_text().splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:  # a line cut by a kill during its write: kept aside as it is
                dropped.append(json.dumps({"dropped_at": self._now(), "unparsable": line}))
                continue
            if step > 0 and row.get("step", 0) <= step:
                kept.append(line)
            else:
                dropped.append(json.dumps({**row, "dropped_at": self._now()}))
        if not dropped:
            return
        with open(self.run_dir / "metrics.dropped.jsonl", "a") as f:
            f.write("".join(line + "\n" for line in dropped))
            f.flush()
            os.fsync(f.fileno())
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.path)
        steps = sorted({json.loads(x).get("step", "?") for x in dropped}, key=str)
        print(f"metrics: {len(dropped)} row(s) after step {step} (steps {', '.join(map(str, steps))}) moved from "
              f"{self.path.name} to metrics.dropped.jsonl (the resumed run redoes them)", file=self.stream, flush=True)

    @staticmethod
    def _now() -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%S")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        self.before_write()
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, int | float) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(record, step=step)
        self._progress(step, record)

    def _progress(self, step: int, r: dict[str, Any]) -> None:
        done = step - self.start_step
        elapsed = time.perf_counter() - self._t0
        eta = elapsed / max(done, 1) * (self.total_steps - step)
        width = 20
        filled = int(width * step / max(self.total_steps, 1))
        bar = "#" * filled + "-" * (width - filled)

        def f(key: str, fmt: str = "{:.3f}") -> str:
            v = r.get(key)
            return fmt.format(v) if isinstance(v, int | float) else "-"

        evals = [f"{k.removeprefix('eval/')} {v:.3f}" for k, v in r.items()
                 if k.startswith("eval/") and k.count("/") == 2 and isinstance(v, float)][:4]
        if "acc/mean" not in r:  # an evaluation-only record (step 0: the starting policy)
            print(f"[{bar}] step {step}/{self.total_steps} | eval: {', '.join(evals)}", file=self.stream, flush=True)
            return
        print(f"[{bar}] step {step}/{self.total_steps} | acc {f('acc/mean')} | reward {f('reward/mean')} | "
              f"kept {f('filter/kept_groups', '{:.0f}')}/{f('gen/groups', '{:.0f}')} groups in "
              f"{f('gen/rounds', '{:.0f}')} rounds | daa {f('daa/activation_frac', '{:.2f}')} | "
              f"loss {f('train/loss', '{:.4f}')} | {f('time/step', '{:.1f}')} s/step | "
              f"ETA {time.strftime('%H:%M:%S', time.gmtime(eta))}" + (f" | eval: {', '.join(evals)}" if evals else ""),
              file=self.stream, flush=True)

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

