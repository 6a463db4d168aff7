"""Compute-matched algorithm comparison: a grid of {method} x {seed} training runs through the real trainer, and the
report that answers "does DAA help?" at equal training steps AND at equal generated samples.

Why two axes: dynamic sampling (DAPO, DA3PO) throws away groups with p_hat in {0, 1} and over-samples prompts until the
batch is full, so one of its steps costs more generated samples (and tokens) than a GRPO/GSPO step. The paper compares
checkpoints at equal steps; a user paying for generation also wants equal samples. Both are reported.

What the report holds (all numbers are mean +- std over seeds, std with ddof=1):

- **equal steps**: at the last step where every run has a held-out evaluation, held-out avg@k and greedy accuracy
  overall and per difficulty bucket, and training (rollout) accuracy per bucket (trailing mean of the last ``window``
  steps, because one step's rollout accuracy is noisy);
- **equal generated samples**: at budgets B (default: the largest budget every run reached, and half of it), each
  run's curve is **linearly interpolated** in ``gen/cumulative_samples`` (responses generated so far, filtered groups
  and discarded surplus included). Held-out curves are interpolated between their evaluation points (the step-0 record
  holds the starting policy's eval at 0 samples); training curves are the trailing-mean series interpolated the same
  way. No extrapolation: a run that did not reach B has no value at B (and B is chosen so that every run reached it);
- **verdict**: each method with DAA (Eq. 14) against the same algorithm without DAA (da3po vs dapo; grpo:lambda vs
  grpo; ...), and against the other baselines, on held-out avg@k overall and on the *hard* buckets (those where the
  starting policy's held-out avg@k is below ``daa.tau`` = 0.5, the p_hat < tau regime where DAA acts). A difference of
  seed means counts as significant only beyond ``z`` (= 2) standard errors, SE = sqrt(s_a^2/n_a + s_b^2/n_b); with
  three seeds this is a coarse screen, and the text says so. The verdict sentences are generated from the numbers;
  nothing is hard-coded;
- PNG curves (mean line, +-std band over seeds): training accuracy vs steps / generated samples / generated tokens,
  held-out avg@k vs steps / samples (overall and per bucket), held-out avg@k per bucket at equal steps, the filtered
  fraction, DAA activation, and the Theorem 3.1 diagnostic (mean advantage on kept / all groups vs alpha+ / alpha-);
- the raw ``metrics.jsonl`` of every run, copied.

The grid runner starts ``python -m da3po_megatron.cli train --config BASE model.path=... trainer.run_dir=...
trainer.seed=... trainer.total_steps=... <method overrides>`` per run, sequentially; it is resumable: a run whose
``DONE`` marker or ``metrics.jsonl`` shows the requested final step is skipped, an unfinished one is simply started
again (the trainer resumes from its latest checkpoint). The warm-up starting policy (:mod:`da3po_megatron.data.warmup`)
is built once and shared by every run.

Left out: parallel runs (2 cores), significance tests beyond the 2-SE screen (no t-distribution, no multiple-comparison
correction), math-benchmark evals (the report reads ``eval/synthetic/*``; other ``eval/<bench>/avg@k`` keys are
plotted by ``eval.curves``), wall-clock-matched comparisons.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from da3po_megatron.eval.curves import read_metrics

__all__ = [
    "Comparison",
    "Method",
    "RunSpec",
    "build_report",
    "compare_means",
    "curve_at",
    "grid_specs",
    "interp_at",
    "load_grid",
    "mean_std",
    "parse_methods",
    "run_grid",
    "run_status",
    "trailing_mean",
]

ALGORITHMS = ("grpo", "dapo", "gspo", "da3po")
DONE_MARKER = "DONE"
_EVAL_AVG_RE = re.compile(r"^eval/synthetic/avg@(\d+)$")
_BUCKET_RE = re.compile(r"^gen/acc_bucket/(\d+)$")
_EVAL_BUCKET_RE = re.compile(r"^eval/synthetic/bucket(\d+)/")


# ======================================================================================================================
# Methods and the grid


@dataclass(frozen=True)
class Method:
    """One column of the comparison: a label (``da3po:2``) and the config overrides that make it."""

    label: str
    algorithm: str
    overrides: tuple[str, ...]
    daa: bool

    @property
    def slug(self) -> str:
        """Directory-safe name: ``da3po:1.5`` -> ``da3po_1.5``."""
        return re.sub(r"[^A-Za-z0-9_.-]", "_", self.label)

    @property
    def filters(self) -> bool:
        """Dynamic sampling on (the preset's default)."""
        return self.algorithm in ("dapo", "da3po")

    @property
    def baseline(self) -> str:
        """Label of the same algorithm without DAA (da3po -> dapo)."""
        return "dapo" if self.algorithm == "da3po" else self.algorithm


def parse_method(spec: str) -> Method:
    """``grpo`` | ``dapo`` | ``gspo`` | ``da3po`` (paper lambda) | ``da3po:<lambda>`` | ``da3po:adaptive``;
    ``grpo:<lambda>`` / ``gspo:<lambda>`` / ``dapo:<lambda>`` turn DAA on for that algorithm (the paper: DAA "only
    modifies Dynamic Sampling", it applies to GRPO/GSPO too)."""
    name, _, param = spec.strip().partition(":")
    if name not in ALGORITHMS:
        raise ValueError(f"method {spec!r}: algorithm must be one of {list(ALGORITHMS)}, e.g. 'da3po:2' or 'grpo'")
    ov = [f"algorithm.name={name}"]
    daa = name == "da3po"
    if param:
        daa = True
        if name != "da3po":
            ov.append("daa.enable=true")
        if param == "adaptive":
            ov.append("daa.mode=adaptive")
        else:
            try:
                lam = float(param)
            except ValueError:
                raise ValueError(f"method {spec!r}: the part after ':' must be a lambda (number > 0) or 'adaptive'"
                                 ) from None
            if lam <= 0:
                raise ValueError(f"method {spec!r}: lambda must be > 0, got {lam}")
            ov += ["daa.mode=constant", f"daa.lambda_={lam:g}"]
    elif name != "da3po":
        ov.append("daa.enable=false")
    return Method(label=spec.strip(), algorithm=name, overrides=tuple(ov), daa=daa)


def parse_methods(csv: str | Sequence[str]) -> list[Method]:
    items = [s for s in (csv.split(",") if isinstance(csv, str) else csv) if s.strip()]
    methods = [parse_method(s) for s in items]
    labels = [m.label for m in methods]
    dup = {x for x in labels if labels.count(x) > 1}
    if dup:
        raise ValueError(f"methods listed twice: {sorted(dup)}")
    if not methods:
        raise ValueError("no methods given (e.g. --methods grpo,dapo,da3po:2)")
    return methods


@dataclass
class RunSpec:
    method: Method
    seed: int
    run_dir: Path
    steps: int


def grid_specs(methods: Sequence[Method], seeds: Sequence[int], steps: int, runs_root: str | Path) -> list[RunSpec]:
    """Seed-major order, so that an interrupted grid has complete seeds of every method rather than all seeds of one."""
    root = Path(runs_root)
    return [RunSpec(m, s, root / m.slug / f"seed{s}", steps) for s in seeds for m in methods]


def last_step(run_dir: str | Path) -> int:
    """The largest step in ``run_dir/metrics.jsonl`` (0 when absent or empty; unreadable lines are ignored)."""
    p = Path(run_dir) / "metrics.jsonl"
    best = 0
    if p.exists():
        for line in p.read_text().splitlines():
            try:
                best = max(best, int(json.loads(line).get("step", 0)))
            except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
                continue
    return best


def run_status(run_dir: str | Path, steps: int) -> str:
    """``done`` (DONE marker with >= steps, or metrics.jsonl reaching ``steps``), ``partial`` (something there: the
    trainer will resume from its latest checkpoint) or ``new``."""
    d = Path(run_dir)
    marker = d / DONE_MARKER
    if marker.exists():
        try:
            if int(json.loads(marker.read_text()).get("total_steps", 0)) >= steps:
                return "done"
        except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
            pass  # a damaged marker: fall back to the metrics
    if last_step(d) >= steps:
        return "done"
    return "partial" if d.exists() and any(d.iterdir()) else "new"


def train_command(spec: RunSpec, base_config: str | Path, model_path: str | Path, extra: Sequence[str] = (),
                  python: str = sys.executable) -> list[str]:
    """The trainer subprocess of one run (extra overrides last, so they win)."""
    return [python, "-m", "da3po_megatron.cli", "train", "--config", str(base_config),
            f"model.path={model_path}", f"trainer.run_dir={spec.run_dir}", f"trainer.seed={spec.seed}",
            f"trainer.total_steps={spec.steps}", f"trainer.experiment_name={spec.method.slug}-seed{spec.seed}",
            *spec.method.overrides, *extra]


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


class Stop(Exception):
    """The grid runner was asked to stop (SIGUSR1 / SIGTERM): the current run checkpointed and exited."""


def _run_logged(cmd: list[str], log_path: Path, timeout_s: float | None) -> tuple[int, float]:
    """Run ``cmd`` in its own process group, stdout+stderr appended to ``log_path``.

    SIGUSR1 / SIGTERM to this process (Slurm's time-limit warning, scancel) is forwarded to the child as SIGUSR1 --
    the trainer checkpoints after its current step and exits -- and then :class:`Stop` is raised so the grid ends;
    the next invocation resumes. On timeout: the same SIGUSR1, then SIGKILL of the group after 180 s.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    stop = []
    with log_path.open("a") as log:
        log.write(f"\n$ {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_child_env(), start_new_session=True)

        def forward(signum, frame) -> None:  # noqa: ARG001
            stop.append(signum)
            if proc.poll() is None:
                proc.send_signal(signal.SIGUSR1)  # the driver only: SIGUSR1 would kill its helper processes

        old = {s: signal.signal(s, forward) for s in (signal.SIGUSR1, signal.SIGTERM)}
        try:
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGUSR1)
                try:
                    proc.wait(timeout=180)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                rc = 124
            except KeyboardInterrupt:
                proc.send_signal(signal.SIGUSR1)
                proc.wait(timeout=180)
                raise
        finally:
            for s, h in old.items():
                signal.signal(s, h)
    if stop:
        raise Stop(f"signal {stop[0]}: {shlex.join(cmd[:6])} ... checkpointed and exited (exit {rc})")
    return rc, time.perf_counter() - t0


def ensure_warmup(warmup_dir: str | Path, warmup_args: Sequence[str] = (), log: Callable[[str], None] = print,
                  source: str | Path | None = None) -> Path:
    """The grid's starting policy in ``warmup_dir``, made once: kept if present; else a copy of ``source`` (built
    there first if missing); else built in place with ``python -m da3po_megatron.data.warmup --out DIR ...``."""
    d = Path(warmup_dir)
    if (d / "warmup_report.json").exists():
        log(f"warm-up: reusing {d} (sha256 {warmup_digest(d)[:12]})")
        return d
    target = Path(source) if source else d
    if not (target / "warmup_report.json").exists():
        cmd = [sys.executable, "-m", "da3po_megatron.data.warmup", "--out", str(target), *warmup_args]
        log(f"warm-up: {shlex.join(cmd)}")
        rc, wall = _run_logged(cmd, target.parent / f"{target.name}.log", None)
        if rc != 0 or not (target / "warmup_report.json").exists():
            raise RuntimeError(f"warm-up failed (exit {rc}); see {target.parent / (target.name + '.log')}")
        log(f"warm-up: done in {wall:.0f} s")
    if target != d:
        shutil.copytree(target, d)
        (d / "SOURCE").write_text(f"copied from {target}\n")
        log(f"warm-up: snapshot of {target} -> {d}")
    log(f"warm-up: {d} (sha256 {warmup_digest(d)[:12]})")
    return d


def warmup_digest(warmup_dir: str | Path) -> str:
    """sha256 of the starting policy's weights (``*.safetensors``), to show that every run started from it."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted(Path(warmup_dir).glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


def run_grid(specs: Sequence[RunSpec], base_config: str | Path, model_path: str | Path, extra: Sequence[str] = (),
             timeout_s: float | None = None, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run every unfinished spec (sequentially); returns one record per spec (status, exit code, wall seconds).

    A failed run is recorded and the grid continues: the report then names it. Each run dir gets ``train.log`` (the
    trainer's output), ``compare_run.json`` (commands, attempts, wall seconds) and, on success, ``DONE``.
    """
    records = []
    for i, spec in enumerate(specs, 1):
        name = f"{spec.method.label} seed {spec.seed}"
        status = run_status(spec.run_dir, spec.steps)
        rec: dict[str, Any] = {"method": spec.method.label, "seed": spec.seed, "run_dir": str(spec.run_dir),
                               "before": status}
        if status == "done":
            log(f"[{i}/{len(specs)}] {name}: done, skipped")
            records.append({**rec, "rc": 0, "wall_s": 0.0, "status": "done"})
            continue
        cmd = train_command(spec, base_config, model_path, extra)
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        info_path = spec.run_dir / "compare_run.json"
        info = json.loads(info_path.read_text()) if info_path.exists() else {"attempts": []}
        prev = [a["cmd"] for a in info["attempts"]]
        if prev and _without_steps(prev[-1]) != _without_steps(cmd):
            warnings.warn(f"{spec.run_dir}: the command differs from the previous attempt's (other than the step "
                          "count); the resumed run mixes settings", stacklevel=2)
        log(f"[{i}/{len(specs)}] {name}: {'resuming' if status == 'partial' else 'starting'} "
            f"(log: {spec.run_dir / 'train.log'})")
        from_step = last_step(spec.run_dir)
        commit = _git_commit()
        rc, wall = _run_logged(cmd, spec.run_dir / "train.log", timeout_s)
        info["attempts"].append({"cmd": cmd, "rc": rc, "wall_s": round(wall, 1), "from_step": from_step,
                                 "to_step": last_step(spec.run_dir), "git": commit,
                                 "finished_at": time.strftime("%Y-%m-%d %H:%M:%S")})
        info["wall_s_total"] = round(sum(a["wall_s"] for a in info["attempts"]), 1)
        info_path.write_text(json.dumps(info, indent=2) + "\n")
        reached = last_step(spec.run_dir)
        ok = rc == 0 and reached >= spec.steps
        if ok:
            (spec.run_dir / DONE_MARKER).write_text(json.dumps({"total_steps": spec.steps, "wall_s":
                                                                info["wall_s_total"]}) + "\n")
        log(f"[{i}/{len(specs)}] {name}: {'done' if ok else f'FAILED (exit {rc}, reached step {reached})'} "
            f"in {wall:.0f} s")
        records.append({**rec, "rc": rc, "wall_s": wall, "status": "done" if ok else "failed"})
    return records


def _git_commit() -> str:
    """HEAD of the checkout the runs execute (+ "-dirty" with uncommitted changes), recorded per attempt."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _without_steps(cmd: Sequence[str]) -> list[str]:
    return [c for c in cmd if not c.startswith("trainer.total_steps=")]


# ======================================================================================================================
# Loading and statistics


def load_grid(specs: Sequence[RunSpec]) -> dict[str, dict[int, list[dict]]]:
    """{method label: {seed: metrics rows}} for every spec whose run has a metrics.jsonl (others are left out)."""
    grid: dict[str, dict[int, list[dict]]] = {}
    for s in specs:
        p = s.run_dir / "metrics.jsonl"
        if p.exists():
            rows = read_metrics(p)
            if rows:
                grid.setdefault(s.method.label, {})[s.seed] = rows
    return grid


def mean_std(values: Sequence[float]) -> tuple[float, float, int]:
    """(mean, sample std with ddof=1 -- 0 for one value, n) of the finite values; (nan, nan, 0) when none."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=np.float64)
    if v.size == 0:
        return math.nan, math.nan, 0
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0, int(v.size)


def interp_at(xs: Sequence[float], ys: Sequence[float], x: float) -> float | None:
    """Linear interpolation of the points (xs increasing) at ``x``; None outside [xs[0], xs[-1]] (no extrapolation).
    Repeated xs keep their last y (a step that generated nothing new)."""
    pts: dict[float, float] = {}
    for a, b in zip(xs, ys, strict=True):
        if a is not None and b is not None and math.isfinite(a) and math.isfinite(b):
            pts[float(a)] = float(b)
    if not pts:
        return None
    px = sorted(pts)
    if x < px[0] - 1e-9 or x > px[-1] + 1e-9:
        return None
    return float(np.interp(x, px, [pts[a] for a in px]))


def trailing_mean(ys: Sequence[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at each position (fewer at the start)."""
    if window < 1:
        raise ValueError(f"trailing_mean: window must be >= 1, got {window}")
    out = []
    for i in range(len(ys)):
        chunk = ys[max(0, i - window + 1): i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def _x_of(row: dict, x_key: str) -> float | None:
    if x_key == "step":
        return float(row["step"])
    v = row.get(x_key)
    if isinstance(v, int | float) and not isinstance(v, bool):
        return float(v)
    return 0.0 if row.get("step") == 0 else None  # the step-0 record (starting policy): nothing generated yet


def series(rows: Sequence[dict], key: str, x_key: str = "step", window: int = 1) -> tuple[list[float], list[float]]:
    """(x, y) of ``key`` over the rows that have it (and x); ``window`` > 1 applies :func:`trailing_mean` to y."""
    xs, ys = [], []
    for r in rows:
        y, x = r.get(key), _x_of(r, x_key)
        if isinstance(y, int | float) and not isinstance(y, bool) and math.isfinite(y) and x is not None:
            xs.append(x)
            ys.append(float(y))
    return xs, (trailing_mean(ys, window) if window > 1 else ys)


def curve_at(rows: Sequence[dict], key: str, x: float, x_key: str = "step", window: int = 1) -> float | None:
    """``key`` of one run at ``x`` (a step or a cumulative-sample budget), interpolated; None if not reached."""
    xs, ys = series(rows, key, x_key, window)
    return interp_at(xs, ys, x)


@dataclass
class Comparison:
    """Difference of seed means a - b with its standard error and the z-screen's outcome."""

    a: str
    b: str
    diff: float
    se: float
    n_a: int
    n_b: int
    outcome: str  # "better" | "worse" | "no significant difference" | "undetermined"


def compare_means(a_label: str, a: Sequence[float], b_label: str, b: Sequence[float], z: float = 2.0) -> Comparison:
    """``a`` vs ``b`` (per-seed values): significant iff |mean_a - mean_b| > z * sqrt(s_a^2/n_a + s_b^2/n_b).
    Fewer than 2 seeds on either side: "undetermined" (no variance estimate)."""
    ma, sa, na = mean_std(a)
    mb, sb, nb = mean_std(b)
    if na == 0 or nb == 0:
        return Comparison(a_label, b_label, math.nan, math.nan, na, nb, "undetermined")
    diff = ma - mb
    if na < 2 or nb < 2:
        return Comparison(a_label, b_label, diff, math.nan, na, nb, "undetermined")
    se = math.sqrt(sa**2 / na + sb**2 / nb)
    if abs(diff) > z * se and diff != 0:
        outcome = "better" if diff > 0 else "worse"
    else:
        outcome = "no significant difference"
    return Comparison(a_label, b_label, diff, se, na, nb, outcome)


# ======================================================================================================================
# The report


def _keys(grid: dict[str, dict[int, list[dict]]]) -> tuple[int | None, list[int]]:
    """(k of eval/synthetic/avg@k, sorted difficulty buckets) present in the logs."""
    ks, buckets = set(), set()
    for runs in grid.values():
        for rows in runs.values():
            for r in rows:
                for key in r:
                    if m := _EVAL_AVG_RE.match(key):
                        ks.add(int(m.group(1)))
                    elif m := _BUCKET_RE.match(key) or _EVAL_BUCKET_RE.match(key):
                        buckets.add(int(m.group(1)))
    return (max(ks) if ks else None), sorted(buckets)


def start_evals(grid: dict[str, dict[int, list[dict]]], key: str) -> dict[str, float]:
    """{"<method> seed <k>": step-0 value of ``key``} -- equal for all runs when they share the starting policy (the
    step-0 eval samples with a fixed seed)."""
    out = {}
    for label, runs in grid.items():
        for seed, rows in runs.items():
            if rows and rows[0].get("step") == 0 and isinstance(rows[0].get(key), int | float):
                out[f"{label} seed {seed}"] = float(rows[0][key])
    return out


def _fmt(m: float, s: float, n: int, pct: bool = True) -> str:
    if n == 0 or not math.isfinite(m):
        return "--"
    f = 100.0 if pct else 1.0
    return f"{m * f:.1f} ± {s * f:.1f}" if pct else f"{m:,.0f} ± {s:,.0f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


@dataclass
class Point:
    """Where a table is read: at a step (x_key='step') or at a cumulative-sample budget."""

    name: str
    x_key: str
    x: float


def _values(grid, method: str, key: str, pt: Point, window: int = 1) -> list[float]:
    vals = []
    for rows in grid.get(method, {}).values():
        v = curve_at(rows, key, pt.x, pt.x_key, window)
        if v is not None:
            vals.append(v)
    return vals


def _hard_value(rows: Sequence[dict], hard: Sequence[int], metric: str, pt: Point) -> float | None:
    vals = [curve_at(rows, f"eval/synthetic/bucket{b}/{metric}", pt.x, pt.x_key) for b in hard]
    return None if not vals or any(v is None for v in vals) else sum(vals) / len(vals)


@dataclass
class ReportData:
    methods: list[Method]
    grid: dict[str, dict[int, list[dict]]]
    k: int | None
    buckets: list[int]
    hard: list[int]
    start_acc: dict[int, float]
    step_point: Point | None
    sample_points: list[Point]
    window: int
    z: float
    tau: float
    hard_rule: str = ""


def _eval_steps(rows: Sequence[dict], key: str) -> set[int]:
    return {int(r["step"]) for r in rows if isinstance(r.get(key), int | float)}


def choose_points(grid, key: str | None) -> tuple[Point | None, list[Point]]:
    """The equal-steps point (the last step where every run has ``key``) and the equal-samples budgets (the largest
    budget every run reached, and half of it)."""
    all_rows = [rows for runs in grid.values() for rows in runs.values()]
    if not all_rows:
        return None, []
    step_pt = None
    if key:
        common = set.intersection(*(_eval_steps(rows, key) for rows in all_rows))
        common.discard(0)
        if common:
            step_pt = Point(f"step {max(common)}", "step", float(max(common)))
    if step_pt is None:
        s = min(int(rows[-1]["step"]) for rows in all_rows)
        step_pt = Point(f"step {s}", "step", float(s)) if s > 0 else None
    finals = [max((r["gen/cumulative_samples"] for r in rows if isinstance(r.get("gen/cumulative_samples"),
                                                                          int | float)), default=0.0)
              for rows in all_rows]
    budget = min(finals)
    pts = [Point(f"{b:,.0f} samples", "gen/cumulative_samples", float(b)) for b in (budget / 2, budget) if b > 0]
    return step_pt, pts


def prepare(methods: Sequence[Method], grid: dict[str, dict[int, list[dict]]], window: int = 5, z: float = 2.0,
            tau: float = 0.5, start_acc: dict[int, float] | None = None) -> ReportData:
    k, buckets = _keys(grid)
    key = f"eval/synthetic/avg@{k}" if k else None
    step_pt, sample_pts = choose_points(grid, key)
    if start_acc is None:  # the starting policy's held-out avg@k per bucket: the step-0 eval, averaged over runs
        start_acc = {}
        for b in buckets:
            vals = [r.get(f"eval/synthetic/bucket{b}/avg@{k}") for runs in grid.values() for rows in runs.values()
                    for r in rows[:1] if r.get("step") == 0]
            m, _, n = mean_std([v for v in vals if isinstance(v, int | float)])
            if n:
                start_acc[b] = m
    hard = [b for b in buckets if b in start_acc and start_acc[b] < tau]
    hard_rule = f"starting held-out avg@k < tau = {tau:g}, where DAA acts"
    if not hard and start_acc:  # a strong starting policy: the hardest quarter of the buckets (at least one)
        n = max(1, len(start_acc) // 4)
        hard = sorted(sorted(start_acc, key=lambda b: start_acc[b])[:n])
        hard_rule = (f"no bucket starts below tau = {tau:g}, so the {n} with the lowest starting held-out avg@k; "
                     "DAA acts on their prompts with p_hat < tau")
    return ReportData(list(methods), grid, k, buckets, hard, start_acc, step_pt, sample_pts, window, z, tau,
                      hard_rule)


def _heldout_table(d: ReportData, pt: Point, metric: str) -> tuple[str, dict]:
    header = ["method", "seeds", "all"] + (["hard"] if d.hard else []) + [f"b{b}" for b in d.buckets]
    rows, summ = [], {}
    for m in d.methods:
        runs = d.grid.get(m.label, {})
        all_v = _values(d.grid, m.label, f"eval/synthetic/{metric}", pt)
        row = [m.label, str(len(runs)), _fmt(*mean_std(all_v))]
        summ[m.label] = {"all": mean_std(all_v)}
        if d.hard:
            hv = [v for rows_ in runs.values() if (v := _hard_value(rows_, d.hard, metric, pt)) is not None]
            row.append(_fmt(*mean_std(hv)))
            summ[m.label]["hard"] = mean_std(hv)
        for b in d.buckets:
            bv = _values(d.grid, m.label, f"eval/synthetic/bucket{b}/{metric}", pt)
            row.append(_fmt(*mean_std(bv)))
            summ[m.label][f"b{b}"] = mean_std(bv)
        rows.append(row)
    return _table(header, rows), summ


def _train_table(d: ReportData, pt: Point) -> tuple[str, dict]:
    header = ["method", "acc (all)"] + [f"b{b}" for b in d.buckets] + ["samples", "tokens"]
    rows, summ = [], {}
    for m in d.methods:
        acc = _values(d.grid, m.label, "acc/mean", pt, d.window)
        row = [m.label, _fmt(*mean_std(acc))]
        summ[m.label] = {"all": mean_std(acc)}
        for b in d.buckets:
            bv = _values(d.grid, m.label, f"gen/acc_bucket/{b}", pt, d.window)
            row.append(_fmt(*mean_std(bv)))
            summ[m.label][f"b{b}"] = mean_std(bv)
        for key in ("gen/cumulative_samples", "gen/cumulative_tokens"):
            v = _values(d.grid, m.label, key, pt)
            row.append(_fmt(*mean_std(v), pct=False))
        rows.append(row)
    return _table(header, rows), summ


def _per_run_mean(runs: dict[int, list[dict]], key: str) -> list[float]:
    """Per run: the mean of ``key`` over its training steps (step > 0)."""
    out = []
    for rows in runs.values():
        v = [r[key] for r in rows if isinstance(r.get(key), int | float) and r.get("step", 0) > 0]
        if v:
            out.append(float(np.mean(v)))
    return out


def _per_step(runs: dict[int, list[dict]], key: str) -> list[float]:
    """Per run: the last value of a cumulative ``key`` divided by its step (e.g. samples per step)."""
    out = []
    for rows in runs.values():
        last = [r for r in rows if isinstance(r.get(key), int | float)]
        if last and last[-1]["step"] > 0:
            out.append(last[-1][key] / last[-1]["step"])
    return out


def _cost_table(d: ReportData, walls: dict[str, list[float]]) -> str:
    header = ["method", "final step", "samples / step", "tokens / step", "filtered %", "DAA activation %",
              "DAA lambda (mean)", "s / step", "run wall s"]
    rows = []
    for m in d.methods:
        runs = d.grid.get(m.label, {})
        finals = [rows_[-1]["step"] for rows_ in runs.values()]

        per_run = lambda key: _per_run_mean(runs, key)  # noqa: B023
        per_step = lambda key: _per_step(runs, key)  # noqa: B023
        rows.append([m.label, ", ".join(str(s) for s in sorted(set(finals))) or "--",
                     _fmt(*mean_std(per_step("gen/cumulative_samples")), pct=False),
                     _fmt(*mean_std(per_step("gen/cumulative_tokens")), pct=False),
                     _fmt(*mean_std(per_run("filter/frac_filtered"))),
                     _fmt(*mean_std(per_run("daa/activation_frac"))),
                     (lambda t: f"{t[0]:.2f}" if t[2] else "--")(mean_std(per_run("daa/lambda_mean"))),
                     (lambda t: f"{t[0]:.1f}" if t[2] else "--")(mean_std(per_run("time/step"))),
                     (lambda t: f"{t[0]:.0f}" if t[2] else "--")(mean_std(walls.get(m.label, [])))])
    return _table(header, rows)


def _comparisons(d: ReportData, pt: Point, metric: str, subset: str) -> list[Comparison]:
    """Each DAA method vs its own baseline first, then vs the other non-DAA methods present."""
    out = []
    labels = {m.label for m in d.methods if d.grid.get(m.label)}
    baselines = [m for m in d.methods if not m.daa and m.label in labels]

    def vals(label: str) -> list[float]:
        if subset == "all":
            return _values(d.grid, label, f"eval/synthetic/{metric}", pt)
        return [v for rows in d.grid.get(label, {}).values() if (v := _hard_value(rows, d.hard, metric, pt))
                is not None]

    for m in d.methods:
        if not m.daa or m.label not in labels:
            continue
        own = [b for b in baselines if b.label == m.baseline]
        for b in own + [b for b in baselines if b.label != m.baseline]:
            out.append(compare_means(m.label, vals(m.label), b.label, vals(b.label), d.z))
    return out


def _describe_comparisons(cs: Sequence[Comparison], own: dict[str, str]) -> str:
    parts = []
    for c in cs:
        if c.outcome == "undetermined":
            parts.append(f"{c.a} vs {c.b}: undetermined (fewer than 2 seeds)")
            continue
        word = {"better": "**better**", "worse": "**worse**"}.get(c.outcome, "no significant difference")
        parts.append(f"{c.a} vs {c.b}{' (its baseline)' if own.get(c.a) == c.b else ''}: "
                     f"{c.diff * 100:+.1f} pts (SE {c.se * 100:.1f}) -> {word}")
    return "; ".join(parts)


def verdict(d: ReportData, metric: str) -> tuple[str, dict]:
    """The verdict paragraph: generated from the comparisons at equal steps and at the full equal-samples budget."""
    if d.k is None:
        return "No held-out evaluation in the logs: no verdict.", {}
    own = {m.label: m.baseline for m in d.methods if m.daa}
    points = [p for p in ([d.step_point] + d.sample_points[-1:]) if p is not None]
    lines, counts, data = [], {"better": 0, "worse": 0, "no significant difference": 0, "undetermined": 0}, {}
    own_counts = dict.fromkeys(counts, 0)
    n_seeds = sorted({len(r) for r in d.grid.values()})
    for pt in points:
        for subset in ["all"] + (["hard"] if d.hard else []):
            cs = _comparisons(d, pt, metric, subset)
            if not cs:
                continue
            data[f"{pt.name}|{subset}"] = [asdict(c) for c in cs]
            for c in cs:
                counts[c.outcome] += 1
                if own.get(c.a) == c.b:
                    own_counts[c.outcome] += 1
            where = "all buckets" if subset == "all" else f"hard buckets {', '.join(map(str, d.hard))}"
            lines.append(f"- At **{'equal steps' if pt.x_key == 'step' else 'equal generated samples'} "
                         f"({pt.name})**, held-out {metric} on {where}: {_describe_comparisons(cs, own)}.")
    if not lines:
        return ("No method with DAA and no baseline both present: nothing to compare.", {})
    total_own = sum(own_counts.values())
    if total_own == 0:
        head = "No DAA method could be compared with its own baseline (not in the grid, or no runs)."
    elif own_counts["undetermined"] == total_own:
        head = "With fewer than 2 seeds per method no significance can be claimed."
    elif own_counts["better"] and not own_counts["worse"]:
        head = (f"DAA was significantly better than its baseline in {own_counts['better']} of {total_own} "
                f"comparisons and never significantly worse.")
    elif own_counts["worse"] and not own_counts["better"]:
        head = (f"DAA was significantly worse than its baseline in {own_counts['worse']} of {total_own} comparisons "
                f"and never significantly better.")
    elif own_counts["better"] and own_counts["worse"]:
        head = (f"Mixed: DAA was significantly better than its baseline in {own_counts['better']} and significantly "
                f"worse in {own_counts['worse']} of {total_own} comparisons.")
    else:
        head = (f"**No significant difference**: in all {total_own} comparisons of a DAA method with its own "
                f"baseline the difference of seed means is within {d.z:g} standard errors.")
    seeds_txt = "/".join(map(str, n_seeds))
    text = (f"{head} (Against all baselines: {counts['better']} better, {counts['worse']} worse, "
            f"{counts['no significant difference']} not significantly different, {counts['undetermined']} "
            f"undetermined.) The screen is a difference of seed means beyond {d.z:g} standard errors with "
            f"{seeds_txt} seed(s) per method, uncorrected for the number of comparisons: a coarse test -- read "
            "'no significant difference' as 'this budget cannot tell them apart', not as 'equal'.\n\n"
            + "\n".join(lines))
    return text, {"counts": counts, "own_baseline_counts": own_counts, "comparisons": data}


# ---------------------------------------------------------------------------------------------------------- figures


def _band(ax, xs_list: Sequence[Sequence[float]], ys_list: Sequence[Sequence[float]], label: str, color: str,
          grid_pts: int = 60, marker: str | None = None) -> None:
    """Mean line +- std band of several runs' curves, interpolated onto a common x grid (the overlap of the runs)."""
    pairs = [(list(x), list(y)) for x, y in zip(xs_list, ys_list) if len(x) > 0]
    if not pairs:
        return
    lo, hi = max(x[0] for x, _ in pairs), min(x[-1] for x, _ in pairs)
    if len(pairs) == 1 or hi <= lo:
        x, y = max(pairs, key=lambda p: len(p[0]))
        ax.plot(x, y, label=label, color=color, marker=marker, markersize=3)
        return
    same_x = all(x == pairs[0][0] for x, _ in pairs)
    grid = np.asarray(pairs[0][0], dtype=float) if same_x else np.linspace(lo, hi, grid_pts)
    ys = np.stack([np.interp(grid, x, y) for x, y in pairs])
    m, s = ys.mean(0), ys.std(0, ddof=1)
    ax.plot(grid, m, label=f"{label} (n={len(pairs)})", color=color, marker=marker if same_x else None, markersize=3)
    ax.fill_between(grid, m - s, m + s, color=color, alpha=0.15, linewidth=0)


def _plot(d: ReportData, fig_dir: Path, metric: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    colors = {m.label: f"C{i % 10}" for i, m in enumerate(d.methods)}
    x_names = {"step": "training step", "gen/cumulative_samples": "generated samples (responses)",
               "gen/cumulative_tokens": "generated tokens"}

    def save(fig, name: str) -> None:
        fig.tight_layout()
        p = fig_dir / name
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)

    def panel(ax, key: str, x_key: str, window: int, title: str, ylabel: str, methods=None, marker=None) -> bool:
        drawn = False
        for m in methods or d.methods:
            runs = d.grid.get(m.label, {})
            ss = [series(rows, key, x_key, window) for rows in runs.values()]
            ss = [s for s in ss if s[0]]
            if ss:
                _band(ax, [s[0] for s in ss], [s[1] for s in ss], m.label, colors[m.label], marker=marker)
                drawn = True
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(x_names.get(x_key, x_key))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=7)
        return drawn

    # training accuracy vs steps / samples / tokens
    for x_key, name in (("step", "steps"), ("gen/cumulative_samples", "samples"), ("gen/cumulative_tokens",
                                                                                     "tokens")):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        if panel(ax, "acc/mean", x_key, d.window, f"Training accuracy ({d.window}-step trailing mean) vs {name}",
                 "fraction of rollouts correct"):
            save(fig, f"train_acc_vs_{name}.png")
        else:
            plt.close(fig)
    if d.k:
        key = f"eval/synthetic/{metric}"
        for x_key, name in (("step", "steps"), ("gen/cumulative_samples", "samples")):
            fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
            panel(axes[0], key, x_key, 1, f"Held-out {metric}, all buckets", metric, marker="o")
            panel(axes[1], "eval/synthetic/greedy", x_key, 1, "Held-out greedy accuracy, all buckets", "greedy",
                  marker="o")
            save(fig, f"heldout_vs_{name}.png")
        if d.buckets:
            cols = min(4, len(d.buckets))
            nrows = math.ceil(len(d.buckets) / cols)
            fig, axes = plt.subplots(nrows, cols, figsize=(3.6 * cols, 3.0 * nrows), squeeze=False)
            for ax, b in zip(axes.flat, d.buckets):
                panel(ax, f"eval/synthetic/bucket{b}/{metric}", "gen/cumulative_samples", 1,
                      f"bucket {b}" + (" (hard)" if b in d.hard else ""), metric, marker="o")
                ax.get_legend() and b != d.buckets[0] and ax.get_legend().remove()
            for ax in list(axes.flat)[len(d.buckets):]:
                ax.set_visible(False)
            save(fig, "heldout_buckets_vs_samples.png")
        if d.step_point and d.buckets:
            fig, ax = plt.subplots(figsize=(max(6.4, 0.9 * len(d.buckets) * len(d.methods) / 3), 4.2))
            width = 0.8 / max(len(d.methods), 1)
            for i, m in enumerate(d.methods):
                ms = [mean_std(_values(d.grid, m.label, f"eval/synthetic/bucket{b}/{metric}", d.step_point))
                      for b in d.buckets]
                xs = np.arange(len(d.buckets)) + (i - (len(d.methods) - 1) / 2) * width
                ax.bar(xs, [t[0] for t in ms], width, yerr=[t[1] for t in ms], label=m.label, color=colors[m.label],
                       capsize=2)
            if d.start_acc:
                ax.plot(range(len(d.buckets)), [d.start_acc.get(b, math.nan) for b in d.buckets], "k_",
                        markersize=18, label="starting policy")
            ax.set_xticks(range(len(d.buckets)), [str(b) for b in d.buckets])
            ax.set_xlabel("difficulty bucket (digits)")
            ax.set_ylabel(metric)
            ax.set_title(f"Held-out {metric} per bucket at {d.step_point.name} (mean ± std over seeds)", fontsize=10)
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3, axis="y")
            save(fig, "heldout_by_bucket.png")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    if panel(ax, "filter/frac_filtered", "step", 1, "Dynamic sampling: fraction of generated groups filtered",
             "fraction of groups with p_hat in {0, 1}", [m for m in d.methods if m.filters]):
        save(fig, "filtered_frac.png")
    else:
        plt.close(fig)
    daa_methods = [m for m in d.methods if m.daa]
    if daa_methods:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        panel(axes[0], "daa/activation_frac", "step", 1, "DAA activation (Eq. 14)", "fraction of responses amplified",
              daa_methods)
        panel(axes[1], "daa/lambda_mean", "step", 1, "Mean lambda of amplified responses", "lambda", daa_methods)
        save(fig, "daa_activation.png")
    written += _plot_theory(d, fig_dir, colors, plt)
    return written


def _plot_theory(d: ReportData, fig_dir: Path, colors: dict[str, str], plt) -> list[Path]:
    """Measured kept/all mean-advantage ratio per step vs the Thm 3.1 prediction alpha+/alpha- (filtering methods)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    drawn = False
    for ax, label, alpha in ((axes[0], "correct", "alpha_plus"), (axes[1], "incorrect", "alpha_minus")):
        for m in (m for m in d.methods if m.filters):
            px, py = [], []
            for rows in d.grid.get(m.label, {}).values():
                for r in rows:
                    for b in ("0.0-0.5", "0.5-1.0"):
                        kept, all_ = r.get(f"theory/{b}/adv_{label}_kept"), r.get(f"theory/{b}/adv_{label}_all")
                        pred = r.get(f"theory/{b}/{alpha}")
                        if None not in (kept, all_, pred) and abs(all_) > 1e-9 and r.get(
                                f"theory/{b}/n_{label}_kept", 1) > 0:
                            px.append(pred)
                            py.append(kept / all_)
            if px:
                ax.scatter(px, py, s=8, alpha=0.5, color=colors[m.label], label=m.label)
                drawn = True
        lim = ax.get_xlim() if drawn else (1, 2)
        ax.plot([min(lim[0], 1), lim[1]], [min(lim[0], 1), lim[1]], "k--", lw=0.8, label="y = x (Thm 3.1)")
        ax.set_xlabel(f"predicted {alpha.replace('_', '')} at the kept groups' mean p_hat")
        ax.set_ylabel(f"mean advantage of {label} responses: kept / all")
        ax.set_title(f"Thm 3.1 diagnostic, {label} responses (per step and p_hat bin)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if not drawn:
        plt.close(fig)
        return []
    fig.tight_layout()
    p = fig_dir / "theory_diagnostic.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return [p]


# ---------------------------------------------------------------------------------------------------------- markdown


def build_report(specs: Sequence[RunSpec], methods: Sequence[Method], out_dir: str | Path, *, command: str = "",
                 rebuilt_with: str = "", base_config: str = "", records: Sequence[dict] | None = None,
                 window: int = 5, z: float = 2.0, tau: float = 0.5, warmup_dir: str | Path | None = None,
                 page: str | Path | None = None,
                 title: str = "Does DAA help? Compute-matched algorithm comparison", figures: bool = True) -> Path:
    """Write ``out_dir/report.md``, ``out_dir/figures/*.png``, ``out_dir/logs/<method>/seed<k>.jsonl`` and
    ``out_dir/summary.json`` from the runs of ``specs``; with ``page``, also a copy of the report at that path whose
    figure links are relative to it (e.g. docs/results_cpu.md). Returns the report path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    grid = load_grid(specs)
    start_acc = None
    warm = None
    if warmup_dir and (Path(warmup_dir) / "warmup_report.json").exists():
        warm = json.loads((Path(warmup_dir) / "warmup_report.json").read_text())
    d = prepare(methods, grid, window=window, z=z, tau=tau, start_acc=start_acc)
    metric = f"avg@{d.k}" if d.k else "avg@k"

    logs = out / "logs"
    for s in specs:
        src = s.run_dir / "metrics.jsonl"
        if src.exists():
            dst = logs / s.method.slug / f"seed{s.seed}.jsonl"
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
    figs = _plot(d, out / "figures", metric) if grid and figures else []

    walls: dict[str, list[float]] = {}
    resumed = 0
    for s in specs:
        info = s.run_dir / "compare_run.json"
        if info.exists():
            data = json.loads(info.read_text())
            w = data.get("wall_s_total")
            if isinstance(w, int | float):
                walls.setdefault(s.method.label, []).append(float(w))
            resumed += sum(a.get("rc") == 0 for a in data.get("attempts", [])) > 1
    starts = start_evals(grid, f"eval/synthetic/{metric}")
    missing = [f"{s.method.label} seed {s.seed}" for s in specs if s.seed not in grid.get(s.method.label, {})]
    short = [f"{s.method.label} seed {s.seed} (step {grid[s.method.label][s.seed][-1]['step']} of {s.steps})"
             for s in specs if s.seed in grid.get(s.method.label, {})
             and grid[s.method.label][s.seed][-1]["step"] < s.steps]
    failed = [f"{r['method']} seed {r['seed']} (exit {r['rc']})" for r in records or [] if r["status"] == "failed"]

    def body(fig_prefix: str) -> str:
        md: list[str] = [f"# {title}", ""]
        md += ["_Generated by `tools/compare_algorithms.py` from the runs' `metrics.jsonl` "
               "(da3po_megatron/eval/compare.py); regenerate with the command below._", ""]
        if command:
            md += ["## Command", "", "Reproduce (finished runs are skipped, so re-running it only rebuilds this report "
                   "unless the runs directory is removed):", "", "```bash", command, "```", ""]
            if rebuilt_with:
                md += ["This report was rebuilt from the existing runs with:", "", "```bash", rebuilt_with, "```", ""]
        steps = sorted({s.steps for s in specs})
        seeds = sorted({s.seed for s in specs})
        md += ["## Setup", "",
               f"- base config: `{base_config}`" if base_config else "- base config: (not recorded)",
               "- methods: " + ", ".join(f"`{m.label}` ({' '.join(m.overrides)})" for m in methods),
               f"- seeds: {', '.join(map(str, seeds))}; steps per run: {', '.join(map(str, steps))}",
               f"- held-out metric: `{metric}` (sampling) and greedy accuracy on the held-out split of the synthetic "
               "task, per difficulty bucket (bucket = number of digits)"]
        total_wall = sum(w for ws in walls.values() for w in ws)
        if total_wall:
            md.append(f"- training wall time, all runs together: {total_wall / 60:.0f} min (each run: its own trainer "
                      "process with Ray, vLLM and the Megatron policy; per-run times in the cost table)")
        if resumed:
            md.append(f"- {resumed} of {len(specs)} runs were trained in more than one invocation of the runner "
                      "(resumed from their checkpoints; per-attempt commands, steps and times in each run's "
                      "`compare_run.json`)")
        if d.start_acc:
            md.append("- starting policy (warm-up, shared by all runs), held-out "
                      f"{metric} per bucket at step 0: " + ", ".join(f"b{b} {100 * v:.1f}%" for b, v in
                                                                      sorted(d.start_acc.items())))
        if warmup_dir and list(Path(warmup_dir).glob("*.safetensors")):
            md.append(f"- starting-policy weights: `{warmup_dir}` (sha256 {warmup_digest(warmup_dir)[:12]})")
        if len({round(v, 9) for v in starts.values()}) > 1:
            md.append(f"- **WARNING: the runs did not all start from the same policy**: their step-0 held-out {metric} "
                      "differ (" + ", ".join(f"{k} {100 * v:.1f}%" for k, v in sorted(starts.items())) + "); the "
                      "comparison is not valid")
        elif starts:
            md.append(f"- all {len(starts)} runs start from the same policy: identical step-0 held-out {metric} "
                      f"({100 * next(iter(starts.values())):.1f}%)")
        if warm:
            md.append("- warm-up report (one temperature-1 sample per held-out prompt): " + ", ".join(
                f"b{b} {100 * v:.1f}%" for b, v in warm.get("accuracy_by_bucket", {}).items()))
        if d.hard:
            md.append(f"- **hard buckets** ({d.hard_rule}): {', '.join(map(str, d.hard))}; the `hard` column is "
                      "their mean")
        if missing or short or failed:
            md += ["", "**Incomplete grid** -- the tables use what exists:"]
            md += [f"- no metrics: {', '.join(missing)}"] if missing else []
            md += [f"- unfinished: {', '.join(short)}"] if short else []
            md += [f"- failed in this invocation: {', '.join(failed)}"] if failed else []
        md.append("")
        md += ["## Verdict", "", verdict_text, ""]
        if d.step_point:
            t, _ = _heldout_table(d, d.step_point, metric)
            g, _ = _heldout_table(d, d.step_point, "greedy")
            tr, _ = _train_table(d, d.step_point)
            md += [f"## Equal training steps ({d.step_point.name})", "",
                   f"Held-out {metric} (%, mean ± std over seeds):", "", t, "",
                   "Held-out greedy accuracy (%):", "", g, "",
                   f"Training (rollout) accuracy (%, {d.window}-step trailing mean) per bucket, and what the runs "
                   "had generated by then (samples = responses, tokens = response tokens):", "", tr, ""]
        for pt in d.sample_points:
            t, _ = _heldout_table(d, pt, metric)
            g, _ = _heldout_table(d, pt, "greedy")
            tr, _ = _train_table(d, pt)
            md += [f"## Equal generated samples ({pt.name})", "",
                   f"Held-out {metric} (%), each run's eval curve interpolated linearly in cumulative generated "
                   "samples:", "", t, "", "Held-out greedy accuracy (%):", "", g, "",
                   f"Training accuracy (%, {d.window}-step trailing mean, interpolated at the budget):", "", tr, ""]
        cost = _cost_table(d, walls)
        md += ["## Cost and dynamics (means over steps, then mean ± std over seeds)", "", cost, ""]
        md += ["## Figures", ""]
        captions = {
            "train_acc_vs_steps.png": "Training accuracy vs training steps.",
            "train_acc_vs_samples.png": "Training accuracy vs generated samples (the compute-matched view).",
            "train_acc_vs_tokens.png": "Training accuracy vs generated tokens.",
            "heldout_vs_steps.png": f"Held-out {metric} and greedy accuracy vs steps.",
            "heldout_vs_samples.png": f"Held-out {metric} and greedy accuracy vs generated samples.",
            "heldout_buckets_vs_samples.png": f"Held-out {metric} per difficulty bucket vs generated samples.",
            "heldout_by_bucket.png": f"Held-out {metric} per bucket at equal steps, with the starting policy.",
            "filtered_frac.png": "Fraction of generated groups thrown away by dynamic sampling (p_hat in {0, 1}).",
            "daa_activation.png": "DAA activation (fraction of responses amplified, Eq. 14) and mean lambda.",
            "theory_diagnostic.png": "Theorem 3.1: mean advantage of correct / incorrect responses on kept groups "
                                     "divided by that on all groups of the same p_hat bin, vs the predicted alpha+ / "
                                     "alpha- (dynamic-sampling methods). The theorem holds one prompt's success "
                                     "probability p fixed; the diagnostic pools prompts by observed p_hat, so prompts "
                                     "the policy cannot solve (true p ~ 0: all-wrong groups, zero advantage) pull the "
                                     "'all' mean of incorrect responses towards 0 and push that ratio above alpha-.",
        }
        for p in figs:
            md += [f"![{p.stem}]({fig_prefix}{p.name})", "", f"_{captions.get(p.name, p.stem)}_", ""]
        md += ["## Method", "",
               "- Every run is the real trainer (`python -m da3po_megatron.cli train`: megatron-core policy, vLLM "
               "engines, Ray), started from the same warm-up checkpoint; methods differ only by the overrides listed "
               "above; seeds change data order, sampling and nothing else.",
               "- Equal steps: values at the last step where every run logged a held-out evaluation.",
               "- Equal generated samples: budgets are the largest `gen/cumulative_samples` every run reached and half "
               "of it. Each run's curve is linearly interpolated in cumulative samples (responses generated, including "
               "groups filtered by dynamic sampling and discarded surplus); held-out curves between their evaluation "
               "points (step 0 = 0 samples), training curves after a trailing mean over "
               f"{d.window} steps. No extrapolation.",
               f"- Verdict screen: difference of seed means beyond {z:g} standard errors, SE = sqrt(s_a^2/n_a + "
               "s_b^2/n_b) with sample std (ddof=1); 'undetermined' with fewer than 2 seeds.",
               "- Raw logs: `logs/<method>/seed<k>.jsonl` next to the report (copies of each run's `metrics.jsonl`).",
               ""]
        return "\n".join(md)

    verdict_text, verdict_data = verdict(d, metric)
    report = out / "report.md"
    report.write_text(body("figures/"))
    if page:
        page = Path(page)
        page.parent.mkdir(parents=True, exist_ok=True)
        prefix = os.path.relpath(out / "figures", page.parent).replace(os.sep, "/") + "/"
        page.write_text(body(prefix))

    summary: dict[str, Any] = {"metric": metric, "buckets": d.buckets, "hard_buckets": d.hard,
                               "start_acc": {str(k): v for k, v in d.start_acc.items()}, "verdict": verdict_data,
                               "missing": missing, "unfinished": short, "failed": failed, "tables": {}}
    for pt in ([d.step_point] if d.step_point else []) + d.sample_points:
        summary["tables"][pt.name] = {"heldout": _heldout_table(d, pt, metric)[1],
                                      "greedy": _heldout_table(d, pt, "greedy")[1],
                                      "train": _train_table(d, pt)[1], "x_key": pt.x_key, "x": pt.x}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float) + "\n")
    return report
