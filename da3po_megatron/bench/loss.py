#!/usr/bin/env python
"""Benchmark the DAA-loss paths: reference vs chunked vs Triton vs fused-linear, peak extra memory and fwd+bwd time.

Each path runs in a fresh subprocess (so one path's allocator state cannot hide another's peak):

* GPU: peak extra memory = torch.cuda.max_memory_allocated() during fwd+bwd minus the memory held before it (inputs);
  time = median over --repeats of CUDA-synchronised fwd+bwd; achieved bandwidth of the logits paths =
  3 x logits bytes (forward read, backward read, dlogits write: the minimum traffic) / time, shown against the
  measured device-to-device copy bandwidth; the fused-linear path shows TFLOP/s (4 matmuls of 2 N V H flops).
* CPU: peak extra memory = the process's peak RSS (getrusage high-water mark) minus its RSS before fwd+bwd (inputs
  allocated without temporaries); Triton runs only under TRITON_INTERPRET=1 (far too slow at these sizes, skipped).

The logits paths take a [tokens x vocab] logits tensor as input (not counted as extra; shown as "input"); the
fused-linear path takes hidden [tokens x H] and the output weight [vocab x H] and never creates the logits.

    da3po bench loss                       # 8192 tokens x 151,936 vocab, bf16, hidden 4096 (GPU sizes)
    da3po bench loss --tokens 1024 --hidden 256 --repeats 2   # CPU-sized
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

PATHS = ("reference", "chunked", "chunked_inplace", "triton", "triton_inplace", "fused_linear")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child(args: argparse.Namespace) -> dict:
    import torch

    from da3po_megatron.kernels import LossInputs, OutputLayer, daa_policy_loss, fused_linear_daa_policy_loss

    dev = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    n, v, h = args.tokens, args.vocab, args.hidden
    g = torch.Generator(device=dev).manual_seed(0)
    targets = torch.randint(0, v, (n,), device=dev, generator=g)
    old = -torch.rand(n, device=dev, generator=g) * 3 - 9  # ~log(1/V): ratios of order 1
    adv = torch.randn(n, device=dev, generator=g)
    mask = torch.ones(n, device=dev)
    inputs = LossInputs(targets, old_logprobs=old, advantages=adv, mask=mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                        compute_entropy=args.entropy)
    if args.path == "fused_linear":
        hidden = torch.empty(n, h, device=dev, dtype=dtype).normal_(generator=g).requires_grad_(True)
        weight = torch.empty(v, h, device=dev, dtype=dtype).normal_(std=h**-0.5, generator=g).requires_grad_(True)
        input_bytes = (hidden.numel() + weight.numel()) * hidden.element_size()

        def step():
            hidden.grad = weight.grad = None
            loss = fused_linear_daa_policy_loss(hidden, OutputLayer(weight), inputs)[0]
            loss.backward()
    else:
        logits = torch.empty(n, v, device=dev, dtype=dtype).normal_(std=2.0, generator=g).requires_grad_(True)
        input_bytes = logits.numel() * logits.element_size()

        backend, _, inplace = args.path.partition("_")

        class GradSink(torch.autograd.Function):
            """Stands for the output layer: receives dlogits and drops it (as the layer's matmul backward would after
            use), so no leaf .grad copy of [tokens x vocab] is counted and inplace_backward has a non-leaf to own."""

            @staticmethod
            def forward(ctx, x):
                return x.view_as(x)

            @staticmethod
            def backward(ctx, grad):
                return None

        def step():
            x = GradSink.apply(logits)
            loss = daa_policy_loss(x, inputs, backend=backend, inplace_backward=bool(inplace))
            loss[0].backward()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    sync()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    times = []
    for i in range(args.repeats + (1 if dev.type == "cuda" else 0)):  # GPU: one untimed warm-up (Triton compile)
        t0 = time.perf_counter()
        step()
        sync()
        if dev.type == "cuda" and i == 0:
            continue
        times.append(time.perf_counter() - t0)
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    out = dict(path=args.path, device=str(dev), peak_extra=peak, input_bytes=input_bytes,
               time_s=statistics.median(times))
    if dev.type == "cuda":
        x = torch.empty(2**28, dtype=torch.float32, device=dev)  # 1 GiB
        y = torch.empty_like(x)
        y.copy_(x)
        sync()
        t0 = time.perf_counter()
        for _ in range(5):
            y.copy_(x)
        sync()
        out["copy_gbps"] = 5 * 2 * x.numel() * 4 / (time.perf_counter() - t0) / 1e9
    return out


def _fmt_mib(b: float) -> str:
    return f"{b / 2**20:,.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch (N)")
    ap.add_argument("--vocab", type=int, default=151_936, help="vocab size of this rank (Qwen3: 151,936)")
    ap.add_argument("--hidden", type=int, default=4096, help="hidden size H for the fused-linear path (Qwen3-8B: 4096)")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--repeats", type=int, default=3, help="timed fwd+bwd runs per path (median)")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {PATHS}")
    ap.add_argument("--entropy", action="store_true", help="also compute the per-token entropy")
    ap.add_argument("--cpu", action="store_true", help="run on CPU even when CUDA is available")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    ap.add_argument("--path", help=argparse.SUPPRESS)  # child mode
    args = ap.parse_args()
    if args.path:
        print("RESULT " + json.dumps(_child(args)), flush=True)
        return

    import torch

    on_gpu = torch.cuda.is_available() and not args.cpu
    rows = []
    for path in args.paths.split(","):
        if path not in PATHS:
            ap.error(f"--paths: unknown path {path!r}; choose from {PATHS}")
        if path.startswith("triton") and not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
            rows.append(dict(path=path, skipped="no CUDA (the interpreter is far too slow at these sizes)"))
            continue
        cmd = [sys.executable, "-m", "da3po_megatron.bench.loss", "--path", path, "--tokens", str(args.tokens),
               "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--dtype", args.dtype,
               "--repeats", str(args.repeats)]
        cmd += ["--entropy"] * args.entropy + ["--cpu"] * args.cpu
        print(f"[bench_loss] {path} ...", file=sys.stderr, flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        if r.returncode != 0 or not lines:
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["?"]
            rows.append(dict(path=path, skipped=f"failed (rc {r.returncode}): {tail[0][:100]}"))
            continue
        rows.append(json.loads(lines[-1][len("RESULT "):]))

    ref = next((r for r in rows if r["path"] == "reference" and "skipped" not in r), None)
    dev = next((r["device"] for r in rows if "device" in r), "?")
    print(f"\nDAA loss fwd+bwd: tokens={args.tokens:,} vocab={args.vocab:,} hidden={args.hidden} dtype={args.dtype} "
          f"entropy={args.entropy} device={dev} repeats={args.repeats}")
    head = (f"| {'path':<16}| {'input MiB':>10} | {'peak extra MiB':>14} | {'vs ref':>7} | {'fwd+bwd ms':>10} "
            f"| {'vs ref':>7} |")
    if on_gpu:
        head += f" {'achieved':>18} |"
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['path']:<16}| skipped: {r['skipped']}")
            continue
        mem_ratio = f"{r['peak_extra'] / ref['peak_extra']:.3f}" if ref and ref["peak_extra"] > 0 else "-"
        t_ratio = f"{r['time_s'] / ref['time_s']:.2f}" if ref else "-"
        line = (f"| {r['path']:<16}| {_fmt_mib(r['input_bytes']):>10} | {_fmt_mib(r['peak_extra']):>14} | "
                f"{mem_ratio:>7} | {r['time_s'] * 1e3:>10,.1f} | {t_ratio:>7} |")
        if on_gpu:
            if r["path"] == "fused_linear":
                tflops = 8 * args.tokens * args.vocab * args.hidden / r["time_s"] / 1e12
                line += f" {tflops:>9.1f} TFLOP/s |"
            else:
                gbps = 3 * r["input_bytes"] / r["time_s"] / 1e9
                line += f" {gbps:>7,.0f} GB/s ({gbps / r['copy_gbps']:.0%} of copy {r['copy_gbps']:,.0f}) |"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
