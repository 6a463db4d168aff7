"""torchrun job of tests/test_operations.py: megatron-core's asynchronous dist-checkpoint save on CPU / gloo.

Each rank builds the small policy (da3po_megatron/testing/policy_job.py), trains one step, schedules an asynchronous
save of it, trains ANOTHER step while the save may still be writing (so the live weights move on), finalizes the save,
and then checks that the checkpoint holds the weights of the step it was scheduled at: its HF export equals the live
model's export taken at scheduling time, bit for bit. Rank 0 writes the facts to ``$OUT``."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from da3po_megatron.bridge.export import export_checkpoint, export_policy_state  # noqa: E402
from da3po_megatron.megatron.batching import PolicyBatch  # noqa: E402
from da3po_megatron.megatron.checkpoint_async import async_save_in_flight  # noqa: E402
from da3po_megatron.testing.policy_job import ADVANTAGES, small_policy  # noqa: E402
from da3po_megatron.testing.policy_selfcheck import fixed_batch  # noqa: E402


def batch(w) -> PolicyBatch:
    prompts, responses = fixed_batch()
    b = PolicyBatch(prompts, responses)
    lp = w.compute_logprobs(b)
    return PolicyBatch(prompts, responses, old_logprobs=[list(x) for x in lp],
                       advantages=ADVANTAGES[:len(prompts)])


def main() -> None:
    hf, ckpt, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    tp = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    w = small_policy(hf, tp=tp)
    w.train_step(batch(w))
    at_schedule = export_policy_state(w)
    t0 = time.perf_counter()
    w.save(ckpt, async_save=True)
    scheduled_s = time.perf_counter() - t0
    in_flight = async_save_in_flight()
    loadable_before = (ckpt / "model" / "metadata.json").exists()
    refused = ""
    try:
        w.save(ckpt.parent / "second", async_save=True)
    except RuntimeError as e:
        refused = str(e)
    w.train_step(batch(w))  # the live weights move on while the writer may still run
    moved = export_policy_state(w)
    polls = 0
    while not w.finalize_save(blocking=False):
        polls += 1
        time.sleep(0.05)
    total_s = time.perf_counter() - t0
    facts = {"scheduled_s": scheduled_s, "total_s": total_s, "polls": polls, "in_flight": in_flight,
             "refused_second": refused, "metadata_before_finalize": loadable_before,
             "metadata_after": (ckpt / "model" / "metadata.json").exists()}
    dist.barrier()
    if dist.get_rank() == 0:
        saved = dict(export_checkpoint(ckpt / "model", hf))
        facts["tensors"] = len(saved)
        facts["equal_to_schedule_time"] = all(torch.equal(saved[k], at_schedule[k]) for k in at_schedule) and \
            set(saved) == set(at_schedule)
        facts["live_moved"] = any(not torch.equal(moved[k], at_schedule[k]) for k in at_schedule)
        out.write_text(json.dumps(facts))
    dist.barrier()
    w.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
