"""The driver's state and its part of a checkpoint (was ``run_checkpoints.py``, a mixin of ``Run``; issue 56 made it a
component, ``run.state``): the last completed step, the staleness-1 prefetched batches, the asynchronous producer
and its restored snapshot, the update counters -- and what a checkpoint of the driver holds, the synchronous and
asynchronous saves of the last completed step, and the exact restore.

What it saves of the generation side is the sampler's own :meth:`~da3po_megatron.trainer.generation.sampler.Sampler.
state_dict` (the one capture; dumps store the same), plus the drift monitor's baseline, the engines' weight version,
the prefetched batches and the producer's snapshot. The format is the one written since before issue 56 (keys
``step, prompts, buffer, totals, drift_baseline, engine_weight_step, pending, async_rollout, selection, rng,
config``): checkpoints of the flat layout resume (tests/test_pre_move_checkpoint.py)."""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from da3po_megatron.config import Config, to_dict
from da3po_megatron.trainer.batch import StepRollout, rollout_from_dict, rollout_to_dict
from da3po_megatron.trainer.faults import fault_point
from da3po_megatron.trainer.generation.async_partial import plain_state
from da3po_megatron.trainer.generation.sampler import Sampler
from da3po_megatron.trainer.resume.best import BestCheckpoint, save_checkpoint
from da3po_megatron.trainer.resume.checkpoint import CheckpointManager

UPDATE_TOTALS = ("skipped_updates", "consecutive_skipped_updates")  # trainer/updates.py counts them


class RunState:
    """The driver's resumable state and its checkpoints (see the module docstring). ``policy`` and ``offload`` (the
    ``actor.offload`` cycle, reloaded around a save) are set once bring-up has started them."""

    def __init__(self, cfg: Config, ckpt: CheckpointManager, best: BestCheckpoint | None, sampler: Sampler,
                 drift: Any) -> None:
        self.cfg, self.ckpt, self.best, self.sampler, self.drift = cfg, ckpt, best, sampler, drift
        self.policy: Any = None
        self.offload: Any = None
        self.step = 0  # the last completed step
        self.pending: list[StepRollout] = []  # staleness 1: the next step's batch, generated during this step
        self.producer: Any = None  # staleness >= 2 / partial rollouts: the producer (generation/async_rollout.py)
        self.producer_state: dict[str, Any] | None = None  # its state from the checkpoint resumed from
        self.update_totals = dict.fromkeys(UPDATE_TOTALS, 0)
        self.saved_step = -1
        self.completed: dict[str, Any] = {}  # what a checkpoint of the last completed step holds
        self._async_save: dict[str, Any] | None = None

    def should_checkpoint(self, step: int) -> bool:
        every = self.cfg.trainer.save_every
        return step == self.cfg.trainer.total_steps or (every > 0 and step % every == 0) or self.wants_hf(step)

    def wants_hf(self, step: int) -> bool:
        """Whether the checkpoint of ``step`` also gets HF weights (``trainer.save_hf_every``; and the last step)."""
        n = self.cfg.trainer.save_hf_every
        return n > 0 and (step % n == 0 or step == self.cfg.trainer.total_steps)

    def trainer_state(self, producer: Any = None) -> dict[str, Any]:
        """The driver's part of a checkpoint: plain values and tensors only (``torch.load(weights_only=True)``).
        ``producer``: the producer's snapshot, when already taken (else taken here, first: it waits for the scoring in
        flight, so the sampler's counters and data.selection's history include every group the snapshot holds)."""
        producer = producer if producer is not None or self.producer is None else self.producer.snapshot()
        generation = self.sampler.state_dict()
        return {
            "step": self.step,
            **generation,
            "totals": {**generation["totals"], **self.update_totals},
            "drift_baseline": self.drift.baseline,  # the fresh-sync mismatch level, so a resumed run compares alike
            "engine_weight_step": self.sampler.engine_weight_step,
            "pending": [rollout_to_dict(r) for r in self.pending],
            # the producer's snapshot (references, taken while paused), serialised only when a checkpoint is written
            "async_rollout": producer,
            "config": to_dict(self.cfg),
        }

    def step_completed(self, step: int) -> None:
        """Step ``step`` is done (policy updated, engines synced): remember the trainer state a checkpoint of it holds
        (a stop request during the next step saves this, not the half-done step's state)."""
        self.step = step
        producer = self.producer.snapshot() if self.producer is not None else None  # paused; waits for the scoring
        if self.sampler.replay is not None:  # rollout.dump_dir under the producer: the step's file, with the driver
            self.sampler.replay.completed(step, self.sampler.state_dict)  # state its metrics read (replay.py)
        self.sampler.drain_selection()  # data.selection: this step's counters, reset before the state is taken
        self.completed = self.trainer_state(producer)

    def best_candidate(self, metrics: dict[str, Any]) -> float | None:
        """The value of trainer.keep_best_metric when this step's evaluation beats the best so far (else None)."""
        return self.best.candidate(self.step, metrics) if self.best else None

    def save_checkpoint(self, best_value: float | None = None) -> Path | None:
        """Checkpoint the last completed step (nothing to do when it is already saved); with ``best_value`` also
        record it as the best checkpoint (resume/best.py). ``trainer.save_hf_every``: HF weights into ``hf/`` of
        the same checkpoint. ``trainer.async_save``: the policy's shards are written in the background and this
        returns None; :meth:`poll_checkpoint` completes the checkpoint (``latest`` moves then). At most one save is
        in flight: an earlier one is completed first."""
        step = int(self.completed["step"])
        if step == self.saved_step or step == 0:
            return None
        self.poll_checkpoint(wait=True)  # at most one in flight
        t0 = time.perf_counter()
        asynchronous, hf = self.cfg.trainer.async_save, self.wants_hf(step)

        def save_policy(p: Path) -> None:
            offload = self.offload  # actor.offload: reloaded for the save, offloaded after
            with offload.resident() if offload is not None else nullcontext():
                _save_policy(p)

        def _save_policy(p: Path) -> None:
            record = self.offload.record if self.offload is not None else (lambda event: None)
            if asynchronous:
                self.policy.call("save", str(p), async_save=True)  # scheduled: megatron-core writes it meanwhile
            else:
                self.policy.save(str(p))
            record("policy:save async" if asynchronous else "policy:save")  # the device-memory timeline's events
            if hf:  # the weight sync's export stream, into the same temporary directory (one atomic rename)
                from da3po_megatron.bridge.save_hf import save_policy_hf

                save_policy_hf(self.policy, p.parent / "hf", self.cfg.model.path)
                record("policy:save_hf")
            fault_point("checkpoint", step, self.sampler)

        if asynchronous:
            pending = self.ckpt.start(step, save_policy, plain_state(self.completed))
            self.saved_step = step
            self._async_save = {"pending": pending, "best": best_value, "t0": t0,
                                "blocking_s": time.perf_counter() - t0}
            print(f"checkpoint step {step}: written asynchronously into {pending.tmp} "
                  f"({self._async_save['blocking_s']:.1f} s in the step)", flush=True)
            return None
        path = save_checkpoint(self.ckpt, self.best, step, save_policy, plain_state(self.completed), best_value)
        self.saved_step = step
        note = f"; best {self.best.metric} = {best_value:.4f}" if self.best and best_value is not None else ""
        print(f"checkpoint step {step} -> {path} ({time.perf_counter() - t0:.1f} s){note}", flush=True)
        return path

    def poll_checkpoint(self, wait: bool = False) -> Path | None:
        """Complete the asynchronous save in flight once every rank's writer is done (``wait``: wait for it):
        megatron's finalize (collective), then the manifest + CRC, ``COMPLETE``, the rename and ``latest``
        (``CheckpointManager.finish``). Returns the checkpoint's path when it completed now, else None."""
        a = self._async_save
        if a is None:
            return None
        error: Exception | None = None
        if not wait:
            try:
                if not self.policy.call("finalize_save", False):
                    return None
            except Exception as e:  # noqa: BLE001 - reported as the checkpoint's write error below
                error = e
        self._async_save = None
        t_wait = time.perf_counter()

        def complete() -> None:
            if error is not None:
                raise error
            self.policy.call("finalize_save", True)

        pending = a["pending"]
        path = self.ckpt.finish(pending, wait=complete)
        if self.best is not None and a["best"] is not None:
            self.best.mark(pending.step, path, a["best"])
            self.ckpt.prune()
        note = f"; best {self.best.metric} = {a['best']:.4f}" if self.best and a["best"] is not None else ""
        print(f"checkpoint step {pending.step} -> {path} (asynchronous: {a['blocking_s']:.1f} s in the step, "
              f"complete {time.perf_counter() - a['t0']:.1f} s after it began, "
              f"{time.perf_counter() - t_wait:.1f} s waited here){note}", flush=True)
        return path

    def finish_saving(self) -> None:
        """A run that ends waits for its asynchronous checkpoint (a failure is a warning: ``latest`` keeps the
        previous complete one)."""
        if self._async_save is None:
            return
        step = self._async_save["pending"].step
        try:
            self.poll_checkpoint(wait=True)
        except Exception as e:  # noqa: BLE001 - closing must not hide the real error
            print(f"warning: the asynchronous checkpoint of step {step} did not complete ({e}); latest still "
                  "names the previous complete one", flush=True)

    def load(self, state: dict[str, Any]) -> None:
        """The driver's side of a restore from a checkpoint's trainer state (any layout since f5d1453)."""
        self.step = int(state["step"])
        note = self.sampler.load_state_dict(state)
        if note is not None:
            print(note, flush=True)
        self.update_totals.update({k: v for k, v in state["totals"].items() if k in self.update_totals})
        self.drift.baseline = state.get("drift_baseline", self.drift.baseline)
        # staleness 1: the next step's batch was complete when this checkpoint was written (the loop joins the
        # prefetch before the weight sync and the checkpoint); it is saved and trained on as is after a resume
        self.pending = [rollout_from_dict(r) for r in state.get("pending", [])]
        # staleness >= 2 / partial rollouts: the producer's queue, decided groups and interrupted partials (with
        # their per-token versions), saved while it was paused after the sync; the loop restarts it from them
        self.producer_state = state.get("async_rollout")

    def restore(self, path: Path, sync_weights: Any) -> None:
        """Resume from the checkpoint ``path``: the driver's state, then ``sync_weights()`` (the engines start from
        the HF weights; they get the checkpoint's). The policy's part was loaded at bring-up (``Cluster.start(...,
        checkpoint=path)``), before the ``actor.offload`` cycle offloads the tier and the colocated engines start:
        dist_checkpointing loads into the storages as they are, and a load after the offload would need the whole
        policy back beside the engines' KV cache (issue 57, P1)."""
        t0 = time.perf_counter()
        state = self.ckpt.load_trainer_state(path)
        self.load(state)
        sync_weights()
        self.sampler.engine_weight_step = self.step
        print(f"resumed from {path} at step {self.step} ({time.perf_counter() - t0:.1f} s)", flush=True)
