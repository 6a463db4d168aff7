"""Training curves from the trainer's ``RUN_DIR/metrics.jsonl``, several runs overlaid (the paper's Figure 3 and the
diagnostics behind it).

Input: one JSON object per line, with ``step`` and any of the keys below; a key missing from a line (eval runs only
every few steps) or from a whole run is skipped, a line that is not valid JSON (a run killed mid-write) is skipped
with a warning, and a step logged twice (resume) keeps its last value.

Figures written (PNG, one per quantity, plus ``overview.png`` with all of them):

  reward.png          ``reward/mean``              mean shaped reward R = R_acc + R_len of the rollouts
  accuracy.png        ``acc/mean``                 fraction of correct rollouts (R_acc > 0)
  eval_<bench>.png    ``eval/<bench>/avg@k``       validation avg@k; ``eval_aime24.png`` is Figure 3 of the paper
                      (``avg@32``-style keys with the number are accepted too)
  daa_activation.png  ``daa/activation_frac``      fraction of responses whose advantage DAA amplified (Eq. 14)
  filtered.png        ``filter/frac_filtered``     fraction of groups thrown away by dynamic sampling (p_hat in {0,1})

The x axis is the training step, or ``gen/cumulative_samples`` (responses generated so far) with ``x="samples"``:
dynamic sampling makes steps cost different numbers of samples, so the sample axis is the fair one for comparing
DAPO-style runs with GRPO. Left out: confidence bands across seeds, wall-clock axes.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections.abc import Sequence
from pathlib import Path

__all__ = ["PANELS", "discover_eval_keys", "plot_runs", "read_metrics"]

# (file stem, metrics key, title, y label)
PANELS: list[tuple[str, str, str, str]] = [
    ("reward", "reward/mean", "Training reward", "mean R"),
    ("accuracy", "acc/mean", "Training accuracy", "fraction correct"),
    ("daa_activation", "daa/activation_frac", "DAA activation (Eq. 14)", "fraction of responses amplified"),
    ("filtered", "filter/frac_filtered", "Dynamic sampling: filtered groups", "fraction filtered"),
]
_EVAL_RE = re.compile(r"^eval/([^/]+)/avg@(k|\d+)$")
_X_KEYS = {"step": "step", "samples": "gen/cumulative_samples"}


def read_metrics(run: str | os.PathLike) -> list[dict]:
    """The rows of ``run/metrics.jsonl`` (or of the given .jsonl file), sorted by step, last write of a step wins."""
    path = Path(run)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics file (the trainer writes RUN_DIR/metrics.jsonl)")
    by_step: dict[float, dict] = {}
    bad = 0
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            if not isinstance(row, dict) or not _is_number(row.get("step")):
                bad += 1
                continue
            by_step.setdefault(row["step"], {}).update(row)
    if bad:
        warnings.warn(f"{path}: skipped {bad} line(s) that are not JSON objects with a numeric 'step'", stacklevel=2)
    return [by_step[s] for s in sorted(by_step)]


def discover_eval_keys(runs: Sequence[Sequence[dict]]) -> dict[str, list[str]]:
    """{benchmark: [metrics keys]} of all ``eval/<bench>/avg@k`` keys present in any run (AIME24 first)."""
    found: dict[str, set[str]] = {}
    for rows in runs:
        for row in rows:
            for key in row:
                m = _EVAL_RE.match(key)
                if m:
                    found.setdefault(m.group(1), set()).add(key)
    order = sorted(found, key=lambda b: (b != "aime24", b))
    return {b: sorted(found[b]) for b in order}


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _series(rows: Sequence[dict], keys: Sequence[str], x_key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for row in rows:
        x = row.get(x_key)
        y = next((row[k] for k in keys if _is_number(row.get(k))), None)
        if _is_number(x) and y is not None:
            xs.append(float(x))
            ys.append(float(y))
    return xs, ys


def _ema(ys: list[float], alpha: float) -> list[float]:
    if alpha <= 0 or not ys:
        return ys
    out, acc = [], ys[0]
    for y in ys:
        acc = alpha * acc + (1 - alpha) * y
        out.append(acc)
    return out


def plot_runs(run_dirs: Sequence[str | os.PathLike], out_dir: str | os.PathLike,
              labels: Sequence[str] | None = None, x: str = "step", smooth: float = 0.0) -> list[Path]:
    """Overlay the runs' curves; write one PNG per quantity present in at least one run, plus ``overview.png``.

    ``labels``: legend names (default: run directory names). ``x``: "step" or "samples". ``smooth``: exponential
    moving-average factor in [0, 1) applied to training curves (not to eval curves). Returns the written paths.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if x not in _X_KEYS:
        raise ValueError(f"plot_runs: x must be one of {sorted(_X_KEYS)}, got {x!r}")
    if not 0 <= smooth < 1:
        raise ValueError(f"plot_runs: smooth must be in [0, 1), got {smooth}")
    if not run_dirs:
        raise ValueError("plot_runs: no run directories given")
    runs = [read_metrics(r) for r in run_dirs]
    if labels is None:
        labels = [Path(r).name if Path(r).is_dir() else Path(r).parent.name for r in run_dirs]
    if len(labels) != len(runs):
        raise ValueError(f"plot_runs: {len(labels)} labels for {len(runs)} runs")
    x_key = _X_KEYS[x]
    x_label = "training step" if x == "step" else "responses generated"

    # order: reward, accuracy, validation curves (AIME24 first), DAA activation, filtered fraction
    train = [(s, [k], t, y, False) for s, k, t, y in PANELS]
    evals = [(f"eval_{bench}", keys, f"Validation {bench} avg@k" + (" (Figure 3)" if bench == "aime24" else ""),
              "avg@k", True) for bench, keys in discover_eval_keys(runs).items()]
    panels = train[:2] + evals + train[2:]

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    drawn: list[tuple[str, list[str], str, str, bool]] = []
    written: list[Path] = []
    for panel in panels:
        stem, keys, title, ylabel, is_eval = panel
        series = [_series(rows, keys, x_key) for rows in runs]
        if not any(xs for xs, _ in series):
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        _draw(ax, series, labels, title, x_label, ylabel, is_eval, smooth)
        fig.tight_layout()
        path = out / f"{stem}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
        drawn.append(panel)
    if drawn:
        cols = min(3, len(drawn))
        nrows = math.ceil(len(drawn) / cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
        for ax, (_, keys, title, ylabel, is_eval) in zip(axes.flat, drawn):
            _draw(ax, [_series(rows, keys, x_key) for rows in runs], labels, title, x_label, ylabel, is_eval, smooth)
        for ax in list(axes.flat)[len(drawn):]:
            ax.set_visible(False)
        fig.tight_layout()
        path = out / "overview.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    else:
        warnings.warn(f"plot_runs: none of the known keys found in {list(map(str, run_dirs))}", stacklevel=2)
    return written


def _draw(ax, series, labels, title, x_label, ylabel, is_eval, smooth) -> None:
    for i, ((xs, ys), label) in enumerate(zip(series, labels)):
        if not xs:
            continue
        color = f"C{i % 10}"  # a run keeps its colour on every panel, even where other runs lack the key
        if is_eval:
            ax.plot(xs, ys, marker="o", markersize=3, label=label, color=color)
        else:
            ax.plot(xs, _ema(ys, smooth), label=label, color=color)
    ax.set_title(title)
    ax.set_xlabel(x_label)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if sum(bool(xs) for xs, _ in series) > 0:
        ax.legend(fontsize=8)
