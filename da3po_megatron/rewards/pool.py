"""RewardPool: score responses in worker processes with a per-item time limit (the "reward workers" of DESIGN.md).

Why processes: math-verify (sympy underneath) can take unbounded time on pathological model output, and time limits
based on SIGALRM only work in a process's main thread. Each worker is a process with its own main thread; the pool
enforces the limit at two levels so that one bad answer can never hang or crash a training step:

1. soft: the worker arms ``signal.setitimer(ITIMER_REAL, timeout_s)`` around each item; when it fires, the item is
   abandoned (the worker survives and takes the next item);
2. hard: if a worker has not answered ``kill_grace_s`` after the soft limit (C code that never returns to the
   interpreter), or it dies (segfault, OOM kill), the pool kills it and starts a replacement. The item a dying
   worker held is scored once more on the fresh worker (the death may not be the item's fault: a stray kill, the
   OOM killer), so the step's rewards stay those of an undisturbed run; only an item that kills its worker twice
   counts as an error.

Either way the item scores ``failure_reward`` (-1, the DAPO convention for "not correct") and is counted in
:attr:`RewardPool.stats` (``timeouts``, ``errors``, ``restarts``) -- never silently. A pool that is broken rather than
unlucky -- every item of a batch of at least ``broken_min_items`` items with more than one ground truth fails with an
error (the reward function does not import, every worker dies) -- raises :class:`RewardPoolError` with the first
error instead of scoring the whole batch -1: a broken pool once scored 1,000 evaluation answers -1 without a word.

Reward functions are plain functions named by import path (slime-style extension point): ``fn(response, answer)`` ->
``float`` or ``(float, info_dict)``. Built-in kinds: ``math`` (:func:`da3po_megatron.rewards.math_verify.score_math`)
and ``synthetic`` (:func:`da3po_megatron.data.synthetic.synthetic_reward`); add your own with
``RewardPool(extra_kinds={"mine": "my_pkg.rewards:score"})``.

Workers are started with multiprocessing's ``forkserver`` method: the server imports and warms the verifier once
(math-verify's first call builds its LaTeX grammar, ~1 s, which must not count against an item's time limit), so
replacing a killed worker costs milliseconds, and the driver -- which runs Ray and torch threads -- is never forked.
A reward function module may define ``warm_up()``; workers call it before their first item.
"""

from __future__ import annotations

import importlib
import math
import multiprocessing as mp
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["BUILTIN_KINDS", "RewardPool", "RewardPoolError", "ScoreResult", "default_num_workers",
           "resolve_reward_fn"]

BUILTIN_KINDS: dict[str, str] = {
    "math": "da3po_megatron.rewards.math_verify:score_math",
    "synthetic": "da3po_megatron.data.synthetic:synthetic_reward",
    "coin": "da3po_megatron.data.synthetic:coin_reward",
}


def resolve_reward_fn(path: str) -> Callable[..., Any]:
    """Import ``"package.module:function"`` and return the function (clear error naming the path otherwise)."""
    mod_name, sep, fn_name = path.partition(":")
    if not sep or not mod_name or not fn_name:
        raise ValueError(f"reward function path {path!r} must look like 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import reward function {path!r}: {e}") from e
    if not callable(fn):
        raise ValueError(f"reward function {path!r} is not callable")
    return fn


@dataclass
class ScoreResult:
    """Per-item rewards of one :meth:`RewardPool.score_batch` call, in input order.

    ``infos[i]`` has ``status`` ("ok" | "timeout" | "error"), ``seconds`` and whatever the reward function returned
    (for ``math``: ``extracted``, ``how``); errors add ``error`` (the exception text, truncated).
    """

    rewards: list[float]
    infos: list[dict[str, Any]]
    timeouts: int = 0
    errors: int = 0
    seconds: float = 0.0


class RewardPoolError(RuntimeError):
    """The pool cannot score at all (every item of a batch failed with an error); the message has the first error."""


class _ItemTimeout(BaseException):
    """Raised by the worker's SIGALRM handler; BaseException so that `except Exception` in sympy cannot swallow it."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _ItemTimeout()


def _worker_main(conn: Connection, kinds: dict[str, str], timeout_s: float) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's business; it closes our pipe
    signal.signal(signal.SIGALRM, _on_alarm)
    fns: dict[str, Callable[..., Any]] = {}
    for kind, path in kinds.items():  # import + warm up before the first timed item (a no-op after forkserver preload)
        try:
            fns[kind] = resolve_reward_fn(path)
            warm = getattr(importlib.import_module(path.partition(":")[0]), "warm_up", None)
            if callable(warm):
                warm()
        except Exception:  # noqa: BLE001 - reported per item below
            fns.pop(kind, None)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        item_id, kind, response, answer = msg
        t0 = time.perf_counter()
        info: dict[str, Any] = {}
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, timeout_s)
                fn = fns.get(kind) or fns.setdefault(kind, resolve_reward_fn(kinds[kind]))
                out = fn(response, answer)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            reward, info = (out if isinstance(out, tuple) else (out, {}))
            reward = float(reward)
            if not math.isfinite(reward):
                raise ValueError(f"reward function for kind {kind!r} returned {reward}")
            status = "ok"
        except _ItemTimeout:
            reward, status = None, "timeout"
        except Exception as e:  # noqa: BLE001 - any failure of one item must not stop the batch
            reward, status, info = None, "error", {"error": f"{type(e).__name__}: {e}"[:500]}
        info = dict(info, status=status, seconds=time.perf_counter() - t0)
        try:
            conn.send((item_id, reward, info))
        except (BrokenPipeError, OSError):
            return


class _Worker:
    def __init__(self, ctx: Any, kinds: dict[str, str], timeout_s: float) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, kinds, timeout_s), daemon=True)
        self.proc.start()
        child.close()
        self.item: int | None = None
        self.started_at = 0.0

    def kill(self) -> None:
        try:
            self.conn.close()
        finally:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(timeout=5)


class RewardPool:
    """A process pool that turns (response, ground truth) pairs into rewards with a per-item time limit.

    Args:
      num_workers: worker processes (0 = score in the calling process: no time limit at all, for debugging only).
      timeout_s: per-item time limit in seconds (soft, inside the worker); a timed-out item scores
        ``failure_reward`` and counts in ``stats["timeouts"]``.
      kill_grace_s: extra seconds after ``timeout_s`` before a silent worker is killed and replaced.
      failure_reward: reward of a timed-out or failed item (-1: DAPO's "incorrect").
      extra_kinds: more reward kinds, ``{"name": "package.module:function"}``.
      start_method: multiprocessing start method ("forkserver" default; "spawn" also works).
      broken_min_items: a batch of at least this many items in which every item fails with an error raises
        :class:`RewardPoolError` (0 = never raise).

    Use as a context manager or call :meth:`close`. Not thread-safe across concurrent ``score_batch`` calls
    (a lock serialises them).
    """

    def __init__(
        self,
        num_workers: int = 4,
        timeout_s: float = 10.0,
        *,
        kill_grace_s: float = 2.0,
        failure_reward: float = -1.0,
        extra_kinds: dict[str, str] | None = None,
        start_method: str = "forkserver",
        broken_min_items: int = 4,
    ) -> None:
        if num_workers < 0:
            raise ValueError(f"RewardPool num_workers must be >= 0, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"RewardPool timeout_s must be > 0, got {timeout_s}")
        self.kinds = {**BUILTIN_KINDS, **(extra_kinds or {})}
        for path in self.kinds.values():  # fail at construction, not on the first item of step 1
            resolve_reward_fn(path)
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.kill_grace_s = float(kill_grace_s)
        self.failure_reward = float(failure_reward)
        self.broken_min_items = int(broken_min_items)
        self._stats = {"n": 0, "timeouts": 0, "errors": 0, "restarts": 0, "seconds": 0.0}
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            preload = {p.partition(":")[0] for p in BUILTIN_KINDS.values()} | {"da3po_megatron.rewards._preload"}
            self._ctx.set_forkserver_preload(sorted(preload))
        self._workers = [self._spawn() for _ in range(num_workers)]

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def _spawn(self) -> _Worker:
        return _Worker(self._ctx, self.kinds, self.timeout_s)

    def close(self) -> None:
        """Stop all workers (idempotent)."""
        workers, self._workers = self._workers, []
        for w in workers:
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 2.0
        for w in workers:
            w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
            w.kill()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    @property
    def stats(self) -> dict[str, float]:
        """Cumulative counters: ``n`` items scored, ``timeouts``, ``errors``, ``restarts`` (workers replaced),
        ``seconds`` (wall time inside score_batch)."""
        return dict(self._stats)

    @property
    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers if w.proc.pid is not None]

    # -- scoring ---------------------------------------------------------------------------------------------------
    def score_batch(self, responses: Sequence[str], answers: Sequence[str], kind: str = "math") -> ScoreResult:
        """Score ``responses[i]`` against ``answers[i]`` with the reward function of ``kind``.

        Returns rewards in input order; a timed-out / crashed / failing item gets ``failure_reward``.
        """
        if len(responses) != len(answers):
            raise ValueError(f"score_batch: {len(responses)} responses but {len(answers)} answers")
        if kind not in self.kinds:
            raise ValueError(f"score_batch: unknown reward kind {kind!r}; known: {sorted(self.kinds)}")
        for name, seq in (("responses", responses), ("answers", answers)):
            for i, s in enumerate(seq):
                if not isinstance(s, str):
                    raise TypeError(f"score_batch: {name}[{i}] is {type(s).__name__}, expected str")
        with self._lock:
            t0 = time.perf_counter()
            if self.num_workers == 0:
                results = [self._score_inline(r, a, kind) for r, a in zip(responses, answers)]
            else:
                results = self._score_in_workers(responses, answers, kind)
            out = ScoreResult(rewards=[], infos=[], seconds=time.perf_counter() - t0)
            for reward, info in results:
                out.rewards.append(self.failure_reward if reward is None else reward)
                out.infos.append(info)
                out.timeouts += info["status"] == "timeout"
                out.errors += info["status"] == "error"
            self._stats["n"] += len(results)
            self._stats["timeouts"] += out.timeouts
            self._stats["errors"] += out.errors
            self._stats["seconds"] += out.seconds
        if (self.broken_min_items and len(results) >= self.broken_min_items and out.errors == len(results)
                and len(set(answers)) > 1):  # one unparsable ground truth is bad data, not a broken pool
            first = next((i.get("error") for i in out.infos if i.get("error")), "?")
            raise RewardPoolError(f"reward pool is broken: all {len(results)} items of the batch failed (kind "
                                  f"{kind!r}, {self._stats['restarts']} worker restarts so far); first error: {first}")
        return out

    def _score_inline(self, response: str, answer: str, kind: str) -> tuple[float | None, dict[str, Any]]:
        t0 = time.perf_counter()
        try:
            out = resolve_reward_fn(self.kinds[kind])(response, answer)
            reward, info = out if isinstance(out, tuple) else (out, {})
            return float(reward), dict(info, status="ok", seconds=time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001
            return None, {"status": "error", "error": f"{type(e).__name__}: {e}"[:500], "seconds": 0.0}

    def _replace(self, idx: int) -> None:
        self._workers[idx].kill()
        self._workers[idx] = self._spawn()
        self._stats["restarts"] += 1

    def _score_in_workers(
        self, responses: Sequence[str], answers: Sequence[str], kind: str
    ) -> list[tuple[float | None, dict[str, Any]]]:
        results: list[tuple[float | None, dict[str, Any]] | None] = [None] * len(responses)
        pending = deque(range(len(responses)))
        deaths: dict[int, int] = {}  # item -> workers that died holding it
        hard_limit = self.timeout_s + self.kill_grace_s
        for idx, w in enumerate(self._workers):  # a worker may have died between calls
            if not w.proc.is_alive():
                self._replace(idx)
        while pending or any(w.item is not None for w in self._workers):
            for idx, w in enumerate(self._workers):
                while w.item is None and pending:
                    item = pending.popleft()
                    try:
                        w.conn.send((item, kind, responses[item], answers[item]))
                    except (BrokenPipeError, OSError):
                        pending.appendleft(item)
                        self._replace(idx)
                        w = self._workers[idx]
                        continue
                    w.item, w.started_at = item, time.monotonic()
            busy = [w for w in self._workers if w.item is not None]
            now = time.monotonic()
            wait_s = max(0.0, min(w.started_at + hard_limit for w in busy) - now)
            ready = set(wait([w.conn for w in busy] + [w.proc.sentinel for w in busy], timeout=wait_s))
            now = time.monotonic()
            for idx, w in enumerate(self._workers):
                if w.item is None:
                    continue
                item = w.item
                if w.conn in ready:
                    try:
                        got_item, reward, info = w.conn.recv()
                    except (EOFError, OSError):
                        got_item = None
                    if got_item == item:
                        results[item] = (reward, info)
                        w.item = None
                        continue
                if w.proc.sentinel in ready or w.conn in ready:  # died (or spoke out of turn): replace
                    w.proc.join(timeout=1.0)  # the pipe closes a moment before the process can be reaped
                    code = w.proc.exitcode
                    deaths[item] = deaths.get(item, 0) + 1
                    if deaths[item] < 2:  # once: maybe not the item's fault (OOM killer, a stray kill): re-score
                        pending.appendleft(item)
                    else:  # it killed a worker twice: an error
                        results[item] = (None, {"status": "error", "seconds": now - w.started_at,
                                                "error": f"reward worker died twice on this item (exit code {code})"})
                    w.item = None
                    self._replace(idx)
                elif now - w.started_at >= hard_limit:
                    results[item] = (None, {"status": "timeout", "seconds": now - w.started_at, "killed": True})
                    self._replace(idx)
        return [r for r in results if r is not None]  # all filled


def default_num_workers() -> int:
    """A sensible pool size: the CPUs this process may use, minus one for the driver, at least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    return max(1, n - 1)


