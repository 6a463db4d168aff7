#!/usr/bin/env python
"""Benchmark rollout generation: generated tokens per second for given prompts x n samples x response length.

Builds engines through ``RolloutClient`` exactly as the trainer does (in-process, or one Ray actor per engine with
``--ray``), warms up once, then times ``--repeats`` calls of ``generate`` on ``--prompts`` synthetic prompts of about
``--prompt-len`` characters, n samples each, up to ``--max-tokens`` tokens (``--ignore-eos`` forces every response to
full length, so the token count is fixed). Reports median wall time, generated tokens/s, prompt tokens/s and
responses/s, as a table and one JSON line.

    da3po bench rollout                                   # tiny random Qwen3 built on the fly (CPU)
    da3po bench rollout --model /ckpt/Qwen3-4B-Base --dtype bfloat16 --prompts 512 --n 16 \\
        --max-tokens 4096 --engines 8 --ray --tp 1                   # a paper-sized step on a GPU node
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: build the tiny random Qwen3)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (group size G)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64, help="approximate prompt length in characters")
    ap.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1, help="vLLM tensor_parallel_size per engine")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--ray", action="store_true", help="one Ray actor per engine (default: in-process engines)")
    ap.add_argument("--kv-cache-mb", type=int, default=None, help="KV cache per engine, MiB (CPU default 256)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def prompts(count: int, length: int) -> list[str]:
    base = "Find the sum of all integers k such that {i} <= k <= {j}, and explain every step. "
    out = []
    for i in range(count):
        text = base.format(i=i, j=i + 17)
        out.append((text * (length // len(text) + 1))[:length])
    return out


def main(argv=None) -> dict:
    args = parse(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from da3po_megatron.rollout import EngineConfig, RolloutClient, SamplingConfig

    model = args.model
    if model is None:
        from da3po_megatron.tiny import build_model

        model = str(build_model(tempfile.mkdtemp(prefix="bench_rollout_") + "/qwen3", seed=0))
    cfg = EngineConfig(model, tensor_parallel_size=args.tp, dtype=args.dtype,
                       kv_cache_memory_bytes=args.kv_cache_mb * 2**20 if args.kv_cache_mb else None,
                       gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed)
    t0 = time.perf_counter()
    if args.ray:
        import ray

        from da3po_megatron.trainer.cluster.bringup import start_local_ray

        if not ray.is_initialized():
            if "RAY_ADDRESS" in os.environ:
                ray.init(address=os.environ["RAY_ADDRESS"], include_dashboard=False, log_to_driver=False)
            else:  # Ray's default logical CPUs: the machine's cores
                start_local_ray(None, os.cpu_count() or 1, log_to_driver=False)
        client = RolloutClient.ray(cfg, args.engines)
    else:
        client = RolloutClient.local(cfg, args.engines)
    startup = time.perf_counter() - t0
    try:
        ps = prompts(args.prompts, args.prompt_len)
        sampling = SamplingConfig(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature,
                                  seed=args.seed, ignore_eos=args.ignore_eos)
        client.generate(ps[: max(1, min(len(ps), 2))], sampling)  # warm-up
        times, gen_tokens, prompt_tokens, responses = [], 0, 0, 0
        for _ in range(args.repeats):
            t = time.perf_counter()
            out = client.generate(ps, sampling)
            times.append(time.perf_counter() - t)
            gen_tokens = sum(c.num_tokens for g in out for c in g)
            prompt_tokens = sum(len(g[0].prompt_token_ids) for g in out)
            responses = sum(len(g) for g in out)
    finally:
        client.shutdown()
    wall = statistics.median(times)
    result = {
        "bench": "rollout", "model": model, "engines": args.engines, "tp": args.tp, "ray": args.ray,
        "dtype": args.dtype, "prompts": args.prompts, "n": args.n, "max_tokens": args.max_tokens,
        "startup_s": round(startup, 2), "wall_s": round(wall, 4), "generated_tokens": gen_tokens,
        "prompt_tokens": prompt_tokens, "tokens_per_s": round(gen_tokens / wall, 1),
        "prompt_tokens_per_s": round(prompt_tokens / wall, 1), "responses_per_s": round(responses / wall, 2),
        "mean_response_tokens": round(gen_tokens / max(responses, 1), 1),
    }
    print(f"engines={args.engines} (tp={args.tp}, {'ray' if args.ray else 'in-process'}) prompts={args.prompts} "
          f"n={args.n} max_tokens={args.max_tokens}")
    print(f"  start-up {startup:.1f} s; generate median {wall:.3f} s over {args.repeats}: {gen_tokens} tokens "
          f"-> {result['tokens_per_s']:.0f} tok/s ({result['responses_per_s']:.1f} responses/s, mean "
          f"{result['mean_response_tokens']:.1f} tokens)")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
