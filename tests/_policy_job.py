"""What the torchrun jobs of tests/test_megatron_policy.py (tests/_policy_*.py) share: the small policy they build,
the batch's advantages, and the ending (rank 0 writes the JSON, every rank waits, the worker shuts down)."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from da3po_megatron.bridge.export import load_policy_hf
from da3po_megatron.megatron.model import ModelOptions
from da3po_megatron.megatron.policy import BatchingOptions, LossOptions, OptimizerOptions, PolicyConfig, PolicyWorker
from da3po_megatron.megatron.runtime import ParallelLayout

ADVANTAGES = [1.0, -1.0, 2.0, 0.5, -1.0, 2.0, -0.5, 1.0]  # one per response of selfcheck.fixed_batch(), as selfcheck


def small_policy(hf: str, tp: int = 1, pp: int = 1, *, padded_vocab: bool = True,
                 loss: LossOptions | None = None) -> PolicyWorker:
    """The real PolicyWorker on ``hf`` at TP x PP (the rest of WORLD_SIZE: data parallel), lr 1e-4, micro-batches
    of 24 tokens. ``padded_vocab``: make_vocab_size_divisible_by=48 (128 -> 144 columns at TP=1, 192 at TP=2, where
    TP rank 1 holds 32 real and 64 padding columns)."""
    cfg = PolicyConfig(hf_dir=hf, layout=ParallelLayout(tp, pp),
                       model=ModelOptions(make_vocab_size_divisible_by=48) if padded_vocab else ModelOptions(),
                       optimizer=OptimizerOptions(lr=1e-4, adam_eps=1e-4, clip_grad=1.0),
                       loss=loss or LossOptions(),
                       batching=BatchingOptions(max_tokens_per_microbatch=24))
    w = PolicyWorker(cfg)
    if not load_policy_hf(w, hf):
        raise RuntimeError(f"the HF weights in {hf} were not loaded")
    return w


def finish(w: PolicyWorker, res: dict, out: str) -> int:
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(res))
    dist.barrier()
    w.shutdown()
    return 0
