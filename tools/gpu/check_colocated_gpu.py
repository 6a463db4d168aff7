#!/usr/bin/env python
"""Colocation on one GPU (issue 49, point 5; tools/gpu/gpu_check.sh step ``colocated``): a TP 2 policy as two processes
on one GPU (gloo with CUDA tensors: NCCL refuses two ranks on one device) and a receiver process standing in for the
engines (vLLM is not on the device image).

1. Offload: each rank, per ``actor.offload`` tier, ``torch.cuda.memory_allocated`` before, while offloaded and after
   the reload (device bytes freed against what ``megatron/offload.py`` says it released; all back after the reload),
   and the offload / reload GB/s of the copied bytes beside a pinned ``copy_`` of the same bytes.
2. IPC: both ranks walk the colocated IPC sync's bucket sequence (``rollout/ipc.py: ipc_buckets``: the TP all-gather
   on CUDA tensors) and export their buckets by CUDA-IPC handle through the real ``_ipc_push``; each rank is given a
   GPU UUID of its own (``<uuid>#rank<r>``, both on the one physical GPU) so that both ranks export; rank 0 ships the
   handles to the receiver, whose two workers (the real ``IpcReceiverMixin.da3po_ipc_load``, one per rank's UUID)
   map them and hash every tensor. Fails unless both workers received every HF tensor with the bytes of
   ``export_policy`` (sha256).

``--small`` on a CPU machine runs the same processes and code over gloo with CPU tensors, with a stand-in for the
CUDA-IPC export named as such: the bucket is put in shared memory and its pickled handle travels instead
(torch.multiprocessing's file_system strategy); there the offload step reports the bookkeeping only (no device).

    python tools/gpu/check_colocated_gpu.py [--small] [--json OUT]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def _standin_ipc(ipc) -> None:
    """CPU only: the CUDA-IPC export / map replaced by shared memory (``reduce_tensor`` -> a pickled shared-memory
    tensor at the handle's place, ``rebuild_cuda_tensor`` -> unpickle it); the routing, packing, shipping and pick
    are the real code."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing.reductions as reductions

    mp.set_sharing_strategy("file_system")
    ipc.require_ipc = lambda what: None
    ipc._cuda_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.ipc_collect = lambda: None
    keep: list[torch.Tensor] = []  # the shared copies live until this process ends (the receiver maps them later)

    def export(t: torch.Tensor) -> tuple:
        keep.append(t.clone().share_memory_())
        return None, (None,) * 7 + (bytes(ForkingPickler.dumps(keep[-1])),) + (None,) * 7

    reductions.reduce_tensor = export
    reductions.rebuild_cuda_tensor = lambda *args: pickle.loads(args[7])


def receiver(requests, answers, uuids: list[str], cuda: bool) -> None:
    """The engines' stand-in: one worker per UUID, each maps its own handle and hashes what it loaded."""
    from da3po_megatron.rollout import ipc

    if not cuda:
        _standin_ipc(ipc)
    got: dict[str, dict[str, str]] = {u: {} for u in uuids}

    class Worker(ipc.IpcReceiverMixin):
        def __init__(self, uuid: str) -> None:
            self.uuid = uuid

        def _da3po_cuda_index(self) -> int:
            return 0

        def da3po_load_bucket(self, tensors: dict) -> dict:
            got[self.uuid].update({n: _digest(t) for n, t in tensors.items()})
            return {"tensors": len(tensors)}

    workers = [Worker(u) for u in uuids]
    real = ipc.gpu_uuid
    while True:
        msg = requests.get()
        if msg is None:
            break
        engine, handles, meta = msg
        w = workers[engine]
        ipc.gpu_uuid = lambda index=None, u=w.uuid: u  # this worker's GPU, as the policy rank's was named
        answers.put(w.da3po_ipc_load(handles, meta))
        ipc.gpu_uuid = real
    answers.put(got)


def policy_rank(rank: int, port: int, hf: str, requests, answers, out: str, cuda: bool, bucket: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    import da3po_megatron.megatron.runtime as runtime
    from da3po_megatron.bridge.export import export_policy
    from da3po_megatron.megatron.batching import PolicyBatch
    from da3po_megatron.rollout import ipc
    from da3po_megatron.rollout.ipc_routing import plan_ipc_routes
    from da3po_megatron.testing.policy_job import ADVANTAGES, small_policy
    from da3po_megatron.testing.policy_selfcheck import fixed_batch

    runtime.backend = lambda: "gloo"  # two ranks on one GPU: NCCL refuses them; gloo carries CUDA tensors
    w = small_policy(hf, tp=2, overrides=("actor.offload=all",))
    prompts, responses = fixed_batch()
    lp = w.compute_logprobs(PolicyBatch(prompts, responses))
    w.train_step(PolicyBatch(prompts, responses, lp, ADVANTAGES))  # Adam's state exists now
    res: dict = {"rank": rank, "device": str(w.device), "offload": []}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    alloc = (lambda: int(torch.cuda.memory_allocated())) if cuda else (lambda: 0)
    for tier, parts in (("grads", ("grads",)), ("grads+optimizer", ("grads", "optimizer")),
                        ("all", ("grads", "optimizer", "params"))):
        w.offload_state(parts)  # the first cycle allocates the host buffers
        w.reload_offloaded()
        sync()
        a0, t0 = alloc(), time.perf_counter()
        freed = w.offload_state(parts)
        sync()
        t1, a1 = time.perf_counter(), alloc()
        w.reload_offloaded()
        sync()
        t2, a2 = time.perf_counter(), alloc()
        copied = sum(v for k, v in freed.items() if k != "grads")
        row = {"tier": tier, "said_freed": sum(freed.values()), "device_freed": a0 - a1, "back": a2 - a0,
               "copied": copied, "offload_gbps": copied / max(t1 - t0, 1e-9) / 1e9,
               "reload_gbps": copied / max(t2 - t1, 1e-9) / 1e9}
        if copied:  # the reference: a pinned copy of the same bytes
            src = torch.empty(copied, dtype=torch.uint8, device=w.device)
            host = torch.empty(copied, dtype=torch.uint8, pin_memory=cuda)
            sync()
            t0 = time.perf_counter()
            host.copy_(src, non_blocking=cuda)
            sync()
            row["pinned_copy_gbps"] = copied / max(time.perf_counter() - t0, 1e-9) / 1e9
            del src, host
        res["offload"].append(row)
    truth = {n: _digest(t) for n, t in export_policy(w)}  # TP rank 0 holds every tensor (TP 2, DP 1, PP 1)

    real = ipc.gpu_uuid() if cuda else "GPU-cpu-standin"
    if not cuda:
        _standin_ipc(ipc)
    mine = f"{real}#rank{rank}"
    ipc.gpu_uuid = lambda index=None: mine
    places = [{"rank": r, "uuid": f"{real}#rank{r}", "tp": r, "pp": 0, "dp": 0} for r in range(2)]
    routes = plan_ipc_routes(places, [[f"{real}#rank0"], [f"{real}#rank1"]])

    class Client:  # the engines' side of RolloutClient: each call goes to the receiver process and waits
        num_engines = 2

        def _call(self, i, method, handles, meta):
            requests.put((i, handles, meta))
            return answers.get(timeout=120)

        def _gather(self, pending, what):
            return [v for _, v in pending]

    t0 = time.perf_counter()
    res["ipc"] = ipc._ipc_push(w, Client(), bucket, None, routes)
    res["ipc"]["seconds"] = time.perf_counter() - t0
    res["ipc"]["role"] = routes.role(rank)
    if rank == 0:
        requests.put(None)
        got = answers.get(timeout=120)
        res["ipc"]["engines_ok"] = {u: got[u] == truth for u in got}
        res["ipc"]["tensors_truth"] = len(truth)
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    w.shutdown()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="CPU exercise (tiny model, shared-memory IPC stand-in)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from da3po_megatron import tiny
    from da3po_megatron.megatron.runtime import free_port

    cuda = torch.cuda.is_available()
    if not cuda and not args.small:
        raise SystemExit("no CUDA: run with --small for the CPU exercise")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as d:
        kw = tiny.real_shape("Qwen3-8B")
        if not args.small:
            kw.update(num_layers=4, hidden_size=1024, ffn_hidden_size=3072)
        hf = tiny.build_model(Path(d) / "hf", kw.pop("family"), 0, **kw)
        requests, answers = ctx.Queue(), ctx.Queue()
        real = "GPU-cpu-standin"
        if cuda:
            from da3po_megatron.rollout.ipc import gpu_uuid

            real = gpu_uuid(0)
        bucket = (256 if args.small else 8192) * 1024
        t0 = time.perf_counter()
        rec = ctx.Process(target=receiver, args=(requests, answers, [f"{real}#rank0", f"{real}#rank1"], cuda))
        rec.start()
        port = free_port()
        ranks = [ctx.Process(target=policy_rank, args=(r, port, str(hf), requests, answers, d, cuda, bucket))
                 for r in range(2)]
        for p in ranks:
            p.start()
        for p in ranks:
            p.join(timeout=600)
        rec.join(timeout=30)
        codes = [p.exitcode for p in ranks] + [rec.exitcode]
        if any(c != 0 for c in codes):
            raise SystemExit(f"colocated check: process exit codes {codes} (ranks 0, 1, receiver)")
        parts = [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(2)]
    res = {"check": "colocated", "cuda": cuda, "seconds": time.perf_counter() - t0, "ranks": parts}
    ok = all(parts[0]["ipc"]["engines_ok"].values()) and len(parts[0]["ipc"]["engines_ok"]) == 2
    for p in parts:
        for row in p["offload"]:
            print(f"rank {p['rank']} offload {row['tier']:16s} said {row['said_freed']:>11d} B, device freed "
                  f"{row['device_freed']:>11d} B, back {row['back']:>4d} B; offload {row['offload_gbps']:.2f} GB/s, "
                  f"reload {row['reload_gbps']:.2f} GB/s, pinned copy {row.get('pinned_copy_gbps', 0):.2f} GB/s")
            if cuda:
                ok &= row["device_freed"] >= 0.99 * row["said_freed"] and row["back"] == 0
        print(f"rank {p['rank']} ipc ({p['ipc']['role']}): {p['ipc']['buckets']} buckets, {p['ipc']['tensors']} "
              f"tensors shipped, {p['ipc']['seconds']:.2f} s")
    print(f"engines got every tensor byte-equal to export_policy: {parts[0]['ipc']['engines_ok']} "
          f"({parts[0]['ipc']['tensors_truth']} tensors)")
    res["ok"] = bool(ok)
    print(json.dumps({k: v for k, v in res.items() if k != "ranks"}))
    if args.json:
        Path(args.json).write_text(json.dumps(res))
    if not ok:
        raise SystemExit("colocated check FAILED")
    return res


if __name__ == "__main__":
    main()
