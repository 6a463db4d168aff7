"""The DA3PO RL loop, Algorithm 1 of the paper, read top to bottom.

    for each step:
        repeat (generation rounds) until the batch holds train_batch_size informative groups:   # dynamic sampling
            sample prompts; generate G responses each                                             # vLLM engines
            score them: R = R_acc (verifier) + R_len (Eq. 8)                                      # reward pool
            keep groups with 0 < p_hat < 1                                                        # DAPO filter
        [staleness k >= 1: the engines generate the next batches meanwhile, k versions ahead at most]  # overlap
        A = group z-scores of R (Eq. 3); A~ = lambda * A where correct and p_hat < tau (Eq. 14)   # <- DAA is HERE
        pi_old = the policy's log-probs of the sampled tokens (or the engines', if configured)
        mini-batch updates of the clipped surrogate (Eq. 5/9/11) on the Megatron policy
        sync the new weights into the engines (+ prefix-cache reset)
        log metrics; checkpoint; evaluate

Everything heavy lives with its owner, one jump away: ``trainer/run.py`` builds the owners; ``run.sampler``
(``generation/sampler.py``) generates and scores, ``generation/collect.py`` fills one step's batch with it (the
paper's generation rounds or streaming with abort) and ``generation/async_rollout.py`` generates beside the loop;
``trainer/batch.py`` holds the batch math; ``trainer/old_logprobs.py`` is phase 3; ``run.state``
(``resume/run_state.py``) completes and checkpoints steps; ``observability/step_metrics.py`` makes a step's metrics.
This file is only the schedule.
``rollout.staleness=1`` prefetches the next step's batch while this step trains; ``rollout.staleness >= 2`` or
``rollout.partial_rollouts`` take batches from the asynchronous producer, paused around each weight sync.
GRPO / DAPO / GSPO differ only through the config's preset: no filtering (GRPO/GSPO), the loss aggregation and ratio
level (in the policy's loss), and DAA off (all but DA3PO).
"""

from __future__ import annotations

import time

from da3po_megatron.config import Config
from da3po_megatron.ranges import phase as named_range
from da3po_megatron.trainer import batch as B
from da3po_megatron.trainer.generation.async_engines import EngineFailure
from da3po_megatron.trainer.generation.async_rollout import AsyncRollout, ProducerStalled, uses_producer
from da3po_megatron.trainer.generation.collect import DynamicSamplingError, Prefetch, collect
from da3po_megatron.trainer.generation.rescore import rescore
from da3po_megatron.trainer.observability.profiling import PhaseTimer
from da3po_megatron.trainer.observability.step_metrics import step_metrics
from da3po_megatron.trainer.old_logprobs import old_logprobs
from da3po_megatron.trainer.run import Run

__all__ = ["run_steps", "train"]


def after_previous_step(run: Run, previous: dict[str, float]) -> str:
    """What the step before a dynamic-sampling failure did to the policy: its update ratio and accuracy (a keep rate
    that collapses right after an update points at the update, not at the prompts)."""
    if not previous:
        return ""
    p = {k: previous.get(k, float("nan")) for k in ("train/update_ratio", "train/lr", "train/grad_norm", "acc/mean")}
    return (f" The previous step ({previous['step']}) had update ratio ||dtheta||/||theta|| "
            f"{p['train/update_ratio']:.3g} (trainer.max_update_ratio={run.cfg.trainer.max_update_ratio:g}), lr "
            f"{p['train/lr']:.3g}, grad norm {p['train/grad_norm']:.3g} and accuracy {p['acc/mean']:.3f}.")


def train(cfg: Config, allow_config_change: bool = False) -> Run:
    """Run (or resume) training as configured; returns the finished :class:`Run` (closed). ``allow_config_change``:
    ``--allow-config-change`` (``trainer/resume/config_drift.py``).

    A stop request (SIGTERM / SIGUSR1 / SIGINT / ``run_dir/PREEMPT``, see ``trainer/cluster/signals.py``) abandons the
    step in progress while it is in phases 1-3 (a resumed run redoes it exactly), or lets it finish from phase 4 on;
    then the last completed step is checkpointed and the run ends."""
    run = Run(cfg, allow_config_change)
    try:
        try:
            run_steps(run)
        except KeyboardInterrupt:  # StepAbandoned (ray.get re-raises it as a plain KeyboardInterrupt) or SIGINT x2
            if run.stop.exit_now or not run.stop.abandoned:
                raise
        except (EngineFailure, ProducerStalled):  # an engine of the producer died / hung, not restarted: the last
            run.state.save_checkpoint()  # completed step is saved (a no-op when it is), then the run stops
            run.state.poll_checkpoint(wait=True)
            raise
        if run.preempted():
            run.state.save_checkpoint()
            run.state.poll_checkpoint(wait=True)  # an asynchronous save completes before the run ends
            print(f"stop requested ({run.stop.describe()}): step {run.state.step} checkpointed; exiting", flush=True)
    finally:
        run.close()
    return run


def run_steps(run: Run) -> None:
    """Algorithm 1: the steps from ``run.state.step + 1`` to ``trainer.total_steps`` (or until a stop request)."""
    cfg, sampler, state = run.cfg, run.sampler, run.state
    if state.step == 0 and run.should_evaluate(0):  # the starting policy, for before/after comparisons
        run.logger.log(0, run.evaluate())
    previous: dict[str, float] = {}  # the last completed step's metrics (named when dynamic sampling fails)
    # generates from here on, beside us (a staleness-1 checkpoint's prefetched batch moves into its queue)
    producer = state.producer = AsyncRollout(sampler, sampler.engine_weight_step, state.producer_state,
                                             state.pending) if (
        uses_producer(cfg) and state.step < cfg.trainer.total_steps) else None
    for step in range(state.step + 1, cfg.trainer.total_steps + 1):
        t_step, timer = time.perf_counter(), PhaseTimer(sampler, step)
        run.profiler.start(step)  # trainer.profile.steps: traces of this step (a no-op otherwise)
        with run.stop.abandonable():  # a stop request in phases 1-3 abandons the step (nothing of it is kept)
            # 1. Generation + rewards + dynamic sampling (DAPO) until the batch is full -- or, with staleness 1, the
            #    batch generated while the previous step trained; then start generating the next one. Staleness
            #    k >= 2: the next kept groups in FIFO order from the producer, which never stops generating.
            try:
                rollout = state.pending.pop(0) if state.pending else (
                    producer.take(step) if producer else collect(sampler, step))
            except DynamicSamplingError as e:  # keep what was measured: the filter's counts say why
                state.save_checkpoint()  # the last completed step first (a no-op when it is saved): not redone
                run.logger.log(step, {**e.stats, "dynamic_sampling/failed": 1.0})
                raise DynamicSamplingError(str(e) + after_previous_step(run, previous), e.stats) from None
            prefetch = Prefetch(lambda s=step + 1: collect(sampler, s)) if (  # (a producer run replayed: none)
                cfg.rollout.staleness == 1 and not cfg.rollout.partial_rollouts and step < cfg.trainer.total_steps
            ) else None
            if prefetch is None and producer is None:
                run.engines_idle()  # colocated CUDA: engines sleep while the policy trains (woken by the sync)
            groups = rollout.groups
            for phase, seconds in rollout.phase_seconds.items():
                timer.seconds[phase] = seconds

            # 2. Advantages: group z-scores (Eq. 3), then Direct Advantage Amplification (Eq. 14).
            daa = B.compute_advantages(groups, cfg.algorithm.advantage_eps, cfg.daa.enable, cfg.daa.lambda_,
                                       cfg.daa.tau, cfg.daa.mode, cfg.daa.lambda_min, cfg.daa.lambda_max,
                                       advantage_fn=cfg.algorithm.advantage_fn)

            # 3. pi_old: recomputed by the policy (default) or the engines' sampled-token log-probs; the tokens the
            #    current weights sampled (per-token versions) measure the sync.
            batch = B.policy_batch(groups)
            run.replay.record(step, rollout, batch)  # rollout.dump_dir: the step's rollout + batch (generation/replay)
            with timer("old_logprobs"):
                batch, mismatch = old_logprobs(run, batch, versions=B.token_versions(groups),
                                               routes=B.route_sample(groups))

        # 4. Mini-batch updates with the clipped surrogate on the Megatron policy.
        with timer("train"):
            train_metrics = run.policy.train_step(batch)
        run.check_update(step, train_metrics)  # non-finite loss / gradients: updates skipped; too many in a row: stop

        # 5. New weights into the engines (bucketed stream; prefix cache reset) -- after the next step's
        #    generation has finished (staleness 1), or the producer drained / interrupted what runs (k >= 2), so
        #    weights never change under a running request.
        if prefetch is not None:
            next_rollout, timer.seconds["wait_rollout"] = prefetch.join()
            state.pending.append(next_rollout)
        if producer is not None:
            with timer("rollout_pause"):
                producer.pause()
        with timer("weight_sync"):
            sync = run.sync_weights()
        sampler.engine_weight_step = step

        # 6. Metrics, checkpoint, periodic evaluation.
        state.step_completed(step)
        metrics = step_metrics(cfg, step, rollout, daa, mismatch, train_metrics, sync, timer.seconds,
                               time.perf_counter() - t_step, {**sampler.totals, **state.update_totals},
                               sampler.data_skipped_rows, sampler.selection_metrics)
        if cfg.eval.rescore_groups:  # diagnostic (issue 47): this step's p_hat decisions under the new weights
            metrics.update(rescore(sampler, rollout.generated, step))
        if run.should_evaluate(step):
            with timer("eval"):
                metrics.update(run.evaluate())
        run.logger.log(step, metrics)
        previous = {**metrics, "step": step}
        best = state.best_candidate(metrics)  # trainer.keep_best_metric improved: keep this step's checkpoint
        state.poll_checkpoint()  # trainer.async_save: an earlier step's save whose write is done becomes `latest`
        if state.should_checkpoint(step) or run.preempted() or best is not None:
            with named_range("checkpoint"):
                state.save_checkpoint(best_value=best)
        run.profiler.stop()
        if run.preempted():
            break
        if producer is not None and step < cfg.trainer.total_steps:  # the engines hold this step's weights
            producer.resume(step)
