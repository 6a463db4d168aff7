"""Evaluation: avg@k and unbiased pass@k (``metrics``), the benchmark runner (``runner``: ``evaluate``, also the
trainer's periodic evaluation), the `da3po eval` command (``command``) and paper-style Markdown tables (``tables``).
Benchmark files and the paper's protocol live in ``data.benchmarks``."""

from da3po_megatron.eval.metrics import (
    BenchmarkScore,
    average_scores,
    avg_at_k,
    pass_at_k,
    per_problem_pass_at_k,
    score_benchmark,
    standard_error,
)
from da3po_megatron.eval.runner import evaluate, flat_metrics, write_results
from da3po_megatron.eval.tables import render_table

__all__ = [
    "BenchmarkScore",
    "average_scores",
    "avg_at_k",
    "evaluate",
    "flat_metrics",
    "pass_at_k",
    "per_problem_pass_at_k",
    "render_table",
    "score_benchmark",
    "standard_error",
    "write_results",
]
