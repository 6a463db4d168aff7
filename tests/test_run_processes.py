"""The processes of a run end with it: an in-process caller of ``main()`` whose start-up failed after the actors
started is left with nothing open, and a SIGKILLed driver's processes -- its Ray head's agents, and a process that
left its tree before any scan (megatron-core's forked asynchronous-save writer) -- are stopped by the reaper
(trainer/cluster/reaper.py). Split from tests/test_run_integrity_units.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from da3po_megatron.config import load_config, to_dict

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples/tiny_cpu_da3po.yaml"


# A caller of main() that keeps the error it reports (as pytest keeps a failed test's traceback, or a wrapper that
# logs it at the end): the frames of the failed start-up -- the Run and its actor handles -- then live until the
# interpreter's teardown, after Ray's own atexit shutdown; then the caller returns normally.
CALLER = """
import sys
from da3po_megatron.trainer.main import main
error = None
try:
    rc = main(sys.argv[1:])
except Exception as e:
    error = e
    rc = f"raised {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
print(f"main returned: {rc}", flush=True)
# what of the run is still open now that main() has returned: alive actors, placement groups, reward workers
import json, multiprocessing, time
import ray
from ray._private import state
from ray.util import placement_group_table
deadline = time.monotonic() + 15  # a killed actor is marked DEAD by the GCS a moment later
while True:
    left = {"actors": sum(a["State"] != "DEAD" for a in state.actors().values()),
            "placement_groups": sum(g["state"] != "REMOVED" for g in placement_group_table().values()),
            "reward_workers": len(multiprocessing.active_children())}
    if not any(left.values()) or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print("left open: " + json.dumps(left), flush=True)
"""


def _tagged(tag: str) -> list[str]:
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and f"DA3PO_TEST_RUN_TAG={tag}".encode() in (d / "environ").read_bytes():
                cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ")[:100].decode(errors="replace")
                found.append(f"{d.name}: {cmdline}")
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_restore_that_fails_after_the_actors_started_closes_them_and_an_in_process_caller_ends_in_seconds(tmp_path):
    """Point 3 (issue 35): the checkpoint chosen for the resume loses its policy shards during start-up (pruned by a
    force-unlocked trainer, removed by hand): restoring raises after the policy ranks and the engine have started.
    Before, Run.__init__ closed nothing: when main() returned, the policy and engine actors, their placement group
    and the reward workers were still alive in the caller (the issue saw such a caller hang at exit, in
    PolicyGroup.__del__ -> ray.kill). Now main() returns with nothing of the run open, and the caller ends in seconds.
    The real trainer, one policy rank, one engine."""
    import shutil
    import tempfile
    import uuid

    from da3po_megatron.tiny import build_model

    model = build_model(tmp_path / "model", "qwen3", seed=0)
    run_dir = tmp_path / "run"
    overrides = [f"model.path={model}", f"trainer.run_dir={run_dir}", "trainer.total_steps=2",
                 "data.synthetic.max_digits=3", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
                 "rollout.n=4", "rollout.max_response_length=8", "algorithm.overlong.buffer_length=2", "eval.every=0",
                 "trainer.tensorboard=false"]
    step = run_dir / "checkpoints/step_000001"
    step.mkdir(parents=True)  # intact by its marker (no manifest: an older version's), its policy/ already gone
    torch.save({"step": 1, "config": to_dict(load_config(EXAMPLE, overrides))}, step / "trainer_state.pt")
    (step / "COMPLETE").write_text("1\n")
    (run_dir / "checkpoints/latest").write_text("step_000001\n")
    tag, ray_tmp = uuid.uuid4().hex, tempfile.mkdtemp(prefix="ray_t35_", dir="/tmp")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "DA3PO_RAY_LOG_TO_DRIVER": "0", "DA3PO_TEST_RUN_TAG": tag, "DA3PO_RAY_TMP": ray_tmp,
           "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-c", CALLER, "--config", str(EXAMPLE), *overrides], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out: list[str] = []
    try:
        returned = None
        for line in p.stdout:
            out.append(line)
            if line.startswith("main returned: "):
                returned = time.monotonic()
                break
        assert returned is not None, "".join(out[-40:])
        out.append(p.stdout.readline())
        assert out[-1] == 'left open: {"actors": 0, "placement_groups": 0, "reward_workers": 0}\n', "".join(out[-20:])
        returned = time.monotonic()
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        ended = time.monotonic() - returned
        out += p.stdout.read().splitlines(keepends=True) if p.poll() is not None else []
        text = "".join(out)
        print(f"{''.join(out[-2:])}the caller ended {ended:.1f} s after main() returned (and its check)")
        assert p.poll() is not None, f"the caller still runs {ended:.0f} s after main() returned:\n{text[-3000:]}"
        # the actors had started: since a352d86 a resume loads inside the start, before the "ready" line
        assert "policy rank 0 failed in load" in text, text[-3000:]
        assert "main returned: raised" in text or "main returned: 2" in text, text[-3000:]
        assert ended < 20, text[-3000:]
        assert p.returncode == 0, text[-3000:]
        left = _tagged(tag)
        assert not left, f"processes of the run left after the caller ended: {left}"
        assert not (run_dir / "LOCK").exists()  # the lock released too
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()
        for entry in _tagged(tag):  # whatever a hung caller started (a Ray head of its own, on 27dab78)
            try:
                os.kill(int(entry.split(":")[0]), 9)
            except OSError:
                pass
        shutil.rmtree(ray_tmp, ignore_errors=True)


DRIVER = """
import subprocess, sys, time
from da3po_megatron.trainer.cluster.reaper import start_reaper
start_reaper(interval_s=0.2)
child = subprocess.Popen(["sh", "-c", "sleep 600 & wait"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
time.sleep(1.0)  # the grandchild started (a raylet's agents); the reaper's first scans
print(child.pid, flush=True)
time.sleep(600)
"""


def test_the_drivers_processes_end_within_seconds_of_a_kill_9_of_the_driver(tmp_path):
    """Point 4: what a SIGKILLed driver started (here a child and a grandchild standing in for the raylet and its
    agents, which outlived the driver by 35-60 s: Ray's 60 s report timeout) is stopped by the reaper."""
    import signal

    def running(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except OSError:
            return False

    drv = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    tree: list[int] = []
    try:
        child = int(drv.stdout.readline())
        tree = [child] + [int(x) for x in Path(f"/proc/{child}/task/{child}/children").read_text().split()]
        assert len(tree) == 2, tree
        t0 = time.monotonic()
        drv.send_signal(signal.SIGKILL)
        drv.wait()
        while any(running(p) for p in tree) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        print(f"the driver's child and grandchild ended {time.monotonic() - t0:.1f} s after its SIGKILL")
        assert not any(running(p) for p in tree)
    finally:
        drv.kill()
        drv.wait()
        for pid in tree:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


ORPHAN_DRIVER = """
import subprocess, sys, time
from da3po_megatron.trainer.cluster.reaper import start_reaper
start_reaper(interval_s=0.2)
time.sleep(0.5)
# a child that forks a writer and leaves it at once (a double fork: init's child, never a descendant of this driver),
# as megatron-core's asynchronous save forks from a policy actor that the kill then takes down
out = subprocess.run(["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True)
print(out.stdout.strip(), flush=True)
time.sleep(600)
"""


def test_a_process_that_left_the_drivers_tree_before_any_scan_is_killed_by_its_inherited_tag(tmp_path):
    """The CI failure of 2026-12-05 (`ray::PolicyWorker.save` left 30 s after a SIGKILL at a checkpoint): a process
    the run started but that is no longer the driver's descendant, and was never seen by a scan, is found by the
    ``DA3PO_REAPER_TAG`` in its environment (trainer/cluster/reaper.py) and killed. Without the tag it lives on."""
    import signal

    drv = subprocess.Popen([sys.executable, "-c", ORPHAN_DRIVER], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    orphan = 0
    try:
        orphan = int(drv.stdout.readline())
        assert Path(f"/proc/{orphan}").exists()
        assert b"DA3PO_REAPER_TAG=" in Path(f"/proc/{orphan}/environ").read_bytes()
        t0 = time.monotonic()
        drv.send_signal(signal.SIGKILL)
        drv.wait()

        def running() -> bool:
            try:
                return Path(f"/proc/{orphan}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
            except OSError:
                return False
        while running() and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        print(f"the orphaned process ended {time.monotonic() - t0:.1f} s after the driver's SIGKILL")
        assert not running()
    finally:
        drv.kill()
        drv.wait()
        if orphan:
            try:
                os.kill(orphan, signal.SIGKILL)
            except OSError:
                pass
