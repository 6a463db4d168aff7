"""A torchrun job for tests/test_megatron_policy.py: train steps of the real PolicyWorker with token weights.

Every case starts from the same full checkpoint (model, Adam moments, LR schedule, RNG), so the steps differ only by
their batch. Per loss path -- the torch loss on the token-mean (da3po) and per-sequence (grpo) aggregations, and the
fused kernel (da3po) -- it records the metrics and the log-probs after one step of: no weights; weights all 1.0;
weights constant within each response; the same factors folded into the advantages instead; random per-token weights.
Rank 0 writes the JSON (with the batch, the old log-probs and the weights, for the test's reference loss).

    python -m torch.distributed.run --nproc-per-node 2 tests/_policy_token_weights.py --hf HF --ckpt DIR --out OUT
"""

from __future__ import annotations

import argparse
import os
import random

import torch.distributed as dist

from da3po_megatron.config import algorithm_config
from da3po_megatron.megatron.batching import PolicyBatch
from da3po_megatron.testing.policy_job import ADVANTAGES, finish, loss_backend, small_policy
from da3po_megatron.testing.policy_selfcheck import fixed_batch, perturbed

LOSS_PATHS = (("da3po", "torch"), ("da3po", "kernel"), ("grpo", "torch"))
CUSTOM_LOSS = f"{os.path.join(os.path.dirname(os.path.abspath(__file__)), '_custom_loss.py')}:half_policy_loss"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    # world of WORLD_SIZE ranks at TP = PP = 1: data parallel
    w = small_policy(args.hf, padded_vocab=False)  # da3po, torch loss
    prompts, responses = fixed_batch()
    w.train_step(PolicyBatch(prompts, responses, perturbed(w.compute_logprobs(PolicyBatch(prompts, responses))),
                             ADVANTAGES))  # one step first, so that the checkpoint holds Adam moments
    lp = w.compute_logprobs(PolicyBatch(prompts, responses))
    old = perturbed(lp)
    w.save(args.ckpt)

    rng = random.Random(3)
    per_response = [rng.uniform(0.1, 2.0) for _ in responses]
    per_token = [[rng.uniform(0.05, 2.0) for _ in r] for r in responses]
    cases = {
        "plain": PolicyBatch(prompts, responses, old, ADVANTAGES),
        "ones": PolicyBatch(prompts, responses, old, ADVANTAGES, token_weights=[[1.0] * len(r) for r in responses]),
        "per_response": PolicyBatch(prompts, responses, old, ADVANTAGES,
                                    token_weights=[[c] * len(r) for c, r in zip(per_response, responses)]),
        "scaled_advantages": PolicyBatch(prompts, responses, old, [a * c for a, c in zip(ADVANTAGES, per_response)]),
        "per_token": PolicyBatch(prompts, responses, old, ADVANTAGES, token_weights=per_token),
    }
    res: dict = {"world_size": dist.get_world_size(), "logprobs": lp, "old_logprobs": old, "advantages": ADVANTAGES,
                 "per_token_weights": per_token, "paths": {}}
    for algorithm, backend in LOSS_PATHS:
        w.set_loss(algorithm_config(algorithm), loss_backend(backend))
        out = res["paths"][f"{algorithm}/{backend}"] = {}
        for name, batch in cases.items():
            w.load(args.ckpt)
            out[name] = {"metrics": w.train_step(batch),
                         "logprobs_after": w.compute_logprobs(PolicyBatch(prompts, responses))}
    # a custom loss by import path (algorithm.policy_loss_fn) on the real policy: half the built-in loss, also
    # with a kernel backend (which must then compute log-probs only and call the custom function)
    res["custom_loss"] = {}
    for backend in ("torch", "kernel"):
        w.set_loss(algorithm_config("da3po", policy_loss_fn=CUSTOM_LOSS), loss_backend(backend))
        w.load(args.ckpt)
        res["custom_loss"][backend] = {"metrics": w.train_step(cases["plain"]), "name": w.loss_backend_name()}
    w.set_loss(algorithm_config("gspo"), "torch")
    try:
        w.train_step(cases["per_token"])
        res["gspo_error"] = None
    except ValueError as e:
        res["gspo_error"] = str(e)
    return finish(w, res, args.out)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
