"""A torchrun job for tests/test_export_parity.py: the weight sync's HF stream of a live TP x PP policy, and the
checkpoint that policy saves, for several models in one world.

Per ``--hf`` directory: the real PolicyWorker at TP x PP (vocabulary padded, 128 -> 192 rows at TP=2) loads the HF
weights through the bridge, takes one train step (so the exported weights are not the HF files' own), and then
(1) iterates :func:`da3po_megatron.bridge.export.export_policy` -- the stream ``push_policy_weights`` sends to the
engines -- saving what each pipeline stage's sending rank gets as ``OUT/{i}_sync_pp{stage}.pt``, and (2) saves a full
training checkpoint to ``OUT/{i}_ckpt`` (what ``da3po convert megatron-to-hf`` reads).

    python -m torch.distributed.run --nproc-per-node 4 tests/_export_parity.py --tp 2 --pp 2 --out OUT --hf A --hf B
"""

from __future__ import annotations

import argparse
import gc
import os
import random
from pathlib import Path

import torch

from da3po_megatron.bridge.export import export_policy
from da3po_megatron.megatron.batching import PolicyBatch
from da3po_megatron.testing.policy_job import ADVANTAGES, finish, small_policy


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", action="append", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    rng = random.Random(0)
    prompts = [[rng.randrange(6, 100) for _ in range(rng.randint(2, 6))] for _ in ADVANTAGES]
    responses = [[rng.randrange(6, 100) for _ in range(rng.randint(1, 8))] for _ in ADVANTAGES]
    res = {}
    w = None
    for i, hf in enumerate(args.hf):
        w = small_policy(hf, tp=args.tp, pp=args.pp)  # the same process groups for every model (same layout)
        lp = w.compute_logprobs(PolicyBatch(prompts, responses))
        res[hf] = {"step": w.train_step(PolicyBatch(prompts, responses, lp, ADVANTAGES)), "info": w.info()}
        sent = {name: t.detach().cpu().clone() for name, t in export_policy(w)}  # every rank iterates (collective)
        if w.tp_rank == 0 and w.dp_rank == 0:
            torch.save(sent, out / f"{i}_sync_pp{w.pp_rank}.pt")
        w.save(out / f"{i}_ckpt")
        if i + 1 < len(args.hf):
            del w
            gc.collect()
    return finish(w, res, str(out / "result.json"))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
