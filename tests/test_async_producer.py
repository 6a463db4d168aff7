"""The asynchronous producer, second round (issue 47, points 1-7; trainer/generation/async_rollout.py, docs/async.md):
no hang when a pause races admission, a pause on every engine at once, two calls in flight per engine and scoring off
the producer thread, bounded waits and engine restarts with per-uid exactly-once accounting, resumes that change the
asynchronous settings (migrated or refused), the behaviour-correction rules, and the checkpoint snapshot.

Engines here are stand-ins, said in each test's name: the scripted engine mock of ``test_async_rollout.py``
(synchronous, in process) and ``da3po_megatron/testing/standin_engines.py`` (one worker thread per engine, as a Ray
actor with max_concurrency 1; each engine step sleeps). Both ignore unknown interrupt keys, as ``rollout/stream.py``
does."""

from __future__ import annotations

import collections
import threading
import time
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest
from test_async_rollout import LONG, TASK, G, drive, mock_run

from da3po_megatron.config import ConfigError, load_config
from da3po_megatron.data.datasets import Example
from da3po_megatron.rollout.types import Completion
from da3po_megatron.testing.standin_engines import StandInStreamEngines
from da3po_megatron.trainer import batch as B
from da3po_megatron.trainer.batch import StepRollout
from da3po_megatron.trainer.generation.async_engines import EngineFailure
from da3po_megatron.trainer.generation.async_partial import Partial
from da3po_megatron.trainer.generation.async_rollout import AsyncRollout


def within(seconds: float, fn):
    """fn() in a thread; its result or its error, or a failure when it has not returned after ``seconds``."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(seconds)
    if th.is_alive():
        pytest.fail(f"still waiting after {seconds:.0f} s: hung")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def standin_run(engines: StandInStreamEngines, task, **kw):
    run = mock_run(task, **kw)
    run.rollout = engines
    return run


def uids_of_state(state: dict) -> list[str]:
    return ([g["example"]["uid"] for g in state["released"]] + [g["example"]["uid"] for _, g in state["decided"]]
            + [p["example"]["uid"] for p in state["partials"]])


def accounted_once(out, state) -> None:
    """Per uid: every admitted prompt (u000 .. u{next_j - 1}) is trained once, or filtered once, or still in the
    producer's state -- nothing lost, nothing twice."""
    trained = [g.example.uid for _, r in out for g in r.groups]
    filtered = [g.example.uid for _, r in out for g in r.generated if not 0.0 < g.p_hat < 1.0]
    held = uids_of_state(state)
    every = trained + filtered + held
    dup = [u for u, c in collections.Counter(every).items() if c > 1]
    assert not dup, f"accounted more than once: {dup}"
    assert set(every) == {f"u{i:03d}" for i in range(state["next_j"])}


# ------------------------------------------------------------------------------------------- point 3: the race
def test_a_pause_arriving_right_after_admission_never_hangs_the_trainer_mock(monkeypatch):
    """pause() lands the instant the producer released its lock after admitting groups (simulated by setting the
    flag inside _submissions): the admitted groups must reach the engines before the pause is served, or they stay
    'running' forever and the drain loop spins (HEAD hung here)."""
    task = [(6, "mix")] * 40
    run = mock_run(task, need=2, k=2, partial=True, inflight=4)
    original = AsyncRollout._submissions
    armed = threading.Event()
    armed.set()

    def racing(self, e):
        out = original(self, e)
        if out and armed.is_set():
            armed.clear()
            self._want_pause = True  # pause() arrives right after the lock is released
        return out

    monkeypatch.setattr(AsyncRollout, "_submissions", racing)
    producer = AsyncRollout(run, 0)
    try:
        within(10, producer.pause)
        assert all(not x for x in run.rollout.running), "a request runs through the pause"
        producer.resume(0)
        r = within(10, lambda: producer.take(1))
        assert len(r.groups) == 2
        within(10, producer.pause)
    finally:
        producer.close()


# ------------------------------------------------------------------------------------------- point 5: parallel pause
def test_the_pause_drains_every_engine_at_once_standin():
    """Without partial rollouts the pause drains: each engine holds one long group at the pause. With 4 engines the
    pause must last about as long as with 1 (the slowest engine's drain), not 4 times (HEAD: serial, ~4x)."""
    pauses = {}
    for n_eng in (1, 4):
        engines = StandInStreamEngines(n_eng, G, step_s=0.002)
        run = standin_run(engines, [(150, "mix")] * 100, need=n_eng, k=2, inflight=n_eng, steps_per_call=4)
        producer = AsyncRollout(run, 0)
        try:
            within(30, lambda p=producer: p.take(1))
            t0 = time.perf_counter()
            within(30, producer.pause)
            pauses[n_eng] = time.perf_counter() - t0
        finally:
            producer.close()
            engines.shutdown()
    print(f"pause seconds: 1 engine {pauses[1]:.3f}, 4 engines {pauses[4]:.3f}")
    assert pauses[1] > 0.1  # a real drain happened
    assert pauses[4] < 2.0 * pauses[1]


# ------------------------------------------------------------------------------------------- point 6: no idling
def test_engines_keep_two_calls_in_flight_and_rewards_are_scored_off_the_producer_thread_standin(monkeypatch):
    """One engine (the case HEAD missed: it planned one call per engine answer, so a lone engine never had a second
    call queued outside a pause and idled on every round trip): outside the pauses, most calls are queued behind
    one the engine is running."""
    engines = StandInStreamEngines(1, G, step_s=0.001)
    run = standin_run(engines, [((40 if i % 3 == 0 else 12), "mix") for i in range(200)], need=3, k=2, inflight=6)
    threads: set[str] = set()
    score = run.score
    producers: list[AsyncRollout] = []
    queued_behind = collections.Counter()  # calls outside the pause: queued behind a running one or not
    start, init = engines.stream_start, AsyncRollout.__init__

    def counting_start(e, submit, sampling, abort=None, max_steps=8, interrupt=None):
        if producers and not producers[0]._want_pause:
            queued_behind[engines.inflight[e] > 0] += 1
        return start(e, submit, sampling, abort, max_steps, interrupt)

    def keep(self, *a, **kw):
        producers.append(self)
        init(self, *a, **kw)

    engines.stream_start = counting_start
    monkeypatch.setattr(AsyncRollout, "__init__", keep)

    def slow_score(examples, completions):
        threads.add(threading.current_thread().name)
        time.sleep(0.01)  # a reward pool that takes time: the engines must keep generating meanwhile
        return score(examples, completions)

    run.score = slow_score
    try:
        out, _ = within(60, lambda: drive(run, 4, 2))
    finally:
        engines.shutdown()
    assert [len(r.groups) for _, r in out] == [3] * 4
    assert engines.max_inflight == [2], f"calls in flight per engine: {engines.max_inflight}"
    print(f"calls outside the pauses: queued behind a running one {queued_behind[True]}, "
          f"on an idle engine {queued_behind[False]}")
    assert queued_behind[True] > 2 * queued_behind[False], dict(queued_behind)
    assert threads == {"da3po-async-scorer"}, threads
    assert all(0.0 <= r.stats["rollout/async/engine_idle_frac"] <= 1.0 for _, r in out)


# ------------------------------------------------------------------------------------------- point 4: faults
def test_a_hung_engine_stops_the_run_with_an_error_naming_it_within_the_timeout_standin():
    engines = StandInStreamEngines(2, G, step_s=0.001)
    engines.hang_at.add((1, 4))
    run = standin_run(engines, [(10, "mix")] * 200, need=2, k=2, inflight=4)
    run.cfg.rollout.producer_timeout_s = 1.0
    producer = AsyncRollout(run, 0)

    def steps():
        for step in range(1, 20):
            producer.take(step)
            producer.pause()
            producer.resume(step)

    try:
        t0 = time.perf_counter()
        with pytest.raises(EngineFailure, match="rollout engine 1: no answer .*producer_timeout_s = 1 s"):
            within(20, steps)
        assert time.perf_counter() - t0 < 10
        t0 = time.perf_counter()
        within(20, producer.close)  # close() returns (nothing spins)
        assert time.perf_counter() - t0 < 5
    finally:
        engines.shutdown()


@pytest.mark.parametrize("partial", [False, True])
def test_an_engine_killed_mid_stream_is_restarted_and_every_admitted_group_trained_once_standin(partial):
    """Engine 1 dies in the middle of a stream call (rollout.restart_on_failure): it is restarted with the last
    synced weights, the groups it ran are resubmitted from their prefixes, the run finishes, and per uid every
    admitted prompt is trained exactly once, filtered once, or still held (HEAD: EngineDeadError stopped the run)."""
    engines = StandInStreamEngines(2, G, step_s=0.0005, restart_on_failure=True)
    engines.die_at[1] = (6, 2)  # its first call from the 6th on that runs groups dies after 2 engine steps
    task = [((LONG // 100 if i % 4 == 0 else 8), "all" if i % 5 == 4 else "mix") for i in range(200)]
    run = standin_run(engines, task, need=3, k=2, inflight=4, partial=partial, max_versions=4, steps_per_call=4)
    try:
        out, state = within(60, lambda: drive(run, 6, 2))
    finally:
        engines.shutdown()
    assert engines.restarts == 1
    assert sum(r.stats.get("rollout/async/engine_restarts", 0) for _, r in out) == 1
    assert sum(r.stats.get("rollout/async/resubmitted_groups", 0) for _, r in out) >= 1
    assert all(len(r.groups) == 3 for _, r in out)
    accounted_once(out, state)
    for _, r in out:  # resubmitted groups keep token, log-prob and version arrays aligned
        for g in r.groups:
            for i, ids in enumerate(g.response_ids):
                assert len(ids) == len(g.rollout_logprobs[i]) == int(g.example.problem_text.split(":")[0][1:])


def test_a_lone_engine_restarted_without_its_weights_is_resynced_by_the_waiting_loop_standin():
    """One engine, killed mid-stream; its weights cannot be replayed from the driver (pushed by the policy ranks):
    the producer cannot sync from its thread (the policy may be training), so the engine waits; the loop, waiting for
    a batch with its policy idle, syncs it (client.resync) and the run finishes, every admitted uid accounted once."""
    engines = StandInStreamEngines(1, G, step_s=0.0005, restart_on_failure=True, replayable=False)
    engines.die_at[0] = (5, 1)
    synced = []
    engines.resync = lambda: synced.append(threading.current_thread().name)
    run = standin_run(engines, [((30 if i % 3 == 0 else 6), "mix") for i in range(200)], need=2, k=2, inflight=2,
                      partial=True, steps_per_call=4)
    try:
        out, state = within(60, lambda: drive(run, 5, 2))
    finally:
        engines.shutdown()
    assert engines.restarts == 1 and len(synced) == 1, synced
    assert synced[0] not in ("da3po-async-rollout", "da3po-async-scorer")  # the loop's thread
    assert all(len(r.groups) == 2 for _, r in out)
    accounted_once(out, state)


def test_an_engine_failure_checkpoints_the_last_completed_step_and_stops_fake(monkeypatch):
    from da3po_megatron.trainer import loop

    calls = []
    state = SimpleNamespace(save_checkpoint=lambda: calls.append("save"),  # run.state (resume/run_state.py)
                            poll_checkpoint=lambda wait=False: calls.append(f"poll wait={wait}"))
    fake = SimpleNamespace(state=state, close=lambda: calls.append("close"), preempted=lambda: False)
    monkeypatch.setattr(loop, "Run", lambda cfg, allow=False: fake)

    def failing(run):
        raise EngineFailure(1, "rollout engine 1: no answer to a stream call within rollout.producer_timeout_s")

    monkeypatch.setattr(loop, "run_steps", failing)
    with pytest.raises(EngineFailure, match="engine 1"):
        loop.train(None)
    assert calls == ["save", "poll wait=True", "close"]


# ------------------------------------------------------------------------------------------- point 1: resumes
def _groups(uids, weight_step, kind="mix"):
    exs = [Example(u, [{"role": "user", "content": f"L3:{kind}"}], kind, "s", {"bucket": 3}) for u in uids]
    comps = [[Completion(0, j, [1], [9, 9, 9], "x", [-1.0] * 3, "stop", 3) for j in range(G)] for _ in exs]
    from test_trainer_streaming import scripted_score

    groups = scripted_score(exs, comps)
    for g in groups:
        g.weight_step = weight_step
    return groups


def loop_run_fake(run, step: int, total: int, pending: list, trained: list, monkeypatch):
    """What trainer/loop.run_steps calls on a Run and its owners, faked around the scripted engine mock (no policy, no
    sync): ``run`` (the mock) stands in for the sampler too; pi_old and the step's metrics are patched in the loop."""
    from da3po_megatron.trainer import loop

    run.cfg.trainer.total_steps = total
    state = SimpleNamespace(step=step, producer=None, producer_state=None, pending=pending, update_totals={},
                            best_candidate=lambda m: None, poll_checkpoint=lambda wait=False: None,
                            should_checkpoint=lambda s: False, save_checkpoint=lambda: None)
    state.step_completed = lambda s: setattr(state, "step", s)
    run.__dict__.update(
        sampler=run, state=state, engine_weight_step=step, data_skipped_rows=0, selection_metrics={},
        should_evaluate=lambda s: False,
        logger=SimpleNamespace(log=lambda *a: None), profiler=SimpleNamespace(start=lambda s: None, stop=lambda: None),
        stop=SimpleNamespace(abandonable=nullcontext), policy=SimpleNamespace(train_step=lambda b: {}),
        check_update=lambda s, m: None, sync_weights=lambda: {}, preempted=lambda: False, engines_idle=lambda: None,
        replay=SimpleNamespace(record=lambda *a: None))
    monkeypatch.setattr(loop, "old_logprobs", lambda run, batch, **kw: (batch, {}))
    monkeypatch.setattr(loop, "step_metrics", lambda cfg, step, rollout, *a: trained.append(
        (step, [g.weight_step for g in rollout.groups], [g.example.uid for g in rollout.groups])) or {})
    return run


def test_a_staleness_1_checkpoint_resumed_into_the_producer_trains_its_batch_at_the_right_version_mock(monkeypatch):
    """Resumed at step 3 from a staleness-1 checkpoint holding the prefetched batch of step 4 (generated by version 2)
    into the producer (k=2): step 4 trains exactly that batch, and no group of any step is trained more than k
    versions after it started (HEAD: the batch bypassed take(), first_version lagged one, groups k+1 late)."""
    from da3po_megatron.trainer.loop import run_steps

    run = mock_run([(3, "mix")] * 80, need=2, k=2, inflight=4)
    pending = [StepRollout(_groups(["p0", "p1"], 2), _groups(["p0", "p1"], 2) + _groups(["pf"], 2, "all"), {}, 2)]
    trained: list = []
    run = loop_run_fake(run, 3, 8, pending, trained, monkeypatch)
    within(60, lambda: run_steps(run))
    run.state.producer.close()
    assert trained[0][0] == 4 and trained[0][2] == ["p0", "p1"]
    for step, versions, _ in trained:
        assert all((step - 1) - v <= 2 for v in versions), (step, versions)
    assert [s for s, _, _ in trained] == [4, 5, 6, 7, 8]


def _resume_state(cfg_old, cfg_new, state):
    from da3po_megatron.config import to_dict
    from da3po_megatron.trainer.resume.async_resume import async_resume_problems

    return async_resume_problems(to_dict(cfg_old), to_dict(cfg_new), state)


BASE = ["model.path=x", "data.format=synthetic", f"rollout.n={G}", "actor.ppo_mini_batch_size=1",
        "data.train_batch_size=2", "rollout.mode=streaming", "algorithm.rollout_correction=tis", "algorithm.name=dapo"]


def test_a_resume_that_changes_the_async_settings_refuses_before_ray_or_migrates_mock(tmp_path):
    """A producer checkpoint (queued groups and interrupted partials) resumed (a) without the producer: refused
    before anything starts, naming the fields; (b) with k lowered so saved groups break the new bound: refused;
    (c) with k raised: migrated (a note). HEAD: every change only warned, and the groups were dropped / trained late."""
    import torch
    import yaml

    from da3po_megatron.config import to_dict
    from da3po_megatron.trainer.resume.config_drift import ConfigDriftError, check_resume_config

    run = mock_run([(2, "mix")] * 2 + [(LONG, "mix")] * 2 + [(2, "mix")] * 60, need=2, k=2, partial=True,
                   max_versions=8, inflight=4)
    _, state = drive(run, 1, 2)  # paused after step 1: long groups interrupted, short ones decided behind them
    assert state["partials"] and state["decided"]
    old = load_config(None, BASE + ["rollout.staleness=2", "rollout.partial_rollouts=true",
                                    "rollout.max_versions_per_response=8", f"trainer.run_dir={tmp_path}"])
    ck = tmp_path / "checkpoints" / "step_000001"
    ck.mkdir(parents=True)
    torch.save({"step": 1, "async_rollout": state, "pending": [], "config": to_dict(old)}, ck / "trainer_state.pt")
    (tmp_path / "checkpoints" / "latest").write_text("step_000001")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(old), sort_keys=False))

    def resume(*over):
        new = load_config(None, BASE + [f"trainer.run_dir={tmp_path}", "trainer.resume=true", *over])
        lines: list[str] = []
        check_resume_config(new, allow=True, log=lines.append)
        return lines

    with pytest.raises(ConfigDriftError, match=r"rollout.staleness: 2 -> 1.*never train"):
        resume("rollout.staleness=1")
    with pytest.raises(ConfigDriftError, match=r"rollout.staleness: 2 -> 1.*could be trained more than"):
        resume("rollout.staleness=1", "rollout.partial_rollouts=true", "rollout.max_versions_per_response=8")
    with pytest.raises(ConfigDriftError, match="max_versions_per_response=1"):
        resume("rollout.staleness=2", "rollout.partial_rollouts=true", "rollout.max_versions_per_response=1")
    lines = resume("rollout.staleness=4", "rollout.partial_rollouts=true", "rollout.max_versions_per_response=8")
    assert any("migrated" in x for x in lines)
    # the pure rule: staleness 1 -> 0 with a prefetched batch is refused, 1 -> producer migrated
    s1 = load_config(None, BASE + ["rollout.staleness=1"])
    assert _resume_state(s1, load_config(None, BASE + ["rollout.staleness=0"]), {"pending": [{}]})
    assert not _resume_state(s1, old, {"pending": [{}], "step": 2})


# ------------------------------------------------------------------------------------------- point 2: correction
def test_the_producer_refuses_to_train_without_a_behaviour_correction():
    base = ["model.path=x", "data.format=synthetic", "rollout.n=2", "actor.ppo_mini_batch_size=1",
            "rollout.mode=streaming"]
    for over in (["rollout.staleness=2"], ["rollout.staleness=1", "rollout.partial_rollouts=true"]):
        with pytest.raises(ConfigError, match="algorithm.rollout_correction = 'none' is out of range.*allow_"):
            load_config(None, base + over + ["algorithm.name=dapo"])
        load_config(None, base + over + ["algorithm.name=dapo", "rollout.allow_uncorrected=true"])  # the opt-out
        load_config(None, base + over + ["algorithm.name=dapo", "algorithm.rollout_correction=tis"])
        with pytest.raises(ConfigError, match="algorithm.name = 'gspo' is out of range"):
            load_config(None, base + over + ["algorithm.name=gspo"])
        with pytest.raises(ConfigError, match="actor.use_rollout_logprobs = True is out of range"):
            load_config(None, base + over + ["algorithm.name=dapo", "actor.use_rollout_logprobs=true",
                                             "rollout.allow_uncorrected=true"])
    load_config(None, base + ["rollout.staleness=1", "algorithm.name=gspo"])  # one-step-off: unchanged


# ------------------------------------------------------------------------------------------- point 7
def test_partials_keep_routes_and_the_producer_state_is_serialised_only_at_checkpoints_mock(monkeypatch):
    ex = Example("u0", [{"role": "user", "content": "q"}], "1", "s")
    p = Partial(0, ex, start_version=0, n=2)
    p.add_segment({"token_ids": [[5, 5], [5]], "logprobs": [[-1.0] * 2, [-1.0]], "finished": [False, True],
                   "reasons": ["", "stop"], "texts": ["", "t"],
                   "routed_experts": [np.zeros((3, 1, 2), np.uint8), np.ones((2, 1, 2), np.uint8)]}, 0)
    final = [Completion(0, 0, [1], [7], "w", [-0.5], "stop", 1, routed_experts=np.full((3, 1, 2), 4, np.uint8)),
             Completion(0, 1, [1], [], "", [], "", 0)]
    c0, c1 = p.completions(final, 1)
    assert c0.routed_experts is not None and c0.routed_experts.tolist() == final[0].routed_experts.tolist()
    assert c1.routed_experts.tolist() == np.ones((2, 1, 2), np.uint8).tolist()  # finished in its first segment

    from da3po_megatron.trainer.resume.run_state import RunState

    run = mock_run(TASK, need=2, k=2, inflight=4)
    producer = AsyncRollout(run, 0)
    try:
        producer.take(1)
        producer.pause()
        calls = []
        monkeypatch.setattr(B, "group_to_dict", lambda g: calls.append(g) or {})
        sampler = SimpleNamespace(state_dict=lambda: {"totals": {}}, engine_weight_step=1)
        run_state = RunState(run.cfg, None, None, sampler, SimpleNamespace(baseline=None))
        run_state.producer = producer
        state = run_state.trainer_state()
        assert not calls  # a step's end serialises nothing of the producer
        from da3po_megatron.trainer.generation.async_partial import plain_state

        assert isinstance(plain_state(state)["async_rollout"], dict) and calls  # a checkpoint does
    finally:
        producer.close()
