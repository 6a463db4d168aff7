"""A torchrun job for tests/test_sequence_parallel.py: the same policy with sequence parallelism off and on.

Two real PolicyWorkers in one world at the same layout (TP = ``--tp``, EP = ``--ep``, DP the rest), loaded from the
same HF weights, one with ``parallel.sequence_parallel=false`` and one with ``true``. Each computes the log-probs of
the fixed batch, then trains three steps on it (the same perturbed old log-probs and advantages), recording every
step's loss and gradient norm and the log-probs after the last. ``--moe``: the batch also carries engine routes
(random top-k sets, ``moe.routing_replay=rollout``), so both replay the same experts -- a wrong per-TP-rank slice of
the routes would replay other experts and change the log-probs -- and each step's router-agreement counts are
recorded (the same pairs must be counted once with SP as without).

megatron-core refuses to TRAIN a MoE layer at TP > 1 without SP (``transformer/moe/moe_layer.py`` 379-383, a guard
"performance may degrade", not a correctness check; ``attn_tp_group`` is read nowhere else in the layer). For the
SP-off reference of a MoE model the job swaps that attribute of each MoE layer for
:class:`_TPGroupSizeOneForTheMoEGuardOnly` (a stand-in, says so in its name), so the reference trains as megatron
would without the guard; the project's own start-up refusal of that layout (``policy.validate_config``) is lifted
for it the same way. Rank 0 writes the JSON.

    python -m torch.distributed.run --nproc-per-node 2 tests/_policy_sp.py --hf HF --out O --tp 2 [--ep 2 --moe]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from _policy_job import ADVANTAGES, finish, small_policy
from _policy_selfcheck import fixed_batch, perturbed

from da3po_megatron.megatron.batching import PolicyBatch

STEPS = 3


class _TPGroupSizeOneForTheMoEGuardOnly:
    """Stands in for ``MoELayer.attn_tp_group`` in the SP-off MoE reference only: megatron reads it only for its
    "MoE + TP without SP" training guard (``moe_layer.py`` 96, 379)."""

    def size(self) -> int:
        return 1


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
    if args.moe:  # the SP-off MoE reference: our own start-up check refuses it too (policy.validate_config)
        from dataclasses import replace

        from da3po_megatron.megatron import policy

        real = policy.validate_config

        def validate_as_if_sequence_parallel_for_the_reference(cfg, *a, **kw):
            return real(replace(cfg, parallel=replace(cfg.parallel, sequence_parallel=True)), *a, **kw)

        policy.validate_config = validate_as_if_sequence_parallel_for_the_reference
    for sp in (False, True) if args.tp > 1 else (False,):  # (TP 1: the single-rank-TP reference, by hand)
        workers[sp] = small_policy(args.hf, args.tp, overrides=(*common, f"parallel.sequence_parallel={sp}",
                                                                f"parallel.data_parallel_size={world // args.tp}"))
    if args.moe:
        from megatron.core.transformer.moe.moe_layer import MoELayer

        for m in workers[False]._bare.modules():
            if isinstance(m, MoELayer):
                m.attn_tp_group = _TPGroupSizeOneForTheMoEGuardOnly()
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
    return finish(workers[args.tp > 1], res, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
