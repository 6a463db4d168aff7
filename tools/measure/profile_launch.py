"""Where a `da3po train` launch spends its time before the first RL step, phase by phase.

Runs the real trainer in this process (``trainer.main.main``, the same code as ``da3po train``) with timers wrapped
around the start-up calls of ``trainer/run.py`` and ``trainer/loop.py``, stops after the first step, and prints one
row per phase: when it started (seconds since the interpreter started) and how long it took. Phases that overlap
(the policy ranks and the engines start side by side) are shown with their own start and end, so the table also shows
what runs in parallel. A phase the code under test does not have (an older commit) is left out.

    python tools/measure/profile_launch.py --model outputs/demo/warmup [--run-dir /tmp/x] [override ...]
    PYTHONPATH=/tmp/old-worktree python tools/measure/profile_launch.py ...      # the same for another commit

The run directory is fresh by default (a temporary one, removed afterwards), so nothing is resumed. ``--json`` also
writes the rows to a file. This is a measurement tool, not a test: on a loaded machine the figures grow.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

T_START = time.time()
try:  # the interpreter's own start, not this module's: imports count too
    import psutil

    T_START = psutil.Process().create_time()
except Exception:  # noqa: BLE001 - psutil is optional here
    pass

ROWS: list[dict] = []
FIRST_STEP: dict[str, float] = {}


def _now() -> float:
    return time.time() - T_START


def _timed(label: str | None, fn, *, once: bool = False, arg_label: bool = False):
    seen = {"n": 0}

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        seen["n"] += 1
        if once and seen["n"] > 1:
            return fn(*args, **kwargs)
        name = label
        if arg_label:  # PolicyGroup.run_on_all(fn, ...) / start("method", ...): name the call by what it runs
            what = next((a for a in args[1:] if callable(a) or isinstance(a, str)), None)
            name = f"{label}({getattr(what, '__name__', what)})"
        t0 = _now()
        try:
            return fn(*args, **kwargs)
        finally:
            ROWS.append({"phase": name, "start": t0, "seconds": _now() - t0})
    return wrapper


def _patch(module: str, attr: str, label: str, **kw) -> None:
    """Wrap ``module.attr`` (a function or ``Class.method``) if it exists in the code under test."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return
    owner, _, name = attr.rpartition(".")
    target = getattr(mod, owner, None) if owner else mod
    if target is None or not hasattr(target, name):
        return
    fn = getattr(target, name)
    if isinstance(target, type) and isinstance(target.__dict__.get(name), classmethod):
        wrapped = _timed(label, fn.__func__, **kw)
        setattr(target, name, classmethod(wrapped))
        return
    setattr(target, name, _timed(label, fn, **kw))


def process_cpu() -> list[tuple[str, float]]:
    """CPU seconds (user + system) so far of this process and every process it started (Ray's own, the actors,
    vLLM's, the reward workers), by name: a load-independent view of what the launch costs on 2 cores."""
    out: list[tuple[str, float]] = []
    try:
        me = psutil.Process()
        for p in [me, *me.children(recursive=True)]:
            try:
                t = p.cpu_times()
                name = " ".join(p.cmdline())
            except Exception:  # noqa: BLE001 - a process that just ended
                continue
            if "ray::" in name:
                name = name.split()[0]
            elif "ray/" in name or "ray\\" in name:
                name = "ray: " + next((Path(a).name for a in p.cmdline() if "ray/" in a), name[:40])
            elif p.pid == me.pid:
                name = "driver (this process)"
            else:  # a helper process: named with its parent (the reward pool's forkserver, a checkpoint writer)
                try:
                    parent = p.parent()
                    pname = parent.name() if parent is not None and parent.pid != me.pid else "the driver"
                    pname = next((a for a in parent.cmdline() if a.startswith("ray::")), pname) if parent else pname
                except Exception:  # noqa: BLE001
                    pname = "?"
                name = f"{name[:48]} (child of {pname})"
            out.append((name, t.user + t.system + getattr(t, "children_user", 0) + getattr(t, "children_system", 0)))
    except NameError:  # no psutil
        pass
    return out


def install_timers() -> None:
    t0 = _now()
    import da3po_megatron.trainer.loop as loop  # noqa: F401 - the trainer's own imports

    ROWS.append({"phase": "import trainer", "start": t0, "seconds": _now() - t0})
    run = "da3po_megatron.trainer.run"
    for attr, label in [("load_train_data", "data"), ("preflight", "preflight (arch, sizes)"),
                        ("init_ray", "ray.init")]:
        _patch(run, attr, label)
    for attr, label in [("plan_for_cluster", "placement plan"), ("memory_preflight", "memory plan")]:
        _patch("da3po_megatron.trainer.cluster.bringup", attr, label)  # called by bring-up's Cluster.start
    _patch("da3po_megatron.trainer.inputs", "load_tokenizer", "tokenizer")
    _patch("da3po_megatron.trainer.inputs", "check_prompts", "check prompts")
    _patch("da3po_megatron.trainer.cluster.placement_ray", "reserve", "placement groups")
    _patch("da3po_megatron.trainer.cluster.placement_ray", "probe_devices", "device probes")
    _patch("da3po_megatron.megatron.actor_group", "PolicyGroup.from_config", "policy actors scheduled")
    _patch("da3po_megatron.megatron.actor_group", "PolicyGroup.wait_ready", "policy ready (wait)", once=True)
    _patch("da3po_megatron.megatron.actor_group", "PolicyGroup.run_on_all", "policy", arg_label=True)
    _patch("da3po_megatron.megatron.actor_group", "PolicyGroup.start", "policy start", arg_label=True)
    _patch("da3po_megatron.rollout.client", "RolloutClient.ray", "engine actors scheduled")
    _patch("da3po_megatron.rollout.client", "RolloutClient.wait_ready", "engines ready (wait)", once=True)
    _patch(run, "Run.__init__", "Run.__init__ (all start-up)")
    _patch(run, "Run.evaluate", "first evaluation", once=True)
    _patch(run, "Run.sync_weights", "first weight sync", once=True)

    orig_collect = loop.collect

    def collect(run_, step):  # the first step starts here
        if "start" not in FIRST_STEP:
            FIRST_STEP["start"] = _now()
            FIRST_STEP["cpu"] = process_cpu()
        return orig_collect(run_, step)
    loop.collect = collect


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="model directory (e.g. outputs/demo/warmup)")
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[2] / "examples/tiny_cpu_da3po.yaml"))
    ap.add_argument("--run-dir", default=None, help="run directory (default: a fresh temporary one, removed)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tmp = None if args.run_dir else tempfile.mkdtemp(prefix="da3po-launch-")
    run_dir = args.run_dir or os.path.join(tmp, "run")
    install_timers()
    from da3po_megatron.trainer.main import main as train_main

    t0 = _now()
    rc = 1
    try:
        rc = train_main(["--config", args.config, f"model.path={args.model}", f"trainer.run_dir={run_dir}",
                         "trainer.total_steps=1", "trainer.save_every=0", *args.overrides])
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        report(t0, rc, args.json)
    return rc


def report(t0: float, rc: int, json_out: str | None) -> None:
    total = _now()
    first = FIRST_STEP.get("start")
    print(f"\nlaunch profile (seconds since the interpreter started; train main() entered at {t0:.1f} s):")
    print(f"{'phase':<44} {'start':>7} {'seconds':>8} {'end':>7}")
    for r in sorted(ROWS, key=lambda r: r["start"]):
        print(f"{r['phase']:<44} {r['start']:7.1f} {r['seconds']:8.1f} {r['start'] + r['seconds']:7.1f}")
    cpu = FIRST_STEP.get("cpu") or []
    if cpu:
        print("\nCPU seconds by process at the first step's start (user + system):")
        for name, sec in sorted(cpu, key=lambda x: -x[1]):
            print(f"  {sec:7.1f}  {name}")
        print(f"  {sum(s for _, s in cpu):7.1f}  in all")
    line = f"launch to first step: {first:.1f} s" if first is not None else "the first step was not reached"
    print(f"{line} (whole run {total:.1f} s, exit {rc}; load average {os.getloadavg()[0]:.1f})")
    if json_out:
        Path(json_out).write_text(json.dumps({"rows": ROWS, "first_step_s": first, "exit": rc, "cpu": cpu},
                                             indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
