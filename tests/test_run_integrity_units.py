"""Run integrity without the heavy stack: the run-directory lock (trainer/lock.py) between real processes, the config
drift check on resume (trainer/config_drift.py) against a real checkpoint file, and the update-guard's driver side
(trainer/updates.py). The same on the real trainer: tests/test_reliability_faults.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from da3po_megatron.config import load_config, to_dict

ROOT = Path(__file__).resolve().parents[1]
HOLD = """
import sys, time
from da3po_megatron.trainer.lock import RunDirLock
lock = RunDirLock(sys.argv[1], lease_s=float(sys.argv[2])).acquire()
print("held", flush=True)
time.sleep(float(sys.argv[3]))
"""


def _holder(run_dir: Path, lease: float, sleep: float) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir), str(lease), str(sleep)], stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_holder_is_refused_naming_the_first_and_a_dead_one_is_taken_over(tmp_path):
    from da3po_megatron.trainer.lock import RunDirLock, RunDirLocked

    first = _holder(tmp_path, lease=60, sleep=60)
    try:
        info = json.loads((tmp_path / "LOCK").read_text())
        assert info["pid"] == first.pid and info["host"] and info["lease_s"] == 60
        t0 = time.monotonic()
        with pytest.raises(RunDirLocked, match=f"in use by another trainer: host .*, pid {first.pid}, started"):
            RunDirLock(tmp_path).acquire()
        assert time.monotonic() - t0 < 2
    finally:
        first.kill()
        first.wait()
    lines: list[str] = []  # SIGKILLed: the lock stays, and the next one takes it over at once (pid dead)
    lock = RunDirLock(tmp_path, lease_s=60, log=lines.append).acquire()
    assert any(f"took over {tmp_path / 'LOCK'} from host" in x and f"pid {first.pid}," in x and "is gone" in x
               for x in lines), lines
    assert json.loads((tmp_path / "LOCK").read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / "LOCK").exists()


def test_a_stale_heartbeat_is_taken_over_and_the_loser_notices(tmp_path):
    from da3po_megatron.trainer.lock import RunDirLock

    lost: list[str] = []
    old = RunDirLock(tmp_path, lease_s=600, on_lost=lost.append).acquire()
    old._stop.set()  # a frozen trainer: its heartbeat stops ...
    old._thread.join()
    info = json.loads((tmp_path / "LOCK").read_text())
    info.update(host="another-node", heartbeat=time.time() - 700)  # ... on another node, past its lease
    (tmp_path / "LOCK").write_text(json.dumps(info))
    lines: list[str] = []
    new = RunDirLock(tmp_path, lease_s=600, log=lines.append).acquire()
    assert any("took over" in x and "another-node" in x and "past its lease of 600 s" in x for x in lines), lines
    assert old.heartbeat() is False and "run_dir lock lost" in lost[0]  # it would now stop (SIGKILL by default)
    new.release()


def test_force_unlock_takes_a_live_lock(tmp_path):
    from da3po_megatron.trainer.lock import RunDirLock

    first = _holder(tmp_path, lease=60, sleep=60)
    try:
        lines: list[str] = []
        RunDirLock(tmp_path, log=lines.append).acquire(force=True).release()
        assert any("--force-unlock" in x for x in lines)
    finally:
        first.kill()
        first.wait()


def test_a_requeued_start_of_the_same_slurm_job_waits_for_the_earlier_one(tmp_path, monkeypatch):
    from da3po_megatron.trainer.lock import RunDirLock

    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    first = _holder(tmp_path, lease=60, sleep=2)  # inherits SLURM_JOB_ID: the earlier start, in its grace period
    lines: list[str] = []
    t0 = time.monotonic()
    RunDirLock(tmp_path, log=lines.append).acquire(wait_same_job_s=30).release()
    assert 1 < time.monotonic() - t0 < 20 and "earlier start of this Slurm job" in lines[0], lines
    first.wait()


# ---------------------------------------------------------------------------------------------------- config drift
EXAMPLE = ROOT / "examples/tiny_cpu_da3po.yaml"


def _checkpoint(run_dir: Path, overrides: list[str]) -> None:
    cfg = load_config(EXAMPLE, [f"trainer.run_dir={run_dir}", *overrides])
    step = run_dir / "checkpoints/step_000004"
    step.mkdir(parents=True)
    torch.save({"step": 4, "config": to_dict(cfg)}, step / "trainer_state.pt")
    (run_dir / "checkpoints/latest").write_text("step_000004\n")


def test_resume_refuses_a_changed_algorithm_and_records_an_allowed_one(tmp_path):
    from da3po_megatron.trainer.config_drift import ConfigDriftError, check_resume_config

    _checkpoint(tmp_path, [])
    changed = load_config(EXAMPLE, [f"trainer.run_dir={tmp_path}", "algorithm.name=dapo", "daa.lambda_=3.0",
                                    "trainer.total_steps=40"])
    with pytest.raises(ConfigDriftError) as e:
        check_resume_config(changed, log=print)
    msg = str(e.value)
    assert "algorithm.name: 'da3po' -> 'dapo'" in msg and "daa.enable: True -> False" in msg
    assert "daa.lambda_: 2.0 -> 3.0" in msg and "--allow-config-change" in msg
    assert "trainer.total_steps: 30 -> 40" in msg.split("(also changed, allowed:")[1]
    assert not (tmp_path / "config_changes.jsonl").exists()
    lines: list[str] = []
    changes = check_resume_config(changed, allow=True, log=lines.append)
    assert {c["key"] for c in changes} >= {"algorithm.name", "daa.lambda_", "trainer.total_steps"}
    assert any(x.startswith("warning: resume changes algorithm.name") and "allowed by --allow-config-change" in x
               for x in lines)
    rec = json.loads((tmp_path / "config_changes.jsonl").read_text())
    assert rec["allow_config_change"] is True and rec["step"] == 4
    assert {"key": "algorithm.name", "old": "da3po", "new": "dapo", "kind": "defining"} in rec["changes"]


def test_resume_passes_harmless_changes_with_a_one_line_notice_and_says_a_new_lr_has_no_effect(tmp_path):
    from da3po_megatron.trainer.config_drift import check_resume_config

    _checkpoint(tmp_path, [])
    lines: list[str] = []
    check_resume_config(load_config(EXAMPLE, [f"trainer.run_dir={tmp_path}", "trainer.total_steps=40",
                                              "eval.every=5", "optim.lr=3e-4"]), log=lines.append)
    assert "note: resume changes trainer.total_steps: 30 -> 40" in lines
    assert "note: resume changes eval.every: 10 -> 5" in lines
    assert any("optim.lr: 0.0001 -> 0.0003, which has no effect" in x for x in lines), lines
    assert check_resume_config(load_config(EXAMPLE, [f"trainer.run_dir={tmp_path}", "trainer.resume=false",
                                                     "algorithm.name=grpo"])) == []


# ---------------------------------------------------------------------------------------------------- update guard
def test_refused_updates_are_named_with_ratio_lr_and_grad_norm_and_stop_after_the_limit(capsys):
    from da3po_megatron.config import TrainerConfig
    from da3po_megatron.trainer.updates import UpdateSizeError, check_update

    totals = {"skipped_updates": 0, "consecutive_skipped_updates": 0}
    m = {"skipped_updates": 2, "num_updates": 2, "trailing_skipped_updates": 2, "update_ratio_refused_updates": 2,
         "update_ratio": 31.6, "lr": 1000.0, "grad_norm": 0.53}
    t = TrainerConfig(max_update_ratio=0.1, max_consecutive_skipped_updates=3)
    check_update(totals, 1, m, t)
    assert ("warning: step 1: skipped 2 of 2 optimizer updates: update ratio ||dtheta||/||theta|| 31.6 > "
            "trainer.max_update_ratio=0.1 in 2 (lr 1e+03, grad norm 0.53)") in capsys.readouterr().out
    with pytest.raises(UpdateSizeError, match="step 2: 4 optimizer updates in a row refused, the last for their size"):
        check_update(totals, 2, m, t)


def test_the_heartbeat_is_rewritten_every_sixth_of_the_lease(tmp_path):
    from da3po_megatron.trainer.lock import RunDirLock

    lock = RunDirLock(tmp_path, lease_s=0.6).acquire()
    first = json.loads((tmp_path / "LOCK").read_text())
    time.sleep(0.5)
    later = json.loads((tmp_path / "LOCK").read_text())
    lock.release()
    assert later["token"] == first["token"] and later["started"] == first["started"]
    assert later["heartbeat"] > first["heartbeat"] + 0.2
