"""A torchrun job for tests/test_megatron_policy.py: the fused_linear loss backend against the kernel backend.

The real PolicyWorker at TP = WORLD_SIZE / PP (PP = 1, or 2 with ``--pp 2``) with the vocabulary padded
(make_vocab_size_divisible_by=48: 128 -> 144 columns at TP=1; 192 at TP=2, where TP rank 1 holds 32 real and 64
padding columns). Per sampling temperature it records, for backend "kernel" (kernel_backend="chunked", from the
logits) and "fused_linear" (from the final hidden states, no logits): the log-probs and entropies of
compute_logprobs, and for da3po (token-level fused loss) and grpo (log-probs + the per-sequence loss) the metrics of
one train step and the log-probs after it. Every step starts from one full checkpoint (weights, Adam moments, LR
schedule), so the steps differ only by the backend. A forward hook on the real output layer (last stage) counts the
logits it computes, summed over ranks: none with fused_linear. Rank 0 writes the JSON.

    python -m torch.distributed.run --nproc-per-node 2 tests/_policy_fused_linear.py --hf HF --ckpt D --out O [--pp 2]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from da3po_megatron.config import algorithm_config
from da3po_megatron.megatron.batching import PolicyBatch
from da3po_megatron.testing.policy_job import ADVANTAGES, finish, loss_backend, small_policy
from da3po_megatron.testing.policy_selfcheck import fixed_batch, perturbed

TEMPERATURES = (1.0, 0.7)
BACKENDS = ("kernel", "fused_linear")
ALGORITHMS = ("da3po", "grpo")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--pp", type=int, default=1)
    args = ap.parse_args()
    w = small_policy(args.hf, int(os.environ.get("WORLD_SIZE", 1)) // args.pp, args.pp)
    prompts, responses = fixed_batch()
    batch = PolicyBatch(prompts, responses)
    w.train_step(PolicyBatch(prompts, responses, perturbed(w.compute_logprobs(batch)), ADVANTAGES))
    w.save(args.ckpt)  # after one step, so that the checkpoint holds Adam moments
    logits_calls = [0]
    if w.is_last_stage:
        w._bare.output_layer.register_forward_hook(lambda *_: logits_calls.__setitem__(0, logits_calls[0] + 1))
    res: dict = {"info": w.info(), "tied": bool(w._bare.share_embeddings_and_output_weights), "runs": {},
                 "backend_names": {}, "output_layer_calls": {b: 0 for b in BACKENDS}}

    def counted(backend: str, fn, *a, **kw):
        before = logits_calls[0]
        out = fn(*a, **kw)
        res["output_layer_calls"][backend] += logits_calls[0] - before
        return out

    for t in TEMPERATURES:
        run = res["runs"][str(t)] = {"logprobs": {}, "entropy": {}, "steps": {}}
        w.load(args.ckpt)
        for backend in BACKENDS:
            w.set_loss(algorithm_config("da3po"), loss_backend(backend), temperature=t)
            res["backend_names"][backend] = w.loss_backend_name()
            run["logprobs"][backend], run["entropy"][backend] = counted(backend, w.compute_logprobs, batch,
                                                                        return_entropy=True)
        old = perturbed(run["logprobs"]["kernel"])
        for algorithm in ALGORITHMS:
            for backend in BACKENDS:
                w.set_loss(algorithm_config(algorithm), loss_backend(backend), temperature=t)
                w.load(args.ckpt)
                metrics = counted(backend, w.train_step, PolicyBatch(prompts, responses, old, ADVANTAGES))
                run["steps"][f"{algorithm}/{backend}"] = {"metrics": metrics,
                                                          "logprobs_after": counted(backend, w.compute_logprobs,
                                                                                    batch)}
    calls = torch.tensor([res["output_layer_calls"][b] for b in BACKENDS], dtype=torch.float64)
    dist.all_reduce(calls)
    res["output_layer_calls"] = dict(zip(BACKENDS, calls.tolist()))
    return finish(w, res, args.out)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
