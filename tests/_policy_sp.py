"""A torchrun job for tests/test_sequence_parallel.py: the same policy with sequence parallelism off and on.

Two real PolicyWorkers in one world at the same layout (TP = ``--tp``, EP = ``--ep``, DP the rest), loaded from the
same HF weights, one with ``parallel.sequence_parallel=false`` and one with ``true``. Each computes the log-probs of
the fixed batch, then trains three steps on it (the same perturbed old log-probs and advantages), recording every
step's loss and gradient norm and the log-probs after the last. ``--moe``: the batch also carries engine routes
(random top-k sets, ``moe.routing_replay=rollout``), so both replay the same experts -- a wrong per-TP-rank slice of
the routes would replay other experts and change the log-probs -- and each step's router-agreement counts are
recorded (the same pairs must be counted once with SP as without).

megatron-core refuses to TRAIN a MoE layer at TP > 1 without SP (``transformer/moe/moe_layer.py`` 379-383; the
project's start-up check refuses that layout too, ``policy_config.validate_config``, lifted here for the SP-off worker
so that it can be built): for ``--moe`` at TP > 1 the SP-off worker computes the log-probs (eval passes run) and records
the refusal of its first train step; the training reference is the same job at ``--tp 1`` (TP 1 x EP 2 on 2 ranks: the
same DP 2 split, no sequence to split). Rank 0 writes the JSON.

    python -m torch.distributed.run --nproc-per-node 2 tests/_policy_sp.py --hf HF --out O --tp 2 [--ep 2 --moe]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from torch.overrides import TorchFunctionMode

from da3po_megatron.megatron.batching import PolicyBatch
from da3po_megatron.testing.policy_job import ADVANTAGES, finish, small_policy
from da3po_megatron.testing.policy_selfcheck import fixed_batch, perturbed

STEPS = 3


def _routes(prompts, responses, layers: int, experts: int, k: int, seed: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for p, r in zip(prompts, responses):
        n = len(p) + len(r) - 1
        out.append(np.argsort(rng.random((n, layers, experts)), axis=-1)[..., :k].astype(np.uint8))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--moe", action="store_true")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    common = (f"parallel.expert_model_parallel_size={args.ep}",
              *(["parallel.expert_tensor_parallel_size=1", "moe.routing_replay=rollout"] if args.moe else []))
    workers = {}
    if args.moe:  # the SP-off MoE reference: our own start-up check refuses it too (policy_config.validate_config)
        from dataclasses import replace

        from da3po_megatron.megatron import policy_config

        real = policy_config.validate_config

        def validate_as_if_sequence_parallel_for_the_reference(cfg, *a, **kw):
            return real(replace(cfg, parallel=replace(cfg.parallel, sequence_parallel=True)), *a, **kw)

        policy_config.validate_config = validate_as_if_sequence_parallel_for_the_reference
    for sp in (False, True) if args.tp > 1 else (False,):  # (TP 1: the single-rank-TP reference, by hand)
        workers[sp] = small_policy(args.hf, args.tp, overrides=(*common, f"parallel.sequence_parallel={sp}",
                                                                f"parallel.data_parallel_size={world // args.tp}"))
    prompts, responses = fixed_batch()
    routes = None
    if args.moe:
        arch = workers[False].arch
        routes = _routes(prompts, responses, sum(arch.moe_pattern()), arch.num_moe_experts, arch.moe_router_topk)
    batch = PolicyBatch(prompts, responses, routed_experts=routes)
    res: dict = {"world": world, "tp": args.tp, "ep": args.ep, "moe": args.moe}
    old = None
    for sp, w in workers.items():
        t0 = time.perf_counter()
        lp = w.compute_logprobs(batch)
        old = old or perturbed(lp)
        train = PolicyBatch(prompts, responses, old, ADVANTAGES, routed_experts=routes)
        if args.moe and args.tp > 1 and not sp:  # megatron-core refuses it (module doc): log-probs only
            try:
                w.train_step(train)
                refusal = None
            except ValueError as e:
                refusal = str(e)
            res["sp0"] = {"logprobs": lp, "train_refused": refusal, "sequence_parallel": w.sequence_parallel}
            continue
        steps = [w.train_step(train) for _ in range(STEPS)]
        res[f"sp{int(sp)}"] = {
            "info": w.info(), "sequence_parallel": w.sequence_parallel, "logprobs": lp,
            "config_sequence_parallel": bool(w._bare.config.sequence_parallel),
            "sequence_parallel_params": sorted(n for n, q in w._bare.named_parameters()
                                               if getattr(q, "sequence_parallel", False)),
            "loss": [s["loss"] for s in steps], "grad_norm": [s["grad_norm"] for s in steps],
            "route_pairs": [s.get("route_pairs") for s in steps],
            "router_agreement": [s.get("router_agreement") for s in steps],
            "router_agreement_own": [s.get("router_agreement_own") for s in steps],
            "logprobs_after": w.compute_logprobs(batch), "seconds": time.perf_counter() - t0}
    if args.moe:
        res["route_copies"] = _route_copies(workers[args.tp > 1], batch)
    return finish(workers[args.tp > 1], res, args.out)


class _CountHostCopies(TorchFunctionMode):
    """Counts the tensor calls that copy device memory to the host or read a tensor into Python: ``.cpu()``,
    ``.to("cpu")``, ``.tolist()``, ``.item()``, ``.numpy()``. On CPU nothing moves, but the calls are those a GPU
    would make; ``.to(<the compute device>)`` is not one (on a GPU it stays on the GPU)."""

    NAMES = ("cpu", "tolist", "item", "numpy")

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_host = name == "to" and any(isinstance(a, str) and a == "cpu" for a in (*args[1:], kwargs.get("device")))
        if name in self.NAMES or to_host:
            self.count += 1
        return func(*args, **kwargs)


def _route_copies(w, batch: PolicyBatch) -> dict[str, int]:
    """Host copies of ONE micro-batch's forward (the schedule's forward step: routes put on the routers, the
    forward, the router-agreement counts), with the engine routes and without them: the difference is what the
    route bookkeeping costs (issue 46 M6: at most one)."""
    import torch

    shard = w.schedule.dp_shard(batch)
    got = {}
    for name, b in (("with_routes", batch), ("without", PolicyBatch(batch.prompt_ids, batch.response_ids))):
        mbs = w.schedule.microbatches(b, shard, 10 ** 6, True)
        assert len(mbs) == 1
        w.model.eval()
        with torch.no_grad(), _CountHostCopies() as counter:
            w.schedule.run(mbs, lambda mb, output, non_loss_data=False: None, w.loss_backend, forward_only=True)
        got[name] = counter.count
    w.schedule.take_route_counts()
    return got


if __name__ == "__main__":
    raise SystemExit(main())
