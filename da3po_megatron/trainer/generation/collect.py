"""Collecting one step's batch: generation + rewards + dynamic sampling, in the paper's rounds or streamed with abort.

Both pipelines (``trainer/loop.py`` step 1, and the prefetch / asynchronous producer of
``generation/async_rollout.py``) take the run's :class:`~da3po_megatron.trainer.generation.sampler.Sampler` (prompts,
engines, rewards, buffer), never the run; the step's data (:class:`~da3po_megatron.trainer.batch.StepRollout`) is in
``trainer/batch.py`` and the phase timer in ``observability/profiling.py``, below both.

**Prefetch** (``rollout.staleness=1``; verl's one-step-off-policy recipe, AReaL's staleness bound 1; :class:`Prefetch`):
the batch of step t+1 is collected in a driver thread -- the engines generate, the reward pool scores -- while the
policy computes pi_old and trains step t. The loop joins it before the weight sync, so weights never change under a
running request, and every group records ``weight_step``, the policy step whose weights generated it. Exactly
reproducible (seeds alone). (Moved here from ``async_rollout.py``, the producer's module: issue 56.)

**Rounds** (``rollout.mode=rounds``, the paper's dynamic sampling): :func:`fill_batch` generates whole rounds until the
dynamic-sampling buffer holds the batch.

**Streaming** (``rollout.mode=streaming``; slime's over-sampling with abort, in our own code). Instead of whole rounds
that each wait for their longest response, the driver keeps ``rollout.max_inflight_prompts`` prompts in flight over
the engines (each engine holds its share and gets a new prompt as soon as one of its groups finishes), scores every
group with the reward pool as soon as its G responses are done, filters it (0 < p_hat < 1, DAPO), and once the batch
holds ``data.train_batch_size`` kept groups aborts every request still running. Nothing aborted reaches the batch or
the sample metrics; its decoded tokens are counted as waste.

What the streaming batch is a sample of (``rollout.stream_order``):

- ``submission`` (default): the first ``train_batch_size`` kept groups *in prompt order* -- the rule of the round-based
  path (its buffer also takes the oldest kept groups first). Whether a group is kept does not depend on how long its
  responses are, so the batch is distributed like the round-based one (no bias toward short responses), and it is a
  function of the seeds alone: prompt j always goes to engine ``j mod E`` with seed ``f(step, j)``, each engine's
  batches depend only on the calls it receives, and the prompt stream is rewound to just after the last admitted
  prompt (prompts generated beyond it are drawn again next step, never skipped unseen).
- ``completion``: the first kept groups to *finish*. Lower latency, but short responses finish first, so the batch
  over-represents them (measured in ``da3po bench rl-step`` / docs/throughput.md); with several engines it also
  depends on timing. Every submitted prompt counts as consumed.
"""

from __future__ import annotations

import bisect
import collections
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from da3po_megatron.ranges import phase as named_range
from da3po_megatron.trainer import batch as B
from da3po_megatron.trainer.batch import StepRollout
from da3po_megatron.trainer.observability.profiling import PhaseTimer

if TYPE_CHECKING:
    from da3po_megatron.trainer.generation.sampler import Sampler


class DynamicSamplingError(RuntimeError):
    """Dynamic sampling could not fill the batch within algorithm.max_generation_rounds; ``stats`` holds the filter's
    counts and the phase times of the failed step (logged before the run stops)."""

    def __init__(self, message: str, stats: dict[str, float] | None = None) -> None:
        super().__init__(message)
        self.stats = dict(stats or {})


def token_stats(groups: list[B.Group], generated: list[B.Group], aborted_groups: int = 0, aborted_tokens: int = 0,
                unscored_tokens: int = 0) -> dict[str, float]:
    """Decode-token accounting of one collection: decoded = every token the engines produced for it (scored groups,
    groups that finished after the batch was full and were never scored, partial responses of aborted groups); kept =
    the batch's; wasted = decoded - kept (filtered, surplus, unscored and aborted groups)."""
    kept = sum(len(r) for g in groups for r in g.response_ids)
    finished = sum(len(r) for g in generated for r in g.response_ids)
    decoded = finished + unscored_tokens + aborted_tokens
    return {"rollout/decoded_tokens": float(decoded), "rollout/kept_tokens": float(kept),
            "rollout/wasted_tokens": float(decoded - kept), "rollout/aborted_groups": float(aborted_groups),
            "rollout/aborted_tokens": float(aborted_tokens),
            "rollout/decoded_per_kept_token": decoded / kept if kept else 0.0}


def fill_batch(run: Sampler, step: int) -> StepRollout:
    """Generation rounds until the dynamic-sampling buffer holds the batch (the paper's dynamic sampling)."""
    cfg, buffer, timer, weight_step = run.cfg, run.buffer, PhaseTimer(run, step), run.engine_weight_step
    buffer.reset_stats()
    generated: list[B.Group] = []
    t0 = time.perf_counter()
    for round_ in range(cfg.algorithm.max_generation_rounds):
        if buffer.is_full:
            break
        examples = run.next_prompts(run.prompts_for_round(cfg.data.train_batch_size - len(buffer)))
        with timer("generate"):
            completions = run.generate(examples, seed=(seed := run.sampling_seed(step, round_)))
        with timer("reward"):
            groups = run.score(examples, completions)
        for i, g in enumerate(groups):
            g.weight_step, g.seed = weight_step, seed + i * cfg.rollout.n  # prompt i's requests (SamplingConfig.seed)
        generated += groups
        p_hats = [g.p_hat if cfg.algorithm.filter_groups else 0.5 for g in groups]  # 0.5: kept by the filter
        with named_range("filter"):
            run.totals["kept_groups"] += buffer.add(groups, p_hats)
        if round_ or not buffer.is_full:  # a progress line whenever filling the batch takes more than one round
            print(f"step {step} generation round {round_ + 1}/{cfg.algorithm.max_generation_rounds}: "
                  f"{len(buffer)}/{cfg.data.train_batch_size} groups kept ({len(generated)} generated, "
                  f"{time.perf_counter() - t0:.0f} s)", flush=True)
    if not buffer.is_full:
        s = buffer.stats()
        raise DynamicSamplingError(
            f"dynamic sampling kept {len(buffer)} of the {cfg.data.train_batch_size} groups the batch needs after "
            f"{cfg.algorithm.max_generation_rounds} generation rounds: observed keep rate "
            f"{s['dynamic_sampling/kept_frac']:.3f} ({s['dynamic_sampling/kept_groups']:.0f} of "
            f"{s['dynamic_sampling/generated_groups']:.0f} groups; all-correct "
            f"{s['dynamic_sampling/discarded_all_correct_groups']:.0f}, all-wrong "
            f"{s['dynamic_sampling/discarded_all_wrong_groups']:.0f}). Raise algorithm.max_generation_rounds, lower "
            "data.train_batch_size, or use easier/harder prompts.",
            {**s, **{f"time/{k}": v for k, v in timer.seconds.items()}})
    groups = buffer.take()
    stats = {**buffer.stats(), **token_stats(groups, generated)}
    return StepRollout(groups, generated, stats, weight_step, timer.seconds)


def stream_batch(run: Sampler, step: int) -> StepRollout:
    """Fill the batch of ``step`` by streaming generation with abort (see the module docstring)."""
    cfg, client = run.cfg, run.rollout
    need, n_eng = cfg.data.train_batch_size, client.num_engines
    per_engine = max(1, math.ceil((cfg.rollout.max_inflight_prompts or need) / n_eng))
    budget = cfg.algorithm.max_generation_rounds * need  # prompts this step may try before giving up
    in_order = cfg.rollout.stream_order == "submission"
    sampling = run.sampling_config(run.sampling_seed(step, 0))
    weight_step, start = run.engine_weight_step, run.prompts.state_dict()
    examples: list = []  # global prompt index j -> Example (drawn from the stream on demand)
    next_j, running = list(range(n_eng)), [set() for _ in range(n_eng)]  # next index / indices running per engine
    kept_idx: list[int] = []  # submission order: indices of the kept groups scored so far, sorted

    def limit() -> int:
        """Prompts at or beyond this index cannot enter the batch any more (submission order: the need-th kept
        group is known), so they are not submitted and, when running, aborted."""
        return kept_idx[need - 1] + 1 if in_order and len(kept_idx) >= need else budget

    def refill(e: int) -> list[tuple[str, object, int, int | None]]:
        out = []
        while len(running[e]) + len(out) < per_engine and next_j[e] < limit():
            j, next_j[e] = next_j[e], next_j[e] + n_eng
            while len(examples) <= j:
                examples.extend(run.next_prompts(1) or [None])
            if examples[j] is None:  # a finite prompt stream ran out
                break
            ex = examples[j]
            out.append((f"s{step}p{j}", run.render_prompts([ex])[0], j, ex.meta.get("max_tokens")))
        running[e].update(j for _, _, j, _ in out)
        return out

    def useless(e: int) -> list[str]:
        drop = sorted(j for j in running[e] if j >= limit())
        running[e].difference_update(drop)
        return [f"s{step}p{j}" for j in drop]

    t0, reward_s, steps = time.perf_counter(), 0.0, cfg.rollout.stream_steps_per_call
    # Two calls queued per engine: while the driver handles one call's result, the engine already runs the next,
    # so it never idles on a round trip; the driver's answer to call k (new prompts, aborts) goes into call k + 2.
    queued: list[collections.deque] = [collections.deque() for _ in range(n_eng)]
    for e in range(n_eng):
        queued[e].append(client.stream_start(e, refill(e), sampling, None, steps))
        queued[e].append(client.stream_start(e, [], sampling, None, steps))
    scored: dict[int, B.Group] = {}
    batch: list[B.Group] = []
    admitted = 0  # submission order: prompts 0..admitted-1 are decided (kept into the batch or filtered)
    informative = unscored_tokens = 0
    aborted: dict[str, int] = {}
    while any(queued) and len(batch) < need:
        pos, res = client.stream_wait(heads := [(e, q[0]) for e, q in enumerate(queued) if q])
        e = heads[pos][0]
        queued[e].popleft()
        aborted.update(res["aborted"])
        done = [(int(key.rpartition("p")[2]), comps) for key, comps in res["finished"]]
        running[e].difference_update(j for j, _ in done)
        drop, new = useless(e), refill(e)
        if running[e] or drop:
            queued[e].append(client.stream_start(e, new, sampling, drop, steps))
        unscored_tokens += sum(c.num_tokens for j, comps in done if j >= limit() for c in comps)
        done = [(j, comps) for j, comps in done if j < limit()]
        if not done:
            continue
        t_r = time.perf_counter()
        groups = run.score([examples[j] for j, _ in done], [comps for _, comps in done])
        reward_s += time.perf_counter() - t_r
        for (j, _), g in zip(done, groups):
            g.weight_step = weight_step
            keep = not cfg.algorithm.filter_groups or 0.0 < g.p_hat < 1.0
            informative += keep
            scored[j] = g
            if keep:
                bisect.insort(kept_idx, j)
            if not in_order and keep and len(batch) < need:
                batch.append(g)
        while in_order and admitted in scored and len(batch) < need:
            g = scored[admitted]
            if not cfg.algorithm.filter_groups or 0.0 < g.p_hat < 1.0:
                batch.append(g)
            admitted += 1
    # End of the step: let the calls in flight return, then abort everything still running on every engine.
    for e, q in enumerate(queued):
        while q:
            _, res = client.stream_wait([(e, q.popleft())])
            aborted.update(res["aborted"])
            unscored_tokens += sum(c.num_tokens for _, comps in res["finished"] for c in comps)
    ends = client.stream_abort_all()
    if any(end["running"] for end in ends):
        raise RuntimeError(f"streaming: requests still running after the abort: {ends}")
    aborted.update({k: v for end in ends for k, v in end["aborted"].items()})
    if len(batch) < need:
        run.prompts.load_state_dict(start)
        run.prompts.take(len([x for x in examples if x is not None]))
        raise DynamicSamplingError(
            f"dynamic sampling kept {len(batch)} of the {need} groups the batch needs after streaming {len(scored)} "
            f"groups (the budget is algorithm.max_generation_rounds x data.train_batch_size = {budget} prompts): "
            f"observed keep rate {informative / max(len(scored), 1):.3f}. Raise algorithm.max_generation_rounds, "
            "lower data.train_batch_size, or use easier/harder prompts.",
            {"dynamic_sampling/generated_groups": float(len(scored)), "dynamic_sampling/kept_groups": float(len(batch)),
             "dynamic_sampling/aborted_groups": float(len(aborted)), "time/generate": time.perf_counter() - t0})
    # The prompt stream resumes right after the last prompt the batch depends on.
    consumed = admitted if in_order else len([x for x in examples if x is not None])
    run.prompts.load_state_dict(start)
    run.prompts.take(consumed)
    run.totals["kept_groups"] += informative
    generated = [scored[j] for j in sorted(scored)]
    filtered = [g for g in generated if cfg.algorithm.filter_groups and not 0.0 < g.p_hat < 1.0]
    stats = {"dynamic_sampling/generated_groups": float(len(generated)),
             "dynamic_sampling/kept_groups": float(len(batch)),
             "dynamic_sampling/discarded_all_correct_groups": float(sum(g.p_hat >= 1.0 for g in filtered)),
             "dynamic_sampling/discarded_all_wrong_groups": float(sum(g.p_hat <= 0.0 for g in filtered)),
             "dynamic_sampling/discarded_surplus_groups": float(len(generated) - len(filtered) - len(batch)),
             "dynamic_sampling/rounds": 1.0, "dynamic_sampling/kept_frac": len(batch) / max(len(generated), 1),
             "dynamic_sampling/aborted_groups": float(len(aborted)),
             "rollout/consumed_prompts": float(consumed)}
    stats.update(token_stats(batch, generated, len(aborted), sum(aborted.values()), unscored_tokens))
    total = time.perf_counter() - t0
    return StepRollout(batch, generated, stats, weight_step, {"generate": total - reward_s, "reward": reward_s})


def collect(run: Sampler, step: int) -> StepRollout:
    """The batch of ``step`` (``run``: the run's sampler): generation + rewards + dynamic sampling, in rounds or
    streamed -- or, with ``rollout.replay_dir``, the recorded one (``generation/replay.py``, which also keeps what
    ``rollout.dump_dir`` needs)."""
    replay = getattr(run, "replay", None)
    return replay.collect(run, step, lambda: _collect(run, step)) if replay is not None else _collect(run, step)


def _collect(run: Sampler, step: int) -> StepRollout:
    if run.cfg.rollout.mode == "streaming":
        with named_range("generate"):  # streamed: generation, rewards and the filter interleave inside this one range
            return stream_batch(run, step)
    return fill_batch(run, step)


class Prefetch:
    """Collect the next step's batch in a driver thread (``rollout.staleness=1``); :meth:`join` returns it (or
    re-raises its error) and how long the caller waited for it."""

    def __init__(self, collect: Callable[[], StepRollout]) -> None:
        self._result: StepRollout | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(collect,), name="da3po-prefetch", daemon=True)
        self._thread.start()

    def _run(self, collect: Callable[[], StepRollout]) -> None:
        try:
            self._result = collect()
        except BaseException as e:  # noqa: BLE001 - re-raised in the training thread by join()
            self._error = e

    def join(self) -> tuple[StepRollout, float]:
        t0 = time.perf_counter()
        self._thread.join()
        waited = time.perf_counter() - t0
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result, waited
