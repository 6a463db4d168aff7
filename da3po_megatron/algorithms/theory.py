"""Theorem 3.1 / Corollary 3.2 of the paper: how dynamic sampling rescales the expected advantages.

Setting: each of the G responses to a prompt is independently correct with probability p; R_acc = +1 / -1; advantages
are the group z-scores of Eq. 3 (any convention that gives exactly 0 advantage to a uniform group; ``std_mode`` and eps
do not matter). Dynamic sampling keeps a group iff 0 < p_hat < 1 (event F).

    alpha+(p, G) = 1 / (1 - p^(G-1)),   alpha-(p, G) = 1 / (1 - (1-p)^(G-1)),   gamma = alpha+ / alpha-

Precisely which quantity they are ratios of (checked numerically by ``monte_carlo_conditional_advantages`` and pinned
in tests/test_theory.py):

    alpha+ = E[A_i | response i correct, F] / E[A_i | response i correct]         (no filtering in the denominator)
    alpha- = E[A_i | response i incorrect, F] / E[A_i | response i incorrect]

Proof sketch: A_i = 0 outside F, so E[A_i 1_F | correct] = E[A_i | correct], and P(F | i correct) = 1 - p^(G-1)
(F fails given i correct iff the other G-1 responses are all correct). Hence alpha+ = 1 / P(F | i correct); likewise
alpha- = 1 / P(F | i incorrect). They are per-response conditional expectations: the ratio for the un-normalised
advantage mass, E[A_i 1{correct} | F] / E[A_i 1{correct}], is 1 / P(F) = 1 / (1 - p^G - (1-p)^G) for BOTH classes
and is NOT what the theorem states (reported as ``joint_ratio`` for contrast). gamma < 1 iff p < 1/2: on hard prompts
dynamic sampling amplifies the (negative) advantages of incorrect responses more than those of correct ones, which DAA
(Eq. 14) compensates by multiplying the correct ones by lambda.

``main(argv)`` is ``da3po theory``: prints the table for given p and G (and a Monte Carlo check with ``--mc N``).
Figures 1-2 are drawn by ``tools/plot_theory.py``.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from typing import overload

import torch
from torch import Tensor

from .advantages import StdMode, group_advantages


def _check_pg(p: float | Tensor, G: int) -> None:
    if not isinstance(G, int) or G < 2:
        raise ValueError(f"G (group size) must be an int >= 2, got {G!r}")
    if isinstance(p, Tensor):
        if bool(((p < 0) | (p > 1)).any()):
            raise ValueError("p must lie in [0, 1]")
    elif not 0.0 <= p <= 1.0:
        raise ValueError(f"p must lie in [0, 1], got {p}")


@overload
def alpha_plus(p: float, G: int) -> float: ...
@overload
def alpha_plus(p: Tensor, G: int) -> Tensor: ...
def alpha_plus(p, G):
    """alpha+(p, G) = 1 / (1 - p^(G-1)) (Thm 3.1): scaling of E[A | correct] by dynamic sampling; +inf at p = 1."""
    _check_pg(p, G)
    if isinstance(p, Tensor):
        return 1.0 / (1.0 - p.pow(G - 1))
    den = 1.0 - p ** (G - 1)
    return 1.0 / den if den > 0 else math.inf


@overload
def alpha_minus(p: float, G: int) -> float: ...
@overload
def alpha_minus(p: Tensor, G: int) -> Tensor: ...
def alpha_minus(p, G):
    """alpha-(p, G) = 1 / (1 - (1-p)^(G-1)) (Thm 3.1): scaling of E[A | incorrect]; +inf at p = 0."""
    _check_pg(p, G)
    if isinstance(p, Tensor):
        return 1.0 / (1.0 - (1.0 - p).pow(G - 1))
    den = 1.0 - (1.0 - p) ** (G - 1)
    return 1.0 / den if den > 0 else math.inf


@overload
def gamma(p: float, G: int) -> float: ...
@overload
def gamma(p: Tensor, G: int) -> Tensor: ...
def gamma(p, G):
    """gamma = alpha+ / alpha- = (1 - (1-p)^(G-1)) / (1 - p^(G-1)) (Cor 3.2); < 1 iff p < 1/2; 0 at p=0, inf at p=1."""
    _check_pg(p, G)
    if isinstance(p, Tensor):
        return (1.0 - (1.0 - p).pow(G - 1)) / (1.0 - p.pow(G - 1))
    num, den = 1.0 - (1.0 - p) ** (G - 1), 1.0 - p ** (G - 1)
    return num / den if den > 0 else math.inf


def _canonical_advantages(G: int, std_mode: StdMode, eps: float) -> tuple[list[float], list[float]]:
    """A of a correct / an incorrect response in a group with k correct, k = 0..G, via the real Eq. 3 code."""
    a_c, a_w = [], []
    for k in range(G + 1):
        r = torch.tensor([1.0] * k + [-1.0] * (G - k), dtype=torch.float64)
        a = group_advantages(r, G, eps=eps, std_mode=std_mode)
        a_c.append(float(a[0]) if k > 0 else math.nan)
        a_w.append(float(a[-1]) if k < G else math.nan)
    return a_c, a_w


def exact_conditional_advantages(
    p: float, G: int, std_mode: StdMode = "unbiased", eps: float = 1e-6
) -> dict[str, float]:
    """E[A | correct], E[A | correct, F], E[A | incorrect], E[A | incorrect, F] by summing over the binomial law of
    the other G-1 responses (exact up to float rounding), and the ratios ``alpha_plus`` / ``alpha_minus``."""
    _check_pg(p, G)
    a_c, a_w = _canonical_advantages(G, std_mode, eps)
    pmf = [math.comb(G - 1, j) * p**j * (1 - p) ** (G - 1 - j) for j in range(G)]  # j = other correct responses
    # correct response: k = j + 1 correct in total; F iff k < G iff j < G - 1
    ec = sum(pmf[j] * a_c[j + 1] for j in range(G))
    ec_f_mass = sum(pmf[j] * a_c[j + 1] for j in range(G - 1))
    pf_c = sum(pmf[j] for j in range(G - 1))
    # incorrect response: k = j correct in total; F iff k > 0
    ew = sum(pmf[j] * a_w[j] for j in range(G))
    ew_f_mass = sum(pmf[j] * a_w[j] for j in range(1, G))
    pf_w = sum(pmf[j] for j in range(1, G))
    out = {
        "E_A_correct": ec,
        "E_A_correct_kept": ec_f_mass / pf_c if pf_c > 0 else math.nan,
        "E_A_incorrect": ew,
        "E_A_incorrect_kept": ew_f_mass / pf_w if pf_w > 0 else math.nan,
    }
    out["alpha_plus"] = out["E_A_correct_kept"] / ec if ec != 0 else math.nan
    out["alpha_minus"] = out["E_A_incorrect_kept"] / ew if ew != 0 else math.nan
    return out


@dataclass
class MonteCarloResult:
    """Monte Carlo estimates (``*_se``: delta-method standard errors over i.i.d. groups)."""

    p: float
    G: int
    n_trials: int
    E_A_correct: float
    E_A_correct_kept: float
    E_A_incorrect: float
    E_A_incorrect_kept: float
    alpha_plus: float  # E[A | correct, F] / E[A | correct]
    alpha_plus_se: float
    alpha_minus: float  # E[A | incorrect, F] / E[A | incorrect]
    alpha_minus_se: float
    joint_ratio: float  # E[A 1{correct} | F] / E[A 1{correct}] = 1 / P(F): NOT the theorem's alpha
    kept_frac: float  # P(F) estimate


def _ratio_of_ratios(mean: Tensor, cov: Tensor, n: int, ia: int, ib: int, ic: int, id_: int) -> tuple[float, float]:
    """f = (m_a / m_b) / (m_c / m_d) and its delta-method standard error from per-group means / covariance."""
    a, b, c, d = (float(mean[i]) for i in (ia, ib, ic, id_))
    f = (a / b) / (c / d)
    g = torch.zeros(mean.numel(), dtype=torch.float64)
    g[ia] += f / a
    g[ib] += -f / b
    g[ic] += -f / c
    g[id_] += f / d
    var = float(g @ cov @ g) / n
    return f, math.sqrt(max(var, 0.0))


def monte_carlo_conditional_advantages(
    p: float,
    G: int,
    n_trials: int = 200_000,
    seed: int = 0,
    std_mode: StdMode = "unbiased",
    eps: float = 1e-6,
    chunk: int = 65_536,
) -> MonteCarloResult:
    """Simulate ``n_trials`` groups of G Bernoulli(p) responses, compute Eq. 3 advantages with the real
    ``group_advantages``, and estimate E[A | correct (, F)], E[A | incorrect (, F)] and the ratios alpha+ / alpha-.

    Each group is an i.i.d. unit; the ratio estimates use group sums (sum of A over correct responses, number of
    correct responses, each with and without the filter), so their standard errors come from the delta method on the
    group-level covariance. Compare with ``alpha_plus(p, G)`` within a few standard errors.
    """
    _check_pg(p, G)
    if n_trials < 2:
        raise ValueError(f"n_trials must be >= 2, got {n_trials}")
    gen = torch.Generator().manual_seed(seed)
    # per-group vector: [Xc, Yc, Xc_F, Yc_F, Xw, Yw, Xw_F, Yw_F, F]
    s1 = torch.zeros(9, dtype=torch.float64)
    s2 = torch.zeros(9, 9, dtype=torch.float64)
    done = 0
    while done < n_trials:
        n = min(chunk, n_trials - done)
        correct = torch.rand(n, G, generator=gen, dtype=torch.float64) < p
        rewards = torch.where(correct, 1.0, -1.0).to(torch.float64).reshape(-1)
        adv = group_advantages(rewards, G, eps=eps, std_mode=std_mode).view(n, G)
        k = correct.sum(dim=1)
        kept = ((k > 0) & (k < G)).to(torch.float64)
        c, w = correct.to(torch.float64), (~correct).to(torch.float64)
        xc, yc = (adv * c).sum(1), c.sum(1)
        xw, yw = (adv * w).sum(1), w.sum(1)
        v = torch.stack([xc, yc, xc * kept, yc * kept, xw, yw, xw * kept, yw * kept, kept], dim=1)
        s1 += v.sum(0)
        s2 += v.T @ v
        done += n
    mean = s1 / n_trials
    cov = (s2 - n_trials * torch.outer(mean, mean)) / (n_trials - 1)
    nan = math.nan

    def safe_div(a: float, b: float) -> float:
        return a / b if b != 0 else nan

    m = [float(x) for x in mean]
    a_plus, a_plus_se = _ratio_of_ratios(mean, cov, n_trials, 2, 3, 0, 1) if m[3] > 0 and m[0] != 0 else (nan, nan)
    a_minus, a_minus_se = _ratio_of_ratios(mean, cov, n_trials, 6, 7, 4, 5) if m[7] > 0 and m[4] != 0 else (nan, nan)
    return MonteCarloResult(
        p=p,
        G=G,
        n_trials=n_trials,
        E_A_correct=safe_div(m[0], m[1]),
        E_A_correct_kept=safe_div(m[2], m[3]),
        E_A_incorrect=safe_div(m[4], m[5]),
        E_A_incorrect_kept=safe_div(m[6], m[7]),
        alpha_plus=a_plus,
        alpha_plus_se=a_plus_se,
        alpha_minus=a_minus,
        alpha_minus_se=a_minus_se,
        joint_ratio=safe_div(safe_div(m[2], m[8]), m[0]),
        kept_frac=m[8],
    )


def theory_table(ps: list[float], Gs: list[int]) -> list[dict[str, float]]:
    """Rows of (p, G, alpha+, alpha-, gamma, 1/gamma, P(keep)) for every pair."""
    rows = []
    for G in Gs:
        for p in ps:
            g = gamma(p, G)
            rows.append(
                {
                    "p": p,
                    "G": G,
                    "alpha_plus": alpha_plus(p, G),
                    "alpha_minus": alpha_minus(p, G),
                    "gamma": g,
                    "inv_gamma": 1.0 / g if g > 0 else math.inf,
                    "p_keep": 1.0 - p**G - (1.0 - p) ** G,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    """``da3po theory --p 0.1 --G 8 [--mc 200000]``: print alpha+, alpha-, gamma of Thm 3.1."""
    ap = argparse.ArgumentParser(
        prog="da3po theory",
        description="alpha+ = 1/(1-p^(G-1)), alpha- = 1/(1-(1-p)^(G-1)), gamma = alpha+/alpha- (Thm 3.1, Cor 3.2): "
        "the factors by which dynamic sampling (keep 0 < p_hat < 1) scales the expected advantage of a correct / "
        "incorrect response. inv_gamma is the DAA factor that would equalise them; p_keep = P(0 < p_hat < 1).",
    )
    ap.add_argument("--p", type=float, nargs="+", default=[0.1, 0.25, 0.5, 0.75], help="per-response success rate(s)")
    ap.add_argument("--G", type=int, nargs="+", default=[8, 16], help="group size(s)")
    ap.add_argument("--mc", type=int, default=0, metavar="N", help="also run a Monte Carlo check with N groups")
    ap.add_argument("--seed", type=int, default=0, help="Monte Carlo seed")
    args = ap.parse_args(argv)
    for p in args.p:
        if not 0.0 < p < 1.0:
            ap.error(f"--p values must lie in (0, 1), got {p}")
    for G in args.G:
        if G < 2:
            ap.error(f"--G values must be >= 2, got {G}")
    header = f"{'G':>4} {'p':>7} {'alpha+':>10} {'alpha-':>10} {'gamma':>9} {'1/gamma':>9} {'p_keep':>8}"
    if args.mc:
        header += f"  {'MC alpha+ (se)':>20} {'MC alpha- (se)':>20}"
    print(header)
    for row in theory_table(args.p, args.G):
        line = (
            f"{row['G']:>4d} {row['p']:>7.4f} {row['alpha_plus']:>10.4f} {row['alpha_minus']:>10.4f} "
            f"{row['gamma']:>9.4f} {row['inv_gamma']:>9.4f} {row['p_keep']:>8.4f}"
        )
        if args.mc:
            mc = asdict(monte_carlo_conditional_advantages(row["p"], int(row["G"]), args.mc, args.seed))
            line += (
                f"  {mc['alpha_plus']:>10.4f} ({mc['alpha_plus_se']:.4f})"
                f" {mc['alpha_minus']:>10.4f} ({mc['alpha_minus_se']:.4f})"
            )
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
