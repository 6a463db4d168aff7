"""What the torchrun jobs of tests/test_megatron_policy.py (:mod:`policy_selfcheck`, tests/_policy_*.py) and the GPU
checks share: the small policy they build, the batch's advantages, and the ending (rank 0 writes the JSON, every rank
waits, the worker shuts down)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from da3po_megatron.bridge.export import load_policy_hf
from da3po_megatron.bridge.hf_config import gpt_arch
from da3po_megatron.config import Config, standalone_policy_config
from da3po_megatron.megatron.policy import PolicyWorker

ADVANTAGES = [1.0, -1.0, 2.0, 0.5, -1.0, 2.0, -0.5, 1.0]  # one per response of selfcheck.fixed_batch(), as selfcheck


# the small policy's settings, as run-config overrides (float32, lr 1e-4, Adam eps 1e-4, weight decay 0.01, clip 1,
# micro-batches of 24 tokens, the torch loss of da3po; one mini-batch per step)
SMALL_POLICY = ["model.params_dtype=float32", "optim.lr=1e-4", "optim.adam_eps=1e-4", "optim.weight_decay=0.01",
                "optim.clip_grad=1.0", "actor.max_tokens_per_microbatch=24", "actor.loss_backend=torch",
                "actor.ppo_mini_batch_size=512", "data.train_batch_size=512", "trainer.seed=1234"]


def small_policy_config(hf: str, tp: int = 1, pp: int = 1, world_size: int | None = None, *,
                        padded_vocab: bool = True, overrides: tuple[str, ...] = ()) -> Config:
    """The run config of :func:`small_policy` (DP = the rest of ``world_size``, default WORLD_SIZE)."""
    world = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    return standalone_policy_config(hf, [
        *SMALL_POLICY, f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
        f"parallel.data_parallel_size={max(1, world // (tp * pp))}",
        *(["model.make_vocab_size_divisible_by=48"] if padded_vocab else []), *overrides])


def small_policy(hf: str, tp: int = 1, pp: int = 1, *, padded_vocab: bool = True,
                 overrides: tuple[str, ...] = (), store: Any = None) -> PolicyWorker:
    """The real PolicyWorker on ``hf`` at TP x PP (the rest of WORLD_SIZE: data parallel), lr 1e-4, micro-batches
    of 24 tokens. ``padded_vocab``: make_vocab_size_divisible_by=48 (128 -> 144 columns at TP=1, 192 at TP=2, where
    TP rank 1 holds 32 real and 64 padding columns). ``overrides``: more run-config overrides. ``store``: the
    world's rendezvous joined by this rank (a store its parent bound), else torchrun's environment."""
    w = PolicyWorker(small_policy_config(hf, tp, pp, padded_vocab=padded_vocab, overrides=overrides), gpt_arch(hf),
                     store=store)
    if not load_policy_hf(w, hf):
        raise RuntimeError(f"the HF weights in {hf} were not loaded")
    return w


def loss_backend(backend: str) -> str:
    """actor.loss_backend of a loss path: the kernel runs its chunked backend here."""
    return "chunked" if backend == "kernel" else backend


def finish(w: PolicyWorker, res: dict, out: str) -> int:
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(res))
    dist.barrier()
    w.shutdown()
    return 0


# ---- for the test files that launch these jobs (test_megatron_policy.py, test_policy_losses.py)
def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max((abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v)), default=0.0)


def launch(nproc: int, out: Path, *args: str, script: Path | None = None) -> dict:
    """torchrun ``nproc`` processes of the selfcheck (or of ``script``) writing JSON to ``out``; returns it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    target = [str(script)] if script else ["-m", "da3po_megatron.testing.policy_selfcheck"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
           *target, "--out", str(out), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return json.loads(out.read_text())
