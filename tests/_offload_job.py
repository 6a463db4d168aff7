"""A torchrun job for tests/test_offload.py: the real PolicyWorker trained twice from the same state, once plain and
once with the ``actor.offload`` cycle (tier "all", megatron/offload.py) around every generation phase, in the
colocated order: gradients + optimizer state off, the weight push (the export stream, hashed), parameters off,
"generation" (a forward and a train step must be refused, naming actor.offload), everything back, then old
log-probs and the training step. Records per mode the losses and gradient norms (exact, as float.hex), hashes of
every parameter and every Adam-state tensor per rank, the pushed bytes' hash per step, and for the offload mode: the
byte size of every covered storage while offloaded, whether the same tensor objects came back (ids and views), the
host buffers' pointers per cycle and host bytes against the covered bytes. Rank 0 writes the JSON.

    python -m torch.distributed.run --nproc-per-node 2 tests/_offload_job.py --hf HF --layout dp2|tp2|ep2 --out OUT

The second run starts from the first's starting point: HF weights reloaded, Adam's state cleared (torch's AdamW
creates it at the first step, as for a new optimizer), the LR schedule's state restored, the step counter reset.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import torch
import torch.distributed as dist

from da3po_megatron.bridge.export import export_policy, load_policy_hf
from da3po_megatron.megatron.batching import PolicyBatch
from da3po_megatron.megatron.offload import OffloadedError, _optimizers
from da3po_megatron.testing.policy_job import ADVANTAGES, finish, small_policy
from da3po_megatron.testing.policy_selfcheck import fixed_batch, perturbed

LAYOUTS = {"dp1": dict(tp=1, overrides=()),  # one rank: a quick local check, not in the test
           "dp2": dict(tp=1, overrides=()),
           "tp2": dict(tp=2, overrides=()),
           "ep2": dict(tp=1, overrides=("parallel.expert_model_parallel_size=2",
                                        "parallel.expert_tensor_parallel_size=1"))}
STEPS = 3


def _bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes, from a copy: ``.numpy()`` on a view marks the storage under it non-resizable for good."""
    return t.detach().reshape(-1).clone().view(torch.uint8).numpy().tobytes()


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(_bytes(t)).hexdigest()[:16]


def _state(w) -> dict:
    params = {n: _digest(p) for n, p in w._bare.named_parameters()}
    adam = {}
    for i, opt in enumerate(_optimizers(w.optimizer)):
        for j, st in enumerate(opt.state.values()):
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    adam[f"{i}.{j}.{k}"] = _digest(v)
    return {"params": params, "adam": adam}


def _objects(w) -> list[int]:
    """ids of every parameter, optimizer-state tensor and DDP bucket view (must be the same objects after reload)."""
    ids = [id(p) for p in w._bare.parameters()]
    for opt in _optimizers(w.optimizer):
        ids += [id(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    ids += [id(b.grad_data) for b in w.model.buffers + w.model.expert_parallel_buffers]
    return ids


def _push(w) -> str:
    h = hashlib.sha256()
    for name, t in export_policy(w):
        h.update(name.encode())
        h.update(_bytes(t))
    return h.hexdigest()[:16]


def run(w, offload: bool, prompts, responses) -> dict:
    out: dict = {"loss": [], "grad_norm": [], "push": [], "offloaded_sizes": [], "refused": [], "same_objects": [],
                 "host_pointers": [], "host_bytes": [], "covered_bytes": [], "freed": []}
    for _ in range(STEPS):
        # generation phase (the engines generate beside the policy): offloaded in the colocated order, then back
        if offload:
            ids = _objects(w)
            freed = w.offload_state(("grads", "optimizer"))
        out["push"].append(_push(w))
        if offload:
            freed.update(w.offload_state(("params",)))
            out["freed"].append(freed)
            out["offloaded_sizes"].append(w.offloader.sizes())
            refused = []
            for what, call in (("forward", lambda: w.compute_logprobs(PolicyBatch(prompts, responses))),
                               ("train", lambda: w.train_step(PolicyBatch(prompts, responses, [[0.0] * len(r) for r in
                                                                                                responses],
                                                                          ADVANTAGES)))):
                try:
                    call()
                    refused.append(f"{what}: not refused")
                except OffloadedError as e:
                    refused.append(f"{what}: {e}")
            out["refused"].append(refused)
            out["host_pointers"].append(w.offloader.host_pointers())
            out["host_bytes"].append(w.offloader.host_bytes())
            out["covered_bytes"].append(sum(s.nbytes for p in ("optimizer", "params")
                                            for s in w.offloader.storages(p)))
            w.reload_offloaded()
            out["same_objects"].append(_objects(w) == ids)
        lp = w.compute_logprobs(PolicyBatch(prompts, responses))
        m = w.train_step(PolicyBatch(prompts, responses, perturbed(lp), ADVANTAGES))
        out["loss"].append(float(m["loss"]).hex())
        out["grad_norm"].append(float(m["grad_norm"]).hex())
    out["state"] = _state(w)
    out["calls"] = list(w.offloader.calls)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    lay = LAYOUTS[args.layout]
    w = small_policy(args.hf, tp=lay["tp"], overrides=("actor.offload=all", *lay["overrides"]))
    prompts, responses = fixed_batch()
    sched = w.scheduler.state_dict()
    res: dict = {"info": w.info(), "distributed_optimizer": bool(w.cfg.optim.use_distributed_optimizer),
                 "optimizers": type(w.optimizer).__name__}
    per_rank = {}
    for mode in ("plain", "offload"):
        if mode == "offload":  # the plain run's starting point again
            load_policy_hf(w, args.hf)
            for opt in _optimizers(w.optimizer):
                opt.state.clear()
            w.scheduler.load_state_dict(sched)
            w.step = 0
        per_rank[mode] = run(w, mode == "offload", prompts, responses)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, per_rank)
    res["ranks"] = gathered
    return finish(w, res, args.out)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
