"""da3po_megatron/bench/async_rl.py ``--engines`` (issue 58 point 3): the real-trainer engine scan's runs and table,
with the ``da3po train`` runs replaced by canned metrics (the real runs are the bench's, docs/async.md)."""

from __future__ import annotations

from pathlib import Path

from da3po_megatron.bench import async_rl


def test_the_engine_scan_runs_each_order_and_count_weak_scaled_and_prints_ratios_to_one_engine(monkeypatch, capsys):
    runs = []

    def fake_run(args, model, run_dir, extra, env, name):
        runs.append((run_dir.name, extra))
        n = int(next(x for x in extra if x.startswith("rollout.num_engines=")).split("=")[1])
        return [{"step": 3, "time/step": 2.0, "rollout/kept_tokens": 100.0 * n * 1.5 ** (n - 1),
                 "time/rollout_pause": 0.1 * n, "rollout/async/engine_idle_frac": 0.02 * n,
                 "rollout/async/engine_idle_bound_frac": 0.01 * n, "rollout/async/deadline_waits": 1.0}]

    monkeypatch.setattr(async_rl, "train_run", fake_run)
    args = async_rl.parse(["--engines", "1,2", "--prompts", "4", "--inflight", "2", "--warmup", "2", "--steps", "1"])
    assert async_rl.engines_table(args, Path("/nonexistent"), Path("/nonexistent/model"), {5}, {}) == 0
    assert [r for r, _ in runs] == ["e1_fifo", "e2_fifo", "e1_oldest_decided", "e2_oldest_decided"]
    extra = dict(x.split("=", 1) for x in runs[3][1])
    assert extra == {"rollout.num_engines": "2", "rollout.staleness": "2", "rollout.partial_rollouts": "true",
                     "rollout.release_order": "oldest_decided", "data.train_batch_size": "8",
                     "actor.ppo_mini_batch_size": "8", "rollout.max_inflight_prompts": "4"}
    rows = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| oldest_decided | 2 ")]
    assert rows == ["| oldest_decided | 2 | 4.0% | 2.0% | 0.20 | 2.00x | 150 | 3.00x | 2.00 | 1.00 | 0.00 |"]
