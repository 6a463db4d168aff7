"""Compute-matched algorithm comparison: a grid of {method} x {seed} training runs through the real trainer, and the
report that answers "does DAA help?" at equal training steps AND at equal generated samples.

Why two axes: dynamic sampling (DAPO, DA3PO) throws away groups with p_hat in {0, 1} and over-samples prompts until the
batch is full, so one of its steps costs more generated samples (and tokens) than a GRPO/GSPO step. The paper compares
checkpoints at equal steps; a user paying for generation also wants equal samples. Both are reported.

What the report holds (all numbers are mean +- std over seeds, std with ddof=1). "Held-out metric" is whatever the
runs logged (:mod:`~da3po_megatron.studies.compare.keys`): on the synthetic task avg@k and greedy accuracy per
difficulty bucket; on math benchmarks (``eval.benchmarks: [aime24, amc, ...]``) avg@k and pass@k per benchmark with
their mean as "all". Below, "group" is a bucket or a benchmark.

- **equal steps**: at the last step where every run has a held-out evaluation, held-out metrics overall and per
  group, and training (rollout) accuracy, per difficulty bucket where the data has buckets (trailing mean of the last
  ``window`` steps, because one step's rollout accuracy is noisy);
- **equal generated samples**: at budgets B (default: the largest budget every run reached, and half of it), each
  run's curve is **linearly interpolated** in ``gen/cumulative_samples`` (responses generated so far, filtered groups
  and discarded surplus included). Held-out curves are interpolated between their evaluation points (the step-0 record
  holds the starting policy's eval at 0 samples); training curves are the trailing-mean series interpolated the same
  way. No extrapolation: a run that did not reach B has no value at B (and B is chosen so that every run reached it);
- **verdict**: each method with DAA (Eq. 14) against the same algorithm without DAA (da3po vs dapo; grpo:lambda vs
  grpo; ...), and against the other baselines, on the held-out metric overall and on the *hard* groups (those
  where the starting policy's held-out metric is below ``daa.tau`` = 0.5, the p_hat < tau regime where DAA acts). A
  difference of seed means counts as significant only beyond ``z`` (= 2) standard errors, SE = sqrt(s_a^2/n_a +
  s_b^2/n_b); with three seeds this is a coarse screen, and the text says so. The verdict sentences are generated from
  the numbers; nothing is hard-coded;
- PNG curves (mean line, +-std band over seeds): training accuracy vs steps / generated samples / generated tokens,
  held-out metrics vs steps / samples (overall and per group), held-out metric per group at equal steps, the filtered
  fraction, DAA activation, and the Theorem 3.1 diagnostic (mean advantage on kept / all groups vs alpha+ / alpha-);
- the raw ``metrics.jsonl`` of every run, copied.

The grid runner starts ``python -m da3po_megatron.cli train --config BASE model.path=... trainer.run_dir=...
trainer.seed=... trainer.total_steps=... <method overrides>`` per run, sequentially; it is resumable: a run whose
``DONE`` marker or ``metrics.jsonl`` shows the requested final step is skipped, an unfinished one is simply started
again (the trainer resumes from its latest checkpoint). The warm-up starting policy (:mod:`da3po_megatron.data.warmup`)
is built once and shared by every run.

Left out: parallel runs (2 cores), significance tests beyond the 2-SE screen (no t-distribution, no multiple-comparison
correction), wall-clock-matched comparisons.

Where each part lives (this module re-exports their public names, so ``from da3po_megatron.studies import compare``
is the whole API): the grid, its runner and the warm-up in :mod:`~da3po_megatron.studies.compare.grid`; the held-out
metric keys in :mod:`~da3po_megatron.studies.compare.keys`; interpolation,
seed statistics and the significance screen in :mod:`~da3po_megatron.studies.compare.stats` (pure functions); what
the report reads and its table points in :mod:`~da3po_megatron.studies.compare.data`; tables, verdict and
``report.md`` in :mod:`~da3po_megatron.studies.compare.report`; the PNG figures in
:mod:`~da3po_megatron.studies.compare.plots`.
"""

from da3po_megatron.studies.compare.data import ReportData, choose_points, prepare
from da3po_megatron.studies.compare.grid import (
    ALGORITHMS,
    DONE_MARKER,
    Method,
    RunSpec,
    Stop,
    ensure_warmup,
    grid_specs,
    last_step,
    load_grid,
    parse_method,
    parse_methods,
    run_grid,
    run_status,
    train_command,
    warmup_digest,
)
from da3po_megatron.studies.compare.keys import HeldOutKeys, discover
from da3po_megatron.studies.compare.plots import plot_report
from da3po_megatron.studies.compare.report import build_report, start_evals, verdict
from da3po_megatron.studies.compare.stats import (
    Comparison,
    Point,
    compare_means,
    curve_at,
    interp_at,
    mean_std,
    seed_values,
    series,
    trailing_mean,
)

__all__ = [
    "ALGORITHMS",
    "DONE_MARKER",
    "HeldOutKeys",
    "Comparison",
    "Method",
    "Point",
    "ReportData",
    "RunSpec",
    "Stop",
    "build_report",
    "choose_points",
    "compare_means",
    "curve_at",
    "discover",
    "ensure_warmup",
    "grid_specs",
    "interp_at",
    "last_step",
    "load_grid",
    "mean_std",
    "parse_method",
    "parse_methods",
    "plot_report",
    "prepare",
    "run_grid",
    "run_status",
    "seed_values",
    "series",
    "start_evals",
    "trailing_mean",
    "train_command",
    "verdict",
    "warmup_digest",
]
