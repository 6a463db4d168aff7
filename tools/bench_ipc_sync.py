#!/usr/bin/env python
"""The IPC weight-sync leg on one GPU, without vLLM: a sender process packs a Qwen3-1.7B-shaped random model (HF
names, bf16) into flat CUDA buckets (``rollout.collective.iter_flat_buckets``, what the collective and IPC transports
send) and hands each bucket to a receiver process as a CUDA-IPC handle (torch.multiprocessing: ``reduce_tensor`` /
``rebuild_cuda_tensor``, what ``rollout/ipc.py`` does); the receiver copies every tensor into its own preallocated
"engine" parameters (the stand-in for vLLM's ``load_weights`` copy) and acknowledges, then the next bucket goes.

Prints seconds and GB/s of the whole sync, of the packing alone, and the device copy bandwidth (one ``copy_`` of a
model-sized buffer) measured in the same run, as one Markdown table. The NCCL leg of the collective transport needs
two GPUs (NCCL refuses two ranks on one device), so on one GPU only its packing stage is measured (the row "pack").
``tools/gpu_check.sh`` runs it; on CPU (``--small``) the same code runs with shared-memory handles.

    python tools/bench_ipc_sync.py                 # Qwen3-1.7B shape: hidden 2048, FFN 6144, 28 layers, bf16
    python tools/bench_ipc_sync.py --small --layers 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.multiprocessing as mp

QWEN3_17B = dict(hidden=2048, ffn=6144, heads=16, kv_heads=8, head_dim=128, vocab=151936)
SMALL = dict(hidden=64, ffn=128, heads=4, kv_heads=2, head_dim=16, vocab=256)


def shapes(cfg: dict, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """HF tensor names and shapes of a (tied) Qwen3 model."""
    h, f, q, kv = cfg["hidden"], cfg["ffn"], cfg["heads"] * cfg["head_dim"], cfg["kv_heads"] * cfg["head_dim"]
    out = [("model.embed_tokens.weight", (cfg["vocab"], h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (q, h)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, q)), (p + "self_attn.q_norm.weight", (cfg["head_dim"],)),
                (p + "self_attn.k_norm.weight", (cfg["head_dim"],)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                (p + "mlp.down_proj.weight", (h, f))]
    return out + [("model.norm.weight", (h,))]


def receiver(q_in, q_out, spec, dtype, device) -> None:
    from da3po_megatron.rollout.collective import unpack_flat

    params = {n: torch.empty(s, dtype=dtype, device=device) for n, s in spec}  # the "engine's" weights
    q_out.put("ready")
    while True:
        msg = q_in.get()
        if msg is None:
            break
        buf, meta = msg
        for name, t in unpack_flat(buf, meta).items():
            params[name].copy_(t)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        del buf, msg
        q_out.put("ok")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU check of the script)")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from da3po_megatron.rollout.collective import iter_flat_buckets

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16
    spec = shapes(SMALL if args.small else QWEN3_17B, args.layers)
    g = torch.Generator(device=device).manual_seed(0)
    model = [(n, torch.randn(s, generator=g, device=device, dtype=torch.float32).to(dtype)) for n, s in spec]
    nbytes = sum(t.numel() * t.element_size() for _, t in model)
    bucket = int(args.bucket_mb * 2**20)

    def sync_dev() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=receiver, args=(q_in, q_out, spec, dtype, device), daemon=True)
    proc.start()
    assert q_out.get(timeout=300) == "ready"
    rows: dict[str, list[float]] = {"ipc_sync": [], "pack": [], "copy": []}
    for _ in range(args.repeats + 1):  # the first round warms the allocator and the IPC mappings
        sync_dev()
        t0 = time.perf_counter()
        for buf, meta in iter_flat_buckets(iter(model), bucket, device):
            sync_dev()
            q_in.put((buf, meta))
            assert q_out.get(timeout=300) == "ok"
            del buf
        rows["ipc_sync"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for buf, _ in iter_flat_buckets(iter(model), bucket, device):
            del buf
        sync_dev()
        rows["pack"].append(time.perf_counter() - t0)
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        sync_dev()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync_dev()
        rows["copy"].append(time.perf_counter() - t0)
        del src, dst
    q_in.put(None)
    proc.join(timeout=60)
    med = {k: statistics.median(v[1:]) for k, v in rows.items()}
    copy_gbps = nbytes / med["copy"] / 1e9
    shape = "small" if args.small else f"Qwen3-1.7B shape, {args.layers} layers"
    print(f"{shape}, bf16, {nbytes / 1e9:.2f} GB, {device}, bucket {args.bucket_mb} MiB, median of {args.repeats}")
    print("| leg | seconds | GB/s | of device copy |")
    print("|---|---:|---:|---:|")
    for k in ("ipc_sync", "pack", "copy"):
        gbps = nbytes / med[k] / 1e9
        print(f"| {k} | {med[k]:.4f} | {gbps:.2f} | {gbps / copy_gbps:.0%} |")
    result = {"bench": "ipc_sync", "device": str(device), "bytes": nbytes, **{f"{k}_s": v for k, v in med.items()}}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh)
    return result


if __name__ == "__main__":
    main()
