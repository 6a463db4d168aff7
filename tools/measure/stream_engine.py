"""One engine, in-process: ``LLM.generate`` against the request-level streaming loop (``VLLMEngine.stream``) on the
same prompts, seeds and per-prompt lengths, so the engine-side cost of streaming is measured alone (no Ray, no driver
scoring, no abort). Tiny random Qwen3 (hidden 128, 2 layers), 32 prompts x 8 samples, lengths uniform in [8, 64].

    python tools/measure/stream_engine.py [--prompts 32] [--n 8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from da3po_megatron.rollout import EngineConfig, SamplingConfig
    from da3po_megatron.rollout.engine import VLLMEngine
    from da3po_megatron.tiny import build_model

    work = tempfile.mkdtemp(prefix="bench_stream_")
    d = build_model(f"{work}/model", "qwen3", seed=0, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
    eng = VLLMEngine(EngineConfig(str(d), dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=256), 0)
    rng = random.Random(0)
    prompts = [" ".join(str(rng.randint(0, 9)) for _ in range(8)) for _ in range(args.prompts)]
    lens = [rng.randint(args.max_len // 8, args.max_len) for _ in prompts]
    s = SamplingConfig(n=args.n, max_tokens=args.max_len, seed=1, ignore_eos=True)
    eng.generate(prompts[:4], list(range(4)), s)  # warm-up
    print("| repeat | generate s | tokens | stream s | stream calls | stream / generate |\n|---|---|---|---|---|---|")
    for rep in range(args.repeats):
        t0 = time.perf_counter()
        out = eng.generate(prompts, list(range(len(prompts))), s, max_tokens=lens)
        t_gen = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = eng.stream([(f"r{rep}p{i}", p, i, lens[i]) for i, p in enumerate(prompts)], s)
        calls, tokens = 1, res["decoded"]
        while res["running"]:
            res = eng.stream([], s)
            calls, tokens = calls + 1, tokens + res["decoded"]
        t_st = time.perf_counter() - t0
        assert tokens == sum(len(c.token_ids) for c in out)
        print(f"| {rep} | {t_gen:.2f} | {tokens} | {t_st:.2f} | {calls} | {t_st / t_gen:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
