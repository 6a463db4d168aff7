"""Run integrity without the heavy stack: the run-directory lock (trainer/resume/lock.py) between real processes, the
config drift check on resume (trainer/resume/config_drift.py) against a real checkpoint file, and the update-guard's
driver side (trainer/updates.py). The same on the real trainer: tests/test_reliability_faults.py."""

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
from da3po_megatron.trainer.resume.lock import RunDirLock
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
    from da3po_megatron.trainer.resume.lock import RunDirLock, RunDirLocked

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
    from da3po_megatron.trainer.resume.lock import RunDirLock

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
    from da3po_megatron.trainer.resume.lock import RunDirLock

    first = _holder(tmp_path, lease=60, sleep=60)
    try:
        lines: list[str] = []
        RunDirLock(tmp_path, log=lines.append).acquire(force=True).release()
        assert any("--force-unlock" in x for x in lines)
    finally:
        first.kill()
        first.wait()


def test_a_requeued_start_of_the_same_slurm_job_waits_for_the_earlier_one(tmp_path, monkeypatch):
    from da3po_megatron.trainer.resume.lock import RunDirLock

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
    from da3po_megatron.trainer.resume.config_drift import ConfigDriftError, check_resume_config

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
    from da3po_megatron.trainer.resume.config_drift import check_resume_config

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
    from da3po_megatron.trainer.resume.lock import RunDirLock

    lock = RunDirLock(tmp_path, lease_s=0.6).acquire()
    first = json.loads((tmp_path / "LOCK").read_text())
    time.sleep(0.5)
    later = json.loads((tmp_path / "LOCK").read_text())
    lock.release()
    assert later["token"] == first["token"] and later["started"] == first["started"]
    assert later["heartbeat"] > first["heartbeat"] + 0.2


# ---------------------------------------------------------------------------------------------------- issue 35
# A finished run as the trainer leaves it, at test size: checkpoints written by the real CheckpointManager (manifest,
# COMPLETE, `latest`), each trainer_state.pt holding the config it was trained with, metrics.jsonl rows 1..6, and the
# run record run_dir/config.yaml that the first launch writes (trainer/run.py -> config_drift.write_run_record; a
# version without it -- 27dab78 -- has no record, which is the point of the first test).
def _finished_run(run_dir: Path, overrides: tuple[str, ...] = (), steps: tuple[int, ...] = (4, 6),
                  step_overrides: dict[int, tuple[str, ...]] | None = None) -> Path:
    from da3po_megatron.trainer.resume import config_drift
    from da3po_megatron.trainer.resume.checkpoint import CheckpointManager

    cfg = load_config(EXAMPLE, [f"trainer.run_dir={run_dir}", "trainer.total_steps=6", *overrides])
    ckpts = CheckpointManager(run_dir, keep_last=5)

    def policy(p: Path) -> None:
        (p / "model").mkdir(parents=True)
        (p / "model" / "shard_0.distcp").write_bytes(os.urandom(2000))

    for s in steps:
        c = load_config(EXAMPLE, [f"trainer.run_dir={run_dir}", "trainer.total_steps=6", *overrides,
                                  *(step_overrides or {}).get(s, ())])
        ckpts.save(s, policy, {"step": s, "config": to_dict(c)})
    with open(run_dir / "metrics.jsonl", "w") as f:
        f.write("".join(json.dumps({"step": s, "acc/mean": s / 10}) + "\n" for s in range(1, max(steps) + 1)))
    if hasattr(config_drift, "write_run_record"):
        config_drift.write_run_record(cfg)
    return run_dir


def _steps(path: Path) -> list[int]:
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()]


def test_a_damaged_latest_checkpoint_does_not_skip_the_config_check_on_resume(tmp_path, capsys):
    """Point 1 (issue 35): truncating step 6's trainer_state.pt used to make the resume note that it 'could not read
    the config' and train DAPO steps after DA3PO ones in one run directory."""
    from da3po_megatron.trainer.resume.config_drift import ConfigDriftError, check_resume_config

    run_dir = _finished_run(tmp_path / "run")
    state = run_dir / "checkpoints/step_000006/trainer_state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    changed = load_config(EXAMPLE, [f"trainer.run_dir={run_dir}", "algorithm.name=dapo", "daa.lambda_=3.0",
                                    "trainer.total_steps=8"])
    t0 = time.monotonic()
    with pytest.raises(ConfigDriftError) as e:
        check_resume_config(changed)
    msg = str(e.value)
    print(f"refused in {time.monotonic() - t0:.2f} s:\n{msg}")
    assert f"resuming {run_dir} from step_000006 (step 6) would change what defines the run" in msg
    assert "algorithm.name: 'da3po' -> 'dapo'" in msg and "daa.lambda_: 2.0 -> 3.0" in msg
    assert f"compared with the run record {run_dir / 'config.yaml'}" in msg
    assert not (run_dir / "config_changes.jsonl").exists()


def test_a_fallback_checkpoint_is_checked_against_its_own_recorded_config(tmp_path):
    """Point 1: the checkpoint finally loaded (after verification fell back past a damaged one) is checked against
    the config it records: here step 6 was trained as DAPO after an allowed change (the run record says DAPO), step 4
    as DA3PO; with step 6 damaged, a DAPO resume would continue DA3PO's step 4 as DAPO."""
    from da3po_megatron.trainer.resume.checkpoint import CheckpointManager
    from da3po_megatron.trainer.resume.config_drift import (
        ConfigDriftError,
        check_checkpoint_config,
        check_resume_config,
        read_run_record,
    )

    run_dir = _finished_run(tmp_path / "run", ("algorithm.name=dapo",),
                            step_overrides={4: ("algorithm.name=da3po",)})
    assert read_run_record(run_dir)["algorithm"]["name"] == "dapo"
    shard = run_dir / "checkpoints/step_000006/policy/model/shard_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    cfg = load_config(EXAMPLE, [f"trainer.run_dir={run_dir}", "trainer.total_steps=6", "algorithm.name=dapo"])
    assert check_resume_config(cfg) == []  # the record agrees ...
    lines: list[str] = []
    chosen = CheckpointManager(run_dir).latest(log=lines.append)  # ... but the checkpoint loaded is step 4
    assert chosen == run_dir / "checkpoints/step_000004" and any("is damaged" in x for x in lines)
    with pytest.raises(ConfigDriftError) as e:
        check_checkpoint_config(cfg, chosen)
    msg = str(e.value)
    assert "from step_000004 (step 4) would change what defines the run" in msg
    assert "algorithm.name: 'da3po' -> 'dapo'" in msg and f"{chosen / 'trainer_state.pt'}" in msg
    # a run of an older version (no record) whose latest is unreadable: the note, then the same refusal
    legacy = _finished_run(tmp_path / "legacy")
    (legacy / "config.yaml").unlink()
    state = legacy / "checkpoints/step_000006/trainer_state.pt"
    state.write_bytes(state.read_bytes()[:50])
    dapo = load_config(EXAMPLE, [f"trainer.run_dir={legacy}", "trainer.total_steps=6", "algorithm.name=dapo"])
    assert check_resume_config(dapo) == []
    chosen = CheckpointManager(legacy).latest(log=lines.append)
    with pytest.raises(ConfigDriftError, match="from step_000004 .*\n  algorithm.name: 'da3po' -> 'dapo'"):
        check_checkpoint_config(dapo, chosen)
    # allowed: recorded with what it was compared with
    check_checkpoint_config(dapo, chosen, allow=True, log=lines.append)
    rec = json.loads((legacy / "config_changes.jsonl").read_text().splitlines()[-1])
    assert rec["step"] == 4 and rec["allow_config_change"] and "step_000004/trainer_state.pt" in rec["compared_with"]


def test_the_run_record_is_written_atomically_once_and_loads_back_as_the_same_config(tmp_path):
    from da3po_megatron.trainer.resume.config_drift import adopt_checkpoint_record, read_run_record, write_run_record

    cfg = load_config(EXAMPLE, [f"trainer.run_dir={tmp_path}", "daa.lambda_=2.5"])
    path = write_run_record(cfg)
    assert path == tmp_path / "config.yaml" and read_run_record(tmp_path) == to_dict(cfg)
    assert write_run_record(cfg) is None  # unchanged: not rewritten
    assert to_dict(load_config(path)) == to_dict(cfg)  # usable as --config
    assert not list(tmp_path.glob(".config.yaml.*"))  # no temporary left
    # a run of an older version: adopted from its latest checkpoint on the first resume
    old = _finished_run(tmp_path / "old", ("daa.lambda_=1.5",))
    (old / "config.yaml").unlink()
    assert adopt_checkpoint_record(old) and read_run_record(old)["daa"]["lambda_"] == 1.5


def test_a_fresh_start_in_a_used_run_dir_moves_the_previous_run_aside_instead_of_emptying_its_metrics(tmp_path):
    """Point 2 (issue 35): `trainer.resume=false` in a finished run's directory used to empty metrics.jsonl and keep
    the checkpoints, so the next plain launch resumed the old step 6 after the fresh run's rows. The real CLI, stopped
    by a missing model directory right after the launch's own start (before Ray)."""
    run_dir = _finished_run(tmp_path / "run")
    (run_dir / "config_changes.jsonl").write_text('{"step": 4}\n')
    cmd = [sys.executable, "-m", "da3po_megatron.cli", "train", "--config", str(EXAMPLE), f"trainer.run_dir={run_dir}",
           "trainer.resume=false", f"model.path={tmp_path / 'no-model'}", "optim.lr=1e6"]
    p = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                       timeout=300)
    print(p.stdout[-1500:], p.stderr[-1500:])
    assert p.returncode == 2 and "is not a Hugging Face checkpoint directory" in p.stderr
    (aside,) = run_dir.glob("previous-*")
    assert f"trainer.resume=false: {run_dir} held a previous run" in p.stdout
    assert f"moved it aside to {aside}" in p.stdout
    assert "checkpoints step_000004..step_000006" in p.stdout
    assert _steps(aside / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]  # the old run, whole
    assert (aside / "checkpoints/latest").read_text().strip() == "step_000006"
    assert (aside / "config.yaml").exists() and (aside / "config_changes.jsonl").exists()
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()
    assert not (run_dir / "LOCK").exists()
    # the next plain launch finds nothing to resume: the old step 6 cannot be continued after the fresh run's rows
    from da3po_megatron.trainer.resume.checkpoint import CheckpointManager

    assert CheckpointManager(run_dir).latest() is None


def test_metrics_rows_a_resume_drops_are_kept_in_metrics_dropped(tmp_path):
    """Point 2: the rows after the resumed checkpoint (steps the run redoes, a failed step's record) leave
    metrics.jsonl for metrics.dropped.jsonl; a restart from step 0 keeps none of them in metrics.jsonl."""
    import io

    from da3po_megatron.trainer.observability.metrics import MetricsLogger

    run_dir = _finished_run(tmp_path / "run")
    out = io.StringIO()
    MetricsLogger(run_dir, 8, start_step=4, tensorboard=False, stream=out).close()
    assert _steps(run_dir / "metrics.jsonl") == [1, 2, 3, 4]
    assert _steps(run_dir / "metrics.dropped.jsonl") == [5, 6]
    assert "2 row(s) after step 4 (steps 5, 6) moved from metrics.jsonl to metrics.dropped.jsonl" in out.getvalue()
    (run_dir / "metrics.jsonl").write_text((run_dir / "metrics.jsonl").read_text() + '{"step": 5, "acc/m')  # cut
    MetricsLogger(run_dir, 8, start_step=0, tensorboard=False, stream=out).close()
    assert (run_dir / "metrics.jsonl").read_text() == ""
    dropped = [json.loads(x) for x in (run_dir / "metrics.dropped.jsonl").read_text().splitlines()]
    assert [r.get("step") for r in dropped] == [5, 6, 1, 2, 3, 4, None] and all("dropped_at" in r for r in dropped)
    assert dropped[-1]["unparsable"] == '{"step": 5, "acc/m'


FORCE = """
import sys, time
from da3po_megatron.trainer.resume.lock import RunDirLock
RunDirLock(sys.argv[1], lease_s=60, log=lambda m: None).acquire(force=True)
print("held", flush=True)
time.sleep(60)
"""


def test_a_trainer_whose_lock_was_force_unlocked_stops_before_its_next_write(tmp_path):
    """Point 4: the first trainer learns of the takeover at its next write (not up to lease/6 later at a heartbeat),
    writes nothing -- no checkpoint saved, none pruned -- and the message names --force-unlock and the new holder."""
    from da3po_megatron.trainer.resume.checkpoint import CheckpointManager
    from da3po_megatron.trainer.resume.lock import RunDirLock, RunDirLockLost, guard

    run_dir = _finished_run(tmp_path / "run", steps=(1, 2, 3))
    lost: list[str] = []
    lock = RunDirLock(run_dir, lease_s=600, on_lost=lost.append).acquire()
    ckpts = CheckpointManager(run_dir, keep_last=1)
    ckpts.before_write = guard(run_dir)
    ckpts.before_write()  # held: passes
    second = subprocess.Popen([sys.executable, "-c", FORCE, str(run_dir)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert second.stdout.readline().strip() == "held"
        before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        with pytest.raises(RunDirLockLost):
            ckpts.save(4, lambda p: p.mkdir(), {"step": 4})
        with pytest.raises(RunDirLockLost):
            ckpts.prune()
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before  # nothing written or pruned
        assert len(lost) == 1, lost
        assert f"now names host {lock.host}, pid {second.pid}" in lost[0]
        assert "it took this run directory over with --force-unlock" in lost[0] and "heartbeat" not in \
            lost[0].split(";")[1], lost[0]
    finally:
        second.kill()
        second.wait()
        lock.release()


def test_save_every_and_a_bad_override_value_are_named(tmp_path):
    from da3po_megatron.config import ConfigError

    with pytest.raises(ConfigError, match=r"trainer.save_every = -1 is out of range: allowed >= 0"):
        load_config(EXAMPLE, ["trainer.save_every=-1"])
    with pytest.raises(ConfigError) as e:
        load_config(EXAMPLE, ["daa.lambda_=abc"])
    assert str(e.value).startswith("command line override 'daa.lambda_=abc': daa.lambda_: expected a number")
    assert str(EXAMPLE.name) not in str(e.value)


def test_a_full_disk_under_torch_save_is_named_enospc_with_the_path_and_the_free_space(small_tmpfs):
    """Point 4: torch.save on a full disk raises "unexpected pos ..." / "file write failed", not ENOSPC (what a
    policy rank's save reported); the error still says the disk is full, where, and how much is free."""
    from da3po_megatron.trainer.resume.checkpoint import CheckpointManager, CheckpointWriteError

    def policy(p: Path) -> None:
        p.mkdir()
        torch.save({"w": torch.zeros(1_000_000)}, p / "model.pt")  # 4 MB into 2 MiB

    with pytest.raises(CheckpointWriteError) as e:
        CheckpointManager(small_tmpfs).save(1, policy, {"step": 1})
    msg = str(e.value)
    print(msg)
    assert "the disk is full (No space left on device, ENOSPC, on the filesystem of " \
        f"{small_tmpfs / 'checkpoints'})" in msg
    assert "MiB of 0.0 GiB when it failed" in msg and "MiB now" in msg


def test_a_dynamic_sampling_failure_checkpoints_the_last_completed_step_first_with_a_stand_in_run(tmp_path):
    """Point 4: the loop (trainer/loop.py run_steps, real) with a stand-in for the Run around it (no actors): its
    batch cannot be filled (no generation round allowed), so the step fails -- after saving the last completed step
    (save_every=10 had not saved step 3), before the failed step's row is logged. A resume redoes nothing."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from da3po_megatron.algorithms import DynamicSamplingBuffer
    from da3po_megatron.trainer.cluster.signals import StopSignals
    from da3po_megatron.trainer.generation.collect import DynamicSamplingError
    from da3po_megatron.trainer.loop import run_steps

    cfg = load_config(EXAMPLE, [f"trainer.run_dir={tmp_path}", "trainer.save_every=10"])
    cfg.algorithm.max_generation_rounds = 0  # (validated >= 1 at load) no round: the batch stays empty
    events: list[str] = []

    class StandInState:  # run.state (resume/run_state.py)
        step, pending, producer, producer_state = 3, [], None, None

        def save_checkpoint(self, best_value=None) -> None:
            events.append(f"checkpoint step {self.step}")

        def poll_checkpoint(self, wait: bool = False) -> None:
            pass

    class StandInRun:
        stop = StopSignals()
        profiler = type("P", (), {"start": lambda self, s: None, "stop": lambda self: None})()

        def __init__(self) -> None:
            self.cfg = cfg
            self.sampler = SimpleNamespace(cfg=cfg, engine_weight_step=3, replay=None, buffer=DynamicSamplingBuffer(
                cfg.data.train_batch_size, cfg.algorithm.surplus, cfg.rollout.n))
            self.state = StandInState()
            self.logger = type("L", (), {"log": lambda _, s, m: events.append(f"log step {s}")})()

        def should_evaluate(self, step: int) -> bool:
            return False

        def phase(self, name: str):
            return nullcontext()

    with pytest.raises(DynamicSamplingError, match="after 0 generation rounds"):
        run_steps(StandInRun())
    assert events == ["checkpoint step 3", "log step 4"], events
