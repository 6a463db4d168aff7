"""A torchrun job for tests/test_ipc_layouts.py: the colocated IPC transport's bucket sequence at policy TP 2 x PP 2,
TP 2 x EP 2 and PP 2 x EP 2, one 4-rank gloo world, the three layouts one after the other (Megatron's parallel state
is torn down and rebuilt between them; the process group stays).

Per layout, on every rank: the real PolicyWorker loads a tiny model of real proportions (``tiny.real_shape``:
Qwen3-8B for the dense layout, Qwen3-30B-A3B for the MoE ones), then (1) the truth: the digests of
:func:`~da3po_megatron.bridge.export.export_policy` (what the bytes / collective transports send), merged over the
world; (2) :func:`~da3po_megatron.rollout.ipc.ipc_bucket_plan` -- the buckets this rank would export by CUDA-IPC
handle, packed on CPU -- under :class:`AllocTracker`, which records every tensor allocation made while the buckets
are produced and when it is freed: the peak of live new bytes beyond the rank's own weights, and how many bucket
buffers were alive at once. Rank 0 writes ``OUT/result.json``.

    python -m torch.distributed.run --nproc-per-node 4 tests/_ipc_layouts_job.py --out OUT --dense A --moe B
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from da3po_megatron.testing.policy_job import small_policy

LAYOUTS = [("tp2_pp2", "dense", 2, 2, 1), ("tp2_ep2", "moe", 2, 1, 2), ("pp2_ep2", "moe", 1, 2, 2)]


class AllocTracker(TorchDispatchMode):
    """Every storage an op allocates while active (an output whose storage is none of its inputs'), with weak
    references to the tensors that use it (views included); a storage counts as live while any of them is alive.
    ``peak``: the most live bytes at once (measured after every op); ``buckets``: the storages of the bucket buffers
    (marked by :meth:`bucket`), ``max_live_buckets``: the most of them alive at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list] = {}  # data_ptr -> [nbytes, [weakrefs]]
        self.peak = 0
        self.at_peak: list[int] = []  # the live allocations' sizes at the peak
        self.bucket_ptrs: set[int] = set()
        self.max_live_buckets = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr in self.live:
                self.live[ptr][1].append(weakref.ref(t))
            elif ptr not in ins and ptr:
                self.live[ptr] = [t.untyped_storage().nbytes(), [weakref.ref(t)]]
        self.sweep()
        return out

    def sweep(self) -> None:
        for ptr in [p for p, (_, refs) in self.live.items() if all(r() is None for r in refs)]:
            del self.live[ptr]
            self.bucket_ptrs.discard(ptr)
        now = sum(n for n, _ in self.live.values())
        if now > self.peak:
            self.peak, self.at_peak = now, sorted((n for n, _ in self.live.values()), reverse=True)
        self.max_live_buckets = max(self.max_live_buckets, len(self.bucket_ptrs))

    def bucket(self, buf: torch.Tensor) -> None:
        ptr = buf.untyped_storage().data_ptr()
        if ptr not in self.live:  # e.g. allocated outside the mode: count it anyway
            self.live[ptr] = [buf.untyped_storage().nbytes(), [weakref.ref(buf)]]
        self.bucket_ptrs.add(ptr)
        self.sweep()


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def run_layout(hf: str, kind: str, tp: int, pp: int, ep: int, bucket: int) -> dict:
    from da3po_megatron.bridge.export import export_policy
    from da3po_megatron.rollout.ipc import ipc_bucket_plan

    over = ["parallel.expert_tensor_parallel_size=1", f"parallel.expert_model_parallel_size={ep}"] if kind == "moe" \
        else []
    w = small_policy(hf, tp=tp, pp=pp, overrides=tuple(over))
    own = {n: digest(t) for n, t in export_policy(w)}  # collective; items on the ranks that send them today
    truth: list = [None] * dist.get_world_size()
    dist.all_gather_object(truth, own)
    merged = {k: v for part in truth for k, v in part.items()}
    largest = _largest_full_bytes(w, tp)
    mine = sum(p.numel() * p.element_size() for p in w.model.parameters())
    gc.collect()
    tracker = AllocTracker()
    t0 = time.perf_counter()
    with tracker:
        plan = ipc_bucket_plan(w, bucket, observe=tracker.bucket)
    plan.update(seconds=time.perf_counter() - t0, peak_bytes=tracker.peak, at_peak=tracker.at_peak[:6],
                max_live_buckets=tracker.max_live_buckets,
                own_param_bytes=mine, largest_full_bytes=largest, rank=dist.get_rank(), tp_rank=w.tp_rank,
                pp_rank=w.pp_rank)
    plans: list = [None] * dist.get_world_size()
    dist.all_gather_object(plans, plan)
    del w
    gc.collect()
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    return {"truth": merged, "plans": plans}


def _largest_full_bytes(w, tp: int) -> int:
    """The largest full (TP-gathered) Megatron tensor of this rank's stage: a TP-split parameter (megatron-core marks
    it ``tensor_model_parallel``) times TP, an expert's or a replicated one as it is."""
    from da3po_megatron.bridge.megatron_io import unwrap

    return max(p.numel() * p.element_size() * (tp if getattr(p, "tensor_model_parallel", False)
                                               and ".experts." not in n else 1)
               for n, p in unwrap(w.model).named_parameters())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dense", required=True)
    ap.add_argument("--moe", required=True)
    ap.add_argument("--bucket", type=int, default=64 * 1024)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    res = {"bucket": args.bucket}
    for name, kind, tp, pp, ep in LAYOUTS:
        res[name] = run_layout(args.dense if kind == "dense" else args.moe, kind, tp, pp, ep, args.bucket)
    if dist.get_rank() == 0:
        Path(args.out, "result.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
