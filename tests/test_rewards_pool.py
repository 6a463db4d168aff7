"""RewardPool: real worker processes running math-verify with per-item time limits that never hang a step."""

from __future__ import annotations

import os
import time

import pytest

from da3po_megatron.rewards import RewardPool

THIS_MODULE = __name__  # pytest imports this file as a top-level module; pool workers import it by that name


def sleepy_reward(response: str, answer: str) -> float:
    """A reward function that ignores SIGALRM-based limits the way C code would: it blocks the signal and sleeps."""
    import signal

    if response == "hang":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(60)
    if response == "crash":
        os._exit(3)
    if response == "raise":
        raise RuntimeError("boom")
    return 1.0 if response == answer else -1.0


@pytest.fixture
def pool():
    """A pool with a generous limit: ordinary items must never time out, even on a loaded CI machine."""
    with RewardPool(num_workers=2, timeout_s=20.0, extra_kinds={"sleepy": f"{THIS_MODULE}:sleepy_reward"}) as p:
        yield p


@pytest.fixture
def tight_pool():
    """A pool with a short limit, for the tests that hit it on purpose."""
    with RewardPool(num_workers=2, timeout_s=2.0, kill_grace_s=0.5,
                    extra_kinds={"sleepy": f"{THIS_MODULE}:sleepy_reward"}) as p:
        yield p


def test_math_batch_scores_in_order_with_info(pool):
    res = pool.score_batch(["\\boxed{4}", "Answer: 5", "no answer", "Answer: 2\\sqrt{2}"], ["4", "4", "4", "2"],
                           kind="math")
    assert res.rewards == [1.0, -1.0, -1.0, -1.0], res.infos
    assert [i["status"] for i in res.infos] == ["ok"] * 4
    assert res.infos[0]["extracted"] == "4" and res.infos[3]["how"] == "answer_line"
    assert pool.stats["n"] == 4 and pool.stats["timeouts"] == 0 and pool.stats["errors"] == 0


def test_synthetic_kind_runs_in_the_pool(pool):
    res = pool.score_batch(["387", "3 8 7", "388"], ["387"] * 3, kind="synthetic")
    assert res.rewards == [1.0, 1.0, -1.0], res.infos


def test_giant_power_tower_hits_the_time_limit_scores_minus_one_and_is_counted(tight_pool):
    pool = tight_pool
    tower = "Answer: 9^{9^{9^{9^{9}}}}"  # parses instantly, then sympy tries to compare it numerically forever
    t0 = time.monotonic()
    res = pool.score_batch([tower, "\\boxed{5}"], ["5", "5"], kind="math")
    assert time.monotonic() - t0 < 15, res.infos
    assert res.rewards == [-1.0, 1.0], res.infos
    assert res.infos[0]["status"] == "timeout" and res.timeouts == 1
    assert pool.stats["timeouts"] == 1
    # the pool keeps working
    again = pool.score_batch(["\\boxed{6}"], ["6"])
    assert again.rewards == [1.0], (again.infos, pool.stats)


def test_worker_that_ignores_the_alarm_is_killed_and_replaced(tight_pool):
    pool = tight_pool
    pids_before = set(pool.worker_pids)
    t0 = time.monotonic()
    res = pool.score_batch(["hang", "a", "b", "a"], ["a", "a", "a", "a"], kind="sleepy")
    assert time.monotonic() - t0 < 20
    assert res.rewards == [-1.0, 1.0, -1.0, 1.0]
    assert res.infos[0]["status"] == "timeout" and res.infos[0].get("killed") is True
    assert pool.stats["timeouts"] == 1 and pool.stats["restarts"] == 1
    assert set(pool.worker_pids) != pids_before and len(pool.worker_pids) == 2
    assert pool.score_batch(["\\boxed{1}"], ["1"]).rewards == [1.0]


def test_crashing_worker_and_raising_reward_fn_are_errors_not_hangs(pool):
    res = pool.score_batch(["crash", "raise", "x"], ["x", "x", "x"], kind="sleepy")
    assert res.rewards == [-1.0, -1.0, 1.0]
    assert [i["status"] for i in res.infos] == ["error", "error", "ok"]
    assert "exit code 3" in res.infos[0]["error"] and "boom" in res.infos[1]["error"]
    assert pool.stats["errors"] == 2 and pool.stats["restarts"] == 1
    assert pool.score_batch(["x"], ["x"], kind="sleepy").rewards == [1.0]


def test_bad_arguments_fail_loudly(pool):
    with pytest.raises(ValueError, match="unknown reward kind 'nope'"):
        pool.score_batch(["a"], ["a"], kind="nope")
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        pool.score_batch(["a", "b"], ["a"])
    with pytest.raises(TypeError, match=r"answers\[0\] is int"):
        pool.score_batch(["a"], [3])
    with pytest.raises(ValueError, match="cannot import reward function"):
        RewardPool(num_workers=0, extra_kinds={"x": "no_such_module_xyz:f"})


def test_inline_mode_scores_without_workers():
    p = RewardPool(num_workers=0)
    assert p.score_batch(["\\boxed{3}", "Answer: 4"], ["3", "3"]).rewards == [1.0, -1.0]
    p.close()


def test_close_stops_all_workers():
    p = RewardPool(num_workers=2, timeout_s=2.0)
    procs = [w.proc for w in p._workers]
    assert all(pr.is_alive() for pr in procs)
    p.close()
    assert not any(pr.is_alive() for pr in procs)


def test_a_broken_pool_raises_instead_of_scoring_everything_minus_one(pool):
    from da3po_megatron.rewards import RewardPoolError

    # every item of a batch with several ground truths fails: the pool is broken -> one clear error
    with pytest.raises(RewardPoolError, match=r"all 4 items of the batch failed .* first error: RuntimeError: boom"):
        pool.score_batch(["raise"] * 4, ["1", "2", "3", "4"], kind="sleepy")
    assert pool.stats["errors"] == 4  # still counted
    # a single bad ground truth (all items share it) is bad data, not a broken pool: scored -1 and counted
    res = pool.score_batch(["raise"] * 4, ["1"] * 4, kind="sleepy")
    assert res.errors == 4 and res.rewards == [-1.0] * 4
    # a batch with one working item is scored normally
    assert pool.score_batch(["raise", "raise", "raise", "x"], ["1", "2", "3", "x"], kind="sleepy").rewards[-1] == 1.0
