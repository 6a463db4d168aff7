"""Generation beside the loop: the asynchronous producer (``rollout.staleness >= 2`` or ``rollout.partial_rollouts``),
issues 37 and 47. ``trainer/loop.py`` only calls :meth:`AsyncRollout.take` / :meth:`~AsyncRollout.pause` /
:meth:`~AsyncRollout.resume`; docs/async.md is the guide. The producer's engine side is ``async_engines.py``, its
per-group state and checkpoint snapshot ``async_partial.py``; the one-step-off prefetch of ``rollout.staleness=1``
is ``collect.py``'s :class:`~da3po_megatron.trainer.generation.collect.Prefetch`.

**The asynchronous producer** (:class:`AsyncRollout`). A driver thread keeps the engines generating continuously
over the streaming engine API (``RolloutClient.stream_start``, two calls in flight per engine): it admits prompts one
group at a time (at most ``rollout.max_inflight_prompts`` in flight), hands each group to a scorer thread (the reward
pool) the moment its G responses are done, filters it (0 < p_hat < 1), and the loop's :meth:`~AsyncRollout.take`
takes exactly ``data.train_batch_size`` kept decided groups per batch, in the order ``rollout.release_order`` says:
``fifo`` (submission order: a long, hard group holds back the ones admitted after it) or ``oldest_decided`` (out of
order, oldest first, unless an older running group needs the slot for its deadline: the take, not admission, waits
for it; issue 58).

- **Bounded staleness by admission, a deadline per group** (``release.py``, whose docstring states the invariant
  with a picture): a group started under version v is trained at a version <= v + k; admission waits (pacing).
- ``rollout.late_policy=discard`` / ``discard_unpaced`` (for comparison only; the design of systems that bound
  staleness by discarding): groups are released in *completion* order, so short groups overtake long ones, and a kept
  group that would be trained more than k versions after it started is thrown away when released, counted as
  ``rollout/async/discarded_late_groups`` and per bucket. ``discard_unpaced`` does not even pace admission.
- **Weight updates** (:meth:`~AsyncRollout.pause` before the sync, :meth:`~AsyncRollout.resume` after): without
  partial rollouts every running group is finished (drained), so weights never change under a running request. With
  ``rollout.partial_rollouts`` the running groups are interrupted -- aborted on the engine with their tokens kept --
  and continued after the sync from prompt + tokens so far, except groups already spanning
  ``rollout.max_versions_per_response`` versions (drained). Collecting, interrupting and draining run on every engine
  at once, so the pause lasts as long as the slowest engine's part, not the sum.
- **Per-token versions** (``Completion.versions``) next to the behaviour log-probs: TIS and the drift check use them.
- **Seeds**: prompt J (a run-wide admission counter) samples j with seed ``sampling_seed(0, 0) + J * G + j``; a
  continued segment gets a fresh one (``async_partial.continuation_seed``).
- **Faults**: every engine wait is bounded by ``rollout.producer_timeout_s``; a dead or timed-out engine is restarted
  and re-synced (``rollout.restart_on_failure``) and the groups it ran are resubmitted from their prefixes, else the
  error names the engine and the loop checkpoints the last completed step and stops.
- **Checkpoints** (:meth:`~AsyncRollout.snapshot`, taken while paused, serialised only when a checkpoint is
  written): the queued and decided groups and every interrupted partial with its tokens, log-probs and versions. A
  resumed run continues them under the restored weights; an asynchronous run is not bit-reproducible (timing decides
  how far the engines get while a step trains), but its dump (``rollout.dump_dir``) replays it exactly (replay.py).
"""

from __future__ import annotations

import collections
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from da3po_megatron.trainer import batch as B
from da3po_megatron.trainer.faults import fault_point
from da3po_megatron.trainer.generation.async_engines import EngineCalls, EngineSide
from da3po_megatron.trainer.generation.async_partial import Partial, ProducerSnapshot, take_stats, trace_batch
from da3po_megatron.trainer.generation.collect import DynamicSamplingError
from da3po_megatron.trainer.generation.release import FILTERED, KEPT, UNDECIDED, Entry, admissible, pick

if TYPE_CHECKING:
    from da3po_megatron.config import Config
    from da3po_megatron.trainer.generation.sampler import Sampler

__all__ = ["AsyncRollout", "ProducerStalled", "uses_producer"]


def uses_producer(cfg: Config) -> bool:
    """Whether the run's batches come from :class:`AsyncRollout` (else: collected per step, maybe prefetched; a
    producer run's dump replayed, ``rollout.replay_dir``: the recorded batches, no producer, generation/replay.py)."""
    return (cfg.rollout.staleness >= 2 or bool(cfg.rollout.partial_rollouts)) and not cfg.rollout.replay_dir


class ProducerStalled(RuntimeError):
    """The loop waited for the producer (a batch, a pause) with no progress for 2 x ``rollout.producer_timeout_s``."""


class AsyncRollout(EngineSide):
    """The producer thread, its scorer thread and the queue between them and the loop (see the module docstring).

    ``sampler``: the run's :class:`~da3po_megatron.trainer.generation.sampler.Sampler`; ``version``: the policy version
    the engines hold (``sampler.engine_weight_step``); ``state``: a checkpoint's :meth:`state_dict`; ``prefetched``: a
    staleness-1 checkpoint's prefetched batches (``run.state.pending``), moved into the queue (emptied) so the next
    take trains them at the version they were meant for. The threads start at once and run until :meth:`close`.

    **Locking** (the one place it is stated). One condition variable, ``self._cv``, guards every field two threads
    touch: the versions (``version``, ``first_version``), admission (``next_j``, ``prompts_exhausted``, ``_held``,
    ``_waiting``, ``_running``, ``_stale``), the groups (``partials`` and their segments, ``_scoring``, ``decided``,
    ``decided_kept``, ``release_j``, ``released``, ``released_kept``, ``_tried``), the per-take ``counters``,
    ``seconds`` and ``_idle``, and the handshake (``_want_pause``, ``_paused``, ``_stop``, ``_error``, ``_beat``). It is
    never held across an engine call, a reward call or a wait for one. Owned by one thread, without the lock: the engine
    calls in flight (``_calls``, the producer thread), the reward pool (the scorer thread, fed through ``_scores``), the
    prompt stream (the producer thread while it runs; the loop reads its position only while paused), and the engines
    (the producer's while it runs, the loop's weight sync's while paused)."""

    def __init__(self, sampler: Sampler, version: int, state: dict[str, Any] | None = None,
                 prefetched: list[B.StepRollout] | None = None) -> None:
        cfg = sampler.cfg
        r = cfg.rollout
        self.sampler, self.client = sampler, sampler.rollout
        self.k, self.B = int(r.staleness), cfg.data.train_batch_size
        self.partial, self.max_versions = bool(r.partial_rollouts), int(r.max_versions_per_response)
        self.filter = bool(cfg.algorithm.filter_groups)
        self.discard = r.late_policy != "pace"  # comparison only: completion order, late kept groups thrown away
        self.paced = r.late_policy != "discard_unpaced"  # discard_unpaced: admission ignores the bound (issue 47)
        self.order = "fifo" if self.discard else r.release_order  # which decided groups a batch takes (release.py)
        self.n_eng = n_eng = self.client.num_engines
        self.per_engine = max(1, math.ceil((r.max_inflight_prompts or self.B) / n_eng))
        self.budget = cfg.algorithm.max_generation_rounds * self.B  # groups one batch may try before giving up
        self.sampling = sampler.sampling_config(sampler.sampling_seed(0, 0))
        self.timeout_s = float(r.producer_timeout_s)
        self.version = self.first_version = int(version)  # engines' weights; the version the next take trains at
        self.next_j = 0  # run-wide admission counter (key "a{j}", seed base + j * n)
        self.release_j = 0  # every j < release_j is released, or taken out of order (oldest_decided)
        self.partials: dict[int, Partial] = {}  # admitted, undecided: running, interrupted/waiting, or being scored
        self.decided: dict[int, B.Group] = {}  # scored, waiting for an earlier j to be released
        self.decided_kept = 0
        self.released: list[B.Group] = []  # released, not yet taken, in FIFO order (kept and filtered)
        self.released_kept = 0  # kept groups among them (FIFO positions 0.. from the next batch's first)
        self._tried: tuple | None = None  # the state a take last found no batch in (re-picked only when it changes)
        self.counters: collections.Counter = collections.Counter()  # per-take counts (rollout/async/*)
        self.seconds = {"generate": 0.0, "reward": 0.0}  # per-take producer time (time/generate, time/reward)
        self._idle = [0.0, 0.0, 0.0]  # per take: engine-idle s (summed over engines), of it held by the bound, measured
        self.prompts_exhausted = False
        if state:
            self._load(state)
        while prefetched:
            self._adopt(prefetched.pop(0))
        self._running: list[set[int]] = [set() for _ in range(n_eng)]
        self._stale: set[int] = set()  # restarted engines waiting for the next weight sync (no work until then)
        self._scoring: set[int] = set()  # finished on the engine, with the scorer thread
        self._waiting: collections.deque[int] = collections.deque(sorted(self.partials))  # to (re)submit first
        self._cv = threading.Condition()
        self._want_pause = self._paused = self._stop = False
        self._held = False  # admission is waiting for the bound
        self._error: BaseException | None = None
        self._beat = time.monotonic()  # the producer's last sign of progress
        self._calls = EngineCalls(self.client, self.sampling, r.stream_steps_per_call, self.timeout_s)
        self._scores: queue.SimpleQueue = queue.SimpleQueue()
        self._scorer = threading.Thread(target=self._score_main, name="da3po-async-scorer", daemon=True)
        self._thread = threading.Thread(target=self._main, name="da3po-async-rollout", daemon=True)
        self._scorer.start()
        self._thread.start()

    # ------------------------------------------------------------------------------------------ the loop's side
    def take(self, step: int) -> B.StepRollout:
        """The batch of ``step``: ``data.train_batch_size`` kept groups in ``rollout.release_order`` (waits for
        them; :func:`~da3po_megatron.trainer.generation.release.pick`), with the filtered groups released before."""
        t0 = time.perf_counter()
        with self._cv:
            keys: list = []
            self._wait_for(lambda: self._pick(keys), f"the batch of step {step}")
            generated = self._remove(keys[0])
            groups = [g for g in generated if self.keeps(g)]
            counters, self.counters = self.counters, collections.Counter()
            seconds, self.seconds = self.seconds, {"generate": 0.0, "reward": 0.0}
            (idle, held, measured), self._idle = self._idle, [0.0, 0.0, 0.0]
            queued, inflight = self.released_kept + self.decided_kept * (self.order != "fifo"), len(self.partials)
            self.first_version += 1
            self._cv.notify_all()
        waited = time.perf_counter() - t0
        trace_batch(step, groups, generated)
        share = measured * self.n_eng
        stats = take_stats(groups, generated, self.filter, counters, {
            "queued_groups": queued, "inflight_groups": inflight, "engine_idle_frac": idle / share if share else 0.0,
            "engine_idle_bound_frac": held / share if share else 0.0})
        weight_step = min(g.weight_step for g in groups)
        # generate / reward: the producer's time waiting for engine calls / scoring since the previous take (beside
        # training, not on the step's critical path); wait_rollout: what the loop waited for this batch
        return B.StepRollout(groups, generated, stats, weight_step, {**seconds, "wait_rollout": waited})

    def _pick(self, box: list) -> bool:
        """Under the lock: whether the next batch can be taken; its keys (``("r", i)``: ``released[i]``, ``("d",
        j)``: ``decided[j]``) appended to ``box``. Released groups are the oldest (all before ``release_j``)."""
        ready = self.released_kept + self.decided_kept * (self.order != "fifo")
        stamp = (len(self.released), len(self.decided), len(self.partials), self.next_j, self.first_version)
        if ready < self.B or stamp == self._tried:
            return False
        state, n = (lambda g: KEPT if self.keeps(g) else FILTERED), len(self.released)
        entries = [Entry(("r", i), g.weight_step, i - n, state(g)) for i, g in enumerate(self.released)]
        entries += [Entry(("d", j), g.weight_step, j, state(g)) for j, g in self.decided.items()]
        entries += [Entry(("p", j), p.start_version, j, UNDECIDED) for j, p in self.partials.items()]
        keys = pick(self.order, entries, self.first_version, self.B, self.k)
        if keys is None and self.order != "fifo" and sum(e.state == KEPT for e in entries) >= self.B:
            self.counters["deadline_waits"] = 1  # B kept groups decided: an older one in flight needs its slot
        self._tried = stamp if keys is None else None
        box.extend([] if keys is None else [keys])
        return keys is not None

    def _remove(self, keys: list[tuple[str, int]]) -> list[B.Group]:
        """Under the lock: take the groups of ``keys`` (from :meth:`_pick`) out of the queue, in that order; count
        the kept ones taken ahead of an older group still in flight (``rollout/async/out_of_order_groups``)."""
        oldest = min(self.partials, default=None)
        out, taken = [], {i for t, i in keys if t == "r"}
        for t, i in keys:
            g = self.released[i] if t == "r" else self.decided.pop(i)
            keep = self.keeps(g)
            if t == "r":
                self.released_kept -= keep
            else:
                self.decided_kept -= keep
                self.counters["out_of_order_groups"] += keep and oldest is not None and i > oldest
            out.append(g)
        self.released = [g for i, g in enumerate(self.released) if i not in taken]
        return out

    def keeps(self, g: B.Group) -> bool:
        """The DAPO filter: 0 < p_hat < 1 (every group without algorithm.filter_groups)."""
        return not self.filter or 0.0 < g.p_hat < 1.0

    def _wait_for(self, ready: Callable[[], bool], what: str) -> None:
        """Under the lock: wait until ``ready()``; re-raise the producer's error; raise :class:`ProducerStalled`
        when it showed no progress for 2 x rollout.producer_timeout_s (its own engine waits are bounded by 1 x)."""
        while not ready():
            if self._error is not None:
                raise self._error
            if self._stale and len(self._stale) == self.n_eng and not self._want_pause:
                self._resync()  # every engine restarted without its weights: the loop's thread syncs them now
                continue
            if time.monotonic() - self._beat > 2 * self.timeout_s:
                raise ProducerStalled(f"the rollout producer made no progress for {time.monotonic() - self._beat:.0f} "
                                      f"s while the loop waited for {what} (rollout.producer_timeout_s = "
                                      f"{self.timeout_s:g}); groups running per engine: "
                                      f"{[len(x) for x in self._running]}")
            self._cv.wait(0.5)
        if self._error is not None:
            raise self._error

    def pause(self) -> dict[str, float]:
        """Before a weight sync (and a checkpoint / evaluation): no request runs on the engines when this returns.
        Without partial rollouts every running group is finished (drained); with them they are interrupted, keeping
        their tokens, except those already spanning ``rollout.max_versions_per_response`` versions (drained)."""
        t0 = time.perf_counter()
        with self._cv:
            self._want_pause = True
            self._cv.notify_all()
            self._wait_for(lambda: self._paused, "the pause before the weight sync")
        return {"rollout/async/pause_s": time.perf_counter() - t0}

    def resume(self, version: int) -> None:
        """After the sync: the engines hold ``version``; interrupted groups continue first, admission resumes."""
        with self._cv:
            self.version = int(version)
            waiting = sorted(j for j in self.partials if j not in self._scoring)
            for j in waiting:
                self.partials[j].span += 1
            self._waiting = collections.deque(waiting)
            self._stale.clear()  # the sync gave every engine the weights, restarted ones included
            self._want_pause = self._paused = False
            self._cv.notify_all()

    def close(self) -> None:
        """Stop both threads (a drain in progress stops at its next engine answer)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._scores.put(None)
        self._thread.join(timeout=60)  # a daemon: one stuck in an engine wait (<= producer_timeout_s) is left
        self._scorer.join(timeout=60)

    # ------------------------------------------------------------------------------------------ checkpoint
    def snapshot(self) -> ProducerSnapshot:
        """The state a checkpoint of the step just completed holds; only while paused (nothing runs then). Cheap
        (references and copied lists); serialised by :meth:`ProducerSnapshot.to_dict` when a checkpoint is written."""
        with self._cv:
            if self._thread.is_alive() and not self._paused:
                raise RuntimeError("AsyncRollout.snapshot while the producer runs (pause() first)")
            self._wait_for(lambda: not self._scoring, "the scoring of the groups the engines finished")
            return ProducerSnapshot(self.next_j, self.release_j, self.first_version,
                                    [p.copy() for _, p in sorted(self.partials.items())],
                                    sorted(self.decided.items()), list(self.released), dict(self.counters))

    def state_dict(self) -> dict[str, Any]:
        """Plain data (``torch.load(weights_only=True)``): :meth:`snapshot`, serialised."""
        return self.snapshot().to_dict()

    def _load(self, s: dict[str, Any]) -> None:
        snap = ProducerSnapshot.from_dict(s)
        self.next_j, self.release_j, self.counters = snap.next_j, snap.release_j, collections.Counter(snap.counters)
        self.partials, self.decided, self.released = {p.j: p for p in snap.partials}, dict(snap.decided), snap.released
        self.decided_kept = sum(map(self.keeps, self.decided.values()))
        self.released_kept = sum(map(self.keeps, self.released))
        for p in self.partials.values():  # saved after the sync, before resume(): they continue under new weights
            p.span += 1
        self._release()  # an oldest_decided state resumed under fifo: pass over the j's its batches took early

    def _adopt(self, r: B.StepRollout) -> None:
        """A prefetched batch of a staleness-1 checkpoint (issue 47, point 1): its B kept groups enter the queue
        first, so the next take trains exactly them, at ``first_version`` as the prefetch would have (admission counts
        them: the bound holds for everything admitted after); its filtered groups follow (reported with the next
        batch's counts). Its surplus groups were never part of a batch and stay out."""
        for g in list(r.groups) + [g for g in r.generated if not self.keeps(g)]:
            self.released.append(g)
            self.released_kept += self.keeps(g)

    # ------------------------------------------------------------------------------------------ the producer thread
    def _p_max(self) -> int:
        """The largest FIFO position (from the next batch's first) a group admitted now could take."""
        return self.released_kept + self.decided_kept + len(self.partials)

    def _main(self) -> None:
        try:
            self._produce()
        except BaseException as e:  # noqa: BLE001 - re-raised in the loop's thread by take() / pause()
            with self._cv:
                self._error = self._error or e
                self._cv.notify_all()

    def _produce(self) -> None:
        calls = self._calls
        while True:
            with self._cv:
                while True:
                    self._beat = time.monotonic()
                    if self._stop or self._error is not None:
                        return
                    # decided under the lock together with the plan: groups admitted here are always sent before
                    # a pause is served (a pause that arrives later waits for the next round)
                    pausing = self._want_pause and not self._paused
                    if pausing:
                        break
                    plan = {} if self._want_pause else self._plan()
                    if plan or calls.busy():
                        break
                    if self.prompts_exhausted and not self.partials and self.released_kept < self.B:
                        raise DynamicSamplingError(
                            f"the prompt stream ran out with {self.released_kept} of the {self.B} kept groups the "
                            "next batch needs", {"dynamic_sampling/kept_groups": float(self.released_kept)})
                    self._cv.wait(0.5)  # idle: the bound or the prompt stream holds admission
                version = self.version
            if pausing:
                self._quiesce()
                with self._cv:
                    self._paused = True
                    self._cv.notify_all()
                continue
            if calls.counting_since is None:
                calls.counting(True)  # resumed after a sync: engine idle time counts again
            for e, submit in plan.items():
                calls.start(e, submit)
                if any(len(x) > 4 for x in submit):  # continuations now run: tests/test_async_faults.py
                    fault_point("partial_rollout", version + 1, self.sampler)
            if plan:  # plan again before waiting: an engine just given its first call gets its second one queued
                continue  # (a lone engine idled on every round trip otherwise: one call per answer)
            if calls.busy():
                self._next()

    def _plan(self) -> dict[int, list[tuple]]:
        """Under the lock: per engine with room for a call (two in flight at most), its new and continued groups,
        or a call that only steps its running ones."""
        plan = {}
        for e in range(self.n_eng):
            if e in self._stale or self._calls.inflight(e) >= self._calls.depth:
                continue
            submit = self._submissions(e)
            if submit or self._running[e]:
                plan[e] = submit
            elif self._held:
                self._calls.mark_held(e)
        return plan

    def _submissions(self, e: int) -> list[tuple]:
        """New and continued groups for engine ``e`` (under the lock): interrupted ones first, then new prompts as
        long as the admission bound and ``rollout.max_inflight_prompts`` allow."""
        out: list[tuple] = []
        while self._waiting and len(self._running[e]) < self.per_engine:  # continuations (on any engine)
            p = self.partials[self._waiting.popleft()]
            render, cap = self.sampler.render_prompts([p.example])[0], p.example.meta.get("max_tokens")
            if p.segments:
                seeds = [self.sampling.seed + p.j * p.n + i if self.sampling.seed is not None else None
                         for i in range(p.n)]
                out.append((p.key, render, p.j, cap, p.continuation(seeds)))
                self.counters["resumed_groups"] += 1
            else:  # lost with a failed engine before any interruption: it starts again, under the current weights
                p.start_version, p.span = self.version, 1
                out.append((p.key, render, p.j, cap))
            self._running[e].add(p.j)
        while len(self._running[e]) < self.per_engine and not self.prompts_exhausted:
            if self.paced and not admissible(self._p_max(), self.version, self.first_version, self.B, self.k):
                self.counters["admission_waits"] += not self._held  # times admission began to wait (pacing)
                self._held = True
                break
            self._held = False
            examples = self.sampler.next_prompts(1)
            if not examples:
                self.prompts_exhausted = True
                break
            j, self.next_j = self.next_j, self.next_j + 1
            p = self.partials[j] = Partial(j, examples[0], self.version, self.sampling.n)
            out.append((p.key, self.sampler.render_prompts([p.example])[0], j, p.example.meta.get("max_tokens")))
            self._running[e].add(j)
        return out

    # ------------------------------------------------------------------------------------------ the scorer thread
    def _score_main(self) -> None:
        """Score finished groups with the reward pool (off the producer thread: the engines keep generating), then
        decide and release them under the lock."""
        while (item := self._scores.get()) is not None:
            try:
                t0 = time.perf_counter()
                groups = self.sampler.score([p.example for p, _ in item], [c for _, c in item])
                with self._cv:
                    self.seconds["reward"] += time.perf_counter() - t0
                    for (p, cs), g in zip(item, groups):
                        g.weight_step = p.start_version
                        if p.segments:
                            g.token_versions = [c.versions for c in cs]
                            self.counters["resumed_groups_scored"] += 1
                        self._scoring.discard(p.j)
                        del self.partials[p.j]
                        self.decided[p.j] = g
                        self.decided_kept += self.keeps(g)
                    self._beat = time.monotonic()
                    self._release()
                    self._cv.notify_all()
            except BaseException as e:  # noqa: BLE001 - re-raised in the loop's thread by take() / pause()
                with self._cv:
                    self._error = self._error or e
                    self._cv.notify_all()
                return

    def _release(self) -> None:
        """Move decided groups to the queue in submission order (under the lock), passing over those a batch
        already took out of order (``oldest_decided``: neither in flight nor decided)."""
        while self.decided if self.discard else self.release_j < self.next_j and self.release_j not in self.partials:
            if not self.discard and self.release_j not in self.decided:
                self.release_j += 1
                continue
            # FIFO (pace): the next j in submission order; discard: whichever finished first (insertion order)
            g = self.decided.pop(next(iter(self.decided)) if self.discard else self.release_j)
            self.release_j += 1
            keep = self.keeps(g)
            self.decided_kept -= keep
            if keep and self.discard and self.first_version + self.released_kept // self.B - g.weight_step > self.k:
                b = g.bucket  # too late for the bound (late_policy=discard): thrown away, counted by difficulty
                self.counters["discarded_late_groups"] += 1
                self.counters[f"discarded_late/bucket_{b}"] += 1
                self.counters["discarded_late_tokens"] += sum(len(r) for r in g.response_ids)
                continue
            self.released_kept += keep
            self.released.append(g)
            if self.released_kept < self.B and len(self.released) >= self.budget:  # the next batch cannot fill
                kept = self.released_kept
                raise DynamicSamplingError(
                    f"dynamic sampling kept {kept} of the {self.B} groups the batch needs after "
                    f"{len(self.released)} groups (the budget is algorithm.max_generation_rounds x "
                    f"data.train_batch_size = {self.budget}): observed keep rate {kept / len(self.released):.3f}. "
                    "Raise algorithm.max_generation_rounds, lower data.train_batch_size, or use easier/harder prompts.",
                    {"dynamic_sampling/generated_groups": float(len(self.released)),
                     "dynamic_sampling/kept_groups": float(kept)})
