#!/usr/bin/env python
"""The collective transport's receive path on CUDA tensors, in one process pair on one GPU -- as far as one GPU
allows. NCCL refuses two ranks on one device, so the pair talks gloo (ProcessGroupGloo broadcasts CUDA tensors through
pinned host memory, on its own stream ordered after the caller's current stream, like ProcessGroupNCCL), and
everything the worker does with the bytes is the real CUDA path: ``collective_receive.receive_stage`` with
``stream_order.CudaOrder`` -- a receiving thread that enters the loader's stream, CUDA bucket buffers from the pool,
reuse behind recorded events -- while the "worker's" thread runs on a non-default stream made current with
``torch.cuda.set_stream`` (what vLLM's ``current_stream()`` does) and every load is queued behind a deliberately slow
kernel (``torch.cuda._sleep``), so a receive that overwrote a buffer still being read, or a load that read a bucket
before it arrived, would show as wrong bytes. The stand-in for vLLM is only ``load_weights`` (``copy_`` into
preallocated CUDA parameters).

Checks: every tensor arrives exactly; buffers were reused (the event path ran); receive overlapped load. And a
one-rank ProcessGroupNCCL built by ``collective.nccl_group`` (blocking wait) broadcasts on the loader's stream with the
environment restored after it. What it does not show: a two-rank NCCL broadcast (needs two GPUs).

    python tools/gpu/check_collective_cuda.py              # 64 tensors of 4 MiB, 16 MiB buckets
    python tools/gpu/check_collective_cuda.py --small      # CPU: the same code with the no-op stream order
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.multiprocessing as mp


def tensors(n: int, numel: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(f"model.layers.{i}.w", torch.randn(numel, generator=g).to(torch.bfloat16)) for i in range(n)]


def sender(q, n: int, numel: int, bucket_bytes: int) -> None:
    from da3po_megatron.rollout.collective_send import CollectiveSender

    s = CollectiveSender("cuda_check", 2, "gloo", 120, host="127.0.0.1")
    q.put(s.port)
    s.connect()
    q.put(s.send(iter(tensors(n, numel)), bucket_bytes))
    s.close()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny sizes")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from da3po_megatron.rollout.collective import NCCL_ENV_AT_START, broadcast, destroy_group, make_group

    for key, value in NCCL_ENV_AT_START.items():  # as an actor has them from its start (collective.scoped_env)
        os.environ.setdefault(key, value)
    from da3po_megatron.rollout.collective_receive import receive_stage
    from da3po_megatron.rollout.stream_order import order_for

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    n, numel, bucket = (24, 2048, 16384) if args.small else (64, 2 * 2**20, 16 * 2**20)
    if cuda:  # the sender in a process of its own on the same GPU
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        proc = ctx.Process(target=sender, args=(q, n, numel, bucket), daemon=True)
    else:  # CPU (CI): a thread spares a second interpreter; the receive code is the same
        import queue
        import threading

        q = queue.Queue()
        proc = threading.Thread(target=sender, args=(q, n, numel, bucket), daemon=True)
    proc.start()
    port = q.get(timeout=300)
    _, pg = make_group("127.0.0.1", port, 1, 2, backend="gloo", local_ip="127.0.0.1", timeout_s=120,
                       name="cuda_check")
    loader = torch.cuda.Stream(device) if cuda else None
    if cuda:
        torch.cuda.set_stream(loader)  # the worker thread's current stream is not the default one (vLLM)
    params = {name: torch.zeros(t.shape, dtype=t.dtype, device=device) for name, t in tensors(n, numel)}

    def load(bucket_tensors: dict[str, torch.Tensor]) -> None:
        if cuda:
            torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time queued before the copies: a slow device-side load
        for name, t in bucket_tensors.items():
            params[name].copy_(t)

    stats = {"bytes": 0, "buckets": 0, "transfer_s": 0.0, "load_s": 0.0, "fresh_buffers": 0, "overlapped_buckets": 0}
    t0 = time.perf_counter()
    receive_stage(pg, device, load, 0, stats, order=order_for(device))
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    sent = q.get(timeout=300)
    proc.join(timeout=60)
    destroy_group(pg)
    wrong = [name for name, t in tensors(n, numel) if not torch.equal(params[name].cpu(), t)]

    nccl = "not run (no CUDA)"
    if cuda:
        import torch.distributed as dist

        from da3po_megatron.megatron.runtime import bind_rendezvous
        from da3po_megatron.rollout.collective import nccl_group

        before = os.environ.get("TORCH_NCCL_BLOCKING_WAIT")
        store = bind_rendezvous(1, timeout_s=60)
        one = nccl_group(dist.PrefixStore("nccl_check/", store), 0, 1, timedelta(seconds=60))
        x = torch.arange(1024, dtype=torch.float32, device=device)
        broadcast(one, x)  # on the loader stream (current in this thread)
        torch.cuda.synchronize(device)
        ok = bool(torch.equal(x.cpu(), torch.arange(1024, dtype=torch.float32)))
        restored = os.environ.get("TORCH_NCCL_BLOCKING_WAIT") == before
        destroy_group(one)
        nccl = f"1-rank group built in blocking-wait mode, broadcast {'exact' if ok else 'WRONG'}, " \
               f"environment {'restored' if restored else 'NOT restored'}"
        if not (ok and restored):
            wrong.append("nccl")
    result = {"check": "collective_cuda", "device": str(device), "buckets": stats["buckets"],
              "sent_buckets": sent["buckets"], "bytes": stats["bytes"], "fresh_buffers": stats["fresh_buffers"],
              "overlapped_buckets": stats["overlapped_buckets"], "seconds": seconds, "wrong": wrong[:8],
              "nccl": nccl}
    print(f"collective receive on {device}: {stats['buckets']} buckets ({stats['bytes'] / 1e6:.1f} MB) in "
          f"{seconds:.2f} s, {stats['fresh_buffers']} fresh buffers (the rest reused behind events), "
          f"{stats['overlapped_buckets']} received while the previous one loaded; wrong tensors: {len(wrong)}; "
          f"NCCL: {nccl}")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh)
    if wrong or stats["buckets"] != sent["buckets"] or stats["fresh_buffers"] >= stats["buckets"]:
        raise SystemExit(f"collective receive on {device}: FAILED ({result})")
    return result


if __name__ == "__main__":
    main()
