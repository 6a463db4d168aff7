"""trainer.keep_best_metric: the best checkpoint by an eval metric is kept besides the last K, never pruned, and
survives a restart (trainer/resume/best.py with the real CheckpointManager on the file system; the policy's own save is
a small stand-in file, which is what CheckpointManager treats opaquely)."""

from __future__ import annotations

import json

import pytest

from da3po_megatron.config import ConfigError, load_config
from da3po_megatron.trainer.resume.best import BestCheckpoint, save_checkpoint
from da3po_megatron.trainer.resume.checkpoint import CheckpointManager

METRIC = "eval/avg/avg@k"


def _save_policy(p):
    p.mkdir()
    (p / "weights").write_text("x")


def _run(run_dir, evals: dict[int, float], steps: range, keep_last: int = 1, save_every: int = 5,
         mode: str = "max") -> tuple[CheckpointManager, BestCheckpoint]:
    """What trainer/loop.py does per step: a checkpoint on save steps and whenever the eval beats the best."""
    best = BestCheckpoint(run_dir / "checkpoints", METRIC, mode)
    ckpt = CheckpointManager(run_dir, keep_last, protect=best.protected)
    for step in steps:
        metrics = {"step": step, "acc/mean": 0.5}
        if step in evals:
            metrics.update({METRIC: evals[step], "eval/avg/pass@k": 0.9})
        value = best.candidate(step, metrics)
        if step % save_every == 0 or value is not None:
            save_checkpoint(ckpt, best, step, _save_policy, {"step": step}, value)
    return ckpt, best


def _dirs(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))


def test_best_checkpoint_is_kept_besides_the_last_k_and_never_pruned(tmp_path):
    evals = {0: 0.9, 2: 0.3, 4: 0.5, 6: 0.45, 8: 0.5, 10: 0.2, 12: 0.4}  # step 0 = the starting policy: no candidate
    ckpt, best = _run(tmp_path, evals, range(1, 13))
    assert best.state == {"metric": METRIC, "mode": "max", "value": 0.5, "step": 4, "dir": "step_000004"}
    assert _dirs(tmp_path) == ["step_000004", "step_000010"]  # the best + the last K=1 (step 12 was not a save step)
    assert ckpt.latest().name == "step_000010"
    assert json.loads((tmp_path / "checkpoints/best.json").read_text())["step"] == 4  # ties keep the earlier one


def test_best_checkpoint_survives_a_restart_and_a_later_best_replaces_it(tmp_path):
    _run(tmp_path, {2: 0.3, 4: 0.5, 6: 0.4}, range(1, 9))
    assert _dirs(tmp_path) == ["step_000004", "step_000005"]
    # restart (new manager and tracker, as after a requeue): the stored best is the bar to beat and stays protected
    ckpt, best = _run(tmp_path, {10: 0.45, 12: 0.6, 14: 0.55}, range(9, 16))
    assert best.value == 0.6 and best.state["step"] == 12
    assert _dirs(tmp_path) == ["step_000012", "step_000015"]  # the old best (step 4) pruned once superseded
    assert ckpt.latest().name == "step_000015"


def test_min_mode_and_a_missing_metric_names_the_field(tmp_path):
    _, best = _run(tmp_path, {2: 0.3, 4: 0.1, 6: 0.2}, range(1, 7), mode="min")
    assert best.state["step"] == 4
    with pytest.raises(KeyError, match=r"trainer.keep_best_metric='eval/avg/avg@k' .*eval/aime24/avg@k"):
        best.candidate(8, {"eval/aime24/avg@k": 0.4})
    assert best.candidate(9, {"acc/mean": 1.0}) is None  # a step without evaluation


def test_a_best_file_for_another_metric_is_set_aside(tmp_path, capsys):
    _run(tmp_path, {2: 0.3}, range(1, 3))
    other = BestCheckpoint(tmp_path / "checkpoints", "eval/aime24/avg@k")
    assert other.value is None and other.protected() == set()
    assert "tracking starts over" in capsys.readouterr().out


def test_config_requires_an_eval_key_and_evaluations_for_keep_best_metric():
    base = ["model.path=unused", "eval.benchmarks=[aime24]"]
    cfg = load_config("examples/tiny_cpu_da3po.yaml", base + ["eval.every=5", f"trainer.keep_best_metric={METRIC}"])
    assert cfg.trainer.keep_best_metric == METRIC and cfg.trainer.keep_best_mode == "max"
    with pytest.raises(ConfigError, match="trainer.keep_best_metric"):
        load_config("examples/tiny_cpu_da3po.yaml", base + ["eval.every=0", f"trainer.keep_best_metric={METRIC}"])
    with pytest.raises(ConfigError, match="trainer.keep_best_metric"):
        load_config("examples/tiny_cpu_da3po.yaml", base + ["eval.every=5", "trainer.keep_best_metric=acc/mean"])
