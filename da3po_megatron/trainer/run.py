"""Everything a training run holds, built from the config: Ray, policy ranks, engines, data, rewards, logs, checkpoints.

:class:`Run` is what ``trainer/loop.py`` drives. It owns the state an exact resume needs (step, data position,
dynamic-sampling buffer, driver RNG, cumulative counters, the policy's checkpoint) and the placement:

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
import math
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from da3po_megatron.algorithms import DynamicSamplingBuffer, tis_weights
from da3po_megatron.config import Config, to_dict
from da3po_megatron.data.datasets import Example
from da3po_megatron.data.selection import selecting, selection_batch_metrics
from da3po_megatron.data.templates import render_prompt
from da3po_megatron.megatron.batching import PolicyBatch, Ragged
from da3po_megatron.trainer import batch as B
from da3po_megatron.trainer.cluster.bringup import (  # noqa: F401
    _hostname,
    _pin,
    engine_config,
    init_ray,
    load_train_data,
    memory_preflight,
    plan_for_cluster,
    preflight,
)
from da3po_megatron.trainer.cluster.signals import StopSignals
from da3po_megatron.trainer.faults import poisoned, skipped
from da3po_megatron.trainer.generation.replay import NoEngines, Replay, engineless
from da3po_megatron.trainer.observability.metrics import MetricsLogger
from da3po_megatron.trainer.observability.profiling import with_engine_profiler
from da3po_megatron.trainer.resume.best import BestCheckpoint
from da3po_megatron.trainer.resume.checkpoint import CheckpointManager
from da3po_megatron.trainer.resume.run_state import RunCheckpoints


def fresh_drift(drift: Any, step: int, rollout_lp: Any, policy_lp: Any, mismatch: dict[str, float], fresh: bool,
                versions: Ragged | None) -> dict[str, float]:
    """The drift alert's update (``drift``: the run's DriftMonitor, ``step``: the last completed step = the current
    weights' version) from the tokens the current weights sampled (see :meth:`Run.old_logprobs`)."""
    from da3po_megatron.rollout.consistency import logprob_diff_metrics

    if versions is None:
        return drift.update(step + 1, mismatch) if fresh else {}
    mask = versions.values == step
    out = {"rollout/fresh_token_frac": float(mask.mean()) if len(mask) else 0.0}
    if mask.all():  # every token fresh (the synchronous loop): the whole batch's mismatch, as without versions
        return {**out, **drift.update(step + 1, mismatch)}
    if not mask.any():
        return out
    prefix = "rollout/logprob_diff_fresh"
    fresh_m = logprob_diff_metrics([Ragged.from_rows(rollout_lp, np.float64).values[mask]],
                                   [Ragged.from_rows(policy_lp, np.float64).values[mask]], prefix)
    return {**out, **fresh_m, **drift.update(step + 1, fresh_m, prefix)}


class Run(RunCheckpoints):
    def __init__(self, cfg: Config, allow_config_change: bool = False) -> None:
        """Build the run; a failure on the way (bad input, placement, start-up, a restore that raises) closes what was
        already opened -- actors, placement groups, transport, reward pool -- before the error propagates, so an
        in-process caller of ``trainer.main.main()`` returns with nothing of the run left (issue 35, point 3).
        ``allow_config_change``: ``--allow-config-change`` (the checkpoint finally loaded is checked too,
        ``trainer/resume/config_drift.py``)."""
        try:
            self._start(cfg, allow_config_change)
        except BaseException:
            self.close()
            raise

    def _start(self, cfg: Config, allow_config_change: bool) -> None:
        from da3po_megatron.bridge.export import load_policy_hf
        from da3po_megatron.megatron.actor_group import PolicyGroup
        from da3po_megatron.rewards import RewardPool
        from da3po_megatron.rollout import RolloutClient
        from da3po_megatron.trainer.inputs import check_prompts, load_tokenizer

        self.cfg = cfg
        # first: bad inputs fail (InputError / BadRowError, exit 2) before anything is written or started
        dataset = load_train_data(cfg)
        self.tokenizer = load_tokenizer(cfg)  # the model directory's config.json and tokenizer
        arch = preflight(cfg)  # the model in Megatron terms (through the bridge); parallel sizes
        self.run_dir = Path(cfg.trainer.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.step = 0
        self.engine_weight_step = 0  # the policy step whose weights the engines hold (tags every generated group)
        self.pending: list[Any] = []  # staleness 1: the next step's batch, generated during this step (checkpointed)
        self.async_rollout: Any = None  # staleness >= 2 / partial rollouts: the producer (generation/async_rollout.py)
        self.async_state: dict[str, Any] | None = None  # its state from the checkpoint resumed from
        self.totals = {"samples": 0, "tokens": 0, "groups": 0, "kept_groups": 0, "reward_timeouts": 0,
                       "reward_errors": 0, "skipped_updates": 0, "consecutive_skipped_updates": 0}
        from da3po_megatron.rollout.consistency import DRIFT_FLOOR, DriftMonitor

        self.drift = DriftMonitor(cfg.rollout.logprob_drift_factor, DRIFT_FLOOR.get(cfg.model.params_dtype, 1e-2))
        (self.run_dir / "PREEMPT").unlink(missing_ok=True)  # a request of the previous (requeued) job
        self.stop = StopSignals(self.run_dir / "PREEMPT")

        random.seed(cfg.trainer.seed)
        np.random.seed(cfg.trainer.seed)
        torch.manual_seed(cfg.trainer.seed)
        self.dataset = check_prompts(dataset, self.tokenizer, cfg)
        self.data_skipped_rows = self.dataset.stats.skipped if self.dataset.stats is not None else 0
        self.prompts = selecting(self.dataset.iterator(seed=cfg.trainer.seed, shuffle=cfg.data.shuffle), cfg.data,
                                 cfg.trainer.seed)  # data.selection: skips by each prompt's history (data/selection.py)
        self.selection_metrics: dict[str, float] = {}  # drained when a step completes (run_checkpoints.py)
        self.buffer = DynamicSamplingBuffer(cfg.data.train_batch_size, cfg.algorithm.surplus, cfg.rollout.n)
        self.rewards = RewardPool(num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s)
        if self.dataset.stats is not None:  # what the reader kept, dropped and skipped (docs/data_and_rewards.md)
            (self.run_dir / "data_stats.json").write_text(json.dumps(self.dataset.stats.as_dict(), indent=1) + "\n")
        t = cfg.trainer
        self.ckpt = CheckpointManager(self.run_dir, t.keep_last)
        self.best = BestCheckpoint(self.ckpt.root, t.keep_best_metric, t.keep_best_mode) if t.keep_best_metric else None
        self.ckpt.protect = self.best.protected if self.best else self.ckpt.protect
        latest = self.ckpt.latest() if t.resume else None  # verified (a damaged one: the previous) before any actor
        from da3po_megatron.trainer.resume.config_drift import check_checkpoint_config, write_run_record
        from da3po_megatron.trainer.resume.lock import guard

        if latest is not None:  # the checkpoint finally chosen (maybe a fallback) against its own recorded config
            check_checkpoint_config(cfg, latest, allow=allow_config_change)
        write_run_record(cfg)  # run_dir/config.yaml: at the first launch, and after an accepted change
        self.replay = Replay(cfg).start(self, latest, allow_config_change)  # rollout.dump_dir / replay_dir: checked
        self.ckpt.before_write = guard(self.run_dir)  # a trainer whose lock was taken over stops before it writes

        init_ray(cfg)
        self.stop.install()  # after ray.init, which replaces the SIGTERM handler with one that exits at once
        t0 = time.perf_counter()
        from da3po_megatron.trainer.cluster.placement import actor_location, placement_report, probe_devices, reserve

        plan = plan_for_cluster(cfg)  # PlacementError (exit 2) in seconds when the cluster cannot hold the run
        print(plan.describe(), flush=True)
        self.reservation = reserve(plan, cfg.ray.placement_timeout_s)
        self.devices = probe_devices(self.reservation, cfg.model)  # what rank 0 and engine 0 will see
        cfg.actor.max_tokens_per_microbatch = memory_preflight(cfg, arch, self.devices["policy"], plan)
        # policy ranks and engines start side by side: the ranks' resources are requested first, then the engines',
        # and each side's start-up (imports, process groups, model build / vLLM's load) overlaps the other's
        self.policy = PolicyGroup.from_config(cfg, arch, wait=False, placement_group=self.reservation.policy,
                                              num_gpus_per_rank=plan.rank_gpus,
                                              rank_hosts=[plan.host(i) for i in plan.rank_node])
        def start_engines() -> Any:
            if engineless(cfg):  # rollout.replay_mode=train_only: none planned (prepare.plan_for_cluster), none started
                return NoEngines()
            engines = engine_config(cfg, engine_cuda=self.devices["engine"]["cuda"], moe=arch.is_moe)
            return RolloutClient.ray(with_engine_profiler(engines, cfg, self.run_dir),  # trainer.profile.engines
                                     num_engines=cfg.rollout.num_engines,
                                     num_cpus_per_engine=cfg.rollout.num_cpus_per_engine,
                                     num_gpus_per_engine=plan.engine_gpus,
                                     placement_group=self.reservation.engines or self.reservation.policy,
                                     restart_on_failure=cfg.rollout.restart_on_failure, wait=False,
                                     start_timeout_s=cfg.ray.start_timeout_s, **engine_slots(plan, self.policy),
                                     engine_hosts=[plan.host(i) for i in plan.engine_node])

        from da3po_megatron.trainer.cluster.colocation import (
            engine_slots,
            engines_after_policy,
            start_engines_after_policy,
        )

        # colocated on CUDA the engines size their KV cache from free device memory: they start once the policy on
        # their GPUs has finished allocating (trainer/cluster/colocation.py); otherwise both sides start side by side
        after_policy = engines_after_policy(cfg.rollout.colocate, self.devices["engine"]["cuda"])
        if not after_policy:
            self.rollout = start_engines()
        self.policy.wait_ready()
        if not all(self.policy.run_on_all(load_policy_hf, cfg.model.path)):  # HF weights in, through the bridge
            print(f"warning: no *.safetensors in {cfg.model.path}: the policy keeps its random initialisation",
                  flush=True)
        # the first checkpoint's one-time start-up (megatron-core's writer), done while the engines start
        prewarmed = self.policy.start("prewarm_checkpointing", str(self.ckpt.root / ".prewarm"))
        if after_policy:  # prewarm, the policy's cached blocks released, then the engines
            self.rollout = start_engines_after_policy(self.policy, prewarmed, start_engines)
            prewarmed = lambda: None  # noqa: E731 - waited for above
        self.rollout.wait_ready()
        prewarmed()
        print(f"policy ({cfg.policy_world_size} ranks) and {self.rollout.num_engines} engine(s) ready in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        self.pin_cpus()
        # where the actors say they are (their node, the GPU ids Ray gave them): printed and in run_dir/placement.json
        line, record = placement_report(plan, self.policy.run_on_all(actor_location),
                                        self.rollout.call_all("location"))
        print(line, flush=True)
        (self.run_dir / "placement.json").write_text(json.dumps(record, indent=1) + "\n")
        policy_hosts = [d["host"] for d in record["policy"]]
        engine_hosts = [d["host"] for d in record["engines"]]
        print(f"policy loss: {self.policy.info()[0]['loss_backend']} (actor.loss_backend={cfg.actor.loss_backend})",
              flush=True)
        from da3po_megatron.rollout.weight_sync import choose_transport

        has_cuda = self.devices["policy"]["cuda"] and self.devices["engine"]["cuda"]  # what the actors see
        self.weight_transfer = "none" if engineless(cfg) else choose_transport(
            cfg.rollout.weight_transfer, has_cuda=has_cuda, colocate=cfg.rollout.colocate, policy_hosts=policy_hosts,
            engine_hosts=engine_hosts)
        self.rollout.check_transport(self.weight_transfer)  # the installed vLLM has what it needs (names version)
        self._transport: Any = None
        from da3po_megatron.trainer.cluster.colocation import OffloadCycle  # actor.offload around generation
        self.offload = OffloadCycle(self.policy, cfg.actor.offload, self.weight_transfer == "ipc",
                                    cfg.actor.offload_without_sleep, cfg.rollout.staleness)
        self.rollout.resync = self.sync_weights  # an engine restarted after a sync gets the weights again
        from da3po_megatron.trainer.observability.profiling import StepProfiler

        self.profiler = StepProfiler(cfg.trainer.profile, self.run_dir, self.policy, self.rollout)
        print(f"weight transfer: {self.weight_transfer} (rollout.weight_transfer={cfg.rollout.weight_transfer})",
              flush=True)

        if latest is not None:
            self._restore(latest)
        self.saved_step = self.step if latest is not None else -1
        self.completed_state = self.trainer_state()  # what a checkpoint of the last completed step holds
        self.logger = MetricsLogger(self.run_dir, cfg.trainer.total_steps, start_step=self.step,
                                    tensorboard=cfg.trainer.tensorboard, wandb_project=cfg.trainer.wandb_project,
                                    run_name=cfg.trainer.experiment_name, config=to_dict(cfg),
                                    before_write=self.ckpt.before_write)

    # ------------------------------------------------------------------------------------------------ generation
    def next_prompts(self, k: int) -> list[Example]:
        return self.prompts.take(k)

    def prompts_for_round(self, need: int) -> int:
        """Prompts to generate for ``need`` missing groups: over-sampled by the inverse of the keep rate observed so
        far in this run (at most 4x; exactly ``need`` without filtering or on the first round of a run)."""
        if not self.cfg.algorithm.filter_groups or self.totals["groups"] == 0:
            return need
        if hasattr(self.prompts, "round_size"):  # data.selection: the keep rate of the recent windows
            return self.prompts.round_size(need)
        keep_rate = max(self.totals["kept_groups"] / self.totals["groups"], 0.25)
        return max(need, math.ceil(need / keep_rate))

    def sampling_seed(self, step: int, round_: int) -> int:
        """Engine sampling seed of one generation round: a function of (seed, step, round) so a resumed run samples
        exactly what an uninterrupted one would."""
        return (self.cfg.trainer.seed * 1_000_003 + step * 1_009 + round_) % (2**31 - 1)

    def sampling_config(self, seed: int) -> Any:
        from da3po_megatron.rollout import SamplingConfig

        r = self.cfg.rollout
        from da3po_megatron.megatron.memory_host import route_fraction

        return SamplingConfig(n=r.n, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_response_length,
                              seed=seed, apply_chat_template=False, ignore_eos=r.ignore_eos,
                              routes_fraction=route_fraction(self.cfg.moe))

    def render_prompts(self, examples: list[Example]) -> list[Any]:
        return [render_prompt(self.tokenizer, ex.prompt, self.cfg.data.apply_chat_template) for ex in examples]

    def generate(self, examples: list[Example], seed: int) -> list[list[Any]]:
        """G responses per prompt in one round (an example's ``meta["max_tokens"]`` caps its own responses)."""
        from da3po_megatron.rollout.types import EngineDeadError

        r = self.cfg.rollout
        lengths = [ex.meta.get("max_tokens") for ex in examples]
        prompts, sampling = self.render_prompts(examples), self.sampling_config(seed)
        max_tokens = lengths if any(x is not None for x in lengths) else None
        try:
            out = self.rollout.generate(prompts, sampling, max_tokens=max_tokens)
        except EngineDeadError as e:  # the client restarted the engine but cannot replay weights the policy pushed
            if not r.restart_on_failure:
                raise
            print(f"warning: {e}; syncing the policy's weights into the restarted engine and generating again",
                  flush=True)
            self.sync_weights()
            out = self.rollout.generate(prompts, sampling, max_tokens=max_tokens)
        for ex, comps in zip(examples, out, strict=True):
            if len(comps[0].prompt_token_ids) > r.max_prompt_length:
                raise ValueError(f"prompt {ex.uid} has {len(comps[0].prompt_token_ids)} tokens, more than "
                                 f"rollout.max_prompt_length={r.max_prompt_length}")
        return out

    def score(self, examples: list[Example], completions: list[list[Any]]) -> list[B.Group]:
        r = self.cfg.rollout
        for ex, comps in zip(examples, completions, strict=True):
            if len(comps[0].prompt_token_ids) > r.max_prompt_length:
                raise ValueError(f"prompt {ex.uid} has {len(comps[0].prompt_token_ids)} tokens, more than "
                                 f"rollout.max_prompt_length={r.max_prompt_length}")
        texts = [c.text for cs in completions for c in cs]
        answers = [ex.answer for ex, cs in zip(examples, completions) for _ in cs]
        scored = self.rewards.score_batch(texts, answers, kind=self.cfg.reward.kind)
        ov = self.cfg.algorithm.overlong
        groups = B.make_groups(examples, completions, scored.rewards, self.cfg.rollout.max_response_length,
                               ov.buffer_length if ov.enable else None)
        n_tok = sum(len(c.token_ids) for cs in completions for c in cs)
        self.totals["samples"] += len(texts)
        self.totals["tokens"] += n_tok
        self.totals["groups"] += len(groups)
        self.totals["reward_timeouts"] += scored.timeouts
        self.totals["reward_errors"] += scored.errors
        if observe := getattr(getattr(self, "prompts", None), "observe", None):  # data.selection: the history
            observe([(g.example.uid, g.p_hat) for g in groups])
        return groups

    # ------------------------------------------------------------------------------------------------ training
    def old_logprobs(self, batch: PolicyBatch, fresh: bool = True, versions: Ragged | None = None,
                     routes: tuple[list[int], Ragged] | None = None) -> tuple[PolicyBatch, dict[str, float]]:
        """pi_old for the ratio, and the rollout-vs-policy log-prob mismatch of the sampled tokens (logged every step:
        the trainer/engine mismatch problem). With ``actor.use_rollout_logprobs`` only a ``rollout.
        logprob_check_fraction`` sample of responses is recomputed, for the mismatch metric alone. With
        ``algorithm.rollout_correction=tis`` the batch also gets the per-token TIS weights
        min(pi_old / pi_rollout, tis_cap) that correct for the mismatch, and their ``tis/*`` statistics. ``fresh``:
        the batch was generated by the policy's current weights (not one step off, ``rollout.staleness=1``); only
        then does the mismatch measure the sync, and feed the drift alert.

        ``versions`` (``B.token_versions``: the policy version that sampled each token; replaces ``fresh``): only the
        tokens sampled by the current weights (version ``self.step``) measure the sync, so the drift alert is fed
        with their mismatch alone (``rollout/logprob_diff_fresh_*`` when the batch mixes versions; nothing when no
        token is fresh) and ``rollout/fresh_token_frac`` says how many there were. ``rollout/logprob_diff_*`` and
        TIS cover every token: each token's rollout log-prob is the behaviour log-prob of the version that sampled
        it (partial rollouts stitch them per segment), which is what TIS must divide by.

        ``routes`` (``B.route_sample``): when only some responses carry engine routes (the agreement metric's sample,
        ``moe.router_agreement_fraction``), those responses' forward with their routes gives ``moe/router_*``."""
        import random as _random

        from da3po_megatron.rollout.consistency import logprob_diff_metrics

        rollout_lp = batch.old_logprobs
        if self.cfg.moe.routing_replay != "none" and batch.routed_experts is None:  # R3 must not fall back silently
            raise RuntimeError(f"moe.routing_replay={self.cfg.moe.routing_replay!r}, but the step's batch carries no "
                               "routes from the engines (every completion needs Completion.routed_experts; "
                               "docs/moe.md 'Routing replay')")
        agreement: dict[str, float] = {}
        if routes is not None and batch.routed_experts is None:  # MoE: agreement on the sample with routes
            idx, rows = routes
            self.policy.compute_logprobs(PolicyBatch([batch.prompt_ids[i] for i in idx],
                                                     [batch.response_ids[i] for i in idx], routed_experts=rows))
            agreement = {f"moe/{k}": v for k, v in self.policy.call("routing_stats").items()}
            agreement["moe/router_agreement_responses"] = float(len(idx))
        if self.cfg.actor.use_rollout_logprobs:
            n = len(batch)
            k = min(n, math.ceil(self.cfg.rollout.logprob_check_fraction * n))
            idx = sorted(_random.Random(self.step).sample(range(n), k))
            if not idx:
                return batch, {}
            sub = PolicyBatch([batch.prompt_ids[i] for i in idx], [batch.response_ids[i] for i in idx],
                              routed_experts=None if batch.routed_experts is None else batch.routed_experts.take(idx))
            mismatch = logprob_diff_metrics([rollout_lp[i] for i in idx], self.policy.compute_logprobs(sub))
            if sub.routed_experts is not None:  # MoE: the checked sample's router agreement (docs/moe.md)
                mismatch.update({f"moe/{k}": v for k, v in self.policy.call("routing_stats").items()})
            if versions is not None:  # the sample measures the sync only if the current weights sampled all of it
                fresh = all(bool((versions[i] == self.step).all()) for i in idx)
            return batch, {**mismatch, **agreement, **(self.drift.update(self.step + 1, mismatch) if fresh else {})}
        policy_lp = poisoned(self.policy.compute_logprobs(batch), self.step + 1)  # (a no-op outside fault tests)
        mismatch = logprob_diff_metrics(rollout_lp, policy_lp)
        if batch.routed_experts is not None:  # MoE: router agreement of this pass with the engines (docs/moe.md)
            mismatch.update({f"moe/{k}": v for k, v in self.policy.call("routing_stats").items()})
        mismatch.update(fresh_drift(self.drift, self.step, rollout_lp, policy_lp, mismatch, fresh, versions))
        mismatch.update(agreement)
        weights = None
        if self.cfg.algorithm.rollout_correction == "tis":
            # one float64 vector of all tokens each (arrays: no per-token Python); the weights keep the policy's rows
            lp, rollout = Ragged.from_rows(policy_lp, np.float64), Ragged.from_rows(rollout_lp, np.float64)
            w, stats = tis_weights(torch.from_numpy(lp.values), torch.from_numpy(rollout.values),
                                   self.cfg.algorithm.tis_cap)
            weights = Ragged(w.numpy().astype(np.float32), lp.offsets)
            mismatch.update(stats)
        return replace(batch, old_logprobs=policy_lp, token_weights=weights), mismatch

    def check_update(self, step: int, train_metrics: dict[str, Any]) -> None:
        """Refused optimizer updates (non-finite, or too large: ``megatron/update_guard.py``): counted, warned, and
        the run stopped before the sync after too many in a row (``trainer/updates.py``)."""
        from da3po_megatron.trainer.updates import check_update

        check_update(self.totals, step, train_metrics, self.cfg.trainer)

    def sync_weights(self) -> dict[str, float]:
        """Policy -> every engine (``rollout.weight_transfer``) inside the ``actor.offload`` cycle (colocation.py)."""
        if self.weight_transfer == "none" or skipped("weight_sync", self.step + 1):  # train_only replay; fault tests
            return {}
        from da3po_megatron.trainer.cluster.colocation import push_weights

        return self.offload.around_sync(lambda *hooks: push_weights(self, *hooks), inside=self.weight_transfer == "ipc")

    def engines_idle(self) -> None:
        """The step's generation is over. Colocated on CUDA ("ipc"), the engines sleep (level 2: KV cache and weights
        freed; the next sync rewrites every weight) so the policy has the GPU memory; ``ipc_sync`` wakes them."""
        if self.weight_transfer == "ipc":
            self.rollout.sleep(level=2)
        self.offload.engines_asleep(slept=self.weight_transfer == "ipc")  # actor.offload: reloaded before a forward

    def pin_cpus(self) -> None:
        """Placement for overlap: engines on ``ray.engine_cpus``, policy ranks on ``ray.policy_cpus`` (disjoint cores:
        generation and training never compete for one). Prints the resulting affinity."""
        r = self.cfg.ray
        for name, spec in (("policy_cpus", r.policy_cpus), ("engine_cpus", r.engine_cpus)):
            try:
                if name == "policy_cpus":
                    cores = self.policy.run_on_all(_pin, spec) if spec else []
                else:
                    cores = self.rollout.call_all("pin_cpus", spec) if spec else []
            except Exception as e:  # noqa: BLE001 - name the field
                raise ValueError(f"ray.{name}={spec!r}: {e}") from e
            if spec:
                print(f"placement: {name.split('_')[0]} processes pinned to cores {cores}", flush=True)

    # ------------------------------------------------------------------------------------------------ metrics
    def step_metrics(self, rollout, daa, mismatch, train_metrics, sync, phase_seconds, step_seconds
                     ) -> dict[str, float]:
        cfg = self.cfg
        groups, generated = rollout.groups, rollout.generated
        m: dict[str, float] = {}
        m.update(B.group_stats(generated, cfg.rollout.max_response_length, "gen"))
        m.update(B.group_stats(groups, cfg.rollout.max_response_length, "batch"))
        m["acc/mean"] = m.get("gen/acc", 0.0)
        m["reward/mean"] = m.get("gen/reward", 0.0)
        s = rollout.stats
        m.update(s)
        versions = [g.weight_step for g in groups]
        m["rollout/weight_step_min"], m["rollout/weight_step_max"] = float(min(versions)), float(max(versions))
        m["rollout/staleness"] = float(self.step - 1 - min(versions))  # policy step trained from - generating step
        m.update(B.version_stats(groups, self.step - 1, cfg.rollout.staleness, cfg.rollout.max_versions_per_response))
        m["gen/rounds"] = s["dynamic_sampling/rounds"]
        m["gen/groups"] = s["dynamic_sampling/generated_groups"]
        m["filter/kept_groups"] = s["dynamic_sampling/kept_groups"]
        gen = max(s["dynamic_sampling/generated_groups"], 1.0)
        m["filter/frac_filtered"] = (s["dynamic_sampling/discarded_all_correct_groups"]
                                     + s["dynamic_sampling/discarded_all_wrong_groups"]) / gen
        m["gen/cumulative_samples"] = float(self.totals["samples"])
        m["gen/cumulative_tokens"] = float(self.totals["tokens"])
        m["gen/cumulative_groups"] = float(self.totals["groups"])
        m["reward/timeouts_total"] = float(self.totals["reward_timeouts"])
        m["reward/errors_total"] = float(self.totals["reward_errors"])
        m["train/skipped_updates_total"] = float(self.totals["skipped_updates"])
        m["data/skipped_rows"] = float(self.data_skipped_rows)
        m.update(daa)
        m.update(B.theory_stats(generated, groups, cfg.algorithm.advantage_eps))
        m.update({k: float(v) for k, v in mismatch.items()})
        m.update({f"train/{k}": float(v) for k, v in train_metrics.items() if isinstance(v, int | float)})
        m["train/loss_backend"] = train_metrics.get("loss_backend")  # what computed the loss, e.g. "kernel:triton"
        m.update({f"sync/{k}": float(v) for k, v in sync.items() if isinstance(v, int | float)})
        m.update({f"time/{k}": v for k, v in phase_seconds.items()})
        m["time/step"] = step_seconds
        n_tok = sum(len(r) for g in generated for r in g.response_ids)
        m["perf/rollout_tokens_per_s"] = n_tok / max(phase_seconds.get("generate", 0.0), 1e-9)
        m.update(selection_batch_metrics([g.bucket for g in groups], len(generated), n_tok))
        m.update(self.selection_metrics)  # data.selection: skipped prompts per tail, exploration rates
        return m

    # ------------------------------------------------------------------------------------------------ evaluation
    def should_evaluate(self, step: int) -> bool:
        e = self.cfg.eval
        return bool(e.every) and bool(e.benchmarks) and not engineless(self.cfg) and (
            step % e.every == 0 or step == self.cfg.trainer.total_steps)

    def evaluate(self) -> dict[str, float]:
        from da3po_megatron.trainer.evaluation import evaluate_during_training

        return evaluate_during_training(self)

    # ------------------------------------------------------------------------------------------------ preemption
    def preempted(self) -> bool:
        return self.stop.requested

    def close(self) -> None:
        if getattr(self, "async_rollout", None) is not None:  # the producer thread stops before its engines go
            try:
                self.async_rollout.close()
            except Exception as e:  # noqa: BLE001 - closing must not hide the real error
                print(f"warning: stopping the rollout producer failed: {e}", flush=True)
            self.async_rollout = None
        if getattr(self, "_async_save", None) is not None:  # a run that ends waits for its checkpoint
            step = self._async_save["pending"].step
            try:
                self.poll_checkpoint(wait=True)
            except Exception as e:  # noqa: BLE001 - closing must not hide the real error
                print(f"warning: the asynchronous checkpoint of step {step} did not complete ({e}); latest still "
                      "names the previous complete one", flush=True)
        if getattr(self, "_transport", None) is not None:
            try:
                self._transport.teardown(self.rollout)
            except Exception as e:  # noqa: BLE001 - closing must not hide the real error
                print(f"warning: closing the weight-transfer group failed: {e}", flush=True)
            self._transport = None
        for part in ("rollout", "policy", "rewards", "reservation"):
            obj = getattr(self, part, None)
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
