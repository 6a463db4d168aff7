"""How ``trainer_state.pt`` and ``expected.json`` here were written: by the layout before issue 56 (commit f5d1453,
flat ``trainer/``), with that commit's own code -- ``RunCheckpoints.trainer_state`` + ``async_partial.plain_state``
(what ``CheckpointManager.start`` saves) and ``replay.driver_state`` -- over real parts: the tiny demo config with
``data.selection=skip_zero_variance``, its synthetic prompt stream, the dynamic-sampling buffer (surplus carried),
the drift monitor, a staleness-1 prefetched batch and an asynchronous producer snapshot (an interrupted partial, a
decided and a released group). Completions are stand-ins (no engines): the state's shape, not the model, is tested.

Kept for the record; it imports the old paths, so it runs only against f5d1453:
``git worktree add /tmp/wt f5d1453 && PYTHONPATH=/tmp/wt python tests/data/pre_move_checkpoint/make_fixture.py``.
"""
# ruff: noqa
import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from da3po_megatron.algorithms import DynamicSamplingBuffer
from da3po_megatron.config import load_config
from da3po_megatron.data.selection import selecting
from da3po_megatron.rollout.consistency import DriftMonitor
from da3po_megatron.rollout.types import Completion
from da3po_megatron.trainer import batch as B
from da3po_megatron.trainer.async_partial import Partial, ProducerSnapshot, plain_state
from da3po_megatron.trainer.collect import StepRollout
from da3po_megatron.trainer.prepare import load_train_data
from da3po_megatron.trainer.replay import driver_state
from da3po_megatron.trainer.run_checkpoints import RunCheckpoints

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
OVERRIDES = ["data.selection=skip_zero_variance", "data.synthetic.max_digits=3", "data.synthetic.train_per_bucket=2",
             "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=4", "rollout.max_response_length=8", "algorithm.surplus=carry",
             "trainer.run_dir=/tmp/unused"]


def completions(ex, k, n, rng):
    return [Completion(prompt_index=k, sample_index=i, prompt_token_ids=rng.integers(0, 50, 5), token_ids=rng.integers(
        0, 50, 3 + i), text=f"t{i}", logprobs=-rng.random(3 + i), finish_reason="stop", num_tokens=3 + i)
        for i in range(n)]


def main():
    cfg = load_config(ROOT / "examples/tiny_cpu_da3po.yaml", OVERRIDES)
    random.seed(cfg.trainer.seed); np.random.seed(cfg.trainer.seed); torch.manual_seed(cfg.trainer.seed)
    rng = np.random.default_rng(0)
    dataset = load_train_data(cfg)
    prompts = selecting(dataset.iterator(seed=cfg.trainer.seed, shuffle=cfg.data.shuffle), cfg.data, cfg.trainer.seed)
    buffer = DynamicSamplingBuffer(cfg.data.train_batch_size, cfg.algorithm.surplus, cfg.rollout.n)
    n = cfg.rollout.n
    totals = {"samples": 0, "tokens": 0, "groups": 0, "kept_groups": 0, "reward_timeouts": 1, "reward_errors": 0,
              "skipped_updates": 1, "consecutive_skipped_updates": 0}
    accs = [[1, 0, 0, 0], [1, 1, 0, 1], [1, 1, 1, 1], [0, 1, 0, 0], [0, 1, 1, 0], [1, 0, 1, 0]]
    kept = []
    for step in (1, 2):  # two steps of one round each: 3 prompts, the surplus carried
        buffer.reset_stats()
        examples = prompts.take(3)
        comps = [completions(ex, k, n, rng) for k, ex in enumerate(examples)]
        acc = [a for k in range(3) for a in accs[(step - 1) * 3 + k]]
        groups = B.make_groups(examples, comps, acc, cfg.rollout.max_response_length, 2)
        for i, g in enumerate(groups):
            g.weight_step, g.seed = step - 1, 1000 * step + i * n
        prompts.observe([(g.example.uid, g.p_hat) for g in groups])
        totals["samples"] += 3 * n; totals["groups"] += 3
        totals["tokens"] += sum(len(c.token_ids) for cs in comps for c in cs)
        totals["kept_groups"] += buffer.add(groups, [g.p_hat for g in groups])
        kept = buffer.take() if buffer.is_full else kept
        prompts.drain()
    pending = StepRollout(kept, kept, {"dynamic_sampling/rounds": 1.0}, 2, {"generate": 0.5})
    ex = prompts.take(1)[0]
    part = Partial(7, ex, 2, n)
    part.add_segment({"token_ids": [rng.integers(0, 50, 2) for _ in range(n)],
                      "logprobs": [-rng.random(2) for _ in range(n)], "finished": [False] * n,
                      "texts": ["ab"] * n, "reasons": [""] * n}, 2)
    snapshot = ProducerSnapshot(8, 6, 3, [part], [(6, kept[0])], [kept[-1]], {"admitted": 8.0})
    drift = DriftMonitor(cfg.rollout.logprob_drift_factor, 1e-2)
    drift.baseline = 0.0125
    run = SimpleNamespace(cfg=cfg, step=2, prompts=prompts, buffer=buffer, totals=totals, drift=drift,
                          engine_weight_step=2, pending=[pending], async_rollout=SimpleNamespace(snapshot=lambda: snapshot))
    state = plain_state(RunCheckpoints.trainer_state(run))
    torch.save(state, HERE / "trainer_state.pt")
    torch.save(driver_state(run), HERE / "driver_state.pt")  # what rollout.dump_dir wrote per step (replay)
    after = [e.uid for e in prompts.take(4)]  # what the stream yields next (a resume must yield the same)
    expected = {"step": 2, "engine_weight_step": 2, "buffer_groups": len(buffer), "totals": totals,
                "next_uids": after, "pending_groups": [g.example.uid for g in pending.groups],
                "async_next_j": 8, "async_partial_uids": [ex.uid], "drift_baseline": 0.0125,
                "selection_prompts": len(state["selection"]["history"]) if isinstance(state["selection"], dict)
                and "history" in state["selection"] else None,
                "overrides": OVERRIDES, "written_by": "f5d1453"}
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print(json.dumps(expected, indent=1))


if __name__ == "__main__":
    sys.exit(main())
