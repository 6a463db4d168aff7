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


def test_all_wrong_streak_is_capped_and_readmitted_on_a_back_off():
    # p_w in [explore_min_all_wrong, 1/2]; after max_skips_all_wrong * 2^(z-1) skips in a row: generated surely
    assert keep_probability(1, "all_wrong", 0, 0.05, 0.01, P) == pytest.approx(P.explore_min_all_wrong)
    assert keep_probability(2, "all_wrong", 0, 0.05, 0.9, P) == pytest.approx(0.25)  # the cap 1/2
    assert keep_probability(1, "all_wrong", 1, 0.05, 0.3, P) == 1.0
    assert keep_probability(2, "all_wrong", 1, 0.05, 0.3, P) == pytest.approx(0.09)
    assert keep_probability(2, "all_wrong", 2, 0.05, 0.3, P) == 1.0
    assert keep_probability(4, "all_wrong", 7, 0.05, 0.5, P) == pytest.approx(0.0625)
    assert keep_probability(4, "all_wrong", 8, 0.05, 0.5, P) == 1.0
    b2 = SelectionParams(max_skips_all_wrong=2)
    assert keep_probability(3, "all_wrong", 7, 0.05, 0.5, b2) < 1.0
    assert keep_probability(3, "all_wrong", 8, 0.05, 0.5, b2) == 1.0
    assert keep_probability(5, "all_wrong", 0, 0.05, 0.5, SelectionParams(max_skips_all_wrong=0)) == 1.0


def test_shared_tails_is_naive_greso():
    shared = SelectionParams(tails="shared")
    assert keep_probability(2, "all_wrong", 7, 0.2, 0.9, shared) == pytest.approx(0.04)


def test_rates_step_toward_targets_and_respect_floors():
    r = ExplorationRates(P)
    assert (r.correct, r.wrong) == (0.5, 0.5)
    r.update(0.5, 0.5)  # both tails above target: skip more
    assert r.correct == pytest.approx(0.45) and r.wrong == pytest.approx(0.45)
    r.update(0.0, 0.0)  # below target: explore more
    r.update(0.0, 0.0)  # p_w stops at its cap 1/2 (the back-off's rate), p_c goes on
    assert r.correct == pytest.approx(0.55) and r.wrong == pytest.approx(0.5)
    for _ in range(30):
        r.update(0.0, 1.0)
    assert r.wrong == pytest.approx(P.explore_min_all_wrong)
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
    (``drain``, as ``RunState.step_completed`` does), adding its counters to ``totals``."""
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


def test_the_whole_pass_fallback_ranks_by_streak_not_by_tail():
    """The fallback takes the shortest streak of either tail: a prompt all correct once (p_c = 0.01: P(keep) 0.01)
    before prompts all wrong 6 times in a row (P(keep) 0.5^6 ~ 0.016, inside their back-off). Ranked by P(keep)
    (rule 524e5ed) it took the hopeless prompts: on the second comparison regime DAPO + selection generated all 16
    8-digit prompts in one step after skipping each of them."""
    sel = SelectingPrompts(_dataset().iterator(seed=1, shuffle=False), P, seed=3)
    for i in range(8):
        for step in range(1 if i == 5 else 6):
            sel.history.record(f"u{i}", 1.0 if i == 5 else 0.0, -1 - step)
    sel.rates.correct, sel.rates.wrong = 0.01, 0.5
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
    """Every prompt zero-variance (even all correct, odd all wrong) and 3 generated per step (the whole-pass
    fallback): the all-wrong prompts, re-admitted on their back-off, are still generated late in the run, at least as
    often as the retired all-correct ones."""
    sel = SelectingPrompts(_dataset().iterator(seed=1), P, seed=3)
    seen = [u for uids in _drive(sel, 60) for u in uids]
    late = seen[len(seen) // 2:]
    odd = sum(int(u[1:]) % 2 for u in late)
    assert odd >= 0.5 * len(late)
    for u in ("u1", "u3", "u5", "u7"):  # each all-wrong prompt is still generated late in the run
        assert u in late


def _hard_tail(uid: str, step: int) -> float:
    """u0-u7 mixed, u8-u11 all correct, u12-u13 hopeless (never a correct response), u14-u15 all wrong until step
    20, then mixed (a hard prompt the policy learns to solve)."""
    i = int(uid[1:])
    return 0.5 if i < 8 else 1.0 if i < 12 else 0.0 if i < 14 else (0.5 if step >= 20 else 0.0)


def _drive_hard_tail(params: SelectionParams, steps: int = 60) -> dict[str, list[tuple[int, float]]]:
    sel = SelectingPrompts(_dataset(16).iterator(seed=1), params, seed=3)
    gen: dict[str, list[tuple[int, float]]] = {}
    for step in range(steps):
        for _ in range(2):  # 6 prompts a step from 16, so the stream comes round about every 1-2 steps
            exs = sel.take(3)
            sel.observe([(ex.uid, _hard_tail(ex.uid, step)) for ex in exs])
            for ex in exs:
                gen.setdefault(ex.uid, []).append((step, _hard_tail(ex.uid, step)))
        sel.drain()
    return gen


def test_a_hopeless_prompt_costs_log_generations_and_is_never_retired():
    """The all-wrong back-off: over 60 steps a hopeless prompt is generated O(log) times (the rule before it, a
    re-admission after one skip whatever the streak and p_w free to rise to 1, generated u12/u13 25 and 23 times here),
    yet still late in the run; a hard prompt that becomes solvable at step 20 is found and then trained on."""
    gen = _drive_hard_tail(P)
    for u in ("u12", "u13"):
        assert len(gen[u]) <= 12, gen[u]  # 2 log2(60) ~ 11.8; measured 5 and 5
        assert any(step >= 28 for step, _ in gen[u]), gen[u]  # re-admitted in the second half
    for u in ("u14", "u15"):
        mixed = [step for step, p in gen[u] if 0 < p < 1]
        assert mixed and len(mixed) >= 5, gen[u]  # found after step 20, then generated like any mixed prompt


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
    """The contrast: with one rate for both tails (naive GRESO) an all-wrong streak is retired like an all-correct
    one -- no re-admission however long it was skipped --, where the DA3PO-aware rule re-admits it on its back-off."""
    shared = SelectionParams(tails="shared", window=4)
    for skips in (0, 4, 100):
        assert keep_probability(3, "all_wrong", skips, 0.05, 0.05, shared) == pytest.approx(0.05 ** 3)
    assert keep_probability(3, "all_wrong", 4, 0.05, 0.05, P) == 1.0
