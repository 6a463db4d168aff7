"""Step time with a checkpoint every step, synchronous vs asynchronous (issue 39), on the real policy.

    python tools/measure/async_checkpoint.py [--model DIR] [--steps 4] [--out runs/bench/async_ckpt.json]

One policy rank (megatron-core on gloo, the trainer's ``PolicyWorker``) on SmolLM2-135M-Instruct (built offline by
``da3po_megatron/testing/real_model.py``, docs/real_model.md) trains ``--steps`` RL updates on a fixed batch (8
responses x 48 tokens after 32 prompt tokens) and saves a checkpoint after every one through the trainer's own
``CheckpointManager`` (temporary directory, manifest + CRC-32, ``COMPLETE``, rename, ``latest``):

- ``sync``: ``save`` = the policy's dist_checkpointing save + the manifest, all inside the step;
- ``async``: the policy's shards are scheduled (megatron-core's asynchronous save,
  ``megatron/checkpoint_async.py``), the next step starts at once; after each train step a non-blocking finalize
  completes the previous checkpoint if its writer is done (``latest`` moves then), and the next save first completes
  the one in flight (at most one) --
  the trainer's order (``trainer/run.py``: ``poll_checkpoint`` / ``save_checkpoint``).

Reported per mode: the mean step time (train + everything the step waits for), the time from the end of a step's
train phase to the next step's start (the checkpoint's cost to the loop), and, for async, how long after it began a
checkpoint became ``latest``. Resume exactness is the fault suite's (tests/test_reliability_faults.py). Run it on a
quiet machine for numbers to quote; docs/operations.md has the measured ones and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _batch(w, vocab: int):
    import random

    from da3po_megatron.megatron.batching import PolicyBatch

    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab) for _ in range(32)] for _ in range(8)]
    responses = [[rng.randrange(10, vocab) for _ in range(48)] for _ in range(8)]
    lp = w.compute_logprobs(PolicyBatch(prompts, responses))
    adv = [1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 1.0, -1.0]
    return PolicyBatch(prompts, responses, old_logprobs=[[float(v) for v in row] for row in lp], advantages=adv)


def run_mode(w, batch, mode: str, steps: int, root: Path) -> dict:
    from da3po_megatron.trainer.resume.checkpoint import CheckpointManager

    shutil.rmtree(root, ignore_errors=True)
    ckpt = CheckpointManager(root, keep_last=1)
    pending, began = None, 0.0
    step_s, gap_s, complete_after = [], [], []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        w.train_step(batch)
        t_train = time.perf_counter()
        if mode == "async":
            if pending is not None and w.finalize_save(False):  # the previous write is done: it becomes latest
                ckpt.finish(pending)
                complete_after.append(time.perf_counter() - began)
                pending = None
            if pending is not None:  # at most one in flight
                ckpt.finish(pending, wait=lambda: w.finalize_save(True))
                complete_after.append(time.perf_counter() - began)
            began = time.perf_counter()
            pending = ckpt.start(step, lambda p: w.save(p, async_save=True), {"step": step})
        else:
            ckpt.save(step, lambda p: w.save(p), {"step": step})
        t_next = time.perf_counter()
        step_s.append(t_next - t0)
        gap_s.append(t_next - t_train)
        print(f"  {mode} step {step}: {step_s[-1]:.2f} s (train {t_train - t0:.2f} s, then {gap_s[-1]:.2f} s to the "
              f"next step's start)", flush=True)
    if pending is not None:
        ckpt.finish(pending, wait=lambda: w.finalize_save(True))
        complete_after.append(time.perf_counter() - began)
    size = sum(f.stat().st_size for f in (root / "checkpoints").rglob("*") if f.is_file())
    # the first step pays one-time costs (writer start-up, first plans): report the steady state (steps 2..N)
    tail = slice(1, None) if steps > 1 else slice(None)
    return {"mode": mode, "steps": steps, "step_s": step_s, "gap_s": gap_s,
            "mean_step_s": statistics.mean(step_s[tail]), "mean_gap_s": statistics.mean(gap_s[tail]),
            "checkpoint_complete_after_s": complete_after, "checkpoint_bytes": size}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model directory (default: SmolLM2 from "
                    "da3po_megatron.testing.real_model)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "runs/bench/async_checkpoint.json"))
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    if args.model is None:
        from da3po_megatron.testing.real_model import smollm2_dir

        args.model = str(smollm2_dir())
    from da3po_megatron.bridge.export import load_policy_hf
    from da3po_megatron.bridge.hf_config import gpt_arch
    from da3po_megatron.config import standalone_policy_config
    from da3po_megatron.megatron.checkpoint import prewarm_writer
    from da3po_megatron.megatron.policy import PolicyWorker

    cfg = standalone_policy_config(args.model, ["model.params_dtype=float32", "actor.max_tokens_per_microbatch=640",
                                                "actor.loss_backend=torch", "rollout.n=8", "data.train_batch_size=1",
                                                "actor.ppo_mini_batch_size=1", "optim.lr=1e-6"])
    arch = gpt_arch(args.model)
    w = PolicyWorker(cfg, arch, rank=0, world_size=1)  # binds port 0 itself
    load_policy_hf(w, args.model)
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="da3po-async-ckpt-"))
    print(f"prewarm of the checkpoint writer: {prewarm_writer(work / '.prewarm'):.2f} s", flush=True)
    batch = _batch(w, arch.vocab_size)
    results = {}
    try:
        for mode in ("sync", "async"):
            results[mode] = run_mode(w, batch, mode, args.steps, work / mode)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        w.shutdown()
    s, a = results["sync"], results["async"]
    summary = {"model": args.model, "cpus": os.cpu_count(), "load_avg": os.getloadavg(), **results,
               "speedup_step": s["mean_step_s"] / a["mean_step_s"],
               "saved_per_step_s": s["mean_step_s"] - a["mean_step_s"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"checkpoint {s['checkpoint_bytes'] / 2**30:.2f} GiB per step; steps 2..{args.steps}: sync step "
          f"{s['mean_step_s']:.2f} s (next step starts {s['mean_gap_s']:.2f} s after train), async step "
          f"{a['mean_step_s']:.2f} s (next step starts {a['mean_gap_s']:.2f} s after train; checkpoints complete "
          f"{statistics.mean(a['checkpoint_complete_after_s']):.2f} s after they began) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
