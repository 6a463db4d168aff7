"""Measure a policy rank's real peak memory in a train step and compare it with the estimate (da3po_megatron/megatron/
memory.py). One fresh process per configuration (the peak RSS high-water mark cannot be reset): a single-rank
PolicyWorker (TP=PP=1, gloo) on the HF model, a batch of equal-length sequences that fills exactly one micro-batch of
``--tokens`` tokens, old log-probs then one train step; the measured peak is ``ru_maxrss`` at the end minus the RSS
just before the model is built (torch + megatron-core imported, parallel state up), i.e. what the estimate's
non-runtime terms predict.

    python tools/measure/policy_memory.py --hf DIR --tokens 512 1024 --seq-len 320 [--loss-backend torch]
        [--recompute selective|full] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

GiB = 2**30


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _one(args: argparse.Namespace, tokens: int) -> dict:
    import torch

    from da3po_megatron.bridge.hf_config import gpt_arch
    from da3po_megatron.config import standalone_policy_config
    from da3po_megatron.megatron.cpu_compat import apply_if_needed
    from da3po_megatron.megatron.memory import estimate_policy_memory
    from da3po_megatron.megatron.policy import PolicyBatch, PolicyWorker

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")  # one rank: init_parallel binds port 0 itself
    apply_if_needed()
    arch = gpt_arch(args.hf)
    backend = args.loss_backend if args.loss_backend in ("torch", "fused_linear") else "kernel"
    overrides = ["model.params_dtype=float32", f"actor.loss_backend={args.loss_backend}",
                 f"actor.max_tokens_per_microbatch={tokens}", f"actor.logprob_max_tokens_per_microbatch={tokens}",
                 f"rollout.temperature={args.temperature}", "actor.memory_check=skip"]
    if args.recompute:
        overrides.append(f"model.recompute_granularity={args.recompute}")
    if args.recompute == "full":
        overrides += ["model.recompute_method=uniform", "model.recompute_num_layers=1"]
    cfg = standalone_policy_config(args.hf, overrides)
    base = _rss()
    w = PolicyWorker(cfg, arch)
    after_build = _rss()
    n_seq = max(1, tokens // args.seq_len)
    prompt = args.seq_len // 4
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, arch.vocab_size, (n_seq, args.seq_len), generator=g).tolist()
    batch = PolicyBatch(prompt_ids=[r[:prompt] for r in ids], response_ids=[r[prompt:] for r in ids])
    batch.old_logprobs = w.compute_logprobs(batch)
    batch.advantages = [(-1.0) ** i for i in range(n_seq)]
    w.train_step(batch)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    est = estimate_policy_memory(arch, max_tokens_per_microbatch=tokens, max_seq_len=args.seq_len,
                                 recompute_granularity=args.recompute, loss_backend=backend,
                                 temperature_scaled=args.temperature != 1.0, logprob_max_tokens_per_microbatch=tokens)
    measured = peak - base
    predicted = est.total - est.components["runtime"]
    return {"tokens": tokens, "seq_len": args.seq_len, "sequences": n_seq, "loss_backend": args.loss_backend,
            "recompute": args.recompute, "baseline_rss_gib": base / GiB, "model_built_gib": (after_build - base) / GiB,
            "measured_peak_gib": measured / GiB, "estimate_gib": predicted / GiB,
            "error": (predicted - measured) / measured,
            "components_gib": {k: v / GiB for k, v in est.components.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", required=True, help="micro-batch token budgets to measure")
    ap.add_argument("--seq-len", type=int, default=320, help="prompt + response tokens of every sequence")
    ap.add_argument("--loss-backend", default="torch", help="torch | chunked | fused_linear")
    ap.add_argument("--recompute", default=None, choices=[None, "selective", "full"])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--json", default=None, help="append results (one JSON line each) to this file")
    ap.add_argument("--_one", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._one is not None:
        print("RESULT " + json.dumps(_one(args, args._one)), flush=True)
        return 0
    for t in args.tokens:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--_one", str(t)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        if r.returncode or not lines:
            print(f"tokens={t}: failed (exit {r.returncode})\n{r.stderr[-3000:]}", file=sys.stderr)
            return 1
        res = json.loads(lines[-1][7:])
        print(f"tokens {t:5d} seq {res['seq_len']} {res['loss_backend']:>12} recompute {res['recompute'] or 'off':>9}: "
              f"measured {res['measured_peak_gib']:.2f} GiB, estimate {res['estimate_gib']:.2f} GiB, "
              f"error {100 * res['error']:+.0f}% (baseline RSS {res['baseline_rss_gib']:.2f} GiB)", flush=True)
        if args.json:
            with Path(args.json).open("a") as f:
                f.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
