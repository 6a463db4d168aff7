"""The asynchronous producer's engine side (``trainer/generation/async_rollout.py``; docs/async.md): the ``stream``
calls in flight per engine, waits with a timeout that names the engine, and the restart of a dead or hung engine.

- **Two calls in flight per engine** (as the synchronous streaming path keeps them, ``trainer/generation/collect.py``):
  while the driver handles one call's result the engine already runs the next, so it never idles on a round trip. A call
  queued behind another runs ``stream_steps_per_call // 4`` steps (at least 1), so a pause waits for little more
  than the call running (``da3po_megatron/bench/async_rl.py --standin``).
- **Every wait is bounded** by ``rollout.producer_timeout_s``: a call that has not answered that long after it
  became the engine's head call raises :class:`EngineFailure` naming the engine (Ray: ``ray.wait(..., timeout=)``;
  the in-process test engines: ``concurrent.futures.wait``). A dead engine (Ray actor lost: ``EngineDeadError``) is
  an :class:`EngineFailure` too.
- **Restart** (``rollout.restart_on_failure``, as on the synchronous path, ``rollout/client.py:
  RolloutClient._restart``): a fresh actor replaces the engine (a hung one is killed) and the last synced weights are
  replayed into it. Where they cannot be replayed from the driver (pushed by the policy ranks: collective / IPC
  transports), the trainer's ``resync`` would sync the policy from this thread while the loop trains, so it is not
  called: the engine is reported *stale* and gets no work until the next weight sync (:meth:`AsyncRollout.resume`).

An :class:`EngineCalls` object is owned by the producer thread alone (no lock); the counters it returns are moved
into the producer's locked state by the caller.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from typing import Any

from da3po_megatron.trainer.generation.async_partial import index_of


class EngineFailure(RuntimeError):
    """A rollout engine died or did not answer within ``rollout.producer_timeout_s`` (``engine``: its index)."""

    def __init__(self, engine: int, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.engine, self.timed_out = engine, timed_out


class EngineCalls:
    """The ``stream`` calls in flight on each engine, oldest first (``client``: a ``RolloutClient`` or a test engine
    with the same ``stream_start`` / ``stream_wait``; local-mode results may be ``concurrent.futures.Future``)."""

    def __init__(self, client: Any, sampling: Any, steps_per_call: int, timeout_s: float, depth: int = 2) -> None:
        self.client, self.sampling, self.steps, self.timeout_s, self.depth = (
            client, sampling, steps_per_call, float(timeout_s), depth)
        n = client.num_engines
        self.queued: list[collections.deque] = [collections.deque() for _ in range(n)]  # [ref, head since]
        now = time.perf_counter()
        self.idle_since: list[float | None] = [now] * n  # None: a call in flight
        self.held = [False] * n  # idle because the staleness bound holds admission (mark_held), until its next call
        self.counting_since: float | None = now  # None: paused (idle time outside the pause is what is measured)
        self.idle_s = self.idle_held_s = self.active_s = self.wait_s = 0.0

    # ------------------------------------------------------------------------------------------- bookkeeping
    def inflight(self, e: int) -> int:
        return len(self.queued[e])

    def busy(self) -> bool:
        return any(self.queued)

    def mark_held(self, e: int) -> None:
        """Engine ``e`` has nothing to run because the staleness bound holds admission: its idle time until its next
        call is the bound's (by design: the producer is k versions ahead), not a round trip of the producer's."""
        if not self.queued[e]:
            self.held[e] = True

    def _add_idle(self, e: int, seconds: float) -> None:
        self.idle_s += seconds
        self.idle_held_s += seconds if self.held[e] else 0.0

    def counting(self, on: bool) -> None:
        """Measure engine idle time (on) or not (while the producer is paused for a weight sync)."""
        now = time.perf_counter()
        if self.counting_since is not None:
            self.active_s += now - self.counting_since
            for e, t in enumerate(self.idle_since):
                if t is not None:
                    self._add_idle(e, now - max(t, self.counting_since))
                    self.idle_since[e] = now
        self.counting_since = now if on else None

    def take_seconds(self) -> dict[str, float]:
        """Seconds since the last call: driver waits for engines, engine-idle time summed over the engines (and the
        part of it the staleness bound held admission) and the time measured (outside pauses) -- ``engine_idle /
        (engines x measured)`` is the idle fraction."""
        on = self.counting_since is not None
        self.counting(on)
        out = {"generate": self.wait_s, "engine_idle": self.idle_s, "engine_idle_held": self.idle_held_s,
               "engine_measured": self.active_s}
        self.idle_s = self.idle_held_s = self.active_s = self.wait_s = 0.0
        return out

    # ------------------------------------------------------------------------------------------- calls
    def start(self, e: int, submit: list[tuple] | tuple = (), max_steps: int | None = None,
              interrupt: list[str] | None = None) -> None:
        """Queue one ``stream`` call on engine ``e`` (new / continued groups, or an interrupt, or just steps)."""
        if max_steps is None:  # a call queued behind another is short: a pause waits for little engine work
            max_steps = self.steps if not self.queued[e] else max(1, self.steps // 4)
        ref = self.client.stream_start(e, list(submit), self.sampling, None, max_steps, interrupt)
        now = time.perf_counter()
        if not self.queued[e]:
            if self.idle_since[e] is not None and self.counting_since is not None:
                self._add_idle(e, now - max(self.idle_since[e], self.counting_since))
            self.idle_since[e], self.held[e] = None, False
        self.queued[e].append([ref, now])

    def drop(self, e: int) -> None:
        """Forget engine ``e``'s calls (it died or was restarted: they will never answer)."""
        self.queued[e].clear()
        self.idle_since[e] = time.perf_counter()

    def wait_first(self) -> tuple[int, dict[str, Any]]:
        """The result of the first head call to finish, as (engine, result). Raises :class:`EngineFailure` when an
        engine died or its head call ran past ``rollout.producer_timeout_s``."""
        heads = [(e, q[0][0]) for e, q in enumerate(self.queued) if q]
        if not heads:
            raise ValueError("EngineCalls.wait_first: nothing in flight")
        t0 = time.perf_counter()
        oldest = min(((e, self.queued[e][0][1]) for e, _ in heads), key=lambda x: x[1])
        timeout = max(0.0, oldest[1] + self.timeout_s - t0)
        pos, res = self._wait(heads, timeout, oldest[0])
        now = time.perf_counter()
        self.wait_s += now - t0
        e = heads[pos][0]
        self.queued[e].popleft()
        if self.queued[e]:
            self.queued[e][0][1] = now  # the next call's time starts when it becomes the engine's head
        else:
            self.idle_since[e] = now
        return e, res

    def _wait(self, heads: list[tuple[int, Any]], timeout: float, oldest: int) -> tuple[int, dict[str, Any]]:
        from da3po_megatron.rollout.types import EngineDeadError

        late = EngineFailure(oldest, f"rollout engine {oldest}: no answer to a stream call within "
                                     f"rollout.producer_timeout_s = {self.timeout_s:g} s", timed_out=True)
        if getattr(self.client, "mode", "local") == "ray":
            import ray

            ready, _ = ray.wait([ref for _, ref in heads], num_returns=1, timeout=timeout)
            if not ready:
                raise late
            pos = next(i for i, (_, ref) in enumerate(heads) if ref == ready[0])
            try:
                return pos, self.client.stream_wait([heads[pos]])[1]
            except EngineDeadError as err:
                raise EngineFailure(heads[pos][0], str(err)) from err
        futures = [ref for _, ref in heads if isinstance(ref, concurrent.futures.Future)]
        if not futures:  # in-process engines answered when called: in order
            return self.client.stream_wait(heads)
        done, _ = concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)
        if not done:
            raise late
        pos = next(i for i, (_, ref) in enumerate(heads) if ref in done)
        try:
            return pos, heads[pos][1].result()
        except EngineDeadError as err:
            raise EngineFailure(heads[pos][0], str(err)) from err

    def restart(self, e: int, cause: EngineFailure) -> bool:
        """Replace engine ``e`` (``rollout.restart_on_failure``; otherwise ``cause`` is raised) with its last synced
        weights. Returns True when they could not be replayed here: the engine waits for the next weight sync."""
        client = self.client
        if not getattr(client, "restart_on_failure", False):
            raise cause
        stale: list[int] = []
        resync, client.resync = getattr(client, "resync", None), (lambda: stale.append(e))
        try:
            client._restart(e, cause)  # noqa: SLF001 - the synchronous path's restart (rollout/client.py)
        finally:
            client.resync = resync
        self.drop(e)
        return bool(stale)


class EngineSide:
    """The producer thread's engine-facing steps, a mixin of
    :class:`~da3po_megatron.trainer.generation.async_rollout.AsyncRollout` (its fields and its locking discipline,
    stated there): answers, failures, the pause's collect / interrupt / drain on every engine at once, and the
    loop thread's re-sync of engines that all restarted without their weights (:meth:`_resync`)."""

    _calls: EngineCalls
    _cv: Any

    def _next(self) -> tuple[int, dict[str, Any]] | None:
        """Handle the next engine answer (None: an engine failed and was restarted)."""
        try:
            e, res = self._calls.wait_first()
        except EngineFailure as failure:
            self._engine_failed(failure)
            return None
        self._finished(e, res)
        return e, res

    def _resync(self) -> None:
        """Under the lock, in the loop's thread while it waits for a batch (the policy idle, its weights = the
        engines' version): sync every engine (``client.resync``, the trainer's sync_weights), then let the restarted
        ones work. Only when every engine waits for weights (none runs a request); otherwise the next sync does it."""
        resync = getattr(self.client, "resync", None)
        if resync is None:
            raise RuntimeError("every rollout engine was restarted without its weights and nothing can re-sync them")
        self._cv.release()
        try:
            resync()
        finally:
            self._cv.acquire()
        self._stale.clear()
        self._beat = time.monotonic()
        self._cv.notify_all()

    def _engine_failed(self, failure: EngineFailure) -> None:
        """A dead or timed-out engine: restarted and re-synced (``rollout.restart_on_failure``, else the error
        stops the run), the groups it ran resubmitted from their prefixes (the lost segment is generated again)."""
        e = failure.engine
        stale = self._calls.restart(e, failure)
        with self._cv:
            lost = sorted(self._running[e])
            self._running[e].clear()
            self._waiting = collections.deque(sorted(set(self._waiting) | set(lost)))
            if stale:
                self._stale.add(e)
            self.counters["engine_restarts"] += 1
            self.counters["resubmitted_groups"] += len(lost)
            self._beat = time.monotonic()
            self._cv.notify_all()
        print(f"rollout producer: engine {e} {'timed out' if failure.timed_out else 'died'} ({failure}); restarted"
              f"{' (weights at the next sync)' if stale else ' with the last synced weights'}, {len(lost)} groups "
              "resubmitted from their prefixes", flush=True)

    def _quiesce(self) -> None:
        """Pause, on every engine at once: interrupt (partial rollouts) what may be interrupted, drain the rest.
        Nothing waits for every engine at once: an interrupt is queued on each engine behind the calls it has in
        flight (it runs when they end; the keys they finish are ignored by the engine, as ``rollout/stream.py``
        does), and a drain keeps each engine's calls going from its own answers -- so the pause lasts as long as the
        slowest engine's own part (without partial rollouts: its longest running group), not a barrier plus that."""
        calls = self._calls
        calls.counting(False)
        if self.partial:
            with self._cv:  # every group sent to an engine is in _running from its submission on
                plan = {e: [self.partials[j].key for j in sorted(self._running[e])
                            if self.partials[j].span < self.max_versions] for e in range(self.n_eng)}
            for e, keys in plan.items():
                if keys:
                    calls.start(e, (), 0, keys)
            while calls.busy():
                self._next()
        while True:  # drain: finish under the current weights
            with self._cv:
                if self._stop or self._error is not None:
                    return
                self._beat = time.monotonic()
                todo = [e for e in range(self.n_eng) if self._running[e]]
            if not todo and not calls.busy():
                return
            for e in todo:  # full-length calls: no later pause waits for them, and an engine never runs dry
                while calls.inflight(e) < calls.depth:
                    calls.start(e, (), calls.steps)
            got = self._next()
            if got is None:
                continue
            e, res = got
            with self._cv:
                lost = sorted(self._running[e]) if res.get("running") == 0 and not calls.inflight(e) else []
            if lost:  # the engine runs none of them: an error, never a drain that spins forever
                raise RuntimeError(f"rollout engine {e} runs none of the groups a{lost} the producer sent it")

    def _finished(self, e: int, res: dict[str, Any]) -> None:
        """One engine call's result (under the lock): interrupted segments recorded; finished groups handed to the
        scorer thread."""
        seconds = self._calls.take_seconds()
        done = []
        with self._cv:
            self._beat = time.monotonic()
            self.seconds["generate"] += seconds["generate"]
            self._idle[0] += seconds["engine_idle"]
            self._idle[1] += seconds["engine_idle_held"]
            self._idle[2] += seconds["engine_measured"]
            for key, seg in res.get("interrupted", {}).items():
                j = index_of(key)
                if j in self._running[e]:
                    self.partials[j].add_segment(seg, self.version)
                    self._running[e].discard(j)
                    self.counters["interrupted_groups"] += 1
            for key, comps in res["finished"]:
                j = index_of(key)
                if j not in self._running[e]:  # never: a failed engine's calls are dropped
                    continue
                p = self.partials[j]
                self._running[e].discard(j)
                self._scoring.add(j)
                done.append((p, p.completions(comps, self.version)))
            self._cv.notify_all()
        if done:
            self._scores.put(done)

