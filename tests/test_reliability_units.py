"""Reliability without the heavy stack: stop signals, the non-finite guard (2 real gloo ranks), checkpoint manifests,
fallback and disk-full (a real size-limited tmpfs), safe loading, config validation, and bad input files that must
end in one line and exit 2 before any actor starts (the real CLI on a real tiny model directory)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


# ---------------------------------------------------------------------------------------------------- stop signals
def test_stop_signals_first_requests_a_checkpoint_second_sigint_exits_now(tmp_path):
    from da3po_megatron.trainer.cluster.signals import StepAbandoned, StopSignals

    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        stop = StopSignals(tmp_path / "PREEMPT")
        stop.install()
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)  # outside an abandonable phase: only a request
        assert stop.requested and stop.describe() == "SIGTERM" and not stop.abandoned
        with pytest.raises(StepAbandoned):  # a phase that starts after the request is abandoned at once
            with stop.abandonable():
                pass
        stop = StopSignals()
        stop.install()
        with pytest.raises(StepAbandoned):  # inside one: the handler abandons it
            with stop.abandonable():
                os.kill(os.getpid(), signal.SIGINT)
        assert stop.abandoned and not stop.exit_now
        with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C: now
            os.kill(os.getpid(), signal.SIGINT)
        assert stop.exit_now
        stop = StopSignals(tmp_path / "PREEMPT")
        (tmp_path / "PREEMPT").touch()
        assert stop.requested and "PREEMPT exists" in stop.describe()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# ---------------------------------------------------------------------------------------------------- non-finite
# the update guard itself (non-finite loss / grads on one rank skip on all; too-large updates; non-finite weights) is
# tested on a real megatron-core model and optimizer in tests/test_update_guard.py


def test_nonfinite_reward_or_advantage_names_the_prompt_advantage_fn_mocked(monkeypatch):
    from types import SimpleNamespace

    from da3po_megatron.data.datasets import Example
    from da3po_megatron.trainer import batch as B

    ex = Example(uid="p7", prompt=[{"role": "user", "content": "?"}], answer="5", source="t")
    comp = SimpleNamespace(prompt_token_ids=[1], token_ids=[2], text="x", logprobs=[-1.0], finish_reason="stop")
    with pytest.raises(FloatingPointError, match="non-finite rewards for prompt 'p7'.*responses \\[1\\]"):
        B.make_groups([ex], [[comp, comp]], [1.0, float("nan")], 8, None)
    groups = B.make_groups([ex], [[comp, comp]], [1.0, -1.0], 8, None)
    # Eq. 3 as implemented is safe (equal rewards give 0, overflow gives 0); a custom advantage function may not be
    monkeypatch.setattr(B, "group_advantages", lambda r, G, eps: torch.full_like(r, float("nan")))
    with pytest.raises(FloatingPointError, match="non-finite advantages for prompt 'p7'"):
        B.compute_advantages(groups, eps=1e-6, daa=False, lambda_=1.0, tau=0.5)


# ---------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("override, message", [
    ("optim.lr=inf", "optim.lr = inf is not a finite number"),
    ("optim.lr=.nan", "optim.lr = nan is not a finite number"),
    ("optim.lr=-1e-6", "optim.lr = -1e-06 is out of range"),
    ("optim.clip_grad=-1", "optim.clip_grad = -1.0 is out of range: allowed >= 0"),
    ("algorithm.clip_ratio_high=.inf", "algorithm.clip_ratio_high = inf is not a finite number"),
    ("optim.adam_eps=0", "optim.adam_eps = 0.0 is out of range"),
    ("trainer.max_consecutive_skipped_updates=0", "trainer.max_consecutive_skipped_updates = 0 is out of range"),
    ("optim.lrr=1", "command line override 'optim.lrr=1': unknown config key 'optim.lrr'; did you mean 'optim.lr'?"),
])
def test_config_rejects_nonfinite_and_negative_values_and_names_command_line_keys(override, message):
    from da3po_megatron.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "examples/tiny_cpu_da3po.yaml", [override])
    assert message in str(e.value)
    assert "tiny_cpu_da3po.yaml" not in str(e.value)  # not blamed on the YAML file


# ---------------------------------------------------------------------------------------------------- checkpoints
def _fake_policy(size: int = 1000):
    def save(p: Path) -> None:
        (p / "model").mkdir(parents=True)
        (p / "model" / "shard_0.distcp").write_bytes(os.urandom(size))
        (p / "meta.json").write_text("{}")
    return save


def _state(step: int) -> dict:
    return {"step": step, "rng": {"python": __import__("random").getstate(), "torch": torch.get_rng_state()}}


def test_checkpoint_manifest_verify_and_fallback_to_the_newest_intact(tmp_path, capsys):
    from da3po_megatron.trainer.resume.checkpoint import CheckpointManager, main, verify_checkpoint

    m = CheckpointManager(tmp_path, keep_last=3)
    for step in (2, 4, 6):
        m.save(step, _fake_policy(), _state(step))
    root = tmp_path / "checkpoints"
    assert all(verify_checkpoint(root / f"step_00000{s}") == [] for s in (2, 4, 6))
    assert main(["verify", str(tmp_path)]) == 0
    # truncate the latest's shard, change a byte of the previous one's trainer state
    shard = root / "step_000006/policy/model/shard_0.distcp"
    shard.write_bytes(shard.read_bytes()[:500])
    ts = root / "step_000004/trainer_state.pt"
    data = bytearray(ts.read_bytes())
    data[-20] ^= 0xFF
    ts.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert f"{shard}: 500 bytes, the manifest says 1000" in out and f"{ts}: checksum" in out
    got = m.latest(log=print)
    out = capsys.readouterr().out
    assert got == root / "step_000002" and (root / "latest").read_text().strip() == "step_000002"
    assert f"checkpoint {root / 'step_000006'} is damaged: {shard}: 500 bytes" in out
    assert (root / "damaged-step_000006").is_dir() and (root / "damaged-step_000004").is_dir()  # kept, not deleted
    assert "falling back to the newest intact checkpoint" in out


def test_trainer_state_loads_with_weights_only_and_old_pickles_need_the_opt_in(tmp_path, monkeypatch):
    import numpy as np

    from da3po_megatron.megatron.checkpoint import safe_load
    from da3po_megatron.megatron.runtime import numpy_rng_state, set_numpy_rng_state

    state = numpy_rng_state()
    a = np.random.rand(3)
    set_numpy_rng_state(state)
    assert (np.random.rand(3) == a).all()
    torch.save({"numpy": state, "torch": torch.get_rng_state()}, tmp_path / "ok.pt")
    assert safe_load(tmp_path / "ok.pt")["numpy"][0] == "MT19937"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    monkeypatch.delenv("DA3PO_ALLOW_PICKLE_CHECKPOINTS", raising=False)
    with pytest.raises(pickle.UnpicklingError, match="DA3PO_ALLOW_PICKLE_CHECKPOINTS=1"):
        safe_load(tmp_path / "evil.pt")
    assert not (tmp_path / "pwned").exists()  # nothing ran
    torch.save({"old": np.random.get_state()}, tmp_path / "old.pt")  # an old-format state (numpy array inside)
    monkeypatch.setenv("DA3PO_ALLOW_PICKLE_CHECKPOINTS", "1")
    assert safe_load(tmp_path / "old.pt")["old"][0] == "MT19937"


def test_disk_full_during_a_save_says_so_and_keeps_the_previous_checkpoint(small_tmpfs):
    from da3po_megatron.trainer.resume.checkpoint import CheckpointManager, CheckpointWriteError, verify_checkpoint

    m = CheckpointManager(small_tmpfs, keep_last=3)
    m.save(1, _fake_policy(600_000), _state(1))
    with pytest.raises(CheckpointWriteError) as e:
        m.save(2, _fake_policy(3_000_000), _state(2))  # does not fit
    msg = str(e.value)
    assert "writing checkpoint step 2" in msg and "the disk is full" in msg and "still points to" in msg
    assert "(step_000001)" in msg
    root = small_tmpfs / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_000001" and verify_checkpoint(root / "step_000001") == []
    assert not (root / ".tmp-step_000002").exists()  # the partial write is gone: the space is free again
    m.save(3, _fake_policy(600_000), _state(3))  # and the next save fits
    assert m.latest() == root / "step_000003"


# ---------------------------------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from da3po_megatron.tiny import build_model

    return build_model(tmp_path_factory.mktemp("tiny") / "model", "qwen3", seed=0)


def _train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "da3po_megatron.cli", "train", "--config", str(ROOT / "examples/tiny_cpu_da3po.yaml"),
           f"trainer.run_dir={tmp_path / 'run'}", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


def _one_line_exit_2(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "Started a local Ray" not in p.stdout + p.stderr, p.stderr[-3000:]
    for n in needles:
        assert n in p.stderr, p.stderr[-3000:]


def test_non_utf8_line_names_file_and_row_and_skip_skips_and_counts_it(tmp_path):
    from da3po_megatron.data.datasets import BadRowError, load_prompts

    f = tmp_path / "train.jsonl"
    f.write_bytes(b'{"prompt": "1+1?", "answer": "2"}\n{"prompt": "caf\xe9 \xff?", "answer": "1"}\n'
                  b'{"prompt": "3+3?", "answer": "6"}\n')
    with pytest.raises(BadRowError) as e:
        load_prompts(f, format="generic", default_source="t")
    assert f"{f}: row 1 (line 2), field '<json>': not valid UTF-8" in str(e.value)
    ds = load_prompts(f, format="generic", on_bad_row="skip", default_source="t")
    assert len(ds) == 2 and ds.stats.skipped == 1


def test_bad_input_files_end_in_one_line_and_exit_2_before_any_actor(tmp_path, tiny_model):
    data = tmp_path / "train.jsonl"
    data.write_text("")
    _one_line_exit_2(_train(tmp_path, f"model.path={tiny_model}", "data.format=generic",
                            f"data.train_files=[{data}]"), "no usable rows", str(data))

    broken = tmp_path / "broken_config"
    shutil.copytree(tiny_model, broken)
    (broken / "config.json").write_text('{"model_type": "qwen3", "hidden_size": 6')
    _one_line_exit_2(_train(tmp_path, f"model.path={broken}"), f"{broken / 'config.json'}: not valid JSON")

    bad_tok = tmp_path / "broken_tokenizer"
    shutil.copytree(tiny_model, bad_tok)
    for name in ("tokenizer.json", "vocab.json"):
        if (bad_tok / name).exists():
            (bad_tok / name).write_text("{ not json")
    _one_line_exit_2(_train(tmp_path, f"model.path={bad_tok}"), "the tokenizer does not load")

    long_data = tmp_path / "long.jsonl"
    long_data.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n"
                         + json.dumps({"prompt": "9 " * 200, "answer": "9"}) + "\n")
    _one_line_exit_2(_train(tmp_path, f"model.path={tiny_model}", "data.format=generic", "reward.kind=math",
                            "rollout.max_prompt_length=400", f"data.train_files=[{long_data}]"),
                     "row 1 (uid 'long:1')", "more than rollout.max_prompt_length=400")

    p = _train(tmp_path, "optim.lr=inf")
    assert p.returncode == 2 and "optim.lr = inf is not a finite number" in p.stderr


def test_an_output_directory_that_cannot_be_made_is_one_line_exit_2_and_nothing_is_written(tmp_path):
    """Issue 58 point 7: a ``rollout.dump_dir`` under a file ended in a raw ``NotADirectoryError`` traceback (exit 1)
    after the run directory was made. Now: the field named, exit 2, no run directory."""
    from da3po_megatron.config import load_config
    from da3po_megatron.trainer.inputs import InputError, check_output_dirs

    afile = tmp_path / "a_file"
    afile.write_text("")
    p = _train(tmp_path, f"rollout.dump_dir={afile / 'dump'}")
    _one_line_exit_2(p, "rollout.dump_dir", "is not a directory")
    assert not (tmp_path / "run").exists()
    cfg = load_config(ROOT / "examples/tiny_cpu_da3po.yaml", [f"trainer.run_dir={afile / 'run'}"])
    with pytest.raises(InputError, match="trainer.run_dir"):
        check_output_dirs(cfg)
    check_output_dirs(load_config(ROOT / "examples/tiny_cpu_da3po.yaml", [f"trainer.run_dir={tmp_path / 'a/b'}"]))


def test_long_prompts_are_skipped_and_counted_with_on_bad_row_skip(tmp_path, tiny_model):
    from da3po_megatron.config import load_config
    from da3po_megatron.trainer.inputs import check_prompts, load_tokenizer, load_train_data

    f = tmp_path / "long.jsonl"
    f.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in ("1+1?", "9 " * 200, "2+2?")))
    cfg = load_config(ROOT / "examples/tiny_cpu_da3po.yaml", [f"model.path={tiny_model}", "data.format=generic",
                                                               f"data.train_files=[{f}]", "data.on_bad_row=skip",
                                                               "rollout.max_prompt_length=400"])
    ds = check_prompts(load_train_data(cfg), load_tokenizer(cfg), cfg)
    assert len(ds) == 2 and ds.stats.skipped == 1 and ds.stats.skipped_by_field["<prompt_length>"] == 1


def test_very_long_answer_is_scored_within_the_time_limit():
    """A 200 KB ground-truth answer and a 200 KB response: scored, or -1 and counted, within the limit; never a hang."""
    import time

    from da3po_megatron.rewards import RewardPool

    with RewardPool(num_workers=1, timeout_s=2.0, kill_grace_s=1.0) as pool:
        t0 = time.monotonic()
        res = pool.score_batch(["Answer: " + "1" * 200_000, "\\boxed{5}"], ["1" * 200_000, "5"], kind="math")
        assert time.monotonic() - t0 < 15
    assert res.rewards[1] == 1.0 and res.infos[1]["status"] == "ok"
    # this one: math-verify gives up on the answer (an error, -1, counted); a timeout would be counted the same way
    assert res.infos[0]["status"] == "ok" or (res.rewards[0] == -1.0 and res.errors + res.timeouts == 1)


# ---------------------------------------------------------------------------------------------------- Ray start-up
def test_local_ray_start_retries_a_start_up_timeout_and_kills_what_it_started_with_a_stand_in_ray_init(
        monkeypatch, capfd):
    """Ray's fixed 30 s start-up wait cannot be made to run out on demand, so ``ray.init`` is a stand-in here: its
    first call starts a real child process (as the failed start's GCS and raylet are) and raises Ray's message, its
    second succeeds. The retry must kill that child and say so; any other error must not be retried."""
    import psutil
    import ray

    from da3po_megatron.trainer.cluster import bringup as prepare

    calls: list[dict] = []
    started: list[subprocess.Popen] = []

    def fake_init(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:
            started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
            raise Exception("The current node timed out during startup. This could happen because ...")

    monkeypatch.setattr(ray, "init", fake_init)
    prepare.start_local_ray("/tmp/unused", 3, log_to_driver=False)
    assert len(calls) == 2 and calls[1]["num_cpus"] == 3 and calls[1]["log_to_driver"] is False
    started[0].wait(timeout=5)  # killed by the retry (it would sleep 120 s): TimeoutExpired otherwise
    assert not psutil.pid_exists(started[0].pid)
    assert "Ray's local start-up timed out (attempt 1 of 2" in capfd.readouterr().err

    def other_error(**kwargs):
        calls.append(kwargs)
        raise ValueError("bad argument")

    calls.clear()
    monkeypatch.setattr(ray, "init", other_error)
    with pytest.raises(ValueError, match="bad argument"):
        prepare.start_local_ray("/tmp/unused", 3)
    assert len(calls) == 1
