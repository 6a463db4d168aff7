"""Benchmark the whole RL step (generate, reward, old log-probs, train, sync) across step pipelines, side by side.

Each configuration is a real ``da3po train`` run (megatron-core policy, vLLM engines, Ray, reward pool) on a synthetic
task with a random-weight model of the given shape (no download): ``--warmup`` steps, then ``--steps`` measured ones.
Configurations (``--configs``, comma-separated ``MODE/STALENESS``): ``rounds`` (the paper's generation rounds),
``streaming`` (submission-order admission), ``streaming-completion`` (first-finished admission), each with
``rollout.staleness`` 0 or 1. All see the same prompts and seeds.

The task: every prompt's answer is ``coin:p`` (``reward.kind=coin``): a response is correct with probability p by a
hash of its text. A fraction f of the prompts has p = 0.5 (kept by dynamic sampling with probability 1 - 2 * 0.5^G),
the rest p = 0 (always filtered), with f chosen so the keep rate is ``--keep-rate``. Response lengths are fixed
(``--lengths fixed``: every response ``--response-len`` tokens, EOS ignored) or sampled per prompt uniformly from
[response-len / 8, response-len] (``--lengths sampled``).

Printed per configuration (means over the measured steps): step time and its phases (generate, reward, old log-probs,
train, sync, wait = policy waiting for a prefetched batch; with staleness 1 generation runs during old log-probs +
train), engine idle fraction (1 - generate / step), decode tokens per step, trained (kept) tokens, decode per trained
token relative to the ideal (trained / keep rate), trained tokens/s, the kept batch's mean response length, and on GPU
trained tokens/s/GPU and MFU (6 x params x tokens + attention, as da3po_megatron/bench/train_step.py).

Examples::

    da3po bench rl-step --keep-rate 0.5 --lengths sampled --engine-cpus 0 --policy-cpus 1
    da3po bench rl-step --configs rounds/0,rounds/1 --hidden 256 --layers 4   # staleness only
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="rounds/0,streaming/0,streaming-completion/0,rounds/1,streaming/1")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4, help="attention heads (head_dim 32 on CPU)")
    ap.add_argument("--prompts", type=int, default=16, help="data.train_batch_size (kept groups per step)")
    ap.add_argument("--n", type=int, default=8, help="responses per prompt (G)")
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--lengths", choices=["fixed", "sampled"], default="sampled")
    ap.add_argument("--keep-rate", type=float, default=0.5, help="target fraction of groups dynamic sampling keeps")
    ap.add_argument("--ppo-epochs", type=int, default=1, help="actor.ppo_epochs (lengthens the train phase)")
    ap.add_argument("--inflight", type=int, default=0, help="rollout.max_inflight_prompts (0 = prompts / 2)")
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--engine-cpus", default="", help="ray.engine_cpus, e.g. 0")
    ap.add_argument("--policy-cpus", default="", help="ray.policy_cpus, e.g. 1")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="per GPU, for MFU (GPU only)")
    ap.add_argument("--out", default="", help="working directory (default: a temporary one)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--small", action="store_true", help="CI-sized: 8 prompts x 4 responses x 16 tokens, 2 configs")
    args = ap.parse_args(argv)
    if args.small:
        args.prompts, args.n, args.response_len, args.steps, args.configs = 8, 4, 16, 1, "rounds/0,streaming/1"
    return args


def task_keep_probability(n: int) -> float:
    """P(a p = 0.5 group is kept) = 1 - 2 * 0.5^G (neither all correct nor all wrong)."""
    return 1.0 - 2.0 * 0.5**n


def write_task(path: Path, args: argparse.Namespace, count: int = 4096) -> float:
    """The benchmark prompts (generic JSONL); returns the task's expected keep rate."""
    rng = random.Random(args.seed)
    frac = min(1.0, args.keep_rate / task_keep_probability(args.n))
    lo = max(1, args.response_len // 8)
    with path.open("w") as f:
        for i in range(count):
            a, b = rng.randrange(10**3), rng.randrange(10**3)
            length = args.response_len if args.lengths == "fixed" else rng.randint(lo, args.response_len)
            f.write(json.dumps({"prompt": f"{i}: {a}+{b}=", "answer": f"coin:{0.5 if rng.random() < frac else 0.0}",
                                "max_tokens": length}) + "\n")
    return frac * task_keep_probability(args.n)


def overrides(args: argparse.Namespace, data: Path, model: Path, mode: str, staleness: int, run_dir: Path) -> list:
    stream_mode = "streaming" if mode.startswith("streaming") else "rounds"
    order = "completion" if mode == "streaming-completion" else "submission"
    return [f"model.path={model}", "model.params_dtype=float32", "data.format=generic", f"data.train_files=[{data}]",
            "data.template=none", "data.apply_chat_template=false", "data.shuffle=false", "reward.kind=coin",
            "reward.num_workers=1", f"data.train_batch_size={args.prompts}", f"rollout.n={args.n}",
            f"actor.ppo_mini_batch_size={args.prompts}", f"actor.ppo_epochs={args.ppo_epochs}",
            f"rollout.max_response_length={args.response_len}",
            "rollout.max_prompt_length=32", "rollout.ignore_eos=true", "rollout.dtype=float32",
            f"rollout.num_engines={args.engines}", f"rollout.mode={stream_mode}", f"rollout.stream_order={order}",
            f"rollout.max_inflight_prompts={args.inflight or max(1, args.prompts // 2)}",
            f"rollout.staleness={staleness}", "rollout.logprob_check_fraction=1.0", "algorithm.name=da3po",
            "algorithm.overlong.enable=false", "algorithm.overlong.buffer_length=0",
            "algorithm.max_generation_rounds=16",
            f"actor.max_tokens_per_microbatch={max(4096, 32 + args.response_len)}",
            f"ray.engine_cpus='{args.engine_cpus}'", f"ray.policy_cpus='{args.policy_cpus}'",
            f"trainer.total_steps={args.warmup + args.steps}", "trainer.save_every=0", "eval.every=0",
            "trainer.tensorboard=false", f"trainer.seed={args.seed}", f"trainer.run_dir={run_dir}",
            "trainer.resume=false"]


def model_flops_per_token(hidden: int, layers: int, vocab: int) -> float:
    """6 x matmul parameters (forward + backward), the Megatron-LM estimate without the attention term."""
    per_layer = 4 * hidden * hidden + 3 * hidden * 2 * hidden
    return 6.0 * (layers * per_layer + hidden * vocab)


def summarise(rows: list[dict], keep_rate: float, args: argparse.Namespace, vocab: int) -> dict[str, float]:
    def mean(key: str) -> float:
        vals = [r.get(key, 0.0) for r in rows]
        return sum(vals) / len(vals) if vals else 0.0

    out = {k: mean(f"time/{k}") for k in ("step", "generate", "reward", "old_logprobs", "train", "weight_sync",
                                           "wait_rollout")}
    out["decoded_tokens"], out["kept_tokens"] = mean("rollout/decoded_tokens"), mean("rollout/kept_tokens")
    out["decode_vs_ideal"] = out["decoded_tokens"] / max(out["kept_tokens"] / keep_rate, 1e-9)
    out["engine_idle_frac"] = max(0.0, 1.0 - out["generate"] / max(out["step"], 1e-9))
    out["trained_tokens_per_s"] = out["kept_tokens"] / max(out["step"], 1e-9)
    out["kept_response_len"] = mean("batch/response_length_mean")
    out["aborted_groups"] = mean("rollout/aborted_groups")
    import torch

    if torch.cuda.is_available():
        gpus = max(1, torch.cuda.device_count())
        out["tokens_per_s_per_gpu"] = out["trained_tokens_per_s"] / gpus
        out["mfu"] = (out["trained_tokens_per_s"] * model_flops_per_token(args.hidden, args.layers, vocab)
                      / (gpus * args.peak_tflops * 1e12))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    work = Path(args.out or tempfile.mkdtemp(prefix="bench_rl_step_"))
    work.mkdir(parents=True, exist_ok=True)
    from da3po_megatron.tiny import build_model

    model = build_model(work / "model", "qwen3", seed=args.seed, hidden_size=args.hidden, num_layers=args.layers,
                        num_heads=args.heads, num_kv_heads=max(1, args.heads // 2),
                        max_position_embeddings=max(512, 64 + args.response_len))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    keep_rate = write_task(work / "task.jsonl", args)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "DA3PO_RAY_LOG_TO_DRIVER": "0"}
    results = []
    for spec in args.configs.split(","):
        mode, _, stale = spec.strip().partition("/")
        run_dir = work / f"{mode}_s{stale or 0}"
        cmd = [sys.executable, "-m", "da3po_megatron.cli", "train",
               *overrides(args, work / "task.jsonl", model, mode, int(stale or 0), run_dir)]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            print(p.stdout[-3000:], p.stderr[-5000:], file=sys.stderr)
            print(f"error: configuration {spec} failed (exit {p.returncode}); command: {' '.join(cmd)}",
                  file=sys.stderr)
            return 1
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        measured = [r for r in rows if r["step"] > args.warmup]
        results.append({"config": f"{mode} / staleness {stale or 0}", "wall_s": time.perf_counter() - t0,
                        **summarise(measured, keep_rate, args, vocab)})
    print(f"\nRL step: qwen3 hidden {args.hidden} x {args.layers} layers (random weights), {args.prompts} prompts x "
          f"{args.n} responses, {args.lengths} lengths <= {args.response_len} tokens, task keep rate {keep_rate:.3f}, "
          f"{args.engines} engine(s), engine cpus '{args.engine_cpus}', policy cpus '{args.policy_cpus}', "
          f"{args.steps} steps after {args.warmup} warm-up (means per step, seconds)\n")
    cols = ["step", "generate", "reward", "old_logprobs", "train", "weight_sync", "wait_rollout", "engine_idle_frac",
            "decoded_tokens", "kept_tokens", "decode_vs_ideal", "trained_tokens_per_s", "kept_response_len",
            "aborted_groups"]
    if any("mfu" in r for r in results):
        cols += ["tokens_per_s_per_gpu", "mfu"]
    print("| config | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for r in results:
        print(f"| {r['config']} | " + " | ".join(f"{r.get(c, 0.0):.3g}" for c in cols) + " |")
    base = {r["config"]: r for r in results}
    r0, s0 = base.get("rounds / staleness 0"), base.get("streaming / staleness 0")
    if r0 and s0:
        print(f"\nstreaming vs rounds (staleness 0): generation {r0['generate'] / max(s0['generate'], 1e-9):.2f}x "
              f"faster; decode per trained token {s0['decode_vs_ideal']:.2f}x the ideal (rounds "
              f"{r0['decode_vs_ideal']:.2f}x)")
    for mode in ("rounds", "streaming"):
        a, b = base.get(f"{mode} / staleness 0"), base.get(f"{mode} / staleness 1")
        if a and b:
            print(f"{mode}: staleness 1 step time = {b['step'] / max(a['step'], 1e-9):.2f}x of staleness 0")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "keep_rate": keep_rate, "results": results},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
