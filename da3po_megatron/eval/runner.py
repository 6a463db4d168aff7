"""The evaluation behind `da3po eval` and the trainer's periodic evaluation: sample k responses per benchmark
problem with vLLM, verify them, report avg@k / pass@k.

Protocol (paper Sec. 4, Tables 1-2): temperature 1.0, top-p 0.95, k = 32 for AIME24/25/26 and AMC, k = 8 for
Minerva, OlympiadBench and MATH-500 (``data.benchmarks.PROTOCOL``); avg@k = mean accuracy of the k samples, pass@k =
unbiased estimator of Chen et al. 2021 (``eval.metrics``); "Average" = unweighted mean over benchmarks. A response is
correct when the reward verifier (math-verify, ``rewards.RewardPool`` kind ``math``) gives R_acc > 0; the overlong
shaping term R_len (DAPO Eq. 8) is a training signal and plays no part here.

``evaluate(client, benchmarks, ...)`` is the in-process entry, called by the command (:mod:`.command`) and by the
trainer for periodic evaluation with its own rollout client (weights already synced); ``flat_metrics(result)`` turns
its result into ``eval/<bench>/avg@k``-style scalars for the trainer's metrics.jsonl; ``write_results`` writes
results.json, results.md and samples/<b>.jsonl. Like verl and NeMo-RL, generation goes through the same vLLM engines
as training rollouts.

Left out on purpose: majority voting, per-problem token-budget sweeps, and any answer post-processing other than the
verifier's own extraction (the last ``\\boxed{}`` or DAPO ``Answer:`` line).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from da3po_megatron.data.benchmarks import (
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    PROTOCOL,
    canonical_name,
    load_benchmark,
)
from da3po_megatron.eval.metrics import average_scores, score_benchmark

__all__ = ["evaluate", "flat_metrics", "parse_k", "write_results"]

DEFAULT_MAX_TOKENS = 4096  # the paper's response budget during training (4K)


def parse_k(spec: str | int | None, benchmarks: Sequence[str]) -> dict[str, int]:
    """Per-benchmark k: the paper's protocol, overridden by ``spec`` = ``8`` (all) or ``aime24=4,math500=2``."""
    ks = {b: PROTOCOL.get(b, 8) for b in benchmarks}
    if spec is None or spec == "":
        return ks
    if isinstance(spec, int) or str(spec).strip().isdigit():
        return {b: _positive_k(spec, "--k") for b in benchmarks}
    for item in str(spec).split(","):
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--k: expected an integer or NAME=K pairs, got {item!r}")
        b = _name(name.strip())
        if b not in ks:
            raise ValueError(f"--k: {b!r} is not among the evaluated benchmarks {list(ks)}")
        ks[b] = _positive_k(value, f"--k {b}")
    return ks


def _positive_k(value: Any, what: str) -> int:
    try:
        k = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: k must be an integer, got {value!r}") from None
    if k < 1:
        raise ValueError(f"{what}: k must be >= 1, got {k}")
    return k


def _prompt_text(problem: str, template: str) -> str:
    from da3po_megatron.data.templates import format_prompt

    return format_prompt(problem, template)[-1]["content"]


def _fields(p: Any, where: str) -> tuple[str, str, str]:
    """(id, problem text, answer) of a ``BenchmarkProblem``, a ``data.datasets.Example`` (uid, prompt, answer) or a
    dict with the same names."""
    get = p.get if isinstance(p, Mapping) else lambda key, default=None: getattr(p, key, default)
    pid, text, answer = get("id", get("uid")), get("problem", get("prompt")), get("answer")
    if isinstance(text, list):  # chat messages: the last user turn (use template="none" for pre-templated data)
        users = [m.get("content") for m in text if isinstance(m, Mapping) and m.get("role", "user") == "user"]
        text = users[-1] if users else None
    if not isinstance(text, str) or not isinstance(answer, str):
        raise TypeError(f"{where}: expected a problem with string problem/prompt and answer, got {p!r:.200}")
    return str(pid), text, answer


def _name(b: str) -> str:
    """Canonical benchmark name when known (aliases resolve); other names (the synthetic task) pass unchanged."""
    try:
        return canonical_name(b)
    except KeyError:
        return b


def evaluate(
    client: Any,
    benchmarks: Sequence[str] | Mapping[str, Sequence[Any]],
    *,
    k: int | str | Mapping[str, int] | None = None,
    limit: int | None = None,
    data_dir: str | os.PathLike | None = None,
    template: str = "boxed",
    temperature: float = DEFAULT_TEMPERATURE,
    top_p: float = DEFAULT_TOP_P,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    apply_chat_template: bool = True,
    reward_pool: Any | None = None,
    reward_kind: str = "math",
    batch_size: int | None = None,
    seed: int | None = None,
    progress: bool = True,
    keep_responses: bool = False,
) -> dict:
    """Evaluate the policy behind ``client`` (a ``rollout.RolloutClient``) on ``benchmarks``; returns the result dict.

    ``benchmarks``: names (read with ``load_benchmark(name, data_dir, limit)``) or {name: problems}, where a problem
    is a ``BenchmarkProblem``, a ``data.datasets.Example`` or a dict (id/uid, problem/prompt, answer). ``k``: None =
    the paper's protocol (8 for names outside it), an int for all, or a {name: k} mapping / ``"name=k,..."`` string.
    ``template``: ``boxed`` | ``dapo`` | ``none`` (``data.templates``). ``reward_pool``: a ``rewards.RewardPool`` to
    reuse (the trainer's); a temporary one is started and closed otherwise. ``reward_kind``: the pool's verifier
    (``math``; ``synthetic`` for the toy task).
    ``batch_size`` prompts go to the engines per ``generate`` call (each with k samples); the progress bar advances
    after every call, so it moves per finished group of problems. None = 64 with CUDA, 4 on CPU (a CPU engine takes
    minutes per batch of long responses: 50 problems in one call once left the bar at 0 % for 11 minutes).
    Reward errors and timeouts are counted per benchmark (``reward_errors`` / ``reward_timeouts`` in the result, a
    warning on stderr when any occurred); a broken pool raises ``rewards.RewardPoolError``.
    ``seed``: per-request sampling seeds (problem i of a benchmark draws from ``seed + i * k``), so results do not
    depend on batch size or engine count; None = the engines' own generators. The result carries per-problem
    correctness (``samples``) for ``write_results``.
    """
    import torch
    from tqdm.auto import tqdm

    from da3po_megatron.rollout import SamplingConfig

    if batch_size is None:
        batch_size = 64 if torch.cuda.is_available() else 4
    if batch_size < 1:
        raise ValueError(f"evaluate: batch_size must be >= 1, got {batch_size}")

    if isinstance(benchmarks, Mapping):
        problem_sets = {_name(b): list(ps)[:limit] if limit else list(ps) for b, ps in benchmarks.items()}
    else:
        problem_sets = {canonical_name(b): load_benchmark(b, data_dir, limit) for b in benchmarks}
    if not problem_sets:
        raise ValueError("evaluate: no benchmarks given")
    ks = dict(k) if isinstance(k, Mapping) else parse_k(k, list(problem_sets))
    ks = {_name(b): _positive_k(v, f"k[{b}]") for b, v in ks.items()}
    missing = [b for b in problem_sets if b not in ks]
    if missing:
        raise ValueError(f"evaluate: no k given for {missing}")

    own_pool = reward_pool is None
    if own_pool:
        from da3po_megatron.rewards import RewardPool, default_num_workers

        reward_pool = RewardPool(num_workers=default_num_workers(), timeout_s=10.0)
    t_start = time.perf_counter()
    result: dict[str, Any] = {
        "protocol": {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens, "template": template,
                     "apply_chat_template": apply_chat_template, "k": ks, "reward_kind": reward_kind, "seed": seed},
        "benchmarks": {}, "samples": {}, "timing": {},
    }
    total = sum(len(ps) for ps in problem_sets.values())
    bar = tqdm(total=total, desc="eval", unit="problem", disable=not progress, dynamic_ncols=True)
    try:
        for bench, problems in problem_sets.items():
            kb = ks[bench]
            bar.set_postfix_str(f"{bench} k={kb}")
            sampling = SamplingConfig(n=kb, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                      apply_chat_template=apply_chat_template, logprobs=False)
            t0 = time.perf_counter()
            gen_s = verify_s = 0.0
            rows: list[dict[str, Any]] = []
            num_tokens = truncated = reward_errors = reward_timeouts = 0
            for start in range(0, len(problems), batch_size):
                chunk = problems[start:start + batch_size]
                tg = time.perf_counter()
                fields = [_fields(p, f"evaluate[{bench}] problem {start + j}") for j, p in enumerate(chunk)]
                if seed is not None:  # SamplingConfig seeds prompt i of a call with seed + i * n
                    sampling.seed = seed + start * kb
                completions = client.generate([_prompt_text(text, template) for _, text, _ in fields], sampling)
                gen_s += time.perf_counter() - tg
                if len(completions) != len(chunk) or any(len(c) != kb for c in completions):
                    raise RuntimeError(f"evaluate[{bench}]: the rollout client returned "
                                       f"{[len(c) for c in completions]} completions for {len(chunk)} prompts x n={kb}")
                texts = [c.text for cs in completions for c in cs]
                answers = [answer for _, _, answer in fields for _ in range(kb)]
                tv = time.perf_counter()
                scored = reward_pool.score_batch(texts, answers, kind=reward_kind)
                verify_s += time.perf_counter() - tv
                reward_errors += scored.errors
                reward_timeouts += scored.timeouts
                for j, ((pid, _, answer), cs) in enumerate(zip(fields, completions)):
                    sl = slice(j * kb, (j + 1) * kb)
                    row = {"id": pid, "answer": answer,
                           "correct": [int(r > 0) for r in scored.rewards[sl]],
                           "extracted": [info.get("extracted") for info in scored.infos[sl]],
                           "num_tokens": [len(c.token_ids) for c in cs],
                           "finish_reason": [c.finish_reason for c in cs]}
                    if keep_responses:
                        row["responses"] = [c.text for c in cs]
                    rows.append(row)
                    num_tokens += sum(row["num_tokens"])
                    truncated += sum(fr == "length" for fr in row["finish_reason"])
                bar.update(len(chunk))
            score = score_benchmark(bench, [r["correct"] for r in rows], k=kb)
            entry = score.to_dict()
            n_samples = len(rows) * kb
            entry.update(mean_response_tokens=num_tokens / n_samples, truncated_frac=truncated / n_samples,
                         reward_errors=reward_errors, reward_timeouts=reward_timeouts)
            if reward_errors or reward_timeouts:
                print(f"warning: evaluate[{bench}]: {reward_errors} of {n_samples} answers could not be verified "
                      f"(reward errors) and {reward_timeouts} timed out; they count as wrong", file=sys.stderr,
                      flush=True)
            result["benchmarks"][bench] = entry
            result["samples"][bench] = rows
            result["timing"][bench] = {"total_s": time.perf_counter() - t0, "generate_s": gen_s, "verify_s": verify_s}
    finally:
        bar.close()
        if own_pool:
            reward_pool.close()
    from da3po_megatron.eval.metrics import BenchmarkScore

    scores = [BenchmarkScore(**{f: v for f, v in e.items() if f in BenchmarkScore.__dataclass_fields__})
              for e in result["benchmarks"].values()]
    result["average"] = average_scores(scores)
    result["timing"]["total_s"] = time.perf_counter() - t_start
    return result


def flat_metrics(result: Mapping[str, Any], prefix: str = "eval") -> dict[str, float]:
    """Scalars for the trainer's metrics.jsonl.

    Keys: ``eval/<bench>/avg@k``, ``eval/<bench>/pass@k`` (the literal ``k`` keeps keys stable across configs; the
    value of k is ``eval/<bench>/k``), and the benchmark averages ``eval/avg/avg@k``, ``eval/avg/pass@k``.
    """
    out: dict[str, float] = {}
    for bench, s in result["benchmarks"].items():
        out[f"{prefix}/{bench}/avg@k"] = float(s["avg_at_k"])
        out[f"{prefix}/{bench}/pass@k"] = float(s["pass_at_k"])
        out[f"{prefix}/{bench}/k"] = float(s["k"])
    if "average" in result:
        out[f"{prefix}/avg/avg@k"] = float(result["average"]["avg_at_k"])
        out[f"{prefix}/avg/pass@k"] = float(result["average"]["pass_at_k"])
    return out


def write_results(result: Mapping[str, Any], out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write results.json (without the per-sample rows), results.md and samples/<bench>.jsonl under ``out_dir``."""
    from da3po_megatron.eval.tables import render_table

    out = Path(out_dir)
    (out / "samples").mkdir(parents=True, exist_ok=True)
    summary = {key: v for key, v in result.items() if key != "samples"}
    summary["benchmarks"] = {}
    for bench, entry in result["benchmarks"].items():
        rows = result.get("samples", {}).get(bench, [])
        summary["benchmarks"][bench] = dict(entry, correct=[r["correct"] for r in rows]) if rows else dict(entry)
    paths = {"json": out / "results.json", "markdown": out / "results.md"}
    paths["json"].write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    paths["markdown"].write_text(render_table([summary], ci=True), encoding="utf-8")
    for bench, rows in result.get("samples", {}).items():
        path = out / "samples" / f"{bench}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        paths[f"samples/{bench}"] = path
    return paths
