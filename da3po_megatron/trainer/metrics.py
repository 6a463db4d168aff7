"""Metrics sinks and console progress: JSONL always, TensorBoard and Weights & Biases when configured.

``run_dir/metrics.jsonl`` holds one JSON object per step (``{"step": 3, "reward/mean": ..., ...}``); it is the source
of ``tools/plot_curves.py`` and of the algorithm comparison. On resume the file is truncated to the steps before the
checkpoint, so a resumed run's log equals an uninterrupted one.
"""

from __future__ import annotations

import json
import math
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
                 stream=sys.stdout) -> None:
        self.run_dir = Path(run_dir)
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
        """Keep only records with step <= ``step`` (resume from a checkpoint taken at ``step``)."""
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if step > 0 and line.strip() and json.loads(line).get("step", 0) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.path)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
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

