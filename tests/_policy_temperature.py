"""A torchrun job for tests/test_megatron_policy.py: the real PolicyWorker at a sampling temperature T.

TP = 2 with the vocabulary padded (128 -> 192 columns, so TP rank 1 holds 32 real and 64 padding columns): the
division by T meets vocab-parallel logits and masked padding. Per temperature it records the log-probs and entropies
of both loss backends, and the loss and gradient norm of one train step from the HF weights on each loss path -- the
torch loss (da3po), the fused kernel (da3po) and the kernel's log-probs under the per-sequence loss (grpo) -- for the
test to recompute with transformers. Rank 0 writes the JSON.

    python -m torch.distributed.run --nproc-per-node 2 tests/_policy_temperature.py --hf HF --out OUT
"""

from __future__ import annotations

import argparse
import os

from da3po_megatron.bridge.export import load_policy_hf
from da3po_megatron.config import algorithm_config
from da3po_megatron.megatron.batching import PolicyBatch
from da3po_megatron.testing.policy_job import ADVANTAGES, finish, loss_backend, small_policy
from da3po_megatron.testing.policy_selfcheck import fixed_batch, perturbed

TEMPERATURES = (0.7, 1.0)
LOSS_PATHS = (("da3po", "torch"), ("da3po", "kernel"), ("grpo", "kernel"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    w = small_policy(args.hf, tp=2)
    prompts, responses = fixed_batch()
    batch = PolicyBatch(prompts, responses)
    res: dict = {"info": w.info(), "advantages": ADVANTAGES, "runs": {}}
    for t in TEMPERATURES:
        run = res["runs"][str(t)] = {"logprobs": {}, "entropy": {}, "steps": {}}
        load_policy_hf(w, args.hf)  # the HF weights again (the previous temperature's steps moved them)
        for backend in ("torch", "kernel"):
            w.set_loss(algorithm_config("da3po"), loss_backend(backend), temperature=t)
            run["logprobs"][backend], run["entropy"][backend] = w.compute_logprobs(batch, return_entropy=True)
        old = run["old_logprobs"] = perturbed(run["logprobs"]["torch"])
        for algorithm, backend in LOSS_PATHS:
            w.set_loss(algorithm_config(algorithm), loss_backend(backend), temperature=t)
            load_policy_hf(w, args.hf)  # every step from the same weights (loss, grad norm: independent of Adam)
            run["steps"][f"{algorithm}/{backend}"] = w.train_step(PolicyBatch(prompts, responses, old, ADVANTAGES))
    return finish(w, res, args.out)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
