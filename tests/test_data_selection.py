"""Pre-rollout selection (data/selection.py, issue 50): the skip rule, the rates' adaptation, the history's checkpoint
round trip and the selecting iterator's exact resume / rewind. Pure Python, no Ray."""

from __future__ import annotations

import pickle

import pytest

from da3po_megatron.data.datasets import Example, PromptDataset
from da3po_megatron.data.selection import (
    ExplorationRates,
    PromptHistory,
    SelectingPrompts,
    SelectionParams,
    keep_probability,
    oversample,
    uniform,
)

P = SelectionParams(window=4)


def _dataset(n: int = 8) -> PromptDataset:
    return PromptDataset([Example(uid=f"u{i}", prompt=[{"role": "user", "content": str(i)}], answer=str(i),
                                  source="t", meta={"bucket": i % 2}) for i in range(n)], name="toy")


def test_keep_probability_no_streak_always_kept():
    assert keep_probability(0, None, 0, 0.1, 0.5, P) == 1.0


def test_all_correct_streak_is_retired_geometrically():
    assert keep_probability(1, "all_correct", 0, 0.3, 0.9, P) == pytest.approx(0.3)
    assert keep_probability(3, "all_correct", 5, 0.3, 0.9, P) == pytest.approx(0.027)  # no re-admission


def test_all_wrong_streak_keeps_a_floor_and_is_readmitted():
    # the rate below the floor is raised to it; after max_skips_all_wrong skips in a row it is generated surely
    assert keep_probability(1, "all_wrong", 0, 0.05, 0.1, P) == pytest.approx(P.explore_min_all_wrong)
    assert keep_probability(2, "all_wrong", 0, 0.05, 0.6, P) == pytest.approx(0.36)
    assert keep_probability(4, "all_wrong", P.max_skips_all_wrong, 0.05, 0.5, P) == 1.0


def test_shared_tails_is_naive_greso():
    shared = SelectionParams(tails="shared")
    assert keep_probability(2, "all_wrong", 7, 0.2, 0.9, shared) == pytest.approx(0.04)


def test_rates_step_toward_targets_and_respect_floors():
    r = ExplorationRates(P)
    assert (r.correct, r.wrong) == (0.5, 0.5)
    r.update(0.5, 0.5)  # both tails above target: skip more; all-wrong already at its floor
    assert r.correct == pytest.approx(0.45) and r.wrong == pytest.approx(0.5)
    r.update(0.0, 0.0)  # below target: explore more
    assert r.correct == pytest.approx(0.5) and r.wrong == pytest.approx(0.55)
    for _ in range(30):
        r.update(1.0, 0.0)
    assert r.correct == pytest.approx(P.explore_min)
    s = ExplorationRates(SelectionParams(tails="shared"))
    s.update(0.05, 0.5)  # the shared rate follows r_c + r_w against t_c + t_w
    assert s.correct == s.wrong == pytest.approx(0.45)


def test_rates_update_once_per_window():
    r = ExplorationRates(P)
    assert not r.observe(3, 0, 3)
    assert r.observe(1, 0, 1)  # 4 groups: a window, all correct -> down
    assert r.correct == pytest.approx(0.45) and r.keep_ema == pytest.approx(0.5)
    assert r.window["groups"] == 0


def test_oversample_follows_keep_rate_capped():
    assert oversample(10, 1.0) == 10
    assert oversample(10, 0.5) == 20
    assert oversample(10, 0.01) == 40


def test_history_streaks():
    h = PromptHistory()
    h.record("a", 1.0, 0)
    h.record("a", 1.0, 1)
    assert h.streak("a") == (2, "all_correct", 0)
    h.record("a", 0.0, 2)  # the other tail starts a new streak
    assert h.streak("a") == (1, "all_wrong", 0)
    h.skipped("a")
    assert h.streak("a") == (1, "all_wrong", 1)
    h.record("a", 0.5, 3)
    assert h.streak("a") == (0, None, 0)


def _score(uid: str) -> float:
    return 1.0 if int(uid[1:]) % 2 == 0 else 0.0  # even uids all correct, odd all wrong


def _drive(sel: SelectingPrompts, steps: int, start: int = 0, totals: dict[str, float] | None = None,
           rounds: int = 1) -> list[list[str]]:
    """Per step, ``rounds`` times: take 3 prompts and score them by a fixed rule (``_score``); then complete the step
    (``drain``, as ``Run.step_completed`` does), adding its counters to ``totals``."""
    out = []
    for _ in range(start, steps):
        step: list[str] = []
        for _ in range(rounds):
            exs = sel.take(3)
            sel.observe([(ex.uid, _score(ex.uid)) for ex in exs])
            step += [ex.uid for ex in exs]
        out.append(step)
        for k, v in sel.drain().items():
            if totals is not None and k.startswith("selection/skipped"):
                totals[k] = totals.get(k, 0.0) + v
    return out


def test_selecting_prompts_skips_and_counts_by_tail():
    sel = SelectingPrompts(_dataset().iterator(seed=1), P, seed=3)
    m: dict[str, float] = {}
    _drive(sel, 20, totals=m)
    assert m["selection/skipped_all_correct"] > 0 and m["selection/skipped"] == (
        m["selection/skipped_all_correct"] + m["selection/skipped_all_wrong"])
    assert sel.drain()["selection/skipped"] == 0  # drained


def test_one_decision_per_prompt_per_step():
    """A small prompt set goes round several times per step once most prompts are skipped: a prompt skipped in a step
    stays skipped in it, and one generated in it with a zero-variance group is not generated again in it -- so an
    all-wrong prompt is generated at most once per step however often the stream comes round (the first comparison's
    32-prompt run generated one up to ~30 times per step with a per-visit draw). Mixed prompts (0 < p_hat < 1) may
    come twice, as without selection."""
    def score(uid: str) -> float:  # u0, u4, ...: all correct; u1, u5, ...: all wrong; the rest mixed
        return {0: 1.0, 1: 0.0}.get(int(uid[1:]) % 4, 0.5)

    sel = SelectingPrompts(_dataset(16).iterator(seed=1), P, seed=3)
    per_step, skipped = [], 0.0
    for _ in range(30):
        uids: list[str] = []
        for _ in range(7):  # 21 prompts wanted per step from 16: the stream wraps every step
            exs = sel.take(3)
            sel.observe([(ex.uid, score(ex.uid)) for ex in exs])
            uids += [ex.uid for ex in exs]
        per_step.append(uids)
        skipped += sel.drain()["selection/skipped"]
    for uids in per_step:
        assert all(uids.count(u) <= 1 for u in set(uids) if score(u) in (0.0, 1.0)), uids
    assert 0 < skipped <= 8 * 30  # counted once per prompt per step
    late = {u for uids in per_step[15:] for u in uids}
    assert {"u1", "u5", "u9", "u13"} <= late  # the all-wrong prompts are still generated


def test_a_whole_pass_skipped_generates_the_likeliest_prompt():
    """Every prompt has a streak: after a full pass of skips the prompt with the largest P(keep) is generated (here
    the one whose all-correct streak is 1 against 4), not whichever the stream holds next."""
    sel = SelectingPrompts(_dataset().iterator(seed=1, shuffle=False), P, seed=3)
    for i in range(8):
        for step in range(1 if i == 5 else 4):
            sel.history.record(f"u{i}", 1.0, -1 - step)
    sel.rates.correct = P.explore_min
    assert [ex.uid for ex in sel.take(1)] == ["u5"]
    assert sel.inner.consumed == 8 + 6  # one pass skipped, then u5 in the second


def test_a_prompt_is_not_taken_twice_before_its_outcome():
    """A round that goes round the stream (most prompts skipped) does not take a prompt again before it is scored:
    the 128-prompt comparison's DA3PO + selection round took bucket-8 prompts up to 3 times and a mixed one up to
    18 times in one round (generated 2x the tokens per trained token of no selection)."""
    sel = SelectingPrompts(_dataset().iterator(seed=1), P, seed=3)
    _drive(sel, 10)
    uids = [ex.uid for ex in sel.take(8)]  # most are skipped: the stream wraps inside this one round
    assert len(uids) == len(set(uids)) == 8


def test_all_wrong_prompts_stay_in_play_where_all_correct_ones_are_retired():
    sel = SelectingPrompts(_dataset().iterator(seed=1), P, seed=3)
    seen = [u for uids in _drive(sel, 60) for u in uids]
    late = seen[len(seen) // 2:]
    odd = sum(int(u[1:]) % 2 for u in late)
    assert odd > 0.7 * len(late)  # the all-wrong (odd) prompts dominate what is still generated
    for u in ("u1", "u3", "u5", "u7"):  # each all-wrong prompt is still generated late in the run
        assert u in late


def test_history_checkpoint_round_trip_resumes_exactly():
    ref = SelectingPrompts(_dataset().iterator(seed=1), P, seed=3)
    full = _drive(ref, 30)
    a = SelectingPrompts(_dataset().iterator(seed=1), P, seed=3)
    first = _drive(a, 12)
    it_state, sel_state = a.state_dict(), a.selection_state()
    it_state, sel_state = pickle.loads(pickle.dumps(it_state)), pickle.loads(pickle.dumps(sel_state))
    b = SelectingPrompts(_dataset().iterator(seed=1), P, seed=3)
    b.load_state_dict(it_state)
    assert b.load_selection_state(sel_state).startswith("selection: resumed the history")
    assert first + _drive(b, 30, start=12) == full
    assert b.selection_state()["rates"] == ref.selection_state()["rates"]


def test_mid_step_state_round_trip_keeps_the_steps_decisions():
    """A state taken in the middle of a step (decisions made, the step not completed) restores them: the rest of the
    step draws what it would have (the trainer checkpoints at step ends; the replay dump and the producer may not)."""
    a = SelectingPrompts(_dataset().iterator(seed=1), P, seed=3)
    _drive(a, 5)
    exs = a.take(3)
    a.observe([(ex.uid, _score(ex.uid)) for ex in exs])
    assert a.decided
    it_state, sel_state = pickle.loads(pickle.dumps((a.state_dict(), a.selection_state())))
    b = SelectingPrompts(_dataset().iterator(seed=1), P, seed=3)
    b.load_state_dict(it_state)
    b.load_selection_state(sel_state)
    assert b.decided == a.decided
    assert [ex.uid for ex in b.take(12)] == [ex.uid for ex in a.take(12)]


def test_resume_on_another_dataset_starts_a_new_history():
    a = SelectingPrompts(_dataset().iterator(seed=1), P, seed=3)
    _drive(a, 5)
    other = SelectingPrompts(_dataset(6).iterator(seed=1), P, seed=3)
    line = other.load_selection_state(a.selection_state())
    assert "another dataset" in line and "new history" in line and not other.history.rows


def test_rewound_stream_replays_its_decisions():
    """Streaming mode rewinds the stream to just after the last admitted prompt: the replay must draw the same."""
    sel = SelectingPrompts(_dataset().iterator(seed=1), P, seed=3)
    _drive(sel, 6)
    start = sel.state_dict()
    drawn = [ex.uid for ex in sel.take(5)]
    sel.observe([(u, 1.0) for u in drawn])  # the history changes before the rewind
    sel.load_state_dict(start)
    assert [ex.uid for ex in sel.take(3)] == drawn[:3]


def test_skip_coin_is_a_pure_function():
    assert uniform(1, 5) == uniform(1, 5) != uniform(1, 6)
    assert 0.0 <= uniform(0, 0) < 1.0


def test_naive_shared_rate_retires_all_wrong_prompts_too():
    """The contrast: with one rate for both tails (naive GRESO) the all-wrong prompts are retired like easy ones."""
    def late_hard_share(params: SelectionParams) -> tuple[float, dict[str, float]]:
        sel = SelectingPrompts(_dataset().iterator(seed=1), params, seed=3)
        totals: dict[str, float] = {}
        seen = [u for uids in _drive(sel, 60, totals=totals) for u in uids]
        late = seen[len(seen) // 2:]
        return sum(int(u[1:]) % 2 for u in late) / len(late), totals

    separate, s_counts = late_hard_share(P)
    shared, n_counts = late_hard_share(SelectionParams(tails="shared", window=4))
    assert n_counts["selection/skipped_all_wrong"] > 1.5 * s_counts["selection/skipped_all_wrong"]  # 222 vs 135
    assert separate > shared
