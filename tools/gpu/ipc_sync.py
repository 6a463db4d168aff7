#!/usr/bin/env python
"""The colocated IPC weight sync on one GPU, without vLLM (absent from the device image): a "policy" process holds a
Qwen3-1.7B-shaped random transformers model (bf16, tied), packs its HF-named tensors into flat CUDA buckets
(``rollout.collective.iter_flat_buckets``, what the IPC sender packs), routes them with the transport's routing plan
(``rollout.ipc_routing.plan_ipc_routes``: one policy rank, one engine worker, both on this GPU) and hands each bucket
as ``{GPU UUID: reduce_tensor args}`` to an "engine" process. There the transport's own worker code
(``rollout.ipc.IpcReceiverMixin.da3po_ipc_load``: pick this GPU's handle, ``rebuild_cuda_tensor``, load the views,
synchronize) loads them into a second Qwen3 model built from another seed -- the stand-in for vLLM is only the final
``load_weights`` (a ``copy_`` into the model's parameter of the same HF name).

Checks and prints: the engine's log-probs of a fixed token batch before the sync differ from the policy's, after it
equal them (max |diff| < 1e-4, the CPU tests' tolerance); seconds and GB/s of the whole sync, of the packing alone, and
the device copy bandwidth (one ``copy_`` of a model-sized buffer) measured in the same run, as one Markdown table.
``tools/gpu/gpu_check.sh`` runs it (step ipc_sync); on CPU (``--small``) the same code runs with a tiny model, the
engine in a thread and the buffers passed as they are (no CUDA IPC: ``da3po_ipc_load`` needs CUDA, so the load is called
directly).

    python tools/gpu/ipc_sync.py                 # Qwen3-1.7B shape: hidden 2048, FFN 6144, 28 layers, bf16
    python tools/gpu/ipc_sync.py --small --layers 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.multiprocessing as mp

QWEN3_17B = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 vocab_size=151936)
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=256)
TOL = 1e-4


def build(shape: dict, layers: int, seed: int, dtype: torch.dtype, device: torch.device):
    """A random tied Qwen3 (transformers) of ``shape`` on ``device``."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(num_hidden_layers=layers, tie_word_embeddings=True, max_position_embeddings=1024, **shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    return model.eval()


def hf_tensors(model):
    """The HF-named stream of the sync (what ``weight_sync.hf_state_tensors`` yields: the tied head left out)."""
    for name, t in model.state_dict().items():
        if name != "lm_head.weight":
            yield name, t


def logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    ids = ids.to(model.device)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), -1)
    return logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0].cpu()


def engine(q_in, q_out, shape, layers, dtype, device, ids) -> None:
    """The "engine" process: a model from another seed, loaded by the IPC transport's worker code."""
    from da3po_megatron.rollout.ipc import IpcReceiverMixin, gpu_uuid

    model = build(shape, layers, seed=1, dtype=dtype, device=device)
    params = dict(model.named_parameters())

    class Worker(IpcReceiverMixin):
        """The worker extension's IPC half; ``da3po_load_bucket`` stands in for vLLM's ``load_weights``."""


        def da3po_load_bucket(self, tensors: dict) -> dict:
            for name, t in tensors.items():
                params[name].data.copy_(t)
            return {"tensors": len(tensors)}

    worker = Worker()
    worker.device = device  # vLLM's Worker.device: the GPU this worker maps handles on
    q_out.put(("ready", gpu_uuid(device.index) if device.type == "cuda" else "cpu", logprobs(model, ids)))
    while True:
        msg = q_in.get()
        if msg is None:
            break
        if msg == "logprobs":
            q_out.put(logprobs(model, ids))
            continue
        handles, meta = msg
        if device.type == "cuda":
            worker.da3po_ipc_load(handles, meta)
        else:  # CPU: the buffer itself came through shared memory
            from da3po_megatron.rollout.collective import unpack_flat

            worker.da3po_load_bucket(unpack_flat(handles["cpu"], meta))
        del handles, msg
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
    from da3po_megatron.rollout.ipc_routing import plan_ipc_routes

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = SMALL if args.small else QWEN3_17B
    policy = build(shape, args.layers, seed=0, dtype=dtype, device=device)
    model = list(hf_tensors(policy))
    nbytes = sum(t.numel() * t.element_size() for _, t in model)
    bucket = int(args.bucket_mb * 2**20)
    ids = torch.randint(0, shape["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(3))
    want = logprobs(policy, ids)

    def sync_dev() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    if cuda:  # the engine in a process of its own: CUDA IPC between two processes
        ctx = mp.get_context("spawn")
        q_in, q_out = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=engine, args=(q_in, q_out, shape, args.layers, dtype, device, ids), daemon=True)
    else:  # CPU: no IPC to exercise; a thread spares CI a second interpreter importing transformers
        import queue
        import threading

        q_in, q_out = queue.Queue(), queue.Queue()
        proc = threading.Thread(target=engine, args=(q_in, q_out, shape, args.layers, dtype, device, ids), daemon=True)
    proc.start()
    ready, engine_uuid, before = q_out.get(timeout=600)
    assert ready == "ready"
    if cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        from da3po_megatron.rollout.ipc import gpu_uuid

        mine = gpu_uuid(0)
    else:
        mine = "cpu"
    routes = plan_ipc_routes([{"rank": 0, "uuid": mine, "tp": 0, "pp": 0, "dp": 0}], [[engine_uuid]])
    assert routes.serves == {0: [(0, 0)]}, routes
    rows: dict[str, list[float]] = {"ipc_sync": [], "pack": [], "copy": []}
    for _ in range(args.repeats + 1):  # the first round warms the allocator and the IPC mappings
        sync_dev()
        t0 = time.perf_counter()
        for buf, meta in iter_flat_buckets(iter(model), bucket, device):
            sync_dev()  # the packing copies are done before the engine process reads the buffer
            q_in.put(({mine: reduce_tensor(buf)[1]} if cuda else {"cpu": buf}, meta))
            assert q_out.get(timeout=300) == "ok"
            del buf
        rows["ipc_sync"].append(time.perf_counter() - t0)
        if cuda:
            torch.cuda.ipc_collect()
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
    q_in.put("logprobs")
    after = q_out.get(timeout=300)
    q_in.put(None)
    proc.join(timeout=60)
    diff_before = float((before - want).abs().max())
    diff_after = float((after - want).abs().max())
    med = {k: statistics.median(v[1:]) for k, v in rows.items()}
    copy_gbps = nbytes / med["copy"] / 1e9
    name = "small" if args.small else f"Qwen3-1.7B shape, {args.layers} layers"
    print(f"{name}, {str(dtype).removeprefix('torch.')}, {nbytes / 1e9:.2f} GB, {device}, bucket {args.bucket_mb} MiB, "
          f"median of {args.repeats}; engine log-probs vs the policy's: max |diff| {diff_before:.3g} before the sync, "
          f"{diff_after:.3g} after (tolerance {TOL:g})")
    print("| leg | seconds | GB/s | of device copy |")
    print("|---|---:|---:|---:|")
    for k in ("ipc_sync", "pack", "copy"):
        gbps = nbytes / med[k] / 1e9
        print(f"| {k} | {med[k]:.4f} | {gbps:.2f} | {gbps / copy_gbps:.0%} |")
    result = {"bench": "ipc_sync", "device": str(device), "bytes": nbytes, "logprob_diff_before": diff_before,
              "logprob_diff_after": diff_after, **{f"{k}_s": v for k, v in med.items()}}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh)
    if not (diff_after < TOL < diff_before):
        raise SystemExit(f"ipc sync: engine log-probs after the sync differ from the policy's by {diff_after:.3g} "
                         f"(before: {diff_before:.3g}; tolerance {TOL:g})")
    return result


if __name__ == "__main__":
    main()
