"""Pre-rollout prompt selection (``data.selection=skip_zero_variance``): skip prompts whose recent groups were
zero-variance before paying for their generation, with separate rules for all-correct and all-wrong streaks.

Reference: GRESO, "Act Only When It Pays: Efficient Reinforcement Learning for LLM Reasoning via Selective Rollouts"
(arXiv 2506.02177): a prompt whose last ``z`` groups were all zero-variance is skipped with probability
``1 - p_e^z``, and the exploration rate ``p_e`` is moved by a fixed step toward a target zero-variance rate. What is
ours (the DA3PO-aware part): the two tails are separate.

**History** (:class:`PromptHistory`): per prompt uid its last outcome -- p_hat, all-correct, all-wrong, the
training step it was generated in -- the current streak ``z`` (consecutive zero-variance groups of the same tail; a
group with 0 < p_hat < 1 resets it) and the steps in which it came up and was skipped since it was last generated.
Keyed by uid, so it spans epochs.

**One decision per prompt per training step** (the step: completed steps, advanced by :meth:`SelectingPrompts.drain`
when a step completes). A prompt's first visit in a step draws the rule below; a later visit in the same step (the
stream goes round a small prompt set several times per step once most prompts are skipped) repeats that decision,
and a prompt generated earlier in the same step whose group was zero-variance is skipped for the rest of the step
(its outcome under these weights is known); a prompt taken and not yet scored is not taken again (a round may go
round the stream several times). So P(skip) below is per step, as in GRESO, where a prompt comes up once
per step; a per-visit draw let the first comparison's 32-prompt run generate an all-wrong prompt up to ~30 times
per step (step 40 of DAPO + selection, seed 0: 268 groups generated for 16 kept, 224 of them all-wrong).

**When a whole pass is skipped** (every prompt of a small set has a streak, late in training), the next prompt whose
streak is at most the pass's shortest is generated (of either tail: ranked by 2^-z): the likeliest to be informative,
not whichever came next. With "whichever came next", DAPO + selection on 128 prompts generated 86 groups per
step against 63 without selection (steps 41-50, seed 0), every prompt skipped by step ~20. Ranked by P(keep)
instead (rule 524e5ed), the fallback preferred all-wrong prompts -- their rate is capped at 1/2 where p_c sits near
0.05 -- and generated hopeless prompts inside their back-off: on the second regime DAPO + selection generated all 16
8-digit prompts in one step after the rule had skipped each of them (steps 24-27, 36, 42, 45 of seed 0), 299 all-wrong
groups in 50 steps against 321 without selection. For one shared rate (the naive arm) both rankings are the same.

**Skip rule** (:func:`keep_probability`), for a prompt with streak ``z`` of tail ``t`` (c = all-correct,
w = all-wrong) and ``s`` consecutive skips:

    P(keep) = 1                                   if z = 0 (no history, or its last group taught something)
    P(keep) = p_c^z                               all-correct streak: aggressive, p_c >= explore_min
    P(keep) = 1                                   all-wrong streak with s >= b * 2^(z-1) (re-admitted: back-off)
    P(keep) = p_w^z,  explore_min_all_wrong <= p_w <= 1/2    all-wrong streak otherwise

(b = ``max_skips_all_wrong``, default 1). An all-wrong streak is where DAA's rare correct responses come from
(Eq. 14 amplifies exactly those), so it is never retired: after its z-th all-wrong group in a row a prompt is
generated again within b * 2^(z-1) + 1 steps in which it comes up (exponential back-off in the streak). An
all-correct streak carries no such value and is retired geometrically (no re-admission). Why a back-off and not a
constant re-admission: a prompt the policy cannot solve yet (no correct response at all) would otherwise cost a
generation every b + 1 steps for the whole run; with the back-off it costs O(log V) generations over V visits (the
waits 1, 2, 4, ... sum to 2^g - 1 after g generations). A prompt with rare correct responses (a group holds one with
probability q) has its streak reset by each such group, so its waits stay short (a streak of z has probability
(1 - q)^z); a hopeless prompt that becomes solvable is found again after at most about as many visits as it has
been all-wrong for. The cap p_w <= 1/2 is the back-off's own rate: with P(keep) <= 2^-z the expected number of
visits to the next generation is at least ~2^(z-1) too, so the random keeps between re-admissions do not undo the
O(log V) cost (an adapted p_w near 1 would keep every all-wrong prompt at every visit). With the re-admission
guaranteed, p_w's floor no longer has to keep hard prompts in play: it defaults to 0.05 like p_c's. The previous rule
(a16342e: floor 0.5, no cap, re-admission after one skip whatever the streak) made 18 % of the generated groups
all-wrong on the second comparison regime's unlearnable 8-digit bucket, against 13 % without selection: each such
prompt was generated in about every second step (p_w ended at 0.62; docs/results_selection.md). ``tails="shared"`` is
the naive GRESO arm of the comparison: one rate for both tails, the all-correct floor, no re-admission, no cap.

**Adaptation** (:meth:`ExplorationRates.update`, once per window of ``window`` generated groups), with the window's
observed all-correct / all-wrong fractions r_c, r_w and targets t_c, t_w:

    p_t <- clip(p_t - eta, floor_t, cap_t)   if r_t > t_t    (too many zero-variance groups of tail t: skip more)
    p_t <- clip(p_t + eta, floor_t, cap_t)   otherwise       (explore more)

(cap_c = 1, cap_w = 1/2: the back-off's rate, above).

``shared``: one p on r_c + r_w against t_c + t_w. The same window updates the keep-rate estimate used to size each
generation round (adaptive over-sampling): ``keep_ema <- (keep_ema + r_keep) / 2``, prompts per round =
ceil(need / max(keep_ema, 0.25)).

**The posterior rule** (``data.selection=posterior``, :mod:`.selection_posterior`; issue 59) replaces the skip
probability above by a per-prompt Beta posterior over the pass rate, decayed toward its bucket's running mean (MoPPS):
P(keep) = max(1 - P(next group of G zero-variance), floor), the back-off of all-wrong streaks as above, and never
skipped below DAA's tau while a correct response is likely enough; the fallback ranks by P(informative). Everything
else here (one decision per step, the memo, the rates' keep estimate) is shared.

The skip draw is a pure function of (seed, the prompt stream's position): a resumed run draws what an uninterrupted
one would, and a rewound stream (streaming mode) replays the memoised decisions. Left out: GRESO's per-step
time budget; selection by anything but the prompt's own history.
"""

from __future__ import annotations

import hashlib
import math
import threading
from dataclasses import dataclass, field
from typing import Any

from da3po_megatron.data.selection_posterior import PassRatePosteriors, PosteriorParams

__all__ = ["ExplorationRates", "PromptHistory", "SelectingPrompts", "SelectionParams", "keep_probability",
           "oversample", "selecting", "selection_batch_metrics", "uniform"]

CORRECT, WRONG = "all_correct", "all_wrong"
WRONG_RATE_CAP = 0.5  # p_w <= 1/2: the all-wrong back-off's doubling (module docstring)


@dataclass(frozen=True)
class SelectionParams:
    """The rule's constants (``data.selection_*``)."""

    tails: str = "separate"  # "separate" (DA3PO-aware) | "shared" (naive GRESO: one rate)
    target_all_correct: float = 0.10
    target_all_wrong: float = 0.20
    explore_init: float = 0.5
    explore_step: float = 0.05
    explore_min: float = 0.05
    explore_min_all_wrong: float = 0.05
    max_skips_all_wrong: int = 1  # b: re-admitted after b * 2^(z-1) skips in a row (0: never skipped)
    window: int = 16
    posterior: PosteriorParams | None = None  # data.selection=posterior: that rule's constants (else the streak rule)


def uniform(seed: int, position: int) -> float:
    """A uniform draw in [0, 1) that depends only on (seed, position): the skip coin of the prompt at ``position``."""
    h = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64


def keep_probability(streak: int, tail: str | None, skips: int, rate_correct: float, rate_wrong: float,
                     params: SelectionParams) -> float:
    """P(keep) of a prompt (the module docstring's rule). ``tail``: the tail of its streak (None: no streak)."""
    if streak <= 0 or tail is None:
        return 1.0
    if params.tails == "shared":
        return rate_correct ** streak  # one rate (rate_correct holds it) for both tails, no re-admission
    if tail == CORRECT:
        return rate_correct ** streak
    if skips >= params.max_skips_all_wrong * 2 ** (streak - 1):  # exponential back-off in the streak
        return 1.0
    return _wrong_rate(rate_wrong, params) ** streak


def _wrong_rate(rate: float, params: SelectionParams) -> float:
    """p_w within [explore_min_all_wrong, 1/2] (the back-off's rate: module docstring)."""
    return min(max(rate, params.explore_min_all_wrong), WRONG_RATE_CAP)


def oversample(need: int, keep_rate: float, max_factor: float = 4.0) -> int:
    """Prompts to send for ``need`` missing kept groups at the measured keep rate (at most ``max_factor`` x need)."""
    return max(need, math.ceil(need / max(keep_rate, 1.0 / max_factor)))


@dataclass
class ExplorationRates:
    """The exploration rates p_c, p_w (``shared``: p_c serves both) and the keep-rate estimate, adapted per window."""

    params: SelectionParams
    correct: float = -1.0
    wrong: float = -1.0
    keep_ema: float = 1.0
    window: dict[str, int] = field(default_factory=lambda: {"groups": 0, CORRECT: 0, WRONG: 0})

    def __post_init__(self) -> None:
        if self.correct < 0:
            self.correct = self.params.explore_init
        if self.wrong < 0:
            self.wrong = _wrong_rate(self.params.explore_init, self.params)

    def observe(self, all_correct: int, all_wrong: int, groups: int) -> bool:
        """Count generated groups; update the rates when a window is complete (returns whether it did)."""
        w = self.window
        w["groups"] += groups
        w[CORRECT] += all_correct
        w[WRONG] += all_wrong
        if w["groups"] < self.params.window:
            return False
        self.update(w[CORRECT] / w["groups"], w[WRONG] / w["groups"])
        self.window = {"groups": 0, CORRECT: 0, WRONG: 0}
        return True

    def update(self, r_correct: float, r_wrong: float) -> None:
        p, eta = self.params, self.params.explore_step
        if p.tails == "shared":
            self.correct = _step(self.correct, eta, r_correct + r_wrong > p.target_all_correct + p.target_all_wrong,
                                 p.explore_min)
            self.wrong = self.correct
        else:
            self.correct = _step(self.correct, eta, r_correct > p.target_all_correct, p.explore_min)
            self.wrong = _step(self.wrong, eta, r_wrong > p.target_all_wrong, p.explore_min_all_wrong, WRONG_RATE_CAP)
        self.keep_ema = 0.5 * (self.keep_ema + (1.0 - r_correct - r_wrong))

    def state_dict(self) -> dict[str, Any]:
        return {"correct": self.correct, "wrong": self.wrong, "keep_ema": self.keep_ema, "window": dict(self.window)}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.correct, self.wrong, self.keep_ema = float(s["correct"]), float(s["wrong"]), float(s["keep_ema"])
        self.window = {k: int(v) for k, v in s["window"].items()}


def _step(rate: float, eta: float, too_many: bool, floor: float, cap: float = 1.0) -> float:
    return min(cap, max(floor, rate - eta if too_many else rate + eta))


class PromptHistory:
    """Per-uid outcome history: ``{uid: [p_hat, all_correct, all_wrong, step, streak, skips]}`` (plain values)."""

    def __init__(self) -> None:
        self.rows: dict[str, list] = {}

    def record(self, uid: str, p_hat: float, step: int) -> None:
        """A generated group's outcome (``step``: the training step it was generated in): extends the streak of its
        tail, or resets it (0 < p_hat < 1)."""
        prev = self.rows.get(uid)
        correct, wrong = p_hat >= 1.0, p_hat <= 0.0
        streak = 0
        if correct or wrong:
            same = prev is not None and bool(prev[1]) == correct and bool(prev[2]) == wrong
            streak = (prev[4] + 1) if same else 1
        self.rows[uid] = [float(p_hat), correct, wrong, int(step), streak, 0]

    def streak(self, uid: str) -> tuple[int, str | None, int]:
        row = self.rows.get(uid)
        if row is None or row[4] == 0:
            return 0, None, 0
        return row[4], CORRECT if row[1] else WRONG, row[5]

    def skipped(self, uid: str) -> None:
        if uid in self.rows:  # the posterior rule may skip a prompt never generated (no streak to back off)
            self.rows[uid][5] += 1

    def zero_variance_at(self, uid: str, step: int) -> str | None:
        """The tail of ``uid``'s group if it was generated in training step ``step`` and was zero-variance."""
        row = self.rows.get(uid)
        if row is None or row[3] != step or row[4] == 0:
            return None
        return CORRECT if row[1] else WRONG

    def state_dict(self) -> dict[str, Any]:
        return {"uids": list(self.rows), "rows": [list(r) for r in self.rows.values()]}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.rows = {u: [float(r[0]), bool(r[1]), bool(r[2]), int(r[3]), int(r[4]), int(r[5])]
                     for u, r in zip(s["uids"], s["rows"], strict=True)}


class SelectingPrompts:
    """A prompt iterator that skips by the rule; a drop-in for
    :class:`~da3po_megatron.data.prompt_iterator.PromptIterator` (``take`` / ``state_dict`` / ``load_state_dict``;
    the wrapped iterator's state is unchanged, so a checkpoint's ``prompts`` entry reads the same with selection on
    or off). Thread-safe: the staleness-1 prefetch and the asynchronous producer draw and score from their own threads.

    ``observe(groups)`` (from ``Sampler.score``) records outcomes and adapts the rates; ``drain()`` returns and
    resets the per-step counters."""

    def __init__(self, inner: Any, params: SelectionParams, seed: int) -> None:
        self.inner, self.params, self.seed = inner, params, int(seed)
        self.history, self.rates = PromptHistory(), ExplorationRates(params)
        self.posterior = PassRatePosteriors(params.posterior) if params.posterior else None
        self.memo: dict[int, bool] = {}  # stream position -> skipped (a rewound stream replays its decisions)
        self.step = 0  # training steps completed (drain() advances it): the unit of one decision per prompt
        self.decided: dict[str, tuple[bool, float]] = {}  # uid -> (skipped, P(keep)): this step's decisions
        self.pending: set[str] = set()  # taken this step, not yet scored: not taken again before its outcome
        self.counters = _zero_counters()
        self.lock = threading.RLock()

    # --- the iterator interface
    def take(self, k: int) -> list[Any]:
        out: list[Any] = []
        with self.lock:
            run_of_skips, best, floor = 0, -1.0, None
            while len(out) < k:
                pos = self.inner.consumed
                got = self.inner.take(1)
                if not got:
                    break
                ex = got[0]
                if self.posterior is not None:
                    self.posterior.note(ex.uid, ex.meta.get("bucket"))
                if pos in self.memo:
                    skip = self.memo[pos]
                else:
                    skip, p_keep = self._decide(ex.uid, pos)
                    rank = self._fallback_rank(ex.uid, p_keep)
                    if skip and floor is not None and rank >= floor:  # the fallback: the pass's best candidate
                        skip = False
                        self.decided[ex.uid] = (False, p_keep)
                    best = max(best, rank) if skip else best
                    self.memo[pos] = skip
                if skip:
                    run_of_skips += 1
                    if run_of_skips >= len(self.inner.dataset) and floor is None:
                        floor = best  # a whole pass skipped: keep the next prompt with the pass's shortest streak
                else:
                    out.append(ex)
                    self.pending.add(ex.uid)
                    run_of_skips, best, floor = 0, -1.0, None
        return out

    def _fallback_rank(self, uid: str, p_keep: float) -> float:
        """A skipped prompt's rank for the whole-pass fallback: 2^-z, the shortest streak first whatever its tail
        (module docstring), P(informative) under the posterior rule; ``p_keep`` itself when <= 0 (generated this step
        with a zero-variance group: 0; taken and not yet scored: -1)."""
        if p_keep <= 0:
            return p_keep
        if self.posterior is not None:
            _, p_c, p_w = self.posterior.keep(uid, self.step, 1.0)
            return 1.0 - p_c - p_w
        return 0.5 ** self.history.streak(uid)[0]

    def _decide(self, uid: str, pos: int) -> tuple[bool, float]:
        """(skip ``uid`` now, its P(keep) this step): one decision per prompt per step (module docstring), counted
        once per step; a prompt generated this step with a zero-variance group has P(keep) 0."""
        if uid in self.pending:  # taken earlier in this round / step and not scored yet: below every fallback
            return True, -1.0
        known = self.history.zero_variance_at(uid, self.step)
        if known is not None:  # generated this step, zero-variance: skipped for the rest of the step
            if not self.decided.get(uid, (False, 0.0))[0]:
                self.decided[uid] = (True, 0.0)
                self.counters[f"skipped_{known}"] += 1
            return True, 0.0
        if uid in self.decided:
            return self.decided[uid]
        z, tail, s = self.history.streak(uid)
        if self.posterior is not None:  # the tau guard's threshold: the window's keep rate, at most 1/2
            p_keep, p_c, p_w = self.posterior.keep(uid, self.step, min(self.rates.keep_ema, 0.5),
                                                   z if tail == WRONG else 0, s)
            tail = tail or (WRONG if p_w > p_c else CORRECT)  # a skip without a streak counts by its likelier tail
        else:
            p_keep = keep_probability(z, tail, s, self.rates.correct, self.rates.wrong, self.params)
        skip = uniform(self.seed, pos) >= p_keep
        self.decided[uid] = (skip, p_keep)
        if skip:
            self.history.skipped(uid)
            self.counters[f"skipped_{tail}"] += 1
        return skip, p_keep

    def state_dict(self) -> dict[str, Any]:
        with self.lock:
            s = self.inner.state_dict()
            self.memo = {p: v for p, v in self.memo.items() if p >= s["consumed"]}  # no rewind goes before this
            return s

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.lock:
            self.inner.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:  # epoch, position, consumed, dataset, ...
        if name == "inner":  # not yet set (e.g. copy / unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    # --- outcomes, rates, counters
    def observe(self, p_hats: list[tuple[str, float]]) -> None:
        with self.lock:
            for uid, p_hat in p_hats:
                self.history.record(uid, p_hat, self.step)
                self.pending.discard(uid)
                if self.posterior is not None:
                    self.posterior.observe(uid, p_hat, self.step)
            c = sum(p >= 1.0 for _, p in p_hats)
            w = sum(p <= 0.0 for _, p in p_hats)
            self.counters["generated_groups"] += len(p_hats)
            self.rates.observe(c, w, len(p_hats))

    def round_size(self, need: int) -> int:
        with self.lock:
            return oversample(need, self.rates.keep_ema)

    def drain(self) -> dict[str, float]:
        """This step's selection metrics (counters since the last drain -- prompts skipped, each counted once per step
        --, the current rates); resets the counters. Called when a training step completes: the next decisions are
        the next step's."""
        with self.lock:
            c, self.counters = self.counters, _zero_counters()
            self.step, self.decided, self.pending = self.step + 1, {}, set()
            return {"selection/skipped_all_correct": float(c["skipped_all_correct"]),
                    "selection/skipped_all_wrong": float(c["skipped_all_wrong"]),
                    "selection/skipped": float(c["skipped_all_correct"] + c["skipped_all_wrong"]),
                    "selection/explore_all_correct": self.rates.correct,
                    "selection/explore_all_wrong": self.rates.wrong,
                    "selection/keep_rate_estimate": self.rates.keep_ema,
                    "selection/history_prompts": float(len(self.history.rows))}

    def selection_state(self) -> dict[str, Any]:
        with self.lock:
            return {"fingerprint": self.inner.dataset.fingerprint(), "history": self.history.state_dict(),
                    "rates": self.rates.state_dict(), "memo": [[p, v] for p, v in sorted(self.memo.items())],
                    "step": self.step, "decided": [[u, v[0], v[1]] for u, v in sorted(self.decided.items())],
                    "pending": sorted(self.pending), "counters": dict(self.counters),
                    "posterior": self.posterior.state_dict() if self.posterior is not None else None}

    def load_selection_state(self, s: dict[str, Any] | None) -> str:
        """Restore; returns the one line to print. Another dataset (fingerprint): a new, empty history."""
        with self.lock:
            if not s:
                return "selection: no history in the checkpoint (selection was off): starting a new history"
            if s["fingerprint"] != self.inner.dataset.fingerprint():
                return (f"selection: the checkpoint's history is of another dataset (fingerprint {s['fingerprint']} "
                        f"!= {self.inner.dataset.fingerprint()}): starting a new history")
            self.history.load_state_dict(s["history"])
            self.rates.load_state_dict(s["rates"])
            self.memo = {int(p): bool(v) for p, v in s["memo"]}
            self.step, self.counters = int(s["step"]), {k: int(v) for k, v in s["counters"].items()}
            self.decided = {str(u): (bool(v), float(p)) for u, v, p in s.get("decided", [])}
            self.pending = {str(u) for u in s.get("pending", [])}
            if self.posterior is not None and s.get("posterior"):  # a streak-rule checkpoint: a new posterior
                self.posterior.load_state_dict(s["posterior"])
            return f"selection: resumed the history of {len(self.history.rows)} prompts"


def _zero_counters() -> dict[str, int]:
    return {"skipped_all_correct": 0, "skipped_all_wrong": 0, "generated_groups": 0}


def selection_batch_metrics(batch_buckets: list[Any], generated_groups: int, generated_tokens: int
                            ) -> dict[str, float]:
    """Per step: generated groups and tokens per kept (trained) group, and the trained share of each bucket."""
    n = max(len(batch_buckets), 1)
    out = {"selection/generated_groups_per_kept": generated_groups / n,
           "selection/generated_tokens_per_kept_group": generated_tokens / n}
    for b in sorted(set(batch_buckets), key=str):
        out[f"selection/trained_share_bucket/{b}"] = sum(x == b for x in batch_buckets) / n
    return out


def selecting(inner: Any, data: Any, seed: int, group_size: int = 0, tau: float = 0.5) -> Any:
    """The run's prompt stream: ``inner`` itself with ``data.selection=none``, else a :class:`SelectingPrompts`.
    ``group_size`` (``rollout.n``; 0: learnt from the p_hats) and ``tau`` (``daa.tau``) serve the posterior rule."""
    if data.selection == "none":
        return inner
    posterior = None
    if data.selection == "posterior":
        posterior = PosteriorParams(prior_strength=data.selection_prior_strength, decay=data.selection_decay, tau=tau,
                                    floor_correct=data.selection_explore_min,
                                    floor_wrong=data.selection_explore_min_all_wrong,
                                    max_skips_all_wrong=data.selection_max_skips_all_wrong, group_size=group_size,
                                    sharpness=data.selection_sharpness)
    params = SelectionParams(tails=data.selection_tails, target_all_correct=data.selection_target_all_correct,
                             target_all_wrong=data.selection_target_all_wrong,
                             explore_init=data.selection_explore_init, explore_step=data.selection_explore_step,
                             explore_min=data.selection_explore_min,
                             explore_min_all_wrong=data.selection_explore_min_all_wrong,
                             max_skips_all_wrong=data.selection_max_skips_all_wrong,
                             window=data.train_batch_size, posterior=posterior)
    return SelectingPrompts(inner, params, seed)
