"""One step's metrics from its parts, as pure functions of the batch, the timings and the counters (verl's
``metric_utils.py`` manner): what ``trainer/loop.py`` logs per step -- generation and batch statistics, dynamic
sampling, staleness and versions, DAA and the theory's alpha, the mismatch, the update, the sync, phase times and
throughput, selection. Testable alone; split from ``Run.step_metrics`` (issue 56)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from da3po_megatron.config import Config
from da3po_megatron.data.selection import selection_batch_metrics
from da3po_megatron.trainer import batch as B
from da3po_megatron.trainer.batch import StepRollout


def step_metrics(cfg: Config, step: int, rollout: StepRollout, daa: dict[str, float], mismatch: dict[str, float],
                 train_metrics: dict[str, Any], sync: dict[str, Any], phase_seconds: dict[str, float],
                 step_seconds: float, totals: dict[str, int], data_skipped_rows: int = 0,
                 selection_metrics: dict[str, float] | None = None) -> dict[str, float]:
    """The metrics of step ``step`` (logged once per step) from its parts: the collection (``rollout``), DAA's
    statistics, pi_old's mismatch, the update's and the sync's metrics, the phase times, and the run's cumulative
    counters (``totals``: the sampler's generation counters and the update counters) -- a pure function."""
    groups, generated = rollout.groups, rollout.generated
    m: dict[str, float] = {}
    m.update(B.group_stats(generated, cfg.rollout.max_response_length, "gen"))
    m.update(B.group_stats(groups, cfg.rollout.max_response_length, "batch"))
    m["acc/mean"] = m.get("gen/acc", 0.0)
    m["reward/mean"] = m.get("gen/reward", 0.0)
    s = rollout.stats
    m.update(s)
    versions = [g.weight_step for g in groups]
    m["rollout/weight_step_min"], m["rollout/weight_step_max"] = float(min(versions)), float(max(versions))
    m["rollout/staleness"] = float(step - 1 - min(versions))  # policy step trained from - generating step
    m.update(B.version_stats(groups, step - 1, cfg.rollout.staleness, cfg.rollout.max_versions_per_response))
    if cfg.rollout.staleness >= 1 or cfg.rollout.partial_rollouts:  # at staleness 0 every one is 0: not logged
        m.update(staleness_by_difficulty(groups, step - 1))
    m["gen/rounds"] = s["dynamic_sampling/rounds"]
    m["gen/groups"] = s["dynamic_sampling/generated_groups"]
    m["filter/kept_groups"] = s["dynamic_sampling/kept_groups"]
    gen = max(s["dynamic_sampling/generated_groups"], 1.0)
    m["filter/frac_filtered"] = (s["dynamic_sampling/discarded_all_correct_groups"]
                                 + s["dynamic_sampling/discarded_all_wrong_groups"]) / gen
    m["gen/cumulative_samples"] = float(totals["samples"])
    m["gen/cumulative_tokens"] = float(totals["tokens"])
    m["gen/cumulative_groups"] = float(totals["groups"])
    m["reward/timeouts_total"] = float(totals["reward_timeouts"])
    m["reward/errors_total"] = float(totals["reward_errors"])
    m["train/skipped_updates_total"] = float(totals["skipped_updates"])
    m["data/skipped_rows"] = float(data_skipped_rows)
    m.update(daa)
    m.update(B.theory_stats(generated, groups, cfg.algorithm.advantage_eps))
    m.update({k: float(v) for k, v in mismatch.items()})
    m.update({f"train/{k}": float(v) for k, v in train_metrics.items() if isinstance(v, int | float)})
    m["train/loss_backend"] = train_metrics.get("loss_backend")  # what computed the loss, e.g. "kernel:triton"
    m.update({f"sync/{k}": float(v) for k, v in sync.items() if isinstance(v, int | float)})
    m.update({f"time/{k}": v for k, v in phase_seconds.items()})
    m["time/step"] = step_seconds
    n_tok = sum(len(r) for g in generated for r in g.response_ids)
    m["perf/rollout_tokens_per_s"] = n_tok / max(phase_seconds.get("generate", 0.0), 1e-9)
    m.update(selection_batch_metrics([g.bucket for g in groups], len(generated), n_tok))
    m.update(selection_metrics or {})  # data.selection: skipped prompts per tail, exploration rates
    return m


def p_hat_band(p: float) -> str:
    """The quarter of [0, 1] p_hat falls in, as ``lo-hi`` (kept groups: 0 < p_hat < 1; DAA's tau = 0.5 is a border)."""
    lo = min(int(p * 4), 3) / 4
    return f"{lo:.2f}-{lo + 0.25:.2f}"


def staleness_by_difficulty(groups: Sequence[B.Group], trained_version: int) -> dict[str, float]:
    """Issue 58 point 2: per difficulty bucket (``Group.bucket``) and per p_hat band (:func:`p_hat_band`) of the
    batch's groups, ``rollout/staleness_{bucket,p_hat}/<key>`` = the mean staleness in versions (``trained_version`` -
    the version the group started under) and ``rollout/behaviour_age_{bucket,p_hat}/<key>`` = the mean age in
    versions of the behaviour policy of its response tokens (``trained_version`` - the version that sampled each
    token: per token with partial rollouts, else the group's start), token-weighted. Out-of-order release
    (``rollout.release_order=oldest_decided``) makes long, hard groups the stalest; these say by how much."""
    acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])  # groups, staleness, tokens, age
    for g in groups:
        behind = trained_version - g.weight_step
        if g.token_versions is not None:
            tokens = float(sum(len(v) for v in g.token_versions))
            age = float(sum(trained_version * len(v) - int(np.sum(v, dtype=np.int64)) for v in g.token_versions))
        else:
            tokens = float(sum(len(r) for r in g.response_ids))
            age = behind * tokens
        for key in (f"bucket/{g.bucket}", f"p_hat/{p_hat_band(g.p_hat)}"):
            a = acc[key]
            a[0], a[1], a[2], a[3] = a[0] + 1, a[1] + behind, a[2] + tokens, a[3] + age
    out = {}
    for key, (n, behind, tokens, age) in sorted(acc.items()):
        out[f"rollout/staleness_{key}"] = behind / n
        out[f"rollout/behaviour_age_{key}"] = age / tokens if tokens else behind / n
    return out
