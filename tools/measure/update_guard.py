"""Cost of the update guard on the Qwen3-0.6B shape, on CPU: peak memory above the model + grads + Adam state, and
time, of the non-finite checks before (e6f0361's ``megatron/nonfinite.py``, read from git: ``isfinite().all()`` over
every grad and parameter buffer) and after (``megatron/update_guard.py``: the update-size prediction, which also
replaces the gradient check by megatron's grad norm, and one sum per parameter buffer).

    OMP_NUM_THREADS=2 python tools/measure/update_guard.py [--layers 28] [--json out.json]

A real megatron-core GPTModel of Qwen3-0.6B's shape (28 layers, hidden 1024, 16 heads / 8 KV heads of 128, SwiGLU
3072, vocabulary 151,936, tied embeddings; ~596 M parameters, fp32) in Megatron DDP with the optimizer megatron-core
builds (torch AdamW), one gloo rank. The gradients are random numbers written into DDP's grad buffer (a stand-in for a
backward pass: the guard reads the buffer, not how it was filled) and the Adam state is created by one real optimizer
step. Peak memory is the process's peak RSS (VmHWM) after resetting it (``/proc/self/clear_refs`` 5) right before
each check, minus the RSS before it; megatron's own grad norm (computed by both versions: inside
``optimizer.step()`` before, by the guard after) is measured on its own. Needs ~11 GB of memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def measure(fn, repeat: int = 3) -> dict[str, float]:
    """Peak RSS above the current RSS while ``fn`` runs (MiB), and its time (s, best of ``repeat``)."""
    peaks, times = [], []
    for _ in range(repeat):
        base = _rss("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        peaks.append(_rss("VmHWM") - base)
    return {"peak_mib": max(peaks) / 2**20, "seconds": min(times)}


def old_guard_module() -> types.ModuleType:
    """e6f0361's megatron/nonfinite.py, as it was (read from git)."""
    src = subprocess.check_output(["git", "-C", str(ROOT), "show", "e6f0361:da3po_megatron/megatron/nonfinite.py"],
                                  text=True)
    mod = types.ModuleType("nonfinite_e6f0361")
    exec(compile(src, "nonfinite_e6f0361.py", "exec"), mod.__dict__)  # noqa: S102 - the project's own old code
    return mod


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=28, help="transformer layers (Qwen3-0.6B: 28)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)

    from da3po_megatron.config import ModelConfig, OptimConfig
    from da3po_megatron.megatron.arch import GPTArch
    from da3po_megatron.megatron.model import build_gpt_model
    from da3po_megatron.megatron.optimizer import build_ddp_optimizer
    from da3po_megatron.megatron.runtime import ParallelLayout, destroy_parallel, init_parallel
    from da3po_megatron.megatron.update_guard import check_finite_weights, update_norms

    init_parallel(ParallelLayout(), rank=0, world_size=1)  # binds port 0 itself
    arch = GPTArch(num_layers=args.layers, hidden_size=1024, ffn_hidden_size=3072, num_attention_heads=16,
                   num_query_groups=8, kv_channels=128, vocab_size=151936, qk_layernorm=True,
                   share_embeddings_and_output_weights=True, rotary_base=1_000_000, max_sequence_length=4096)
    t0 = time.perf_counter()
    gpt = build_gpt_model(arch, ModelConfig(params_dtype="float32"))
    model, optimizer, scheduler = build_ddp_optimizer(gpt, OptimConfig(lr=1e-6, use_distributed_optimizer=True),
                                                      total_steps=10, lr_decay_style="constant")
    n_params = sum(p.numel() for p in gpt.parameters())
    buffers = [b.grad_data for b in model.buffers]
    for g in buffers:
        g.normal_(0.0, 1e-4)
    scheduler.step(1)
    optimizer.step()  # creates the Adam state (exp_avg, exp_avg_sq)
    for g in buffers:
        g.normal_(0.0, 1e-4)
    optimizer.prepare_grads()
    sizes = ", ".join(f"{b.numel() / 1e6:.1f} M" for b in buffers)
    print(f"model: {n_params / 1e6:.1f} M parameters, {len(buffers)} grad buffer(s) of {sizes} elements; set-up "
          f"{time.perf_counter() - t0:.0f} s; RSS {_rss('VmRSS') / 2**30:.2f} GiB", flush=True)

    old = old_guard_module()
    loss = [torch.tensor(1.0)]
    results = {
        "before: nonfinite_update (isfinite over grad buffers)": measure(lambda: old.nonfinite_update(loss, model)),
        "before: check_finite_weights (isfinite over param buffers)":
            measure(lambda: old.check_finite_weights(model, "1.1")),
        "after: update_norms (||delta theta||, ||theta||; replaces the grad check)": measure(
            lambda: update_norms(optimizer)),
        "after: check_finite_weights (one sum per param buffer)": measure(lambda: check_finite_weights(model, "1.1")),
        "both: megatron's get_grad_norm": measure(lambda: optimizer.get_grad_norm()),
    }
    dnorm, pnorm = update_norms(optimizer)
    width = max(map(len, results))
    for k, v in results.items():
        print(f"{k:<{width}}  peak +{v['peak_mib']:8.1f} MiB  {v['seconds']:6.2f} s")
    print(f"(update ratio of this random-gradient update at lr 1e-6: {dnorm / pnorm:.3g})")
    if args.json:
        Path(args.json).write_text(json.dumps({"params": n_params, "threads": torch.get_num_threads(),
                                               "results": results}, indent=1))
    destroy_parallel()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    sys.exit(main())
