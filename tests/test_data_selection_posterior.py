"""The pass-rate posterior of pre-rollout selection (``data.selection=posterior``, data/selection_posterior.py, issue
59): the closed-form zero-variance probability against brute force, the decay toward the prior (MoPPS's recursion),
the tau guard, the back-off, G learnt from the p_hats, and the selecting stream's exact resume with the posterior in
its state. Pure Python, no Ray."""

from __future__ import annotations

import math
import pickle
import random
from fractions import Fraction

import pytest

from da3po_megatron.data.datasets import Example, PromptDataset
from da3po_megatron.data.selection import SelectingPrompts, SelectionParams
from da3po_megatron.data.selection_posterior import (
    PassRatePosteriors,
    PosteriorParams,
    beta_binomial_zero_variance,
    infer_group_size,
    p_any_correct,
    posterior_keep_probability,
)

PP = PosteriorParams(group_size=8, sharpness=1.0)  # Eq. P5 at s = 1: P(keep) = 1 - P_zv (the default is 3, below)


def _rising_ratio(a: int, b: int, g: int) -> Fraction:
    """B(a + g, b) / B(a, b) for integers, exactly: prod_{i<g} (a + i) / (a + b + i)."""
    out = Fraction(1)
    for i in range(g):
        out *= Fraction(a + i, a + b + i)
    return out


def _grid_moment(a: float, b: float, g: int, wrong: bool, n: int = 200_000) -> float:
    """E[p^g] (or E[(1-p)^g]) under Beta(a, b) by the midpoint rule on a fine grid of p."""
    log_norm = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    total = 0.0
    for i in range(n):
        p = (i + 0.5) / n
        q = 1.0 - p if wrong else p
        total += q ** g * math.exp((a - 1) * math.log(p) + (b - 1) * math.log(1 - p) - log_norm)
    return total / n


@pytest.mark.parametrize(("a", "b", "g"), [(1, 1, 8), (3, 2, 16), (7, 1, 8), (2, 9, 4)])
def test_zero_variance_closed_form_matches_exact_products_and_the_pmf(a, b, g):
    p_c, p_w = beta_binomial_zero_variance(a, b, g)
    assert p_c == pytest.approx(float(_rising_ratio(a, b, g)), rel=1e-12)
    assert p_w == pytest.approx(float(_rising_ratio(b, a, g)), rel=1e-12)
    # the whole Beta-Binomial pmf sums to 1 with its two ends being the closed form
    pmf = [math.comb(g, k) * math.exp(math.lgamma(a + k) + math.lgamma(b + g - k) - math.lgamma(a + b + g)
                                      - math.lgamma(a) - math.lgamma(b) + math.lgamma(a + b)) for k in range(g + 1)]
    assert sum(pmf) == pytest.approx(1.0, abs=1e-12)
    assert (pmf[g], pmf[0]) == (pytest.approx(p_c, rel=1e-12), pytest.approx(p_w, rel=1e-12))
    assert p_any_correct(a, b, g) == pytest.approx(1.0 - p_w, rel=1e-12)


@pytest.mark.parametrize(("a", "b", "g"), [(1.6, 1.4, 8), (1.35, 2.7, 16), (2.5, 2.5, 8), (6.2, 1.1, 8)])
def test_zero_variance_closed_form_matches_integration_over_p(a, b, g):
    p_c, p_w = beta_binomial_zero_variance(a, b, g)
    assert p_c == pytest.approx(_grid_moment(a, b, g, wrong=False), rel=1e-4)
    assert p_w == pytest.approx(_grid_moment(a, b, g, wrong=True), rel=1e-4)


@pytest.mark.parametrize(("a", "b", "g"), [(0.35, 2.7, 16), (1.9, 0.1, 8), (0.05, 40.0, 8)])
def test_zero_variance_closed_form_matches_the_polya_urn(a, b, g):
    """Below 1 the Beta density is singular at an end (no grid); the urn is exact for real a, b: the predictive of the
    i-th sample after i correct ones is (a + i) / (a + b + i)."""
    urn_c = math.prod((a + i) / (a + b + i) for i in range(g))
    urn_w = math.prod((b + i) / (a + b + i) for i in range(g))
    assert beta_binomial_zero_variance(a, b, g) == (pytest.approx(urn_c, rel=1e-12), pytest.approx(urn_w, rel=1e-12))


def test_the_pass_rate_posterior_decays_toward_the_buckets_prior():
    """A prompt all correct once, in a bucket whose other prompts are all wrong at every step: its posterior mean
    starts high and falls toward the bucket's mean step after step (lam per step), reaching the prior; decay 1 keeps
    it."""
    post = PassRatePosteriors(PP)
    for i in range(4):
        post.note(f"u{i}", 8)
    post.observe("u0", 1.0, 0)
    means = []
    for t in range(80):
        for i in (1, 2, 3):
            post.observe(f"u{i}", 0.0, t)
        a, b = post.beta("u0", t)
        means.append(a / (a + b))
    prior = post.prior("u0", 79)
    assert means[0] > 0.7 and all(x > y for x, y in zip(means, means[1:]))
    assert means[-1] == pytest.approx(prior[0] / sum(prior), abs=1e-3) and means[-1] < 0.05
    keep = PassRatePosteriors(PosteriorParams(group_size=8, decay=1.0))
    keep.observe("u0", 1.0, 0)
    assert keep.beta("u0", 0) == keep.beta("u0", 50)


def test_the_decay_is_moppss_recursion_once_per_step():
    """With a fixed prior, alpha <- lam alpha + (1 - lam) alpha_0 + k per step (MoPPS) gives Eq. P2-P3's posterior."""
    lam, g, a0, b0 = 0.9, 8, 1.2, 0.8
    alpha, beta = a0, b0
    post = PassRatePosteriors(PosteriorParams(group_size=g, decay=lam))
    groups = {0: 0.75, 1: 1.0, 4: 0.5, 9: 0.125}
    for step in range(12):
        k = groups.get(step)
        if k is not None:
            post.observe("u", k, step)
        alpha = lam * alpha + (1 - lam) * a0 + (g * k if k is not None else 0.0)
        beta = lam * beta + (1 - lam) * b0 + (g * (1 - k) if k is not None else 0.0)
    post.prior = lambda uid, step: (a0, b0)  # the recursion's fixed prior
    a, b = post.beta("u", 11)
    assert (a, b) == (pytest.approx(alpha), pytest.approx(beta))


def test_the_bucket_prior_is_the_running_mean_and_unseen_buckets_use_the_datasets():
    post = PassRatePosteriors(PP)
    a, b = post.prior("x", 0)
    assert (a, b) == (pytest.approx(1.0), pytest.approx(1.0))  # nothing seen: mean 1/2, strength 2 (Beta(1, 1))
    post.note("e", 1)
    post.note("h", 8)
    post.note("new", 5)
    post.observe("e", 1.0, 0)
    post.observe("h", 0.25, 0)
    a_e, b_e = post.prior("e", 0)
    a_h, b_h = post.prior("h", 0)
    assert a_e / (a_e + b_e) == pytest.approx(8.5 / 9) and a_h / (a_h + b_h) == pytest.approx(2.5 / 9)
    a_n, b_n = post.prior("new", 0)  # bucket 5 has no group yet: the dataset's mean (10 + 1/2 correct of 16 + 1)
    assert a_n / (a_n + b_n) == pytest.approx(10.5 / 17) and a_n + b_n == pytest.approx(PP.prior_strength)


def test_the_tau_guard_never_skips_a_hard_prompt_with_a_likely_correct_response():
    """Posterior mean below tau and P(at least one correct of G) >= the guard's threshold: kept surely, though the
    predictive puts a fair chance on an all-wrong group; the same prompt above tau, or below the threshold
    (a hopeless prompt), gets 1 - P_zv."""
    a, b = 1.0, 4.0  # mean 0.2 < tau; P(all 8 wrong) = B(1, 12) / B(1, 4) = 4/12
    p_keep, p_c, p_w = posterior_keep_probability(a, b, 8, PP, guard_min=0.5)
    assert p_w == pytest.approx(1 / 3) and p_keep == 1.0
    p_keep, p_c, p_w = posterior_keep_probability(a, b, 8, PP, guard_min=0.7)  # P(k >= 1) = 2/3 < 0.7
    assert p_keep == pytest.approx(1 - p_w - p_c) and p_keep < 0.7
    low_tau = PosteriorParams(group_size=8, tau=0.1)
    assert posterior_keep_probability(a, b, 8, low_tau, guard_min=0.5)[0] < 1.0
    hopeless = posterior_keep_probability(0.05, 40.0, 8, PP, guard_min=0.5)
    assert hopeless[0] == pytest.approx(PP.floor_wrong)  # P(k >= 1) ~ 0.01: the all-wrong floor


def test_floors_and_the_all_wrong_back_off_as_in_the_streak_rule():
    easy = posterior_keep_probability(60.0, 0.05, 8, PP, guard_min=0.5)
    assert easy[0] == pytest.approx(PP.floor_correct) and easy[1] > 0.95
    hopeless = (0.05, 40.0)
    for z, skips, surely in [(1, 0, False), (1, 1, True), (3, 3, False), (3, 4, True)]:
        p_keep = posterior_keep_probability(*hopeless, 8, PP, guard_min=0.5, all_wrong_streak=z, skips=skips)[0]
        assert (p_keep == 1.0) is surely, (z, skips, p_keep)


def test_sharpness_raises_the_informative_chance_to_its_power_above_the_floors_and_leaves_the_guards():
    """Eq. P5 with s: P(keep) = (1 - P_zv)^s; s = 1 is the chance that the group is informative."""
    from dataclasses import replace

    easyish = (9.0, 1.0)  # posterior mean 0.9: above tau, P_zv ~ 0.4 at G = 8
    one = posterior_keep_probability(*easyish, 8, PP, guard_min=0.5)
    assert one[0] == pytest.approx(1.0 - one[1] - one[2])
    for s in (2.0, 3.0):
        keep, p_c, p_w = posterior_keep_probability(*easyish, 8, replace(PP, sharpness=s), guard_min=0.5)
        assert (p_c, p_w) == one[1:] and keep == pytest.approx(one[0] ** s) and keep < one[0]
    assert PosteriorParams().sharpness == 3.0  # the default, from the issue 59 study (docs/results_selection.md)
    sharp = replace(PP, sharpness=8.0)
    assert posterior_keep_probability(60.0, 0.05, 8, sharp, guard_min=0.5)[0] == pytest.approx(PP.floor_correct)
    assert posterior_keep_probability(2.0, 6.0, 8, sharp, guard_min=0.5)[0] == 1.0  # the tau guard holds


def test_nothing_is_skipped_before_the_runs_first_group():
    post = PassRatePosteriors(PP)
    assert post.keep("u0", 0, 0.5) == (1.0, 0.0, 0.0)
    post.observe("u1", 1.0, 0)
    assert post.keep("u0", 0, 0.5)[0] < 1.0  # now the dataset's mean is its prior


def test_group_size_is_learnt_from_the_p_hats():
    assert infer_group_size(0, 0.375) == 8
    assert infer_group_size(infer_group_size(0, 0.5), 0.25) == 4
    assert infer_group_size(4, 3 / 16) == 16
    assert infer_group_size(8, 1.0) == 8
    post = PassRatePosteriors(PosteriorParams())
    assert post.g() == 16  # the paper's G until a mixed group reveals it
    for p in (1.0, 0.0, 0.5, 0.75, 0.125):
        post.observe("u", p, 0)
    assert post.g() == 8


def _dataset(n: int = 16) -> PromptDataset:
    return PromptDataset([Example(uid=f"u{i}", prompt=[{"role": "user", "content": str(i)}], answer=str(i),
                                  source="t", meta={"bucket": i % 4}) for i in range(n)], name="toy")


def _pass_rate(uid: str) -> float:
    return (0.98, 0.7, 0.2, 0.0)[int(uid[1:]) % 4]  # bucket 0 easy ... bucket 3 hopeless


def _drive(sel: SelectingPrompts, steps: int, start: int = 0, g: int = 8) -> list[list[str]]:
    """Per step two rounds of 3 prompts, each group drawn as Binomial(g, the prompt's pass rate) from a generator
    seeded by (step, uid): the same outcomes whether or not the run was resumed."""
    out = []
    for step in range(start, steps):
        taken: list[str] = []
        for _ in range(2):
            exs = sel.take(3)
            scores = []
            for ex in exs:
                rng = random.Random(f"{step}:{ex.uid}:{len(taken)}")
                scores.append((ex.uid, sum(rng.random() < _pass_rate(ex.uid) for _ in range(g)) / g))
            sel.observe(scores)
            taken += [ex.uid for ex in exs]
        out.append(taken)
        sel.drain()
    return out


def _posterior_params() -> SelectionParams:
    return SelectionParams(window=6, posterior=PosteriorParams(group_size=8))


def test_the_posterior_rule_skips_easy_prompts_and_keeps_the_hard_tail():
    sel = SelectingPrompts(_dataset().iterator(seed=1), _posterior_params(), seed=3)
    late = [u for uids in _drive(sel, 60)[30:] for u in uids]
    by_bucket = [sum(int(u[1:]) % 4 == k for u in late) for k in range(4)]
    assert by_bucket[1] + by_bucket[2] > 2 * by_bucket[0], by_bucket  # mixed prompts generated, easy ones skipped
    assert by_bucket[3] > 0, by_bucket  # the hopeless bucket is not retired (back-off)
    assert by_bucket[3] < by_bucket[2], by_bucket


def test_posterior_state_round_trip_resumes_to_identical_decisions():
    ref = SelectingPrompts(_dataset().iterator(seed=1), _posterior_params(), seed=3)
    full = _drive(ref, 30)
    a = SelectingPrompts(_dataset().iterator(seed=1), _posterior_params(), seed=3)
    first = _drive(a, 12)
    it_state, sel_state = pickle.loads(pickle.dumps((a.state_dict(), a.selection_state())))
    assert sel_state["posterior"]["prompts"]  # the posterior travels in the selection's state
    b = SelectingPrompts(_dataset().iterator(seed=1), _posterior_params(), seed=3)
    b.load_state_dict(it_state)
    assert b.load_selection_state(sel_state).startswith("selection: resumed the history")
    assert first + _drive(b, 30, start=12) == full
    b.state_dict(), ref.state_dict()  # both prune their memo to the same stream position
    assert b.selection_state() == ref.selection_state()


def test_a_never_generated_prompt_skipped_by_its_prior_is_counted_by_its_likelier_tail():
    """The posterior may skip a prompt with no history of its own (its bucket is easy): counted as all-correct."""
    sel = SelectingPrompts(_dataset().iterator(seed=1, shuffle=False), _posterior_params(), seed=3)
    post = sel.posterior
    for i in range(0, 16, 4):
        post.note(f"u{i}", 0)
    for step in range(3):
        for uid in ("u0", "u4"):
            post.observe(uid, 1.0, -3 + step)
    p_keep, p_c, _ = post.keep("u8", 0, 0.5)
    assert p_keep < 0.3 and p_c > 0.7  # u8 never generated: its bucket's prior alone
    skipped = 0.0
    for _ in range(5):
        sel.take(4)
        skipped += sel.drain()["selection/skipped_all_correct"]
    assert skipped > 0


def test_the_config_selects_the_posterior_rule():
    """``data.selection=posterior`` (a new value of the existing field) builds the posterior with the config's prior
    strength and decay, the streak rule's floors and back-off base, and the trainer's G and tau."""
    from da3po_megatron.config import load_config
    from da3po_megatron.data.selection import selecting

    cfg = load_config("examples/tiny_cpu_da3po.yaml", ["data.selection=posterior", "data.selection_decay=0.8",
                                                      "data.selection_explore_min=0.02", "data.selection_sharpness=2"])
    sel = selecting(_dataset().iterator(seed=1), cfg.data, seed=0, group_size=8, tau=0.4)
    p = sel.params.posterior
    assert (p.decay, p.prior_strength, p.floor_correct, p.group_size, p.tau, p.sharpness) == (0.8, 2.0, 0.02, 8, 0.4,
                                                                                              2.0)
    assert sel.posterior is not None
    streak = selecting(_dataset().iterator(seed=1), load_config("examples/tiny_cpu_da3po.yaml",
                                                                ["data.selection=skip_zero_variance"]).data, seed=0)
    assert streak.posterior is None and streak.selection_state()["posterior"] is None
