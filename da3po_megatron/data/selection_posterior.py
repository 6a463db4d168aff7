"""The pass-rate posterior of pre-rollout selection (``data.selection=posterior``; issue 59): per prompt a Beta
posterior over its pass rate p, decayed toward a prior, and the posterior probability that the next group of G
samples is zero-variance -- the group dynamic sampling would throw away after paying for it.

Reference: MoPPS, "Can Prompt Difficulty be Online Predicted for Accelerating RL Finetuning of Reasoning Models?"
(Qu et al., arXiv 2507.04632): per prompt Beta(alpha, beta) over its success rate, updated by streaming Bayesian
inference with a temporal discount toward the prior, alpha <- lam * alpha + (1 - lam) * alpha_0 + k (beta likewise
with G - k), then Thompson-sampled. Ours differs in three ways: the discount is applied once per *training step*
(the policy moves whether or not the prompt was generated), the prior is the prompt's bucket's running mean (not a
fixed Beta(1, 1)), and the posterior is not sampled to rank prompts but gives each prompt's skip probability.

Equations (t: training steps completed; a prompt's groups give k correct of G):

    (P1) prior        alpha_0 = n0 * m,  beta_0 = n0 * (1 - m),  m = (S + 1/2) / (N + 1)
                      S, N: the lam-decayed correct and total samples of the prompt's bucket (``meta["bucket"]``), or
                      of the whole dataset while the bucket has none (and for prompts without a bucket)
    (P2) evidence     c(t) = lam^(t - t_u) * c(t_u),  g(t) = lam^(t - t_u) * g(t_u)   (decayed toward the prior)
                      a group at step t:  c <- c(t) + p_hat,  g <- g(t) + 1,  t_u <- t
    (P3) posterior    p ~ Beta(a, b),  a = alpha_0 + G * c(t),  b = beta_0 + G * (g(t) - c(t))
    (P4) predictive   P_zv = P(all G correct) + P(all G wrong) = B(a + G, b) / B(a, b) + B(a, b + G) / B(a, b)
                      (the Beta-Binomial pmf at k = G and k = 0)
    (P5) P(keep)      = 1                        tau guard: a / (a + b) < tau and P(k >= 1) = 1 - B(a, b + G) / B(a, b)
                                                 >= min(keep_rate, 1/2)
                      = 1                        an all-wrong streak of z after b_s * 2^(z-1) skips (today's back-off)
                      = max((1 - P_zv)^s, floor) otherwise; floor = explore_min, or explore_min_all_wrong where
                                                 P(all wrong) > P(all correct); s = sharpness (1: the probability
                                                 that the group is informative; s > 1 skips likely-zero-variance
                                                 prompts harder, nearer a ranking of the prompts by P_zv)

Evidence is kept in groups (c, g) and multiplied by G when a decision is made, so a G learnt late (below) does not
re-weigh old groups. **The tau guard** (Eq. 14: DAA amplifies the correct responses of groups with p_hat < tau): a
prompt the posterior puts below tau is never skipped while its chance of a group with a correct response -- below
tau, of an informative group, the ones DAA amplifies -- is at least that of the average generated group (the
window's keep rate, the run's own yield: skipping it could only lower the trained share of the decoded tokens),
capped at 1/2 (more likely than not). Below that threshold it is kept with probability ~P(k >= 1) anyway, and a
hopeless prompt (no correct response yet) falls under the all-wrong back-off as with the streak rule.

G (``rollout.n``) is a parameter; 0 learns it as the least common multiple of the reduced denominators of the
observed p_hat = k / G (one mixed group with k coprime to G gives it; 16, the paper's G, until then). Left out:
Thompson sampling, priors from anything but the bucket (prompt features, a learnt difficulty model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

__all__ = ["PassRatePosteriors", "PosteriorParams", "beta_binomial_zero_variance", "decayed", "infer_group_size",
           "p_any_correct", "posterior_beta", "posterior_keep_probability", "prior_beta"]

DEFAULT_GROUP_SIZE = 16  # the paper's G, used until the observed p_hats reveal G (module docstring)
DATASET = "*"  # the running-mean key of the whole dataset


@dataclass(frozen=True)
class PosteriorParams:
    """The posterior rule's constants (``data.selection_prior_strength``, ``data.selection_decay``; the floors and
    the back-off base are the streak rule's fields)."""

    prior_strength: float = 2.0  # n0 of (P1): pseudo-samples of the bucket prior (MoPPS's Beta(1, 1) has 2)
    decay: float = 0.9  # lam of (P2), per training step: evidence half-life ~6.6 steps
    tau: float = 0.5  # DAA's tau (Eq. 14; paper 0.5)
    floor_correct: float = 0.05  # floor of P(keep) where the likelier zero-variance tail is all-correct
    floor_wrong: float = 0.05  # ... where it is all-wrong
    max_skips_all_wrong: int = 1  # b_s of the back-off (0: an all-wrong streak is never skipped)
    group_size: int = 0  # G; 0: learnt from the observed p_hats
    sharpness: float = 3.0  # s of (P5): P(keep) = (1 - P_zv)^s above the floors (3: issue 59 study)


def _log_beta_ratio(a: float, b: float, x: float, y: float) -> float:
    """log B(a + x, b + y) - log B(a, b)."""
    return (math.lgamma(a + x) + math.lgamma(b + y) - math.lgamma(a + b + x + y)
            - math.lgamma(a) - math.lgamma(b) + math.lgamma(a + b))


def beta_binomial_zero_variance(a: float, b: float, g: int) -> tuple[float, float]:
    """(P(all ``g`` correct), P(all ``g`` wrong)) under p ~ Beta(a, b) (Eq. P4): B(a+g, b) / B(a, b) and
    B(a, b+g) / B(a, b), the Beta-Binomial pmf at k = g and k = 0."""
    return math.exp(_log_beta_ratio(a, b, g, 0.0)), math.exp(_log_beta_ratio(a, b, 0.0, g))


def p_any_correct(a: float, b: float, g: int) -> float:
    """P(at least one of ``g`` samples correct) under p ~ Beta(a, b): 1 - B(a, b + g) / B(a, b)."""
    return -math.expm1(_log_beta_ratio(a, b, 0.0, g))


def prior_beta(correct: float, total: float, strength: float) -> tuple[float, float]:
    """(alpha_0, beta_0) of Eq. P1 from decayed sample counts: mean m = (S + 1/2) / (N + 1) (never 0 or 1)."""
    m = (correct + 0.5) / (total + 1.0)
    return strength * m, strength * (1.0 - m)


def decayed(value: float, since: int, now: int, decay: float) -> float:
    """Eq. P2: ``value`` recorded at step ``since`` seen from step ``now`` (lam^(now - since) * value)."""
    return value * decay ** max(now - since, 0)


def posterior_beta(prior: tuple[float, float], correct_groups: float, groups: float, g: int) -> tuple[float, float]:
    """Eq. P3: Beta(alpha_0 + G c, beta_0 + G (g - c)) from the decayed group evidence (c: summed p_hat)."""
    return prior[0] + g * correct_groups, prior[1] + g * max(groups - correct_groups, 0.0)


def posterior_keep_probability(a: float, b: float, g: int, params: PosteriorParams, guard_min: float,
                               all_wrong_streak: int = 0, skips: int = 0) -> tuple[float, float, float]:
    """(P(keep), P(all correct), P(all wrong)) of a prompt with posterior Beta(a, b) and groups of ``g`` (Eq. P4,
    P5). ``guard_min``: the tau guard's threshold on P(k >= 1) (the caller passes min(keep rate, 1/2));
    ``all_wrong_streak`` / ``skips``: the prompt's current all-wrong streak z and the steps it was skipped in since
    its last group (the back-off)."""
    p_c, p_w = beta_binomial_zero_variance(a, b, g)
    if a / (a + b) < params.tau and 1.0 - p_w >= guard_min:
        return 1.0, p_c, p_w  # the tau guard: P(k >= 1) = 1 - P(all wrong)
    if all_wrong_streak > 0 and skips >= params.max_skips_all_wrong * 2 ** (all_wrong_streak - 1):
        return 1.0, p_c, p_w
    floor = params.floor_wrong if p_w > p_c else params.floor_correct
    return max(max(1.0 - p_c - p_w, 0.0) ** params.sharpness, floor), p_c, p_w


def infer_group_size(current: int, p_hat: float, limit: int = 4096) -> int:
    """G learnt from p_hat = k / G: the lcm of ``current`` and p_hat's reduced denominator (which divides G)."""
    d = Fraction(p_hat).limit_denominator(limit).denominator
    return d if current <= 0 else math.lcm(current, d)


class PassRatePosteriors:
    """Per-prompt decayed evidence ``{uid: [c, g, t_u]}``, per-bucket and dataset decayed sample counts
    ``{key: [S, N, t_u]}``, the bucket of each prompt seen, and the learnt G; plain values (the checkpoint's
    ``selection`` entry holds :meth:`state_dict`)."""

    def __init__(self, params: PosteriorParams) -> None:
        self.params = params
        self.prompts: dict[str, list] = {}
        self.means: dict[str, list] = {}
        self.bucket: dict[str, str] = {}
        self.group_size = int(params.group_size)

    def note(self, uid: str, bucket: Any) -> None:
        """The prompt's bucket (``meta["bucket"]``; None: the dataset's mean is its prior)."""
        if bucket is not None:
            self.bucket[uid] = str(bucket)

    def g(self) -> int:
        return self.group_size if self.group_size > 1 else DEFAULT_GROUP_SIZE

    def observe(self, uid: str, p_hat: float, step: int) -> None:
        """One generated group of ``uid`` in training step ``step`` (Eq. P2; the running means of P1)."""
        lam = self.params.decay
        if self.params.group_size <= 0:
            self.group_size = infer_group_size(self.group_size, p_hat)
        c, n, t = self.prompts.get(uid, (0.0, 0.0, step))
        self.prompts[uid] = [decayed(c, t, step, lam) + p_hat, decayed(n, t, step, lam) + 1.0, int(step)]
        for key in {DATASET, self.bucket.get(uid, DATASET)}:
            s, tot, t = self.means.get(key, (0.0, 0.0, step))
            self.means[key] = [decayed(s, t, step, lam) + p_hat, decayed(tot, t, step, lam) + 1.0, int(step)]

    def prior(self, uid: str, step: int) -> tuple[float, float]:
        """Eq. P1 for ``uid`` at ``step``: its bucket's running mean, else the dataset's (1/2 before any group)."""
        lam, g = self.params.decay, self.g()
        row = self.means.get(self.bucket.get(uid, DATASET)) or self.means.get(DATASET)
        if row is None:
            return prior_beta(0.0, 0.0, self.params.prior_strength)
        s, tot, t = row
        return prior_beta(g * decayed(s, t, step, lam), g * decayed(tot, t, step, lam), self.params.prior_strength)

    def beta(self, uid: str, step: int) -> tuple[float, float]:
        """Eq. P3: ``uid``'s posterior Beta(a, b) at ``step`` (the prior alone for a prompt never generated)."""
        c, n, t = self.prompts.get(uid, (0.0, 0.0, step))
        lam = self.params.decay
        return posterior_beta(self.prior(uid, step), decayed(c, t, step, lam), decayed(n, t, step, lam), self.g())

    def keep(self, uid: str, step: int, guard_min: float, all_wrong_streak: int = 0, skips: int = 0
             ) -> tuple[float, float, float]:
        """(P(keep), P(all correct), P(all wrong)) of ``uid``'s next group at ``step`` (Eq. P4, P5); before the run's
        first group there is no evidence at all, not even a dataset mean: kept (1, 0, 0)."""
        if not self.means:
            return 1.0, 0.0, 0.0
        a, b = self.beta(uid, step)
        return posterior_keep_probability(a, b, self.g(), self.params, guard_min, all_wrong_streak, skips)

    def state_dict(self) -> dict[str, Any]:
        return {"group_size": self.group_size, "prompts": {u: list(r) for u, r in self.prompts.items()},
                "means": {k: list(r) for k, r in self.means.items()}, "bucket": dict(self.bucket)}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.group_size = int(s["group_size"])
        self.prompts = {str(u): [float(r[0]), float(r[1]), int(r[2])] for u, r in s["prompts"].items()}
        self.means = {str(k): [float(r[0]), float(r[1]), int(r[2])] for k, r in s["means"].items()}
        self.bucket = {str(u): str(b) for u, b in s["bucket"].items()}
