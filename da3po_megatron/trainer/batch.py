"""From sampled completions to the policy's training batch: rewards, groups, advantages with DAA, step statistics.

These are the pure(-ish) middle steps of Algorithm 1, kept out of the loop so that the loop reads top to bottom and
so that they are testable without Ray, vLLM or Megatron:

1. :func:`make_groups` -- one :class:`Group` per prompt with its G completions, R_acc from the verifier and
   R = R_acc + R_len (DAPO Eq. 8 overlong shaping);
2. the dynamic-sampling buffer (``algorithms.dynamic_sampling``) keeps groups with 0 < p_hat < 1;
3. :func:`compute_advantages` -- Eq. 3 group z-scores, then DAA (Eq. 14; constant or adaptive lambda);
4. :func:`policy_batch` -- the flat :class:`PolicyBatch` the policy ranks train on;
5. :func:`group_stats` / :func:`theory_stats` -- what the step logs: accuracy, p_hat histogram, per-bucket accuracy,
   lengths, overlong fraction, and the Theorem 3.1 diagnostic (mean advantage of correct / incorrect responses on the
   kept groups vs all groups, next to alpha+ / alpha- at that p_hat).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from da3po_megatron.algorithms import (
    adaptive_daa_lambda,
    alpha_minus,
    alpha_plus,
    apply_daa,
    daa_stats,
    gamma,
    group_advantages,
)
from da3po_megatron.algorithms.registry import ADVANTAGE_FN_ARGS, load_function
from da3po_megatron.algorithms.reward_shaping import overlong_penalty
from da3po_megatron.data.datasets import Example
from da3po_megatron.megatron.batching import PolicyBatch, Ragged
from da3po_megatron.rollout.route_refs import RouteRefs, is_ref

P_HAT_BINS = (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)


@dataclass
class Group:
    """One prompt and its G sampled responses, scored. Picklable (it may be carried across steps and checkpointed).

    Token ids are int32 arrays and log-probs float32 arrays, as the engines' :class:`Completion` carries them (lists
    are converted): the driver's work per group is O(G), never O(tokens)."""

    example: Example
    prompt_ids: np.ndarray
    response_ids: list[np.ndarray]
    texts: list[str]
    rollout_logprobs: list[np.ndarray]
    finish_reasons: list[str]
    acc: list[float]  # R_acc in {+1, -1}
    rewards: list[float]  # R = R_acc + R_len
    advantages: list[float] = field(default_factory=list)  # filled by compute_advantages (after DAA)
    weight_step: int = 0  # the policy step whose weights generated these responses (0 = the initial checkpoint)
    routed_experts: list[Any] | None = None  # MoE: per response the engine's routes (Completion's: an array, or a
    # RouteRef into the object store, rollout/route_refs.py), None for a response whose routes the engine dropped
    # (moe.router_agreement_fraction), or None for the group
    token_versions: list[np.ndarray] | None = None  # partial rollouts: per response the version of each token (int32);
    # None = every token from weight_step (trainer/generation/async_rollout.py; weight_step is then the version it
    # started under)
    seed: int | None = None  # the engine request seed of response 0 (response j: seed + j); rounds only (replay.py)

    def __post_init__(self) -> None:
        self.prompt_ids = _array(self.prompt_ids, np.int32)
        self.response_ids = [_array(r, np.int32) for r in self.response_ids]
        self.rollout_logprobs = [_array(r, np.float32) for r in self.rollout_logprobs]
        if self.token_versions is not None:
            self.token_versions = [_array(r, np.int32) for r in self.token_versions]
        if self.routed_experts is not None:  # [positions, MoE layers, k], dtype kept (uint8 / int16), or RouteRefs
            self.routed_experts = [r if r is None or is_ref(r) else r.numpy() if isinstance(r, torch.Tensor) else
                                   np.asarray(r) for r in self.routed_experts]

    @property
    def p_hat(self) -> float:
        """Fraction of the G responses with R_acc > 0."""
        return sum(a > 0 for a in self.acc) / len(self.acc)

    @property
    def bucket(self) -> Any:
        return self.example.meta.get("bucket", self.example.source)


def _array(value: Any, dtype: Any) -> np.ndarray:
    """``value`` (a list, numpy array or CPU tensor) as a 1-D numpy array of ``dtype`` (no copy when it is one)."""
    if isinstance(value, torch.Tensor):
        value = value.numpy()
    return np.asarray(value, dtype=dtype).reshape(-1)


def make_groups(examples: Sequence[Example], completions: Sequence[Sequence[Any]], acc: Sequence[float],
                max_response_length: int, overlong_buffer: int | None) -> list[Group]:
    """Pair prompts with their completions and rewards (``acc`` flat, prompt-major, G per prompt).

    ``overlong_buffer`` = L_cache of Eq. 8 (None = no shaping); L_max = ``max_response_length``.
    """
    groups, i = [], 0
    for ex, comps in zip(examples, completions, strict=True):
        g_acc = [float(a) for a in acc[i:i + len(comps)]]
        i += len(comps)
        lengths = [len(c.token_ids) for c in comps]
        if overlong_buffer is None:
            rewards = list(g_acc)
        else:
            rewards = [a + float(overlong_penalty(n, max_response_length, overlong_buffer)) for a, n in
                       zip(g_acc, lengths)]
        groups.append(Group(
            example=ex, prompt_ids=comps[0].prompt_token_ids, response_ids=[c.token_ids for c in comps],
            texts=[c.text for c in comps], rollout_logprobs=[c.logprobs for c in comps],
            finish_reasons=[c.finish_reason for c in comps], acc=g_acc, rewards=rewards,
            routed_experts=[getattr(c, "routed_experts", None) for c in comps] if any(
                getattr(c, "routed_experts", None) is not None for c in comps) else None,
            token_versions=[c.versions for c in comps] if any(
                getattr(c, "versions", None) is not None for c in comps) else None))
    if i != len(acc):
        raise ValueError(f"make_groups: {len(acc)} rewards for {i} completions")
    require_finite(groups, "rewards")
    return groups


def _plain(value: Any) -> Any:
    """Plain Python values (numpy scalars / arrays from data readers -> lists and numbers)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value.tolist() if hasattr(value, "tolist") else value


_TOKEN_FIELDS = ("prompt_ids", "response_ids", "rollout_logprobs", "routed_experts", "token_versions")


def own_tensor(a: Any) -> torch.Tensor:
    """An independent, compact copy of a per-token array as a tensor (what a checkpoint stores). A completion that
    crossed Ray holds read-only views into its object's one buffer, and an empty view shares its address with the
    next array there, of another dtype (int32 tokens, float32 log-probs, uint8 routes): ``torch.from_numpy`` of such
    views makes ``torch.save`` refuse ("view the same data as different types": torch/serialization.py keys saved
    storages by ``data_ptr``), and a non-empty view would pin the whole Ray buffer."""
    return torch.from_numpy(np.array(a, copy=True, order="C"))


def group_to_dict(g: Group) -> dict[str, Any]:
    """A group as plain data (what a checkpoint stores: loads with ``torch.load(weights_only=True)``). Per-token
    fields are tensors (int32 / float32; checkpoints before issue 36 held lists of numbers, which
    :func:`group_from_dict` still reads)."""
    out = _plain({k: getattr(g, k) for k in g.__dataclass_fields__ if k not in _TOKEN_FIELDS and k != "example"})
    out["example"] = _plain(asdict(g.example))
    out["prompt_ids"] = own_tensor(g.prompt_ids)
    out["response_ids"] = [own_tensor(r) for r in g.response_ids]
    out["rollout_logprobs"] = [own_tensor(r) for r in g.rollout_logprobs]
    if g.routed_experts is not None:  # refs stay refs: CheckpointManager.start writes their routes (route_refs.py)
        out["routed_experts"] = [r if r is None or is_ref(r) else own_tensor(r) for r in g.routed_experts]
    if g.token_versions is not None:
        out["token_versions"] = [own_tensor(r) for r in g.token_versions]
    return out


def group_from_dict(d: dict[str, Any]) -> Group:
    """The inverse of :func:`group_to_dict`; also reads the lists of numbers of checkpoints written before it."""
    return Group(**{**d, "example": Example(**d["example"])})


def require_finite(groups: Sequence[Group], attr: str) -> None:
    """A non-finite reward or advantage is an error naming the prompt (it would turn the loss into NaN)."""
    for g in groups:
        bad = [i for i, v in enumerate(getattr(g, attr)) if not math.isfinite(v)]
        if bad:
            raise FloatingPointError(
                f"non-finite {attr} for prompt {g.example.uid!r} (source {g.example.source!r}), responses {bad}: "
                f"{[getattr(g, attr)[i] for i in bad]}; rewards {g.rewards}; answer {g.example.answer!r}")


def compute_advantages(groups: Sequence[Group], eps: float, daa: bool, lambda_: float, tau: float,
                       mode: str = "constant", lambda_min: float = 1.0, lambda_max: float = 3.0,
                       advantage_fn: str = "") -> dict[str, float]:
    """Eq. 3 (or the custom estimator ``advantage_fn``, an import path: ``algorithm.advantage_fn``) then (if ``daa``)
    Eq. 14, written into each group's ``advantages``; returns DAA statistics."""
    if not groups:
        return {}
    G = len(groups[0].acc)
    rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float64)
    correct = torch.tensor([a > 0 for g in groups for a in g.acc])
    p_hat = torch.tensor([g.p_hat for g in groups for _ in g.acc], dtype=torch.float32)
    if advantage_fn:
        fn = load_function(advantage_fn, ADVANTAGE_FN_ARGS, where="algorithm.advantage_fn")
        adv = torch.as_tensor(fn(rewards=rewards, group_size=G, eps=eps), dtype=torch.float64)
        if adv.shape != rewards.shape:
            raise ValueError(f"algorithm.advantage_fn={advantage_fn!r} returned shape {tuple(adv.shape)} for "
                             f"{tuple(rewards.shape)} rewards; it must return one advantage per response")
    else:
        adv = group_advantages(rewards, G, eps=eps)
    stats = {"daa/activation_frac": 0.0, "daa/lambda_mean": 1.0}
    if daa:
        lam = adaptive_daa_lambda(p_hat, G, lambda_min, lambda_max).to(adv.dtype) if mode == "adaptive" else lambda_
        adv = apply_daa(adv, correct, p_hat, lam, tau)
        s = daa_stats(correct, p_hat, tau, lam)
        stats["daa/activation_frac"] = s["daa/active_frac"]
        stats["daa/activation_frac_of_correct"] = s["daa/active_frac_of_correct"]
        # the mean factor over amplified responses; with none amplified: the constant lambda, or 1 (adaptive)
        stats["daa/lambda_mean"] = s["daa/lambda_mean"] if s["daa/num_active"] else \
            (1.0 if torch.is_tensor(lam) else float(lam))
    for gi, g in enumerate(groups):
        g.advantages = adv[gi * G:(gi + 1) * G].tolist()
    require_finite(groups, "advantages")
    return stats


def policy_batch(groups: Sequence[Group], old_logprobs: Any = None) -> PolicyBatch:
    """The flat per-response batch (group-major); ``old_logprobs`` default to the rollout's own. One concatenation
    per field into the batch's int32 / float32 arrays (:class:`~da3po_megatron.megatron.batching.Ragged`)."""
    prompt_ids = Ragged.from_rows([g.prompt_ids for g in groups for _ in g.response_ids], np.int32)
    response_ids = Ragged.from_rows([r for g in groups for r in g.response_ids], np.int32)
    lp = Ragged.from_rows(old_logprobs if old_logprobs is not None else
                          [r for g in groups for r in g.rollout_logprobs], np.float32)
    adv = np.array([a for g in groups for a in g.advantages], dtype=np.float64) if \
        all(g.advantages for g in groups) else None
    routes = None
    if groups and all(g.routed_experts is not None and all(r is not None for r in g.routed_experts)
                      for g in groups):  # MoE engine routes of every response (R3 / agreement on all)
        routes = _routes([r for g in groups for r in g.routed_experts])
    return PolicyBatch(prompt_ids=prompt_ids, response_ids=response_ids, old_logprobs=lp, advantages=adv,
                       routed_experts=routes)


def route_sample(groups: Sequence[Group]) -> tuple[list[int], Ragged] | None:
    """The responses of the batch (indices into :func:`policy_batch`'s group-major order) that carry engine routes
    when only some do (``moe.router_agreement_fraction`` < 1 without R3), with their routes as one array; None when
    none or all do (all: they travel in the batch itself)."""
    flat = [r for g in groups for r in (g.routed_experts or [None] * len(g.response_ids))]
    idx = [i for i, r in enumerate(flat) if r is not None]
    if not idx or len(idx) == len(flat):
        return None
    return idx, _routes([flat[i] for i in idx])


def _routes(rows: list[Any]) -> Any:
    """The batch's routes: one array (``Ragged``) when the engines returned arrays (in-process engines), else the
    refs (``RouteRefs``: each policy rank fetches its share from the object store, issue 60)."""
    if any(is_ref(r) for r in rows):
        return RouteRefs.from_rows(rows)
    return Ragged.from_rows(rows, rows[0].dtype)


def token_versions(groups: Sequence[Group]) -> Ragged:
    """Per response of the batch (group-major, as :func:`policy_batch`) the policy version that sampled each token:
    ``Group.token_versions`` where a response was stitched from several versions, else its group's ``weight_step``.
    int32, one array (no per-token Python)."""
    rows = [v for g in groups for v in (g.token_versions if g.token_versions is not None else
                                         [np.full(len(r), g.weight_step, np.int32) for r in g.response_ids])]
    return Ragged.from_rows(rows, np.int32)


def version_stats(groups: Sequence[Group], trained_version: int, staleness: int,
                  max_versions: int) -> dict[str, float]:
    """Per step: the histogram of staleness (versions behind: ``trained_version`` - the version a group started
    under) over the batch's groups, ``rollout/staleness_hist/0..staleness``, and of the versions each response spans,
    ``rollout/versions_spanned_hist/1..max_versions`` (fractions of groups / responses; ``..._hist/>`` counts what lies
    beyond the bound: 0 whenever it holds), plus ``rollout/staleness_max`` / ``rollout/versions_spanned_max``."""
    if not groups:
        return {}
    behind = [trained_version - g.weight_step for g in groups]
    spans = [max(1, len(np.unique(v))) for g in groups if g.token_versions is not None for v in g.token_versions]
    spans += [1] * sum(len(g.response_ids) for g in groups if g.token_versions is None)
    out = {f"rollout/staleness_hist/{d}": sum(b == d for b in behind) / len(behind) for d in range(staleness + 1)}
    out["rollout/staleness_hist/>"] = sum(b > staleness for b in behind) / len(behind)
    out.update({f"rollout/versions_spanned_hist/{n}": sum(s == n for s in spans) / len(spans)
                for n in range(1, max_versions + 1)})
    out["rollout/versions_spanned_hist/>"] = sum(s > max_versions for s in spans) / len(spans)
    out["rollout/staleness_max"] = float(max(behind))
    out["rollout/versions_spanned_max"] = float(max(spans))
    return out


def group_stats(groups: Sequence[Group], max_response_length: int, prefix: str) -> dict[str, float]:
    """Accuracy, reward, p_hat histogram, per-bucket accuracy and lengths over ``groups`` (prefix e.g. 'gen')."""
    if not groups:
        return {}
    acc = [a > 0 for g in groups for a in g.acc]
    rewards = [r for g in groups for r in g.rewards]
    lengths = [len(r) for g in groups for r in g.response_ids]
    out = {
        f"{prefix}/acc": sum(acc) / len(acc),
        f"{prefix}/reward": sum(rewards) / len(rewards),
        f"{prefix}/response_length_mean": sum(lengths) / len(lengths),
        f"{prefix}/response_length_max": float(max(lengths)),
        f"{prefix}/overlong_frac": sum(n >= max_response_length for n in lengths) / len(lengths),
        f"{prefix}/truncated_frac": sum(f == "length" for g in groups for f in g.finish_reasons) / len(lengths),
    }
    p = [g.p_hat for g in groups]
    for lo, hi in zip(P_HAT_BINS[:-1], P_HAT_BINS[1:]):
        last = hi == 1.0
        n = sum(lo <= x < hi or (last and x == 1.0) for x in p)
        out[f"{prefix}/p_hat_hist/{lo:.3f}-{hi:.3f}"] = n / len(p)
    out[f"{prefix}/p_hat_all_correct_frac"] = sum(x == 1.0 for x in p) / len(p)
    out[f"{prefix}/p_hat_all_wrong_frac"] = sum(x == 0.0 for x in p) / len(p)
    by_bucket: dict[Any, list[bool]] = defaultdict(list)
    for g in groups:
        by_bucket[g.bucket].extend(a > 0 for a in g.acc)
    for b, vals in sorted(by_bucket.items(), key=lambda kv: str(kv[0])):
        out[f"{prefix}/acc_bucket/{b}"] = sum(vals) / len(vals)
        # the share of the groups from this bucket (the batch/ one: what the policy trains on, e.g. how many hard
        # prompts an asynchronous run keeps against the synchronous one; issue 37, da3po_megatron/bench/async_rl.py)
        out[f"{prefix}/group_frac_bucket/{b}"] = sum(g.bucket == b for g in groups) / len(groups)
    return out


def theory_stats(all_groups: Sequence[Group], kept_groups: Sequence[Group], eps: float) -> dict[str, float]:
    """Thm 3.1 diagnostic: mean advantage of correct / incorrect responses, per p_hat bin, over ALL generated groups
    (uniform groups contribute zeros, as they would without filtering) vs the KEPT groups, with alpha+/alpha- at the
    bin's mean p_hat of the kept groups.

    What it shows, and what it cannot: a uniform group's advantages are exactly 0, so in one batch the kept/all ratio
    is, by construction, (responses of that label in all groups) / (those in kept groups) -- the inverse of the
    fraction of correct (incorrect) responses that survive filtering. Thm 3.1 says that this fraction is
    1 - p^(G-1) (1 - (1-p)^(G-1)) in expectation for prompts of success probability p, so the ratio approaches
    alpha+ (alpha-) only when the bin's prompts share one p. A batch mixes prompts: ones the policy never solves
    (p ~ 0) add incorrect responses that are never kept, so the incorrect ratio of the p_hat < 0.5 bin comes out well
    above alpha- (4-6 in the CPU comparison). The theorem itself is checked by Monte Carlo at known p
    (`algorithms.theory`, tests/test_theory.py); this is a description of the run, not a test of it."""
    if not all_groups:
        return {}
    G = len(all_groups[0].acc)
    out: dict[str, float] = {}
    p_mean = sum(g.p_hat for g in all_groups) / len(all_groups)
    if 0 < p_mean < 1:
        out["theory/alpha_plus"] = float(alpha_plus(p_mean, G))
        out["theory/alpha_minus"] = float(alpha_minus(p_mean, G))
        out["theory/gamma"] = float(gamma(p_mean, G))
    out["theory/p_hat_mean"] = p_mean

    def mean_adv(groups: Sequence[Group], correct: bool) -> tuple[float, int]:
        if not groups:
            return 0.0, 0
        r = torch.tensor([x for g in groups for x in g.acc], dtype=torch.float64)
        adv = group_advantages(r, G, eps=eps)
        sel = (r > 0) if correct else (r <= 0)
        return (adv[sel].mean().item() if sel.any() else 0.0), int(sel.sum())

    for lo, hi in ((0.0, 0.5), (0.5, 1.0)):
        name = f"{lo:.1f}-{hi:.1f}"
        in_bin = [g for g in all_groups if lo < g.p_hat < hi or (hi == 1.0 and g.p_hat == 1.0) or
                  (lo == 0.0 and g.p_hat == 0.0)]
        kept = [g for g in kept_groups if lo <= g.p_hat < hi]
        for label, corr in (("correct", True), ("incorrect", False)):
            a_all, _ = mean_adv(in_bin, corr)
            a_kept, n = mean_adv(kept, corr)
            out[f"theory/{name}/adv_{label}_all"] = a_all
            out[f"theory/{name}/adv_{label}_kept"] = a_kept
            out[f"theory/{name}/n_{label}_kept"] = float(n)
        pb = [g.p_hat for g in kept]
        if pb:
            pm = sum(pb) / len(pb)
            out[f"theory/{name}/alpha_plus"] = float(alpha_plus(pm, G))
            out[f"theory/{name}/alpha_minus"] = float(alpha_minus(pm, G))
    return out


# ------------------------------------------------------------------------------------------------ one step's data


@dataclass
class StepRollout:
    """What generation hands to one training step (collect, the producer, replay and the checkpoint's prefetched
    batches all hold this, so it lives here, below them)."""

    groups: list[Group]  # the training batch: exactly data.train_batch_size kept groups
    generated: list[Group]  # every scored group of the step (kept, filtered, surplus); never aborted ones
    stats: dict[str, float]  # dynamic_sampling/* and rollout/* counters of this collection
    weight_step: int  # the policy step whose weights the engines held while generating it
    phase_seconds: dict[str, float] = field(default_factory=dict)  # generate / reward of this collection


def rollout_to_dict(r: StepRollout) -> dict[str, Any]:
    """A prefetched batch as plain data (checkpoints load with ``torch.load(weights_only=True)``)."""
    return {"groups": [group_to_dict(g) for g in r.groups], "generated": [group_to_dict(g) for g in r.generated],
            "stats": dict(r.stats), "weight_step": int(r.weight_step), "phase_seconds": dict(r.phase_seconds)}


def rollout_from_dict(d: dict[str, Any]) -> StepRollout:
    return StepRollout([group_from_dict(g) for g in d["groups"]], [group_from_dict(g) for g in d["generated"]],
                       dict(d["stats"]), int(d["weight_step"]), dict(d.get("phase_seconds", {})))
