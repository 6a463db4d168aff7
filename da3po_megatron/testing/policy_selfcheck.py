"""Parallel-consistency self-check of the policy: run it at several TP x PP x DP layouts and compare the JSON outputs.

Every layout starts from the same weights (a model checkpoint written once by ``--init-base``) and a fixed synthetic
batch, then records: log-probs (packed and padded), entropies, the metrics of one DA3PO train step, the log-probs after
it, the exported full tensors before and after the step, and optionally a full checkpoint, a resume check (save after
step 1, step 2, load, step 2 again: identical), checkpoints of other layouts loaded here, the loss over a few steps on
the fixed batch, and the largest parameter difference between data-parallel replicas. The tests
(``tests/test_megatron_policy.py``) launch it with ``torchrun`` and assert; on a GPU cluster it checks a real install::

    python -m torch.distributed.run --nproc-per-node 1 -m da3po_megatron.testing.policy_selfcheck --hf HF --base B \\
        --init-base --out tp1.json
    python -m torch.distributed.run --nproc-per-node 2 -m da3po_megatron.testing.policy_selfcheck --hf HF --base B \\
        --tp 2 --out tp2.json

Only for small models: exports are written as whole tensors with ``--export``.
"""

from __future__ import annotations

import argparse
import os
import random

import torch
import torch.distributed as dist

from da3po_megatron.config import algorithm_config, standalone_policy_config
from da3po_megatron.megatron.batching import PolicyBatch
from da3po_megatron.megatron.policy import PolicyWorker
from da3po_megatron.testing.policy_job import finish


def fixed_batch(num: int = 8, vocab: int = 100, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of 2-7 tokens and responses of 1-12 tokens (one empty), ids in [6, vocab)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(6, vocab) for _ in range(rng.randint(2, 7))] for _ in range(num)]
    responses = [[rng.randrange(6, vocab) for _ in range(rng.randint(1, 12))] for _ in range(num)]
    responses[3] = []
    return prompts, responses


def perturbed(logprobs: list[list[float]], seed: int = 1, scale: float = 0.15) -> list[list[float]]:
    """Old log-probs near the current ones (so that some tokens are clipped), deterministic."""
    rng = random.Random(seed)
    return [[v + rng.gauss(0.0, scale) for v in row] for row in logprobs]


def _flat_params(w: PolicyWorker) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in w._bare.parameters()])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--base", required=True, help="model checkpoint every layout starts from")
    ap.add_argument("--init-base", action="store_true", help="write --base from this init first")
    ap.add_argument("--load-hf", action="store_true", help="initialise from the HF weights (bridge), not randomly")
    ap.add_argument("--out", required=True, help="JSON results (rank 0)")
    ap.add_argument("--export", default=None, help="prefix of .pt files with exported tensors (per PP stage)")
    ap.add_argument("--save-ckpt", default=None, help="full checkpoint after train step 1")
    ap.add_argument("--resume-check", action="store_true", help="step 2, load --save-ckpt, step 2 again")
    ap.add_argument("--load-ckpt", action="append", default=[], help="full checkpoints to load and score")
    ap.add_argument("--decrease-steps", type=int, default=0, help="train steps on the fixed batch from the base")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--algorithm", default="da3po")
    ap.add_argument("--loss-backend", default="torch", help="actor.loss_backend ('kernel' = 'chunked')")
    args = ap.parse_args(argv)
    # HF weights in and out through the bridge (a test harness, on its way to tests/: issue 14 item 5)
    from da3po_megatron.bridge.export import export_policy_state, load_policy_hf
    from da3po_megatron.bridge.hf_config import gpt_arch

    backend = "chunked" if args.loss_backend == "kernel" else args.loss_backend
    world = int(os.environ.get("WORLD_SIZE", 1))
    cfg = standalone_policy_config(args.hf, [
        "model.params_dtype=float32", f"parallel.tensor_model_parallel_size={args.tp}",
        f"parallel.pipeline_model_parallel_size={args.pp}",
        f"parallel.data_parallel_size={world // (args.tp * args.pp)}",
        f"optim.lr={args.lr}", "optim.adam_eps=1e-4", "optim.weight_decay=0.01", "optim.clip_grad=1.0",
        f"algorithm.name={args.algorithm}", f"actor.loss_backend={backend}",
        f"actor.max_tokens_per_microbatch={args.max_tokens}", "actor.ppo_mini_batch_size=512",
        "data.train_batch_size=512", "trainer.seed=1234"])
    w = PolicyWorker(cfg, gpt_arch(args.hf))
    res: dict = {"info": w.info(), "hf_loaded": bool(args.load_hf and load_policy_hf(w, args.hf))}
    if args.load_hf and not res["hf_loaded"]:
        raise RuntimeError(f"--load-hf: the HF weights in {args.hf} were not loaded")
    if args.init_base:
        w.save_model(args.base)
    w.load_model(args.base)

    prompts, responses = fixed_batch()
    batch = PolicyBatch(prompts, responses)
    lp, ent = w.compute_logprobs(batch, return_entropy=True)
    res["logprobs"], res["entropy"] = lp, ent
    res["logprobs_padded"] = w.compute_logprobs(batch, packing=False)
    export_owner = w.tp_rank == 0 and w.dp_rank == 0

    def export(tag: str) -> None:
        sd = export_policy_state(w)  # the weight sync's HF stream
        if args.export and export_owner:
            torch.save(sd, f"{args.export}_{tag}_pp{w.pp_rank}.pt")

    export("before")
    advantages = [1.0, -1.0, 2.0, 0.5, -1.0, 2.0, -0.5, 1.0]  # 2.0: DAA-amplified (Eq. 14) correct responses
    train = PolicyBatch(prompts, responses, perturbed(lp), advantages)
    res["step1"] = w.train_step(train)
    res["logprobs_after_step1"] = w.compute_logprobs(batch)
    export("after")
    flat = _flat_params(w)
    sizes = torch.tensor([flat.numel()])
    all_sizes = [torch.zeros_like(sizes) for _ in range(dist.get_world_size())]
    dist.all_gather(all_sizes, sizes)
    if len({int(s) for s in all_sizes}) == 1:
        gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
        coords = [None] * dist.get_world_size()
        dist.all_gather_object(coords, (w.tp_rank, w.pp_rank, w.dp_rank))
        diff = 0.0
        for i, ci in enumerate(coords):
            for j, cj in enumerate(coords):
                if ci[:2] == cj[:2] and ci[2] != cj[2]:
                    diff = max(diff, (gathered[i] - gathered[j]).abs().max().item())
        res["dp_param_max_diff"] = diff
    if args.save_ckpt:
        w.save(args.save_ckpt)
    if args.resume_check:
        res["step2"] = w.train_step(train)
        lp2 = w.compute_logprobs(batch)
        res["resume_load"] = w.load(args.save_ckpt)
        res["step2_resumed"] = w.train_step(train)
        lp2b = w.compute_logprobs(batch)
        res["resume_logprob_max_diff"] = max(abs(a - b) for x, y in zip(lp2, lp2b) for a, b in zip(x, y))
    res["loaded"] = {}
    for ck in args.load_ckpt:
        info = w.load(ck)
        res["loaded"][ck] = {"info": info, "logprobs": w.compute_logprobs(batch)}
    if args.decrease_steps:
        w.load_model(args.base)
        base_lp = w.compute_logprobs(batch)
        steady = PolicyBatch(prompts, responses, base_lp, advantages)
        res["decrease_losses"] = [w.train_step(steady)["loss"] for _ in range(args.decrease_steps)]
    res["algorithms"] = {}
    for algorithm in ("grpo", "gspo"):  # sequence-level normaliser / ratio: one step each from the base weights
        w.set_loss(algorithm_config(algorithm))
        w.load_model(args.base)
        res["algorithms"][algorithm] = w.train_step(train)
    return finish(w, res, args.out)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
