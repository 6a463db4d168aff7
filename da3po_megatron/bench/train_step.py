"""Benchmark one policy train step (and the log-prob pass): tokens/s, peak memory, and MFU on GPU.

Runs the real :class:`~da3po_megatron.megatron.policy.PolicyWorker` on a synthetic RL batch (random prompts and
responses of fixed lengths, advantages +-1, old log-probs from the policy itself), ``--warmup`` untimed steps then
``--steps`` timed ones. Launches itself with ``torch.distributed.run`` when ``--ranks`` > 1 (or run it under
``torchrun``/``srun`` yourself). Model: ``--hf DIR`` (weights loaded through the bridge when present) or ``--tiny``
(a tiny random Qwen3 generated locally; ``--tiny-hidden`` / ``--tiny-layers`` to scale it).

MFU (GPU only) = model FLOPs / (step time x ranks x peak FLOPs per device), with model FLOPs per step =
6 x N x tokens (N = parameters doing matmuls: all but the input embedding, unless tied) + 6 x layers x
(heads x head_dim) x sum_i len_i^2 (causal attention, forward + backward), the usual Megatron-LM / PaLM estimate.
``--peak-tflops`` defaults to 989 (H100 / H200 dense bf16).

Examples::

    da3po bench train-step --tiny --batch 32 --prompt-len 64 --response-len 192
    da3po bench train-step --hf /models/Qwen3-4B-Base --ranks 8 --tp 2 --dtype bfloat16 \\
        --batch 64 --prompt-len 1024 --response-len 3072 --max-tokens 16384
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", help="Hugging Face checkpoint directory")
    src.add_argument("--tiny", action="store_true", help="generate a tiny random Qwen3 locally")
    ap.add_argument("--tiny-hidden", type=int, default=64)
    ap.add_argument("--tiny-layers", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=0, help="world size, TP x PP x DP (default TP x PP)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=16, help="responses per step")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--response-len", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=1024, help="max_tokens_per_microbatch")
    ap.add_argument("--mini-batch", type=int, default=0, help="responses per optimizer step, even (0 = whole batch)")
    ap.add_argument("--algorithm", default="da3po")
    ap.add_argument("--loss-backend", default="torch", choices=["torch", "kernel", "fused_linear"],
                    help="policy loss path: Megatron cross-entropy + torch loss, the fused kernel on logits, or the "
                         "fused-linear kernel on the final hidden states (no logits tensor)")
    ap.add_argument("--expect-loss-backend", default=None,
                    help="fail (exit 3) unless the train step reports this loss implementation, e.g. kernel:triton "
                         "(what tools/gpu/gpu_check.sh requires on CUDA)")
    ap.add_argument("--recompute", default=None, choices=[None, "full", "selective"])
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="per device, for MFU (GPU only)")
    ap.add_argument("--json", default=None, help="also write the result here (rank 0)")
    return ap.parse_args(argv)


def model_flops(arch, lengths: list[int]) -> float:
    """6 N T + causal attention FLOPs (forward + backward) of one pass over sequences of the given lengths
    (``arch``: the model's ``megatron.arch.GPTArch``)."""
    h, layers, inter = arch.hidden_size, arch.num_layers, arch.ffn_hidden_size
    heads, groups, hd = arch.num_attention_heads, arch.num_query_groups, arch.kv_channels
    attn = h * hd * (heads + 2 * groups) + heads * hd * h
    mlp = 3 * h * inter
    n = layers * (attn + mlp) + arch.vocab_size * h  # the output layer; the input embedding is a lookup
    tokens = sum(lengths)
    return 6.0 * n * tokens + 6.0 * layers * heads * hd * sum(x * x for x in lengths)


def run(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    from da3po_megatron.bridge.export import load_policy_hf
    from da3po_megatron.bridge.hf_config import gpt_arch
    from da3po_megatron.config import standalone_policy_config
    from da3po_megatron.megatron.batching import PolicyBatch
    from da3po_megatron.megatron.policy import PolicyWorker

    world = int(os.environ.get("WORLD_SIZE", 1))
    # the run config counts mini-batches in prompts x rollout.n responses: n = 2 here, so --mini-batch (responses)
    # becomes mini-batch / 2 prompts
    prompts_per_update = max(1, (args.mini_batch or args.batch) // 2)
    recompute = [f"model.recompute_granularity={args.recompute}"] if args.recompute else []
    if args.recompute == "full":
        recompute += ["model.recompute_method=uniform", "model.recompute_num_layers=1"]
    cfg = standalone_policy_config(args.hf, [
        f"model.params_dtype={args.dtype}", *recompute, f"parallel.tensor_model_parallel_size={args.tp}",
        f"parallel.pipeline_model_parallel_size={args.pp}",
        f"parallel.data_parallel_size={world // (args.tp * args.pp)}",
        "optim.lr=1e-6", f"algorithm.name={args.algorithm}",
        f"actor.loss_backend={'auto' if args.loss_backend == 'kernel' else args.loss_backend}",
        f"actor.max_tokens_per_microbatch={args.max_tokens}", "rollout.n=2",
        f"actor.ppo_mini_batch_size={prompts_per_update}", f"data.train_batch_size={prompts_per_update}"])
    t0 = time.perf_counter()
    arch = gpt_arch(args.hf)
    w = PolicyWorker(cfg, arch)
    load_policy_hf(w, args.hf)
    start_s = time.perf_counter() - t0
    rng = random.Random(0)
    vocab = min(arch.vocab_size, 32000)
    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    responses = [[rng.randrange(10, vocab) for _ in range(args.response_len)] for _ in range(args.batch)]
    batch = PolicyBatch(prompts, responses)
    cuda = torch.cuda.is_available()

    def sync():
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    sync()
    t = time.perf_counter()
    old = w.compute_logprobs(batch)
    sync()
    logprob_s = time.perf_counter() - t
    train = PolicyBatch(prompts, responses, old, [1.0 if i % 2 else -1.0 for i in range(args.batch)])
    for _ in range(args.warmup):
        w.train_step(train)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sync()
    times, metrics = [], {}
    for _ in range(args.steps):
        t = time.perf_counter()
        metrics = w.train_step(train)
        sync()
        times.append(time.perf_counter() - t)
    step_s = sorted(times)[len(times) // 2]
    lengths = batch.lengths()
    tokens = sum(lengths)
    world = dist.get_world_size()
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if cuda else
                         resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20], dtype=torch.float64,
                        device="cuda" if cuda else "cpu")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    n_params = torch.tensor(0.0 if w.dp_rank else float(sum(
        p.numel() for p in w._bare.parameters() if getattr(p, "tensor_model_parallel", False) or w.tp_rank == 0)),
        dtype=torch.float64, device=peak.device)
    dist.all_reduce(n_params)  # every parameter once: TP shards summed, replicated ones from TP rank 0, DP replica 0
    result = {
        "model": os.environ.get("BENCH_MODEL_LABEL", args.hf),
        "params": int(n_params.item()),
        "world": world, "tp": args.tp, "pp": args.pp, "dp": w.dp, "dtype": args.dtype,
        "batch": args.batch, "prompt_len": args.prompt_len, "response_len": args.response_len,
        "max_tokens_per_microbatch": args.max_tokens, "loss_backend": args.loss_backend,
        "loss_backend_ran": metrics.get("loss_backend"),  # what the train step reports ("auto" resolved)
        "num_microbatches": metrics.get("num_microbatches"), "start_s": round(start_s, 2),
        "step_s": round(step_s, 4), "tokens_per_step": tokens,
        "train_tokens_per_s": round(tokens * 1 / step_s, 1),
        "logprob_tokens_per_s": round(tokens / logprob_s, 1),
        "peak_memory_gib": round(float(peak.item()), 3),
        "peak_memory_kind": "cuda max_memory_allocated" if cuda else "max RSS of a rank",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }
    if cuda:
        result["mfu"] = round(model_flops(arch, lengths) / (step_s * world * args.peak_tflops * 1e12), 4)
    w.shutdown()
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    world = args.ranks or args.tp * args.pp
    if args.tiny and args.hf is None:
        from da3po_megatron.tiny import build_model

        os.environ["BENCH_MODEL_LABEL"] = f"tiny-qwen3(hidden={args.tiny_hidden},layers={args.tiny_layers})"
        args.hf = str(build_model(tempfile.mkdtemp(prefix="bench_tiny_"), family="qwen3", seed=0,
                                  hidden_size=args.tiny_hidden, num_layers=args.tiny_layers,
                                  ffn_hidden_size=2 * args.tiny_hidden, num_heads=max(4, args.tiny_hidden // 32),
                                  num_kv_heads=max(2, args.tiny_hidden // 64)))
    if "RANK" not in os.environ and world > 1:

        # the children get --hf instead of --tiny and infer the world from torchrun (no --ranks: torchrun's argparse
        # would take it for an abbreviation of its own options)
        given = list(argv if argv is not None else sys.argv[1:])
        rest = []
        skip = False
        for a in given:
            if skip:
                skip = False
            elif a == "--ranks":
                skip = True
            elif a != "--tiny" and not a.startswith("--ranks="):
                rest.append(a)
        if args.tiny:
            rest += ["--hf", args.hf]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--standalone",
               "-m", "da3po_megatron.bench.train_step", *rest]
        return subprocess.call(cmd)
    result = run(args)
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(result))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    if args.expect_loss_backend and result["loss_backend_ran"] != args.expect_loss_backend:
        print(f"error: the train step ran {result['loss_backend_ran']}, not {args.expect_loss_backend}",
              file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
