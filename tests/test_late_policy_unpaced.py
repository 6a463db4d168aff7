"""rollout.late_policy=discard_unpaced (issue 47 point 8, comparison only): the discard design without pacing --
admission ignores the staleness bound, which is then kept by discarding alone. Against the scripted engine mock of
tests/test_async_rollout.py (no Ray, no vLLM)."""

from test_async_rollout import LONG, drive, mock_run


def test_discard_unpaced_admits_past_the_bound_and_keeps_it_by_discarding_mock():
    task = [((LONG if i % 6 == 3 else 2), "mix") for i in range(300)]  # 1 in 6 hard (long)
    waits, late = {}, {}
    for policy in ("discard", "discard_unpaced"):
        run = mock_run(task, need=2, k=1, inflight=8, partial=True, max_versions=64)
        run.cfg.rollout.late_policy = policy
        out = drive(run, 8, 1, train_s=0.02)[0]  # drive() asserts the bound on every trained group
        waits[policy] = sum(r.stats.get("rollout/async/admission_waits", 0) for _, r in out)
        late[policy] = sum(r.stats.get("rollout/async/discarded_late_groups", 0) for _, r in out)
    print(f"admission waits {waits}, discarded late {late}")
    assert waits["discard"] > 0 and waits["discard_unpaced"] == 0  # paced admission waited; unpaced never does
    assert late["discard_unpaced"] > late["discard"]  # what it generates ahead comes back too late and is thrown away
