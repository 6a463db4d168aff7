"""Release order within the staleness bound (issue 58 points 1, 2 and 6; trainer/generation/release.py, docs/async.md
"Release order"): a property test of the deadline invariant over random response lengths, engine speeds, batch
sizes, k, drains and partial rollouts, under both ``rollout.release_order`` values -- no group trained beyond its
deadline (start + k), none lost, none twice, (I) at every engine step with admission waiting for the admission
bound only (not while a group at its deadline runs: the wait issue 58 asked for is not needed), and under
``oldest_decided`` no decided group waits behind an undecided older one unless that group's deadline needs the slot;
the producer itself (scripted mock and threaded stand-in engines, NOT vLLM) under both orders; staleness per
difficulty; resumes across the change of order.

Everything that exists at f5d1453 (before issue 58) is imported at module level, the rest inside the tests, so at
that commit the FIFO cases pass and the new order's fail."""

from __future__ import annotations

import collections
import random

import pytest
from test_async_rollout import LONG, G, drive, mock_run

from da3po_megatron.config import ConfigError, load_config

ORDERS = ("fifo", "oldest_decided")


# ------------------------------------------------------------------------------------------- the property (pure)
def holds(deadlines: list[int], first_version: int, batch_size: int) -> bool:
    """Invariant (I) in its counting form, written apart from release.fits (which sorts): for every version w, the
    groups due by w fit in the batches trained at first_version .. w."""
    return all(sum(d <= w for d in deadlines) <= (w - first_version + 1) * batch_size for w in set(deadlines)) and \
        all(d >= first_version for d in deadlines)


def simulate(order: str, rng: random.Random) -> dict:
    """One random run of the producer's protocol in engine steps (ticks), through release.py alone: E engines of
    random speeds (tokens per tick) with a few slots each, long-tailed lengths, keep probability 3/4, the loop taking
    a batch, training a random number of ticks, pausing (an instant interrupt with partial rollouts, or a drain with
    admission stopped), syncing (engine version := the version the next batch trains at) and resuming; once in a
    while a running group is lost with its engine and resubmitted (from scratch: a new start version, if it was never
    interrupted). Admission waits for :func:`admissible` alone, also while a group at its deadline is in flight
    (counted: ``due``). Checks the invariant every tick and every property at every take."""
    from da3po_megatron.trainer.generation.release import (
        FILTERED,
        KEPT,
        UNDECIDED,
        Entry,
        admissible,
        pick,
    )

    k, batch, engines = rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 4)
    speeds, slots = [rng.randint(1, 4) for _ in range(engines)], rng.randint(1, 4)
    partial, steps = rng.random() < 0.5, 10
    version = first = 0
    groups: dict[int, dict] = {}  # j -> start, length, progress, engine, state, interrupted
    trained: list[int] = []
    left: list[int] = []  # filtered groups that left with a batch
    phase, until, tick, unforced, due = "take", 0, 0, 0, 0

    def entries() -> list:
        return [Entry(j, g["start"], j, g["state"]) for j, g in groups.items() if g["state"] != "gone"]

    def counted() -> list[int]:
        return [g["start"] + k for g in groups.values() if g["state"] in (KEPT, UNDECIDED)]

    while len(trained) < steps * batch:
        tick += 1
        assert tick < 50000, "the loop never got its batches (liveness)"
        for g in groups.values():  # the engines step
            if g["state"] == UNDECIDED:
                g["progress"] += speeds[g["engine"]]
                if g["progress"] >= g["length"]:
                    g["state"] = KEPT if rng.random() < 0.75 else FILTERED
            if g["state"] == UNDECIDED and rng.random() < 0.002:  # lost with its engine, resubmitted
                if not g["interrupted"]:
                    g["start"], g["progress"] = version, 0
        if phase != "drain":  # admission (stopped while a drain runs)
            for e in range(engines):
                while sum(g["state"] == UNDECIDED and g["engine"] == e for g in groups.values()) < slots:
                    if not admissible(len(counted()), version, first, batch, k):
                        break
                    # no other wait: admission goes on while a group in flight is at its deadline (start + k <= f)
                    due += any(g["state"] == UNDECIDED and g["start"] + k <= first for g in groups.values())
                    length = min(400, max(1, int(rng.lognormvariate(2.5, 1.0))))
                    groups[len(groups)] = {"start": version, "length": length, "progress": 0, "engine": e,
                                           "state": UNDECIDED, "interrupted": False}
        assert holds(counted(), first, batch), "invariant (I) broke"
        if phase == "take":
            keys = pick(order, entries(), first, batch, k)
            decided = sorted((g["start"], j) for j, g in groups.items() if g["state"] == KEPT)
            if keys is None:
                if len(decided) >= batch:  # the take waits though B kept groups are decided: is (I) the reason?
                    rest = [s + k for s, _ in decided[batch:]] + \
                           [g["start"] + k for g in groups.values() if g["state"] == UNDECIDED]
                    forced = not holds(rest, first + 1, batch)
                    unforced += not forced
                    if order == "oldest_decided":
                        assert forced, "a decided group waited behind an undecided older one it did not need to"
                continue
            kept = [j for j in keys if groups[j]["state"] == KEPT]
            assert len(kept) == batch
            for j in kept:
                assert first - groups[j]["start"] <= k, f"group {j} trained beyond its deadline"
            if order == "oldest_decided":
                assert sorted(kept) == sorted(j for _, j in decided[:batch]), "not the oldest decided ones"
            for j in keys:
                (trained if groups[j]["state"] == KEPT else left).append(j)
                groups[j]["state"] = "gone"
            first += 1
            phase, until = "train", tick + rng.randint(1, 12)
        elif phase == "train" and tick >= until:
            if partial:  # interrupt: running groups keep their tokens (and their start) and continue after the sync
                for g in groups.values():
                    g["interrupted"] |= g["state"] == UNDECIDED
                version, phase = first, "take"
            else:
                phase = "drain"
        elif phase == "drain" and not any(g["state"] == UNDECIDED for g in groups.values()):
            version, phase = first, "take"
    held = [j for j, g in groups.items() if g["state"] in (KEPT, FILTERED, UNDECIDED)]
    every = trained + left + held
    assert len(every) == len(set(every)), "a group accounted twice"
    assert set(every) == set(groups), "a group lost"
    return {"unforced": unforced, "out_of_order": sum(a > b for a, b in zip(trained, trained[1:])), "due": due}


@pytest.mark.parametrize("order", ORDERS)
def test_no_group_is_trained_beyond_its_deadline_lost_or_trained_twice_over_random_lengths_and_engine_speeds(order):
    """300 seeded random runs per order (about a second each order)."""
    results = [simulate(order, random.Random(seed)) for seed in range(300)]
    unforced = sum(r["unforced"] for r in results)
    if order == "fifo":  # the head-of-line blocking the new order removes: FIFO waits for the head when not forced
        assert unforced > 0
    else:
        assert unforced == 0 and sum(r["out_of_order"] for r in results) > 0
    assert sum(r["due"] for r in results) > 0  # admitted while a group at its deadline ran: (I) held without a wait


def test_the_docstring_picture_release_by_release():
    """release.py's picture, k = 2, B = 2: a .. f under version 0, b long."""
    from da3po_megatron.trainer.generation.release import FILTERED, KEPT, UNDECIDED, Entry, admissible, fits, pick

    def e(name, start, order, state):
        return Entry(name, start, order, state)

    state = [e("a", 0, 0, KEPT), e("b", 0, 1, UNDECIDED), e("c", 0, 2, KEPT), e("d", 0, 3, KEPT),
             e("e", 0, 4, KEPT), e("f", 0, 5, FILTERED)]
    assert pick("fifo", state, 0, 2, 2) is None  # b, running, holds back c .. f
    assert pick("oldest_decided", state, 0, 2, 2) == ["a", "c", "f"]  # out of order; f (filtered) reported with it
    at2 = [e("b", 0, 1, UNDECIDED), e("f", 0, 5, KEPT), e("g", 1, 6, KEPT), e("h", 1, 7, KEPT)]
    assert pick("oldest_decided", at2, 2, 2, 2) is None  # b at its deadline: the take waits for it
    assert admissible(4, 2, 2, 2, 2) and admissible(5, 2, 2, 2, 2) and not admissible(6, 2, 2, 2, 2)  # i, j, not k
    ij = at2 + [e("i", 2, 8, KEPT), e("j", 2, 9, UNDECIDED)]
    assert fits([x.start + 2 for x in ij], 2, 2) and pick("oldest_decided", ij, 2, 2, 2) is None
    assert pick("oldest_decided", [x._replace(state=KEPT) for x in at2], 2, 2, 2) == ["b", "f"]
    assert fits([2, 2, 3], 1, 2) and not fits([1, 1, 1], 1, 2)


# ------------------------------------------------------------------------------------------- the producer
def _accounted_once(out, state) -> None:
    trained = [g.example.uid for _, r in out for g in r.groups]
    filtered = [g.example.uid for _, r in out for g in r.generated if not 0.0 < g.p_hat < 1.0]
    held = ([g["example"]["uid"] for g in state["released"]] + [g["example"]["uid"] for _, g in state["decided"]]
            + [p["example"]["uid"] for p in state["partials"]])
    every = trained + filtered + held
    assert not [u for u, c in collections.Counter(every).items() if c > 1], "accounted more than once"
    assert set(every) == {f"u{i:03d}" for i in range(state["next_j"])}, "a group lost"


def _task(seed: int) -> list[tuple[int, str]]:
    rng = random.Random(seed)
    return [((LONG if i % 4 == 0 else rng.choice([200, 2000])) if rng.random() < 0.3 else rng.randint(2, 6),
             "all" if rng.random() < 0.2 else "mix") for i in range(400)]


@pytest.mark.parametrize("order", ORDERS)
def test_the_producer_releases_in_its_order_within_every_deadline_mock(order):
    """The real producer against the scripted engine mock, random long-tailed lengths, with and without partial
    rollouts: drive() asserts the bound per batch; every admitted group is trained, filtered or held exactly once;
    FIFO trains in admission order, oldest_decided lets decided groups overtake a running long one."""
    overtaken = 0
    for seed in range(4):
        run = mock_run(_task(seed), need=2, k=2, partial=seed % 2 == 0, max_versions=8, inflight=6)
        run.cfg.rollout.release_order = order
        out, state = drive(run, 6, 2, train_s=0.005)
        _accounted_once(out, state)
        uids = [g.example.uid for _, r in out for g in r.groups]
        overtaken += uids != sorted(uids)
        if order == "oldest_decided":
            assert sum(r.stats.get("rollout/async/out_of_order_groups", 0) for _, r in out) > 0
    assert (overtaken == 0) if order == "fifo" else (overtaken == 4)


@pytest.mark.parametrize("order", ORDERS)
def test_the_producer_keeps_every_deadline_with_engines_of_different_speeds_standin(order):
    """Threaded stand-in engines, one 4x slower than the other, long-tailed lengths, partial rollouts, k = 2: every
    batch within k, every group once, and under oldest_decided takes that waited for a group at its deadline."""
    from test_async_producer import standin_run

    from da3po_megatron.testing.standin_engines import StandInStreamEngines

    engines = StandInStreamEngines(2, G, [0.0005, 0.002])
    rng = random.Random(5)
    task = [(rng.choice([3, 5, 8, 60, 300]), "all" if i % 5 == 4 else "mix") for i in range(400)]
    run = standin_run(engines, task, need=3, k=2, partial=True, max_versions=8, inflight=6, steps_per_call=4)
    run.cfg.rollout.release_order = order
    try:
        out, state = drive(run, 8, 2, train_s=0.01)
    finally:
        engines.shutdown()
    _accounted_once(out, state)  # and drive() asserted every batch within k
    # oldest_decided: some takes waited for an older group at its deadline (3 of 8 in each of 5 runs on 2 cores) while
    # admission went on (it waits only for the admission bound): the bound held without verl's wait
    waits = sum(r.stats.get("rollout/async/deadline_waits", 0) for _, r in out)
    assert waits == 0 if order == "fifo" else waits > 0


# ------------------------------------------------------------------------------------------- config, metrics, resume
def test_release_order_defaults_to_oldest_decided_and_names_the_field_when_wrong():
    """oldest_decided is the default (the hard-prompt study rerun without admission's deadline wait: hard share +0.1,
    SE 0.2, vs sync; docs/async.md); it only acts under the paced producer, and the loop without it accepts either
    value (the default must load everywhere)."""
    base = ["model.path=x", "data.format=synthetic", "rollout.n=2", "actor.ppo_mini_batch_size=1",
            "rollout.mode=streaming", "algorithm.rollout_correction=tis"]
    assert load_config(None, base + ["rollout.staleness=2"]).rollout.release_order == "oldest_decided"
    assert load_config(None, base + ["rollout.staleness=0"]).rollout.release_order == "oldest_decided"
    load_config(None, base + ["rollout.staleness=2", "rollout.release_order=fifo"])
    with pytest.raises(ConfigError, match="rollout.release_order"):
        load_config(None, base + ["rollout.staleness=2", "rollout.release_order=newest"])


def test_staleness_and_behaviour_age_per_bucket_and_p_hat_band():
    import numpy as np

    from da3po_megatron.data.datasets import Example
    from da3po_megatron.trainer import batch as B
    from da3po_megatron.trainer.observability.step_metrics import staleness_by_difficulty

    def group(bucket, start, acc, versions=None):
        ex = Example("u", [{"role": "user", "content": "q"}], "1", "s", {"bucket": bucket})
        ids = [np.full(3, 5, np.int32), np.full(1, 5, np.int32)]
        return B.Group(ex, [1], ids, ["a", "b"], [[-1.0] * 3, [-1.0]], ["stop"] * 2, acc, acc, weight_step=start,
                       token_versions=versions)

    hard = group(8, 1, [1.0, -1.0], [np.array([1, 2, 3], np.int32), np.array([1], np.int32)])
    easy = group(1, 3, [1.0, -1.0])
    m = staleness_by_difficulty([hard, easy], trained_version=3)
    assert m["rollout/staleness_bucket/8"] == 2 and m["rollout/staleness_bucket/1"] == 0
    assert m["rollout/behaviour_age_bucket/8"] == (2 + 1 + 0 + 2) / 4  # per token: versions 1, 2, 3 and 1
    assert m["rollout/staleness_p_hat/0.50-0.75"] == 1.0  # both p_hat = 0.5
    assert m["rollout/behaviour_age_p_hat/0.50-0.75"] == (5 + 0) / 8


def _state(groups_decided, partials, first_version):
    def g(uid, start):
        return {"example": {"uid": uid}, "weight_step": start, "acc": [1.0, -1.0]}

    return {"next_j": 6, "release_j": 3, "first_version": first_version, "released": [],
            "decided": [[j, g(uid, s)] for j, uid, s in groups_decided],
            "partials": [{"j": j, "example": {"uid": uid}, "start_version": s, "span": 1} for j, uid, s in partials]}


def test_a_resume_across_the_release_order_is_migrated_or_refused_naming_the_field():
    """fifo -> oldest_decided: migrated (earliest deadline first meets every deadline admission order meets);
    oldest_decided -> fifo: refused naming rollout.release_order when a group restarted from scratch (j 3, a later
    start) would push an older-started one (j 5) past its deadline in admission order."""
    from da3po_megatron.config import to_dict
    from da3po_megatron.trainer.resume.async_resume import async_resume_problems

    base = ["model.path=x", "data.format=synthetic", f"rollout.n={G}", "actor.ppo_mini_batch_size=1",
            "data.train_batch_size=1", "rollout.mode=streaming", "algorithm.rollout_correction=tis",
            "algorithm.name=dapo", "rollout.staleness=1", "rollout.partial_rollouts=true"]
    fifo = to_dict(load_config(None, base + ["rollout.release_order=fifo"]))
    oldest = to_dict(load_config(None, base))  # the default
    state = {"async_rollout": _state([(5, "u005", 2)], [(3, "u003", 3)], 3)}
    assert not async_resume_problems(oldest, oldest, state)
    problems = async_resume_problems(oldest, fifo, state)
    assert len(problems) == 1 and "rollout.release_order=fifo" in problems[0] and "u005" in problems[0]
    legacy = {**fifo, "rollout": {x: v for x, v in fifo["rollout"].items() if x != "release_order"}}  # older config
    assert not async_resume_problems(legacy, oldest, {"async_rollout": _state([(5, "u005", 3)], [(3, "u003", 3)], 3)})


def test_a_fifo_checkpoint_resumes_under_oldest_decided_and_trains_every_group_once_mock(tmp_path):
    """A FIFO producer checkpoint (long groups interrupted, short ones decided behind them) resumed with
    rollout.release_order=oldest_decided: the drift check migrates it (a note, no refusal) and the resumed producer
    trains every saved group within its deadline, once, over both launches."""
    import torch
    import yaml

    from da3po_megatron.config import to_dict
    from da3po_megatron.trainer.resume.config_drift import check_resume_config

    task = [(2, "mix")] * 2 + [(LONG, "mix")] * 2 + [(2, "mix")] * 120
    run = mock_run(task, need=2, k=2, partial=True, max_versions=8, inflight=4)
    first, state = drive(run, 1, 2)
    assert state["partials"] and state["decided"]
    over = ["model.path=x", "data.format=synthetic", f"rollout.n={G}", "actor.ppo_mini_batch_size=1",
            "data.train_batch_size=2", "rollout.mode=streaming", "algorithm.rollout_correction=tis",
            "algorithm.name=dapo", "rollout.staleness=2", "rollout.partial_rollouts=true",
            "rollout.max_versions_per_response=8", f"trainer.run_dir={tmp_path}"]
    old = load_config(None, over + ["rollout.release_order=fifo"])  # a run of the old default
    ck = tmp_path / "checkpoints" / "step_000001"
    ck.mkdir(parents=True)
    torch.save({"step": 1, "async_rollout": state, "pending": [], "config": to_dict(old)}, ck / "trainer_state.pt")
    (tmp_path / "checkpoints" / "latest").write_text("step_000001")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(old), sort_keys=False))
    lines: list[str] = []
    check_resume_config(load_config(None, over + ["trainer.resume=true"]),  # the new default: oldest_decided
                        allow=False, log=lines.append)
    assert any("rollout.release_order" in x and "migrated" in x for x in lines), lines
    run.cfg.rollout.release_order = "oldest_decided"
    second, end = drive(run, 4, 2, state=state, version=1)  # drive asserts every batch within k
    trained = [g.example.uid for _, r in first + second for g in r.groups]
    assert len(trained) == len(set(trained)) == 10 and {"u002", "u003"} <= set(trained)
    _accounted_once(first + second, end)

