#!/usr/bin/env python
"""Colocation on one GPU (issue 49, point 5; tools/gpu/gpu_check.sh step ``colocated``): a TP 2 policy as two processes
and a receiver process standing in for the engines (vLLM is not on the device image), trained the way the recipe
trains (issue 57, P5; :func:`train_plan` decides, from what the machine has, and says what differs):

- bf16 parameters with fp32 master shards in the distributed optimizer (``model.params_dtype=bfloat16``, the run
  config's default on GPU), so the ``optimizer`` tier moves masters and Adam moments as the recipe's does;
- Transformer-Engine's ``FusedAdam`` when TE imports (megatron-core builds it then: ``optimizer/__init__.py`` 10-32),
  else torch's AdamW -- said in a line and in the JSON (``optimizer``): the device image has no TE;
- NCCL when each rank has a GPU of its own; on one GPU (NCCL refuses two ranks on one device) gloo with CUDA tensors,
  whose single collectives have CUDA paths that stage through host memory, with megatron-core's coalesced DP
  collectives issued one at a time (:func:`one_by_one`): its distributed optimizer all-gathers the parameters inside
  ``torch.distributed._coalescing_manager`` (``distributed/param_and_grad_buffer.py`` 274-290), which on gloo becomes
  ``allgather_coalesced``, a host algorithm handed device pointers (the fourth GPU read, P5). The recipe runs neither
  gradient nor parameter overlap (``megatron/optimizer.py``), so every such collective is synchronous anyway.

1. Offload: each rank, per ``actor.offload`` tier, ``torch.cuda.memory_allocated`` before, while offloaded and after
   the reload (device bytes freed against what ``megatron/offload.py`` says it released; all back after the reload),
   and the offload / reload GB/s of the copied bytes beside a pinned ``copy_`` of the same bytes.
2. IPC: both ranks walk the colocated IPC sync's bucket sequence (``rollout/ipc.py: ipc_buckets``: the TP all-gather
   on CUDA tensors) and export their buckets by CUDA-IPC handle through the real ``_ipc_push``; each rank is given a
   GPU UUID of its own (``<uuid>#rank<r>``, both on the one physical GPU) so that both ranks export; rank 0 ships the
   handles to the receiver, whose two workers (the real ``IpcReceiverMixin.da3po_ipc_load``, one per rank's UUID)
   map them and hash every tensor. Fails unless both workers received every HF tensor with the bytes of
   ``export_policy`` (sha256).

``--small`` on a CPU machine runs the same processes and code over gloo with CPU tensors (bf16, the one-GPU plan's
one-at-a-time collectives, torch's AdamW), with a stand-in for the CUDA-IPC export named as such: the bucket is put in
shared memory and its pickled handle travels instead (torch.multiprocessing's file_system strategy); there the
offload step reports the bookkeeping only (no device).

    python tools/gpu/check_colocated_gpu.py [--small] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import pickle
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class TrainPlan:
    """How the check trains its TP 2 policy here (:func:`train_plan`)."""

    backend: str  # the policy world's torch.distributed backend
    rank_devices: tuple[int, int]  # each rank's CUDA device index (0, 0 on one GPU and on CPU)
    one_by_one: bool  # megatron-core's coalesced DP collectives issued one at a time (:func:`one_by_one`)
    params_dtype: str  # model.params_dtype
    optimizer: str  # what megatron-core builds: "TE FusedAdam" or "torch AdamW"
    said: tuple[str, ...]  # what differs from the recipe here, and why (printed before the run)

    def overrides(self) -> tuple[str, ...]:
        return ("actor.offload=all", f"model.params_dtype={self.params_dtype}")


def train_plan(cuda: bool, gpus: int, te_error: str | None) -> TrainPlan:
    """The recipe's way where the machine allows it (module doc): NCCL with a GPU per rank, else gloo with megatron's
    coalesced collectives one at a time (on CPU too, so the CPU exercise runs the one-GPU path's code); bf16 with
    fp32 master shards; TE's FusedAdam when ``te_error`` is None on CUDA (``model.te_import_error``), else torch's
    AdamW, said."""
    said = []
    if cuda and gpus >= 2:
        backend, devices, one = "nccl", (0, 1), False
    elif cuda:
        backend, devices, one = "gloo", (0, 0), True
        said.append("one GPU: NCCL refuses two ranks on one device, so the ranks run gloo with CUDA tensors (its "
                    "single collectives stage through host memory) and megatron-core's coalesced DP collectives are "
                    "issued one at a time (gloo's coalesced all-gather has no CUDA path)")
    else:
        backend, devices, one = "gloo", (0, 0), True
    if cuda and te_error is None:
        optimizer = "TE FusedAdam"
    else:
        optimizer = "torch AdamW"
        said.append("Transformer-Engine not importable (" + (te_error or "no CUDA") + "): megatron-core builds "
                    "torch's AdamW and Megatron's local layer spec -- TE's FusedAdam, the recipe's optimizer on GPU, "
                    "is NOT covered by this run")
    return TrainPlan(backend, devices, one, "bfloat16", optimizer, tuple(said))


class _Done:
    """What a synchronous coalescing manager hands back (megatron-core ignores it when ``async_op`` is False)."""

    def wait(self) -> None:
        return None


def one_by_one(count: list[int]):
    """A stand-in for ``torch.distributed._coalescing_manager`` that coalesces nothing: the collectives inside run
    one by one as issued (each synchronous: the recipe overlaps neither gradient reduction nor parameter gathering),
    so gloo takes its single-op CUDA paths: ``all_gather_into_tensor`` -> ``ProcessGroupGloo::_allgather_base`` ->
    ``allgather`` (``AsyncAllgatherCUDAWork``), ``reduce_scatter_tensor`` -> ``reduce_scatter_tensor_coalesced``
    (a clone and ``allreduce``, which has a CUDA path) -- pytorch ``torch/csrc/distributed/c10d/ProcessGroupGloo.cpp``
    (read from the code index, not pinned to the image's 2.11). ``count[0]`` counts the uses."""

    @contextlib.contextmanager
    def _coalescing_manager(group=None, device=None, async_ops: bool = False):
        if async_ops:
            raise RuntimeError("one_by_one: an asynchronous coalesced collective (overlap_grad_reduce / "
                               "overlap_param_gather), which the recipe does not use")
        count[0] += 1
        yield _Done()

    return _coalescing_manager


def install_one_by_one() -> list[int]:
    """Replace megatron-core's coalescing manager (the name ``distributed/param_and_grad_buffer.py`` imported, 13)
    with :func:`one_by_one`; returns its use count."""
    from da3po_megatron.megatron.model import import_megatron_core

    import_megatron_core()  # first, as the policy ranks do (a broken Transformer-Engine is hidden)
    from megatron.core.distributed import param_and_grad_buffer

    count = [0]
    param_and_grad_buffer._coalescing_manager = one_by_one(count)
    return count


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


def receiver(requests, answers, uuids: list[str], cuda: bool, devices: tuple[int, int] = (0, 0)) -> None:
    """The engines' stand-in: one worker per UUID (on ``devices``: the GPU of the rank with that UUID), each maps its
    own handle and hashes what it loaded."""
    from da3po_megatron.rollout import ipc

    if not cuda:
        _standin_ipc(ipc)
    got: dict[str, dict[str, str]] = {u: {} for u in uuids}

    class Worker(ipc.IpcReceiverMixin):
        def __init__(self, uuid: str, index: int) -> None:
            self.uuid, self.index = uuid, index

        def _da3po_cuda_index(self) -> int:
            return self.index

        def da3po_load_bucket(self, tensors: dict) -> dict:
            got[self.uuid].update({n: _digest(t) for n, t in tensors.items()})
            return {"tensors": len(tensors)}

    workers = [Worker(u, i) for u, i in zip(uuids, devices)]
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


def policy_rank(rank: int, port: int, hf: str, requests, answers, out: str, cuda: bool, bucket: int,
                plan: dict, uuids: list[str]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(plan["rank_devices"][rank]), OMP_NUM_THREADS="1")
    import da3po_megatron.megatron.runtime as runtime
    from da3po_megatron.bridge.export import export_policy
    from da3po_megatron.megatron.batching import PolicyBatch
    from da3po_megatron.rollout import ipc
    from da3po_megatron.rollout.ipc_routing import plan_ipc_routes
    from da3po_megatron.testing.policy_job import ADVANTAGES, small_policy
    from da3po_megatron.testing.policy_selfcheck import fixed_batch

    runtime.backend = lambda: plan["backend"]  # train_plan: NCCL with a GPU per rank, else gloo
    one = install_one_by_one() if plan["one_by_one"] else None
    w = small_policy(hf, tp=2, overrides=TrainPlan(**plan).overrides(),
                     store=runtime.join_rendezvous("127.0.0.1", port))  # served by the parent (main)
    import megatron.core.optimizer as mo  # (after the policy: megatron-core is imported through import_megatron_core)

    prompts, responses = fixed_batch()
    lp = w.compute_logprobs(PolicyBatch(prompts, responses))
    w.train_step(PolicyBatch(prompts, responses, lp, ADVANTAGES))  # Adam's state exists now
    inner = type(w.optimizer.optimizer)
    masters = [p for g in w.optimizer.optimizer.param_groups for p in g["params"]]
    res: dict = {"rank": rank, "device": str(w.device), "offload": [],
                 "trained": {"backend": torch.distributed.get_backend(), "optimizer": f"{inner.__module__}."
                             f"{inner.__name__}", "torch_optimizer": bool(mo.USING_PYTORCH_OPTIMIZER),
                             "params_dtype": str(next(w.model.parameters()).dtype).replace("torch.", ""),
                             "master_dtype": str(masters[0].dtype).replace("torch.", "") if masters else None,
                             "coalesced_one_by_one": one[0] if one else None}}

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

    if not cuda:
        _standin_ipc(ipc)
    mine = uuids[rank]
    ipc.gpu_uuid = lambda index=None: mine
    places = [{"rank": r, "uuid": uuids[r], "tp": r, "pp": 0, "dp": 0} for r in range(2)]
    routes = plan_ipc_routes(places, [[uuids[0]], [uuids[1]]])

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


def trained_as_planned(plan: TrainPlan, trained: dict) -> bool:
    """What a rank reports it trained with agrees with the plan: backend, bf16 parameters with fp32 master shards,
    TE's FusedAdam exactly when planned, and megatron's coalesced collectives through :func:`one_by_one` when
    planned (at least one use: the grad reduce-scatter and the parameter all-gather of the step)."""
    return (trained["backend"] == plan.backend and trained["params_dtype"] == plan.params_dtype
            and trained["master_dtype"] == "float32"
            and (plan.optimizer == "TE FusedAdam") == (not trained["torch_optimizer"])
            and (not plan.one_by_one or (trained["coalesced_one_by_one"] or 0) > 0))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="CPU exercise (tiny model, shared-memory IPC stand-in)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from da3po_megatron import tiny
    from da3po_megatron.megatron.runtime import bind_rendezvous

    cuda = torch.cuda.is_available()
    if not cuda and not args.small:
        raise SystemExit("no CUDA: run with --small for the CPU exercise")
    te_error = None
    if cuda:
        from da3po_megatron.megatron.model import te_import_error

        te_error = te_import_error()
    plan = train_plan(cuda, torch.cuda.device_count() if cuda else 0, te_error)
    print(f"trains: {plan.backend}, {plan.params_dtype} with fp32 master shards, {plan.optimizer}, ranks on "
          + (", ".join(f"cuda:{i}" for i in plan.rank_devices) if cuda else "cpu")
          + (", megatron's coalesced collectives one at a time" if plan.one_by_one else ""))
    for line in plan.said:
        print(f"note: {line}")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as d:
        kw = tiny.real_shape("Qwen3-8B")
        if not args.small:
            kw.update(num_layers=4, hidden_size=1024, ffn_hidden_size=3072)
        hf = tiny.build_model(Path(d) / "hf", kw.pop("family"), 0, **kw)
        requests, answers = ctx.Queue(), ctx.Queue()
        uuids = ["GPU-cpu-standin#rank0", "GPU-cpu-standin#rank1"]
        if cuda:
            from da3po_megatron.rollout.ipc import gpu_uuid

            real = [gpu_uuid(i) for i in plan.rank_devices]  # two ranks on one GPU: each given a name of its own
            uuids = [f"{u}#rank{r}" for r, u in enumerate(real)] if real[0] == real[1] else real
        bucket = (256 if args.small else 8192) * 1024
        t0 = time.perf_counter()
        rec = ctx.Process(target=receiver, args=(requests, answers, uuids, cuda, plan.rank_devices))
        rec.start()
        store = bind_rendezvous(2)  # the ranks' rendezvous, bound before they are told its port (issue 55)
        ranks = [ctx.Process(target=policy_rank, args=(r, store.port, str(hf), requests, answers, d, cuda, bucket,
                                                       asdict(plan), uuids)) for r in range(2)]
        for p in ranks:
            p.start()
        for p in ranks:
            p.join(timeout=600)
        rec.join(timeout=30)
        codes = [p.exitcode for p in ranks] + [rec.exitcode]
        if any(c != 0 for c in codes):
            raise SystemExit(f"colocated check: process exit codes {codes} (ranks 0, 1, receiver)")
        parts = [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(2)]
    res = {"check": "colocated", "cuda": cuda, "seconds": time.perf_counter() - t0, "plan": asdict(plan),
           "optimizer": parts[0]["trained"]["optimizer"], "ranks": parts}
    ok = all(parts[0]["ipc"]["engines_ok"].values()) and len(parts[0]["ipc"]["engines_ok"]) == 2
    for p in parts:
        t = p["trained"]
        print(f"rank {p['rank']} trained: {t['backend']}, params {t['params_dtype']}, masters {t['master_dtype']}, "
              f"{t['optimizer']}" + (f", {t['coalesced_one_by_one']} coalesced blocks issued one at a time"
                                     if plan.one_by_one else ""))
        ok &= trained_as_planned(plan, t)
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
