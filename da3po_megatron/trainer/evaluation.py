"""Periodic evaluation during training, through the run's own engines (already holding the current weights).

- Math benchmarks (``eval.benchmarks`` names such as aime24, math500): ``eval.runner.evaluate`` with the paper's
  protocol (avg@k / pass@k, temperature 1.0, top-p 0.95), logged as ``eval/<bench>/avg@k`` etc.
- ``synthetic``: the held-out split of the synthetic task (never trained on), per difficulty bucket: avg@k with
  sampling at the rollout temperature and greedy accuracy (``eval/synthetic/avg@k``, ``eval/synthetic/greedy``,
  ``eval/synthetic/bucket<n>/...``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from da3po_megatron.data.templates import render_prompt


def evaluate_synthetic(run: Any, k: int) -> dict[str, float]:
    from da3po_megatron.data.synthetic import make_synthetic_dataset, synthetic_reward
    from da3po_megatron.rollout import SamplingConfig

    cfg = run.cfg
    s = cfg.data.synthetic
    data = make_synthetic_dataset(s.eval_per_bucket, "heldout", seed=0, buckets=range(s.min_digits, s.max_digits + 1))
    prompts = [render_prompt(run.tokenizer, ex.prompt, cfg.data.apply_chat_template) for ex in data]
    out: dict[str, float] = {}
    modes = {f"avg@{k}": SamplingConfig(n=k, temperature=cfg.eval.temperature, top_p=cfg.eval.top_p,
                                        max_tokens=cfg.rollout.max_response_length, seed=12345,
                                        apply_chat_template=False, routes_fraction=0.0),
             "greedy": SamplingConfig(n=1, temperature=0.0, max_tokens=cfg.rollout.max_response_length,
                                      apply_chat_template=False, routes_fraction=0.0)}  # evaluation reads no routes
    for name, sampling in modes.items():
        comps = run.rollout.generate(prompts, sampling)
        per_bucket: dict[int, list[float]] = defaultdict(list)
        for ex, cs in zip(data, comps, strict=True):
            for c in cs:
                per_bucket[ex.meta["bucket"]].append(float(synthetic_reward(c.text, ex.answer)[0] > 0))
        all_vals = [v for vals in per_bucket.values() for v in vals]
        out[f"eval/synthetic/{name}"] = sum(all_vals) / len(all_vals)
        for b, vals in sorted(per_bucket.items()):
            out[f"eval/synthetic/bucket{b}/{name}"] = sum(vals) / len(vals)
    return out


def evaluate_during_training(run: Any) -> dict[str, float]:
    cfg = run.cfg
    out: dict[str, float] = {}
    benchmarks = [b for b in cfg.eval.benchmarks if b != "synthetic"]
    if "synthetic" in cfg.eval.benchmarks:
        out.update(evaluate_synthetic(run, cfg.eval.k or 8))
    if benchmarks:
        from da3po_megatron.eval.runner import evaluate, flat_metrics

        result = evaluate(run.rollout, benchmarks, k=cfg.eval.k, limit=cfg.eval.limit, template=cfg.eval.template,
                          data_dir=cfg.eval.data_dir or None, temperature=cfg.eval.temperature, top_p=cfg.eval.top_p,
                          max_tokens=cfg.rollout.max_response_length, reward_pool=run.rewards, progress=False)
        out.update(flat_metrics(result))
    return out
