"""The comparison grid: which runs make it ({method} x {seed}), how each is trained, and where its metrics are.

A method spec (``da3po:2``, ``grpo``, ...) becomes config overrides of the real trainer; every run is a subprocess
``python -m da3po_megatron.cli train ...`` started sequentially, in seed-major order, from one shared warm-up snapshot.
The grid is resumable: a finished run (``DONE`` marker or final step in ``metrics.jsonl``) is skipped and an
unfinished one started again, the trainer resuming from its latest checkpoint. SIGUSR1 / SIGTERM (Slurm's time-limit
warning, scancel) are forwarded to the running trainer, which checkpoints and exits. The comparison as a whole is
described in :mod:`da3po_megatron.studies.compare`.
"""

from __future__ import annotations

import json
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from da3po_megatron.algorithms.registry import ALGORITHMS, baseline_of, get_algorithm, preset_override_args
from da3po_megatron.eval.curves import read_metrics

DONE_MARKER = "DONE"


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
        """Dynamic sampling on (the algorithm's preset, applied whole by :func:`parse_method`)."""
        return get_algorithm(self.algorithm).filter_groups

    @property
    def baseline(self) -> str:
        """Label of the same algorithm without DAA (da3po -> dapo; from the registry's presets)."""
        return baseline_of(self.algorithm)


def parse_method(spec: str) -> Method:
    """``grpo`` | ``dapo`` | ``gspo`` | ``da3po`` (paper lambda) | ``da3po:<lambda>`` | ``da3po:adaptive``;
    ``grpo:<lambda>`` / ``gspo:<lambda>`` / ``dapo:<lambda>`` turn DAA on for that algorithm (the paper: DAA "only
    modifies Dynamic Sampling", it applies to GRPO/GSPO too).

    The overrides carry the algorithm's WHOLE preset (every field ``algorithms/registry.py`` decides: clips, ratio
    level, aggregation, filtering, overlong shaping, DAA), so no value of the base recipe leaks into a baseline."""
    name, _, param = spec.strip().partition(":")
    if name not in ALGORITHMS:
        raise ValueError(f"method {spec!r}: algorithm must be one of {list(ALGORITHMS)}, e.g. 'da3po:2' or 'grpo'")
    ov = preset_override_args(name)
    daa = get_algorithm(name).daa
    if param:
        if not daa:
            ov[ov.index("daa.enable=false")] = "daa.enable=true"
        daa = True
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
    return Method(label=spec.strip(), algorithm=name, overrides=tuple(ov), daa=daa)


def parse_methods(csv: str | Sequence[str]) -> list[Method]:
    """The grid's columns from ``grpo,dapo,da3po:2`` (or a list); a label listed twice would share a run directory."""
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
    """One cell of the grid: a method trained with one seed for ``steps`` steps in ``run_dir``."""

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
                  source: str | Path | None = None, expect_sha256: str = "") -> Path:
    """The grid's starting policy in ``warmup_dir``, made once: kept if present; else a copy of ``source`` (built
    there first if missing); else built in place with ``python -m da3po_megatron.data.warmup --out DIR ...``.

    ``expect_sha256`` (a prefix of :func:`warmup_digest`): refuse (RuntimeError, before any run) when the starting
    policy's weights hash otherwise. A rebuilt warm-up is not a function of its command alone: 700 AdamW steps amplify
    last-bit differences of the CPU's float kernels (MKL / ATen dispatch by instruction set, library versions) into
    another policy -- the same command hashed a103e6de3beb (2026-11-29), aaff24b64ee4 (12-04) and dda0239830ce (12-07,
    AMD EPYC, AVX-512) -- so the studies commit their warm-ups (reports/selection50/warmups/) and name the hash."""
    d = Path(warmup_dir)
    if (d / "warmup_report.json").exists():
        log(f"warm-up: reusing {d} (sha256 {warmup_digest(d)[:12]})")
        return _check_digest(d, expect_sha256)
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
    return _check_digest(d, expect_sha256)


def _check_digest(d: Path, expect: str) -> Path:
    digest = warmup_digest(d)
    if expect and not digest.startswith(expect.lower()):
        raise RuntimeError(f"the starting policy {d} hashes to {digest[:12]}, not the expected {expect}: another "
                           f"policy than the study's (a rebuilt warm-up depends on the machine's float kernels; use "
                           f"the committed one, or drop --warmup-sha256 to run from this one knowingly)")
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


def load_variant(spec: str) -> tuple[str, dict[int, list[dict]]]:
    """``NAME=DIR`` -> (NAME, {seed: metrics rows}) from ``DIR/seed<k>/metrics.jsonl`` (run directories) or
    ``DIR/seed<k>.jsonl`` (raw logs kept elsewhere, e.g. under ``--logs-dir``); the run directory wins."""
    name, _, path = spec.partition("=")
    if not path:
        raise SystemExit(f"variant {spec!r}: expected NAME=DIR")
    runs = {int(d.name.removeprefix("seed")): read_metrics(d / "metrics.jsonl")
            for d in sorted(Path(path).glob("seed*")) if (d / "metrics.jsonl").exists()}
    runs.update({int(f.stem.removeprefix("seed")): read_metrics(f) for f in sorted(Path(path).glob("seed*.jsonl"))
                 if int(f.stem.removeprefix("seed")) not in runs})
    if not runs:
        raise SystemExit(f"variant {name}: no seed*/metrics.jsonl nor seed*.jsonl under {path}")
    return name, runs
