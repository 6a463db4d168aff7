"""Diagnostic (issue 47, off by default): do the batch's p_hat-based decisions still hold under the current policy?

DA3PO decides twice from a group's p_hat (the fraction of its G responses that are correct): the DAPO filter keeps
the group only if 0 < p_hat < 1, and DAA (Eq. 14) amplifies its correct responses only if p_hat < tau. Under
``rollout.staleness`` k the p_hat was measured by the policy that *generated* the group, up to k versions (more with
partial rollouts, where a group starts under one version) before the one it is trained at. With
``eval.rescore_groups=m`` every step, after the weight sync (the engines hold the new weights, the producer is
paused), up to m kept and m dropped groups of the step's generated groups are generated again -- G fresh responses
each, seed ``sampler.sampling_seed(step, RESCORE_ROUND)`` -- and re-scored; the step logs how often the two decisions
made with the old p_hat differ from the ones the new p_hat gives, per difficulty bucket (``rescore/*``).

The re-generated samples are not trained on and not counted in ``gen/cumulative_samples``. Even at staleness 0 the
rates are not 0: p_hat from G samples is a noisy estimate, and the new weights are one update newer than the ones
that generated the group. The synchronous run's rates are therefore the floor a staleness setting is compared with
(``tools/studies/async_hard.py``).
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from da3po_megatron.trainer import batch as B

if TYPE_CHECKING:
    from da3po_megatron.trainer.generation.sampler import Sampler

__all__ = ["RESCORE_ROUND", "decision_flips", "flip_counts", "pick_groups", "rescore"]

RESCORE_ROUND = 7_919  # the sampling-seed "round" of the re-generation (training uses rounds 0..max_generation_rounds)


def decision_flips(p_stale: float, p_now: float, tau: float) -> tuple[bool, bool]:
    """Whether the DAPO filter's keep decision (0 < p < 1) and DAA's amplify decision (p < tau, Eq. 14) differ
    between the stale estimate ``p_stale`` and the current one ``p_now``."""
    keep_stale, keep_now = 0.0 < p_stale < 1.0, 0.0 < p_now < 1.0
    return keep_stale != keep_now, (p_stale < tau) != (p_now < tau)


def flip_counts(records: Sequence[tuple[Any, float, float, int]], tau: float) -> dict[str, float]:
    """Per-step counts from ``(bucket, p_stale, p_now, age)`` records, overall and per bucket (sums, so that a study
    can add them over steps and seeds):

    - ``kept`` / ``kept_to_dropped``: groups the stale p_hat kept / of those, the ones the current p_hat would drop;
    - ``dropped`` / ``dropped_to_kept``: the same for groups the stale p_hat dropped;
    - ``daa_flips``: kept groups whose DAA decision (p_hat < tau) differs (DAA acts on kept groups only);
    - ``p_diff_sum``: sum of p_now - p_stale over kept groups; ``age_sum``: sum of versions between the two."""
    out: dict[str, float] = defaultdict(float)
    for bucket, p_stale, p_now, age in records:
        keep_flip, daa_flip = decision_flips(p_stale, p_now, tau)
        kept = 0.0 < p_stale < 1.0
        for prefix in ("rescore", f"rescore/bucket{bucket}"):
            out[f"{prefix}/groups"] += 1
            out[f"{prefix}/age_sum"] += age
            if kept:
                out[f"{prefix}/kept"] += 1
                out[f"{prefix}/kept_to_dropped"] += keep_flip
                out[f"{prefix}/daa_flips"] += daa_flip
                out[f"{prefix}/p_diff_sum"] += p_now - p_stale
            else:
                out[f"{prefix}/dropped"] += 1
                out[f"{prefix}/dropped_to_kept"] += keep_flip
    return dict(out)


def pick_groups(generated: Sequence[B.Group], per_kind: int, seed: int) -> list[B.Group]:
    """Up to ``per_kind`` kept (0 < p_hat < 1) and ``per_kind`` dropped groups, drawn at random with ``seed``."""
    rng = random.Random(seed)
    kept = [g for g in generated if 0.0 < g.p_hat < 1.0]
    dropped = [g for g in generated if not 0.0 < g.p_hat < 1.0]
    return [g for pool in (kept, dropped) for g in rng.sample(pool, min(per_kind, len(pool)))]


def rescore(run: Sampler, generated: Sequence[B.Group], step: int) -> dict[str, float]:
    """Re-generate and re-score a sample of ``generated`` with the engines' current weights (version ``step``, after
    the sync; ``run``: the run's sampler) and return :func:`flip_counts` of the old vs new p_hat
    (``eval.rescore_groups`` groups per kind)."""
    cfg = run.cfg
    picked = pick_groups(generated, cfg.eval.rescore_groups, run.sampling_seed(step, RESCORE_ROUND))
    if not picked:
        return {}
    examples = [g.example for g in picked]
    comps = run.generate(examples, run.sampling_seed(step, RESCORE_ROUND))  # not run.score: totals stay untouched
    texts = [c.text for cs in comps for c in cs]
    answers = [ex.answer for ex, cs in zip(examples, comps, strict=True) for _ in cs]
    rewards = run.rewards.score_batch(texts, answers, kind=cfg.reward.kind).rewards
    records, i = [], 0
    for g, cs in zip(picked, comps, strict=True):
        p_now = sum(float(r) > 0 for r in rewards[i:i + len(cs)]) / len(cs)
        i += len(cs)
        records.append((g.bucket, g.p_hat, p_now, step - g.weight_step))
    return flip_counts(records, cfg.daa.tau)
