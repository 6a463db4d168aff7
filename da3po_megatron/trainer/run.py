"""Everything a training run holds, built from the config: Ray, policy ranks, engines, data, rewards, logs, checkpoints.

:class:`Run` is what ``trainer/loop.py`` drives; it builds, holds and closes the owners and keeps no concern of its
own (issue 56): ``run.sampler`` (``generation/sampler.py``: prompts, sampling, engine calls, rewards, its own saved
state), ``run.state`` (``resume/run_state.py``: the last completed step, the prefetched batches, the producer, the
driver's checkpoints), ``run.cluster`` (``cluster/bringup.py``: where the actors run and how they start), the logger
and the profiler; pi_old is ``trainer/old_logprobs.py`` and a step's metrics ``observability/step_metrics.py``.
Where the parts run:

- the policy: ``world = TP x PP x CP x DP`` Ray actors (``megatron.actor_group.PolicyGroup``), one per rank;
- the engines: ``rollout.num_engines`` vLLM Ray actors (``rollout.RolloutClient.ray``);
- where they run: ``trainer/cluster/placement.py`` checks the resources against the Ray cluster before any actor starts
  (exit 2 naming the numbers), reserves node-pinned placement groups (TP groups on one node, engines per
  ``rollout.engine_placement``, or colocated with ranks 0..N-1) and asks one rank's and one engine's bundle what
  device they see -- the KV cache, memory preflight, collective backend and transport follow from that, never from
  this process's CUDA (the driver does not initialise it);
- the reward pool: processes of the driver.

Stop requests: SIGTERM / SIGUSR1 / SIGINT, or a file ``run_dir/PREEMPT`` (what ``slurm/train.sbatch`` creates before
the job is killed), make the loop checkpoint the last completed step and exit 0 (``trainer/cluster/signals.py``: the
handlers are installed after ``ray.init``); the requeued job resumes from ``latest``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from da3po_megatron.config import Config, to_dict
from da3po_megatron.trainer.cluster.bringup import Cluster, engineless, init_ray, preflight
from da3po_megatron.trainer.cluster.signals import StopSignals
from da3po_megatron.trainer.faults import skipped
from da3po_megatron.trainer.generation.replay import Replay
from da3po_megatron.trainer.generation.sampler import Sampler
from da3po_megatron.trainer.inputs import check_prompts, load_tokenizer, load_train_data
from da3po_megatron.trainer.observability.metrics import MetricsLogger
from da3po_megatron.trainer.resume.best import BestCheckpoint
from da3po_megatron.trainer.resume.checkpoint import CheckpointManager
from da3po_megatron.trainer.resume.run_state import RunState


class Run:
    """The run's owners, built from the config (see the module docstring)."""

    def __init__(self, cfg: Config, allow_config_change: bool = False) -> None:
        """Build the run; a failure on the way (bad input, placement, start-up, a restore that raises) closes what was
        already opened -- actors, placement groups, transport, reward pool -- before the error propagates, so an
        in-process caller of ``trainer.main.main()`` returns with nothing of the run left (issue 35, point 3).
        ``allow_config_change``: ``--allow-config-change`` (the checkpoint finally loaded is checked too,
        ``resume/config_drift.py``)."""
        try:
            self._start(cfg, allow_config_change)
        except BaseException:
            self.close()
            raise

    def _start(self, cfg: Config, allow_config_change: bool) -> None:
        from da3po_megatron.rollout.consistency import DRIFT_FLOOR, DriftMonitor
        from da3po_megatron.trainer.observability.profiling import StepProfiler
        from da3po_megatron.trainer.resume.config_drift import check_checkpoint_config, write_run_record
        from da3po_megatron.trainer.resume.lock import guard

        self.cfg = cfg
        # first: bad inputs fail (InputError / BadRowError, exit 2) before anything is written or started
        dataset = load_train_data(cfg)
        tokenizer = load_tokenizer(cfg)  # the model directory's config.json and tokenizer
        arch = preflight(cfg)  # the model in Megatron terms (through the bridge); parallel sizes
        self.run_dir = Path(cfg.trainer.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.drift = DriftMonitor(cfg.rollout.logprob_drift_factor, DRIFT_FLOOR.get(cfg.model.params_dtype, 1e-2))
        (self.run_dir / "PREEMPT").unlink(missing_ok=True)  # a request of the previous (requeued) job
        self.stop = StopSignals(self.run_dir / "PREEMPT")

        random.seed(cfg.trainer.seed)
        np.random.seed(cfg.trainer.seed)
        torch.manual_seed(cfg.trainer.seed)
        dataset = check_prompts(dataset, tokenizer, cfg)
        self.sampler = Sampler(cfg, tokenizer, dataset)  # the prompt stream, the buffer, the reward pool
        if dataset.stats is not None:  # what the reader kept, dropped and skipped (docs/data_and_rewards.md)
            (self.run_dir / "data_stats.json").write_text(json.dumps(dataset.stats.as_dict(), indent=1) + "\n")
        t = cfg.trainer
        self.ckpt = CheckpointManager(self.run_dir, t.keep_last)
        best = BestCheckpoint(self.ckpt.root, t.keep_best_metric, t.keep_best_mode) if t.keep_best_metric else None
        self.ckpt.protect = best.protected if best else self.ckpt.protect
        self.state = RunState(cfg, self.ckpt, best, self.sampler, self.drift)
        latest = self.ckpt.latest() if t.resume else None  # verified (a damaged one: the previous) before any actor
        if latest is not None:  # the checkpoint finally chosen (maybe a fallback) against its own recorded config
            check_checkpoint_config(cfg, latest, allow=allow_config_change)
        write_run_record(cfg)  # run_dir/config.yaml: at the first launch, and after an accepted change
        # rollout.dump_dir / replay_dir: checked before Ray starts
        self.replay = self.sampler.replay = Replay(cfg).start(self.sampler, latest, allow_config_change)
        self.ckpt.before_write = guard(self.run_dir)  # a trainer whose lock was taken over stops before it writes

        init_ray(cfg)
        self.stop.install()  # after ray.init, which replaces the SIGTERM handler with one that exits at once
        self.cluster = Cluster(cfg)  # plan, reservation, policy ranks, engines, transport (cluster/bringup.py)
        # a resume's policy checkpoint is loaded there, before the offload cycle offloads and the engines start
        self.cluster.start(arch, self.run_dir, self.ckpt.root / ".prewarm", checkpoint=latest)
        self.policy, self.rollout = self.cluster.policy, self.cluster.rollout
        self.sampler.rollout, self.state.policy = self.rollout, self.policy
        self.weight_transfer = self.cluster.weight_transfer
        self.offload = self.state.offload = self.cluster.offload  # actor.offload around generation
        self.rollout.resync = self.sync_weights  # an engine restarted after a sync gets the weights again
        self.profiler = StepProfiler(cfg.trainer.profile, self.run_dir, self.policy, self.rollout)
        print(f"weight transfer: {self.weight_transfer} (rollout.weight_transfer={cfg.rollout.weight_transfer})",
              flush=True)

        if latest is not None:
            self.state.restore(latest, self.sync_weights)
        self.state.saved_step = self.state.step if latest is not None else -1
        self.state.completed = self.state.trainer_state()  # what a checkpoint of the last completed step holds
        self.logger = MetricsLogger(self.run_dir, cfg.trainer.total_steps, start_step=self.state.step,
                                    tensorboard=cfg.trainer.tensorboard, wandb_project=cfg.trainer.wandb_project,
                                    run_name=cfg.trainer.experiment_name, config=to_dict(cfg),
                                    before_write=self.ckpt.before_write)

    # ------------------------------------------------------------------------------------------------ owner verbs
    def check_update(self, step: int, train_metrics: dict[str, Any]) -> None:
        """Refused optimizer updates (non-finite, or too large: ``megatron/update_guard.py``): counted, warned, and
        the run stopped before the sync after too many in a row (``trainer/updates.py``)."""
        from da3po_megatron.trainer.updates import check_update

        check_update(self.state.update_totals, step, train_metrics, self.cfg.trainer)

    def sync_weights(self) -> dict[str, float]:
        """Policy -> every engine (``rollout.weight_transfer``) inside the ``actor.offload`` cycle (colocation.py)."""
        if self.weight_transfer == "none" or skipped("weight_sync", self.state.step + 1):  # train_only; fault tests
            return {}
        from da3po_megatron.trainer.cluster.colocation import push_weights

        return self.offload.around_sync(lambda *hooks: push_weights(self.cluster, *hooks),
                                        inside=self.weight_transfer == "ipc")

    def engines_idle(self) -> None:
        """The step's generation is over. Colocated on CUDA ("ipc"), the engines sleep (level 2: KV cache and weights
        freed; the next sync rewrites every weight) so the policy has the GPU memory; ``ipc_sync`` wakes them."""
        if self.weight_transfer == "ipc":
            self.rollout.sleep(level=2)
        self.offload.engines_asleep(slept=self.weight_transfer == "ipc")  # actor.offload: reloaded before a forward

    def should_evaluate(self, step: int) -> bool:
        e = self.cfg.eval
        return bool(e.every) and bool(e.benchmarks) and not engineless(self.cfg) and (
            step % e.every == 0 or step == self.cfg.trainer.total_steps)

    def evaluate(self) -> dict[str, float]:
        from da3po_megatron.trainer.evaluation import evaluate_during_training

        return evaluate_during_training(self.sampler)  # the run's engines (current weights), tokenizer, rewards

    def preempted(self) -> bool:
        return self.stop.requested

    def close(self) -> None:
        state = getattr(self, "state", None)
        if state is not None and state.producer is not None:  # the producer thread stops before its engines go
            try:
                state.producer.close()
            except Exception as e:  # noqa: BLE001 - closing must not hide the real error
                print(f"warning: stopping the rollout producer failed: {e}", flush=True)
            state.producer = None
        if state is not None:  # a run that ends waits for its checkpoint
            state.finish_saving()
        cluster = getattr(self, "cluster", None)
        if cluster is not None:
            cluster.close_transport()
        sampler = getattr(self, "sampler", None)
        parts = (("rollout", cluster), ("policy", cluster), ("rewards", sampler), ("reservation", cluster))
        for part, owner in parts:
            obj = getattr(owner, part, None)
            if obj is not None:
                try:
                    (obj.shutdown if hasattr(obj, "shutdown") else obj.close)()
                except Exception as e:  # closing must not hide the real error of a failed run
                    print(f"warning: closing {part} failed: {e}", flush=True)
        if getattr(self, "logger", None) is not None:
            self.logger.close()
        preempt = self.run_dir / "PREEMPT" if hasattr(self, "run_dir") else None
        if preempt is not None and preempt.exists():
            preempt.unlink()
