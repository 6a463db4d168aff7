"""One step's metrics from its parts, as pure functions of the batch, the timings and the counters (verl's
``metric_utils.py`` manner): what ``trainer/loop.py`` logs per step -- generation and batch statistics, dynamic
sampling, staleness and versions, DAA and the theory's alpha, the mismatch, the update, the sync, phase times and
throughput, selection. Testable alone; split from ``Run.step_metrics`` (issue 56)."""

from __future__ import annotations

from typing import Any

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
