"""Profiling hooks: named phase ranges, torch-profiler traces of chosen steps and ranks, vLLM's engine profiler.

``trainer.profile`` (``config.ProfileConfig``) selects the steps, the policy ranks, the engines and whether memory is
recorded. In a selected step ``N`` the trainer writes, under ``run_dir/profile/step_N/``:

- ``driver.json``: the RL loop's process (torch profiler, CPU activities) -- the phases of Algorithm 1 as ranges
  ``da3po/generate``, ``da3po/reward``, ``da3po/filter``, ``da3po/old_logprobs``, ``da3po/train``,
  ``da3po/weight_sync``, ``da3po/checkpoint`` (and ``da3po/eval``, ``da3po/wait_rollout`` where they happen);
- ``rank_R.json``: policy rank ``R`` (CPU activities, and CUDA activities on GPU), with the rank-side ranges
  ``da3po/train``, ``da3po/logprobs``, ``da3po/weight_sync``, ``da3po/checkpoint`` around its ops;
- ``rank_R_cuda_memory.pickle`` (CUDA only, ``trainer.profile.memory``): the rank's memory snapshot
  (``torch.cuda.memory._record_memory_history`` / ``_dump_snapshot``; open it in https://pytorch.org/memory_viz);
- ``engines/``: each selected engine's trace, written by vLLM's own profiler (``vllm.LLM.start_profile(prefix)`` /
  ``stop_profile()``, vllm 0.32 ``vllm/entrypoints/llm.py`` 801-827; the engine must be built with a torch
  ``profiler_config`` -- ``vllm/config/profiler.py`` ``ProfilerConfig(profiler="torch", torch_profiler_dir=...)``,
  which :func:`engine_profiler_config` gives; without it ``start_profile`` has nothing to run). vLLM names the files
  ``step_N_engineE_rank0.<id>.pt.trace.json``.
- ``index.json``: what was written, and the wall time of the profiled step.

All traces are chrome-trace JSON, which Perfetto (https://ui.perfetto.dev) and ``chrome://tracing`` open.

Ranges (:mod:`da3po_megatron.ranges`, re-exported here; a leaf module the policy imports too): :func:`phase` is a
``torch.profiler.record_function`` (it shows in torch-profiler traces) and, on CUDA, an NVTX range
(``torch.cuda.nvtx.range_push/pop``: nsys timelines read the same names). Zero cost when off: outside a profiled step
(and without ``trainer.profile.nvtx``) :func:`phase` returns one shared ``nullcontext`` after a boolean test -- no
profiler object exists, nothing is recorded (tests/test_operations.py measures it).

Left out: nsys itself (start the job under ``nsys profile`` and set ``trainer.profile.nvtx=true``, docs/operations.md),
the reward pool's processes (pure Python math-verify; the driver's ``reward`` range covers them) and profiling the
engines' own CUDA kernels beyond what vLLM's torch profiler records.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from da3po_megatron.ranges import PREFIX, is_active, phase, ranged, set_active
from da3po_megatron.trainer.faults import fault_point

__all__ = ["PREFIX", "StepProfiler", "cuda_memory_snapshot_supported", "engine_profiler_config", "is_active",
           "phase", "rank_ranges", "ranged", "set_active", "start_rank_profile", "stop_rank_profile",
           "with_engine_profiler"]


def nvtx_available() -> bool:
    """Whether this process can emit NVTX ranges (a CUDA build that sees a GPU; ``torch.cuda.nvtx`` raises
    otherwise)."""
    return torch.cuda.is_available()

def cuda_memory_snapshot_supported() -> bool:
    """Whether this process can record a CUDA memory snapshot (a GPU, and torch's private recording API)."""
    mem = getattr(torch.cuda, "memory", None)
    return torch.cuda.is_available() and hasattr(mem, "_record_memory_history") and hasattr(mem, "_dump_snapshot")


def _activities() -> list[Any]:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def _make_profiler(memory: bool, with_stack: bool, record_shapes: bool) -> torch.profiler.profile:
    return torch.profiler.profile(activities=_activities(), profile_memory=memory, with_stack=with_stack,
                                  record_shapes=record_shapes)


# ------------------------------------------------------------------------------------------- policy ranks (actors)


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def rank_ranges(worker: Any, nvtx: bool) -> bool:
    """Run on every policy rank at start-up (``trainer.profile.nvtx``): the rank's ranges for the whole run -- on,
    with NVTX where the rank sees CUDA -- and the state :func:`stop_rank_profile` returns to after a profiled step.
    Returns whether NVTX ranges are on in this rank."""
    base = (True, True) if nvtx and nvtx_available() else (False, None)
    worker._da3po_ranges = base
    set_active(*base)
    return bool(base[1])


def start_rank_profile(worker: Any, ranks: list[int], memory: bool = False, with_stack: bool = False,
                       record_shapes: bool = False) -> bool:
    """Run on every policy rank (``PolicyGroup.run_on_all``): start the torch profiler on the selected ``ranks``
    (global ranks). Returns whether this rank is profiled. Not collective."""
    rank = _global_rank()
    if rank not in ranks:
        return False
    prof = _make_profiler(memory, with_stack, record_shapes)
    prof.start()
    worker._da3po_profile = {"prof": prof, "memory": memory and cuda_memory_snapshot_supported(), "rank": rank}
    if worker._da3po_profile["memory"]:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    set_active(True)
    return True


def stop_rank_profile(worker: Any, out_dir: str) -> list[str]:
    """Run on every policy rank: stop this rank's profiler (if it runs) and write ``rank_R.json`` (+ the CUDA memory
    snapshot) into ``out_dir``; returns the files written. The rank's ranges return to the run's state
    (:func:`rank_ranges`: NVTX on with ``trainer.profile.nvtx``), not to off."""
    state = getattr(worker, "_da3po_profile", None)
    set_active(*getattr(worker, "_da3po_ranges", (False, None)))
    if not state:
        return []
    worker._da3po_profile = None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    state["prof"].stop()
    trace = out / f"rank_{state['rank']}.json"
    state["prof"].export_chrome_trace(str(trace))
    files.append(str(trace))
    if state["memory"]:
        snap = out / f"rank_{state['rank']}_cuda_memory.pickle"
        torch.cuda.memory._dump_snapshot(str(snap))
        torch.cuda.memory._record_memory_history(enabled=None)
        files.append(str(snap))
    return files


# ------------------------------------------------------------------------------------------- engines


def engine_profiler_config(profile: Any, run_dir: str | Path) -> dict[str, Any]:
    """The ``vllm.LLM(profiler_config=...)`` argument that lets ``start_profile`` run (empty when no engine is
    profiled). vLLM writes its traces into ``torch_profiler_dir``; the trainer moves each step's files to
    ``profile/step_N/engines/``. Plain JSON (uncompressed) so the files open like the others."""
    if not profile.engines or not profile.steps:
        return {}
    return {"profiler_config": {"profiler": "torch",
                                "torch_profiler_dir": str((Path(run_dir) / "profile" / ".engines").resolve()),
                                "torch_profiler_use_gzip": False,
                                "torch_profiler_with_stack": bool(profile.with_stack),
                                "torch_profiler_record_shapes": bool(profile.record_shapes),
                                "torch_profiler_with_memory": bool(profile.memory)}}


def with_engine_profiler(engine_config: Any, cfg: Any, run_dir: str | Path) -> Any:
    """``engine_config`` (an ``EngineConfig``) with vLLM's profiler configured when ``trainer.profile`` selects
    engines; unchanged otherwise."""
    from dataclasses import replace

    extra = engine_profiler_config(cfg.trainer.profile, run_dir)
    return replace(engine_config, extra={**engine_config.extra, **extra}) if extra else engine_config


# ------------------------------------------------------------------------------------------- the driver


class StepProfiler:
    """The trainer's side: in a selected step, start the driver's, the selected ranks' and engines' profilers; at
    the step's end stop them and write ``run_dir/profile/step_N/``. ``policy`` is a ``PolicyGroup`` (``run_on_all``),
    ``rollout`` a ``RolloutClient`` (``call_all``)."""

    def __init__(self, profile: Any, run_dir: str | Path, policy: Any, rollout: Any) -> None:
        self.cfg = profile
        self.root = Path(run_dir) / "profile"
        self.policy, self.rollout = policy, rollout
        self.steps = set(profile.steps)
        self._driver: torch.profiler.profile | None = None
        self._step: int | None = None
        self._t0 = 0.0
        if profile.nvtx:  # every step, the driver and every policy rank: for an nsys capture of the whole job
            if nvtx_available():
                set_active(True, nvtx=True)
            on = policy.run_on_all(rank_ranges, True)
            print(f"profile: NVTX ranges on {sum(map(bool, on))} of {len(on)} policy ranks (trainer.profile.nvtx; "
                  "ranks without CUDA have none)", flush=True)

    def wants(self, step: int) -> bool:
        return step in self.steps

    def start(self, step: int) -> None:
        if not self.wants(step):
            return
        c = self.cfg
        self._step, self._t0 = step, time.perf_counter()
        self.policy.run_on_all(start_rank_profile, list(c.ranks), c.memory, c.with_stack, c.record_shapes)
        if c.engines:
            self.rollout.call_all("start_profile", f"step_{step}", list(c.engines))
        if c.driver:
            self._driver = _make_profiler(c.memory, c.with_stack, c.record_shapes)
            self._driver.start()
        set_active(True)
        print(f"profiling step {step}: driver={c.driver}, policy ranks {list(c.ranks)}, engines {list(c.engines)}"
              f"{', memory' if c.memory else ''}", flush=True)

    def stop(self) -> Path | None:
        """End the profiled step (no-op when none is running): write the traces; returns the step's directory."""
        if self._step is None:
            return None
        step, self._step = self._step, None
        seconds = time.perf_counter() - self._t0
        out = self.root / f"step_{step}"
        out.mkdir(parents=True, exist_ok=True)
        files: list[str] = []
        if self._driver is not None:
            self._driver.stop()
            self._driver.export_chrome_trace(str(out / "driver.json"))
            self._driver = None
            files.append(str(out / "driver.json"))
        set_active(bool(self.cfg.nvtx and nvtx_available()), nvtx=True)
        for part in self.policy.run_on_all(stop_rank_profile, str(out)):
            files += part
        if self.cfg.engines:
            self.rollout.call_all("stop_profile", list(self.cfg.engines))
            files += self._collect_engine_traces(step, out / "engines")
        index = {"step": step, "profiled_seconds": seconds, "write_seconds": time.perf_counter() - self._t0 - seconds,
                 "files": [str(Path(f).relative_to(out)) for f in files],
                 "phases": [PREFIX + p for p in ("generate", "reward", "filter", "old_logprobs", "train",
                                                 "weight_sync", "checkpoint")],
                 "cuda_memory_snapshot": bool(self.cfg.memory and any(f.endswith(".pickle") for f in files))}
        (out / "index.json").write_text(json.dumps(index, indent=1) + "\n")
        print(f"profile of step {step} ({seconds:.1f} s, traces written in {index['write_seconds']:.1f} s) -> {out}: "
              + ", ".join(index["files"]), flush=True)
        return out

    def _collect_engine_traces(self, step: int, dest: Path) -> list[str]:
        """vLLM writes into the shared ``profile/.engines`` directory; move this step's files next to the others."""
        src = self.root / ".engines"
        moved = []
        if src.is_dir():
            dest.mkdir(parents=True, exist_ok=True)
            for f in sorted(src.glob(f"step_{step}_*")):
                f.replace(dest / f.name)
                moved.append(str(dest / f.name))
        return moved


class PhaseTimer:
    """Seconds per phase of one step (and the fault-injection points of the reliability tests, ``faults.py``; ``run``:
    what ``fault_point`` hurts -- anything with the engines' ``rollout`` and the reward pool ``rewards``)."""

    def __init__(self, run: Any = None, step: int = 0) -> None:
        self.seconds: dict[str, float] = {}
        self.run, self.step = run, step

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        fault_point(name, self.step, self.run)
        t0 = time.perf_counter()
        with phase(name):  # a named profiler range (this module); a no-op outside profiled steps
            yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
