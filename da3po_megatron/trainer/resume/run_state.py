"""The checkpoint half of :class:`trainer.run.Run`: what a checkpoint of the driver holds, the synchronous and
asynchronous saves of the last completed step, and the exact restore (split from ``run.py``, which builds the run).

A mixin, not a second object: it reads the run's attributes (``cfg``, ``policy``, ``ckpt``, ``best``, ``buffer``,
``prompts``, ``pending``, ``async_rollout``, ...) that :meth:`Run._start` sets."""

from __future__ import annotations

import random
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from da3po_megatron.config import to_dict
from da3po_megatron.trainer import batch as B
from da3po_megatron.trainer.faults import fault_point
from da3po_megatron.trainer.generation.async_partial import plain_state
from da3po_megatron.trainer.generation.collect import rollout_from_dict, rollout_to_dict
from da3po_megatron.trainer.resume.best import save_checkpoint


class RunCheckpoints:
    """Checkpoint and restore of a :class:`~da3po_megatron.trainer.run.Run` (see its docstring)."""

    cfg: Any
    policy: Any
    def should_checkpoint(self, step: int) -> bool:
        every = self.cfg.trainer.save_every
        return step == self.cfg.trainer.total_steps or (every > 0 and step % every == 0) or self.wants_hf(step)

    def wants_hf(self, step: int) -> bool:
        """Whether the checkpoint of ``step`` also gets HF weights (``trainer.save_hf_every``; and the last step)."""
        n = self.cfg.trainer.save_hf_every
        return n > 0 and (step % n == 0 or step == self.cfg.trainer.total_steps)

    def trainer_state(self) -> dict[str, Any]:
        """The driver's part of a checkpoint: plain values and tensors only (``torch.load(weights_only=True)``)."""
        from da3po_megatron.megatron.runtime import numpy_rng_state

        buffer = self.buffer.state_dict()
        return {
            "step": self.step,
            "prompts": self.prompts.state_dict(),
            "buffer": {**buffer, "groups": [B.group_to_dict(g) for g in buffer["groups"]]},
            "totals": dict(self.totals),
            "drift_baseline": self.drift.baseline,  # the fresh-sync mismatch level, so a resumed run compares alike
            "engine_weight_step": self.engine_weight_step,
            "pending": [rollout_to_dict(r) for r in self.pending],
            # the producer's snapshot (references, taken while paused), serialised only when a checkpoint is written
            "async_rollout": producer.snapshot() if (producer := getattr(self, "async_rollout", None)) else None,
            "selection": self.prompts.selection_state() if hasattr(self.prompts, "selection_state") else None,
            "rng": {"python": random.getstate(), "numpy": numpy_rng_state(), "torch": torch.get_rng_state()},
            "config": to_dict(self.cfg),
        }

    def step_completed(self, step: int) -> None:
        """Step ``step`` is done (policy updated, engines synced): remember the trainer state a checkpoint of it holds
        (a stop request during the next step saves this, not the half-done step's state)."""
        self.step = step
        if hasattr(self.prompts, "drain"):  # data.selection: this step's counters, reset before the state is taken
            self.selection_metrics = self.prompts.drain()
        self.completed_state = self.trainer_state()

    def best_candidate(self, metrics: dict[str, Any]) -> float | None:
        """The value of trainer.keep_best_metric when this step's evaluation beats the best so far (else None)."""
        return self.best.candidate(self.step, metrics) if self.best else None

    def save_checkpoint(self, best_value: float | None = None) -> Path | None:
        """Checkpoint the last completed step (nothing to do when it is already saved); with ``best_value`` also
        record it as the best checkpoint (trainer/resume/best.py). ``trainer.save_hf_every``: HF weights into ``hf/`` of
        the same checkpoint. ``trainer.async_save``: the policy's shards are written in the background and this
        returns None; :meth:`poll_checkpoint` completes the checkpoint (``latest`` moves then). At most one save is
        in flight: an earlier one is completed first."""
        step = int(self.completed_state["step"])
        if step == self.saved_step or step == 0:
            return None
        self.poll_checkpoint(wait=True)  # at most one in flight
        t0 = time.perf_counter()
        asynchronous, hf = self.cfg.trainer.async_save, self.wants_hf(step)

        def save_policy(p: Path) -> None:
            offload = getattr(self, "offload", None)  # actor.offload: reloaded for the save, offloaded after
            with offload.resident() if offload is not None else nullcontext():
                _save_policy(p)

        def _save_policy(p: Path) -> None:
            if asynchronous:
                self.policy.call("save", str(p), async_save=True)  # scheduled: megatron-core writes it meanwhile
            else:
                self.policy.save(str(p))
            if hf:  # the weight sync's export stream, into the same temporary directory (one atomic rename)
                from da3po_megatron.bridge.save_hf import save_policy_hf

                save_policy_hf(self.policy, p.parent / "hf", self.cfg.model.path)
            fault_point("checkpoint", step, self)

        if asynchronous:
            pending = self.ckpt.start(step, save_policy, plain_state(self.completed_state))
            self.saved_step = step
            self._async_save = {"pending": pending, "best": best_value, "t0": t0,
                                "blocking_s": time.perf_counter() - t0}
            print(f"checkpoint step {step}: written asynchronously into {pending.tmp} "
                  f"({self._async_save['blocking_s']:.1f} s in the step)", flush=True)
            return None
        path = save_checkpoint(self.ckpt, self.best, step, save_policy, plain_state(self.completed_state), best_value)
        self.saved_step = step
        note = f"; best {self.best.metric} = {best_value:.4f}" if self.best and best_value is not None else ""
        print(f"checkpoint step {step} -> {path} ({time.perf_counter() - t0:.1f} s){note}", flush=True)
        return path

    def poll_checkpoint(self, wait: bool = False) -> Path | None:
        """Complete the asynchronous save in flight once every rank's writer is done (``wait``: wait for it):
        megatron's finalize (collective), then the manifest + CRC, ``COMPLETE``, the rename and ``latest``
        (``CheckpointManager.finish``). Returns the checkpoint's path when it completed now, else None."""
        a = getattr(self, "_async_save", None)
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

    def _restore(self, path: Path) -> None:
        from da3po_megatron.megatron.runtime import set_numpy_rng_state

        t0 = time.perf_counter()
        state = self.ckpt.load_trainer_state(path)
        self.policy.load(str(path / "policy"))
        self.step = int(state["step"])
        self.prompts.load_state_dict(state["prompts"])
        if hasattr(self.prompts, "load_selection_state"):  # data.selection (another dataset: a new history)
            print(self.prompts.load_selection_state(state.get("selection")), flush=True)
        groups = state["buffer"]["groups"]
        self.buffer.load_state_dict({**state["buffer"], "groups": [  # dicts; Group objects in old (pickled) states
            B.group_from_dict(g) if isinstance(g, dict) else g for g in groups]})
        self.totals = {**self.totals, **state["totals"]}
        self.drift.baseline = state.get("drift_baseline", self.drift.baseline)
        # staleness 1: the next step's batch was complete when this checkpoint was written (the loop joins the
        # prefetch before the weight sync and the checkpoint); it is saved and trained on as is after a resume
        self.pending = [rollout_from_dict(r) for r in state.get("pending", [])]
        # staleness >= 2 / partial rollouts: the producer's queue, decided groups and interrupted partials (with
        # their per-token versions), saved while it was paused after the sync; the loop restarts it from them
        self.async_state = state.get("async_rollout")
        random.setstate(tuple(state["rng"]["python"]))
        set_numpy_rng_state(state["rng"]["numpy"])
        torch.set_rng_state(state["rng"]["torch"])
        self.sync_weights()  # the engines start from the HF weights; give them the checkpoint's
        self.engine_weight_step = self.step
        print(f"resumed from {path} at step {self.step} ({time.perf_counter() - t0:.1f} s)", flush=True)
