"""Generation beside the loop: the one-step-off prefetch (``rollout.staleness=1``) and the asynchronous producer
(``rollout.staleness >= 2`` or ``rollout.partial_rollouts``), issue 37. ``trainer/loop.py`` only calls
:meth:`AsyncRollout.take` / :meth:`~AsyncRollout.pause` / :meth:`~AsyncRollout.resume`; docs/async.md is the guide.

**Prefetch** (``rollout.staleness=1``; verl's one-step-off-policy recipe, AReaL's staleness bound 1): the batch of step
t+1 is collected in a driver thread -- the engines generate, the reward pool scores -- while the policy computes pi_old
and trains step t. The loop joins it before the weight sync, so weights never change under a running request, and
every group records ``weight_step``, the policy step whose weights generated it. Exactly reproducible (seeds alone).

**The asynchronous producer** (:class:`AsyncRollout`). A driver thread keeps the engines generating continuously
over the streaming engine API (``RolloutClient.stream_start`` / ``stream_wait``, ``rollout/stream.py``): it admits
prompts one group at a time (at most ``rollout.max_inflight_prompts`` in flight), scores each group with the reward
pool the moment its G responses are done, filters it (0 < p_hat < 1), and releases decided groups in *submission*
(FIFO) order -- a long, hard group holds back the ones admitted after it, it is never overtaken -- into the queue the
loop's :meth:`~AsyncRollout.take` fills batches from (exactly ``data.train_batch_size`` kept groups each).

- **Bounded staleness by admission** (:func:`admissible`): step t trains at policy version t-1 on FIFO positions
  (t-1)B .. tB-1 of the kept groups. A group admitted under version v may end up at any position up to ``p_max`` =
  kept groups so far + every undecided group before it (all counted as kept), so it is admitted only if
  ``p_max // B <= v + k``; otherwise admission waits for the next weight update (pacing). A group is never discarded
  for being late: the bound holds by construction (``rollout/staleness_hist/*`` shows it every step).
- ``rollout.late_policy=discard`` (for comparison only; the design of systems that bound staleness by discarding):
  groups are released in *completion* order, so short groups overtake long ones and push them to later batches, and
  a kept group that would be trained more than k versions after it started is thrown away when it is released,
  counted as ``rollout/async/discarded_late_groups`` and per difficulty bucket
  ``rollout/async/discarded_late/bucket_<b>``. The long (hard) groups are the late ones -- the starvation FIFO
  release with pacing avoids, which is why ``pace`` is the default.
- **Weight updates** (:meth:`~AsyncRollout.pause` before the sync, :meth:`~AsyncRollout.resume` after): without
  partial rollouts the producer stops admitting and lets every running group finish (drain), so weights never change
  under a running request. With ``rollout.partial_rollouts`` the running groups are interrupted instead -- aborted on
  the engine with their tokens kept -- and continued after the sync from prompt + tokens so far (``max_tokens``
  reduced by the prefix). A group that already spans ``rollout.max_versions_per_response`` versions is not
  interrupted: it is drained (finished under the weights it runs with), so no response spans more versions than that
  and none is cut short or thrown away.
- **Per-token versions**: each response token records the version that sampled it (``Completion.versions`` /
  ``Group.token_versions``, int32 arrays) next to its behaviour log-prob (``logprobs``): TIS and the drift check use
  them per token (``Run.old_logprobs``).
- **Seeds**: prompt J (a run-wide admission counter) samples j = 0..G-1 with the request seed
  ``s = sampling_seed(0, 0) + J * G + j`` (the streaming rule); the continuation of segment m >= 1 gets
  :func:`continuation_seed` (s, m), a fixed mix of both: a fresh, reproducible seed per segment, so the tokens after
  an interruption are a fresh-seed sample of the new policy given the prefix -- never a replay of the first segment's
  random stream (``tests/test_async_rollout.py`` checks it on a real engine).
- **Checkpoints** (:meth:`~AsyncRollout.state_dict`, taken while paused): the queued and decided groups and every
  interrupted partial with its tokens, log-probs and versions; nothing is running then. A resumed run continues them
  (partials are resubmitted under the restored weights). What happens after the resume depends on timing (how far
  the engines get while a step trains), so an asynchronous run is not bit-reproducible -- ``rollout.staleness`` 0
  and 1 are.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from da3po_megatron.trainer import batch as B
from da3po_megatron.trainer.collect import DynamicSamplingError, StepRollout, token_stats
from da3po_megatron.trainer.faults import fault_point

if TYPE_CHECKING:
    from da3po_megatron.config import Config
    from da3po_megatron.trainer.run import Run


def uses_producer(cfg: Config) -> bool:
    """Whether the run's batches come from :class:`AsyncRollout` (else: collected per step, maybe prefetched)."""
    return cfg.rollout.staleness >= 2 or bool(cfg.rollout.partial_rollouts)


# ---------------------------------------------------------------------------------------------------- pure functions
def admissible(p_max: int, version: int, first_version: int, batch_size: int, k: int) -> bool:
    """Admission bound of rollout.staleness = k: a group admitted now, under engine weights ``version``, lands at FIFO
    position <= ``p_max`` among the kept groups (counted from the batch the loop takes next, trained at
    ``first_version``), so it is trained at version <= first_version + p_max // batch_size; admit only if that is
    <= version + k."""
    return first_version + p_max // batch_size <= version + k


def continuation_seed(seed: int | None, segment: int) -> int | None:
    """Request seed of segment ``segment`` (>= 1) of a response whose first request had ``seed``: a splitmix64 mix of
    both, folded into [1, 2**31 - 1) (vLLM's per-request generator). None stays None (engine-drawn)."""
    if seed is None:
        return None
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(segment) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    return 1 + x % (2**31 - 2)


def versions_spanned(versions: np.ndarray) -> int:
    """Distinct policy versions among one response's per-token versions (1 for an empty response)."""
    return max(1, len(np.unique(versions)))


@dataclass
class Partial:
    """One admitted group before it is scored: its prompt, where and under which version it started, and the
    segments of each of its G samples so far (one segment per version it ran under)."""

    j: int  # run-wide admission index (the key is f"a{j}")
    example: Any
    start_version: int
    n: int
    tokens: list[list[np.ndarray]] = field(default_factory=list)  # [sample][segment] int32
    logprobs: list[list[np.ndarray]] = field(default_factory=list)  # [sample][segment] float32
    versions: list[list[np.ndarray]] = field(default_factory=list)  # [sample][segment] int32
    done: list[bool] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    segments: int = 0  # segments interrupted so far (the running one not counted)
    span: int = 1  # versions this group has run under, the running one included

    def __post_init__(self) -> None:
        for name in ("tokens", "logprobs", "versions"):
            if not getattr(self, name):
                setattr(self, name, [[] for _ in range(self.n)])
        self.done = self.done or [False] * self.n
        self.reasons = self.reasons or [""] * self.n
        self.texts = self.texts or [""] * self.n

    @property
    def key(self) -> str:
        """The group's request key on the engine, new per segment (an aborted request's id is never reused)."""
        return f"a{self.j}s{self.segments}"

    def add_segment(self, seg: dict[str, Any], version: int) -> None:
        """Record an interrupted segment (the engine's ``interrupted[key]``) generated under ``version``."""
        for i in range(self.n):
            if self.done[i]:
                continue
            t = np.asarray(seg["token_ids"][i], dtype=np.int32)
            self.tokens[i].append(t)
            self.logprobs[i].append(np.asarray(seg["logprobs"][i], dtype=np.float32))
            self.versions[i].append(np.full(len(t), version, dtype=np.int32))
            if seg["finished"][i]:
                self.done[i], self.reasons[i], self.texts[i] = True, seg["reasons"][i], seg["texts"][i]
        self.segments += 1

    def continuation(self, seeds: list[int | None]) -> dict[str, Any]:
        """The ``cont`` of the resubmission (``rollout/stream.py``): the prefix of each sample, which are done, and
        the next segment's seeds (:func:`continuation_seed` of each sample's first seed)."""
        return {"prefix": [np.concatenate(t).tolist() if t else [] for t in self.tokens], "done": list(self.done),
                "seeds": [continuation_seed(s, self.segments) for s in seeds]}

    def completions(self, final: list[Any], version: int) -> list[Any]:
        """The group's G completions: the segments so far stitched with the final segment ``final`` (the engine's
        Completions of the last, uninterrupted segment, generated under ``version``)."""
        from da3po_megatron.rollout.types import Completion

        if not self.segments:  # never interrupted: one version for every token (Group.weight_step)
            return final
        out = []
        for i, c in enumerate(final):
            tokens = self.tokens[i] + ([c.token_ids] if not self.done[i] else [])
            lps = self.logprobs[i] + ([c.logprobs] if not self.done[i] else [])
            vers = self.versions[i] + ([np.full(len(c.token_ids), version, np.int32)] if not self.done[i] else [])
            ids = np.concatenate(tokens) if tokens else np.zeros(0, np.int32)
            out.append(Completion(
                prompt_index=c.prompt_index, sample_index=c.sample_index, prompt_token_ids=c.prompt_token_ids,
                token_ids=ids, text=self.texts[i] if self.done[i] else c.text,
                logprobs=np.concatenate(lps) if lps else np.zeros(0, np.float32),
                finish_reason=self.reasons[i] if self.done[i] else c.finish_reason, num_tokens=len(ids),
                versions=np.concatenate(vers) if vers else np.zeros(0, np.int32)))
        return out

    def to_dict(self) -> dict[str, Any]:
        import torch

        t = lambda rows: [[torch.from_numpy(np.ascontiguousarray(a)) for a in r] for r in rows]  # noqa: E731
        return {"j": self.j, "example": B._plain(asdict(self.example)), "start_version": self.start_version,
                "n": self.n, "tokens": t(self.tokens), "logprobs": t(self.logprobs), "versions": t(self.versions),
                "done": list(self.done), "reasons": list(self.reasons), "texts": list(self.texts),
                "segments": self.segments, "span": self.span}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Partial:
        from da3po_megatron.data.datasets import Example

        a = lambda rows, dt: [[np.asarray(x, dtype=dt) for x in r] for r in rows]  # noqa: E731
        return cls(j=int(d["j"]), example=Example(**d["example"]), start_version=int(d["start_version"]),
                   n=int(d["n"]), tokens=a(d["tokens"], np.int32), logprobs=a(d["logprobs"], np.float32),
                   versions=a(d["versions"], np.int32), done=list(d["done"]), reasons=list(d["reasons"]),
                   texts=list(d["texts"]), segments=int(d["segments"]), span=int(d["span"]))


# ---------------------------------------------------------------------------------------------------- the producer
class AsyncRollout:
    """The producer thread and the queue between it and the loop (see the module docstring).

    ``version``: the policy version the engines hold (``run.engine_weight_step``); ``state``: a checkpoint's
    :meth:`state_dict`. The thread starts at once and runs until :meth:`close`."""

    def __init__(self, run: Run, version: int, state: dict[str, Any] | None = None) -> None:
        cfg = run.cfg
        r = cfg.rollout
        self.run, self.client = run, run.rollout
        self.k, self.B = int(r.staleness), cfg.data.train_batch_size
        self.partial, self.max_versions = bool(r.partial_rollouts), int(r.max_versions_per_response)
        self.filter = bool(cfg.algorithm.filter_groups)
        self.discard = r.late_policy != "pace"  # comparison only: completion order, late kept groups thrown away
        self.paced = r.late_policy != "discard_unpaced"  # discard_unpaced: admission ignores the bound (issue 47)
        self.steps_per_call = r.stream_steps_per_call
        n_eng = self.client.num_engines
        self.per_engine = max(1, math.ceil((r.max_inflight_prompts or self.B) / n_eng))
        self.budget = cfg.algorithm.max_generation_rounds * self.B  # groups one batch may try before giving up
        self.sampling = run.sampling_config(run.sampling_seed(0, 0))
        self.version = self.first_version = int(version)  # engines' weights; the version the next take trains at
        self.next_j = 0  # run-wide admission counter (key "a{j}", seed base + j * n)
        self.release_j = 0  # every j < release_j is released (kept or filtered)
        self.partials: dict[int, Partial] = {}  # admitted, undecided: running, or interrupted and waiting
        self.decided: dict[int, B.Group] = {}  # scored, waiting for an earlier j to be released
        self.decided_kept = 0
        self.released: list[B.Group] = []  # released, not yet taken, in FIFO order (kept and filtered)
        self.released_kept = 0  # kept groups among them (FIFO positions 0.. from the next batch's first)
        self.counters: collections.Counter = collections.Counter()  # per-take counts (rollout/async/*)
        self.seconds = {"generate": 0.0, "reward": 0.0}  # per-take producer time (time/generate, time/reward)
        self.prompts_exhausted = False
        if state:
            self._load(state)
        self._engine_of: dict[int, int] = {}
        self._running: list[set[int]] = [set() for _ in range(n_eng)]
        self._waiting: collections.deque[int] = collections.deque(sorted(self.partials))  # to (re)submit first
        self._cv = threading.Condition()
        self._want_pause = self._paused = self._stop = False
        self._held = False  # admission is waiting for the bound
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="da3po-async-rollout", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------ the loop's side
    def take(self, step: int) -> StepRollout:
        """The batch of ``step``: the next ``data.train_batch_size`` kept groups in FIFO order (waits for them)."""
        t0 = time.perf_counter()
        with self._cv:
            while self.released_kept < self.B and self._error is None:
                self._cv.wait(0.5)
            if self._error is not None:
                raise self._error
            cut = self._cut()
            generated, self.released = self.released[:cut], self.released[cut:]
            groups = [g for g in generated if self.keeps(g)]
            self.released_kept -= len(groups)
            counters, self.counters = self.counters, collections.Counter()
            seconds, self.seconds = self.seconds, {"generate": 0.0, "reward": 0.0}
            queued, inflight = self.released_kept, len(self.partials)
            self.first_version += 1
            self._cv.notify_all()
        waited = time.perf_counter() - t0
        filtered = [g for g in generated if self.filter and not 0.0 < g.p_hat < 1.0]
        stats = {"dynamic_sampling/generated_groups": float(len(generated)),
                 "dynamic_sampling/kept_groups": float(len(groups)),
                 "dynamic_sampling/discarded_all_correct_groups": float(sum(g.p_hat >= 1.0 for g in filtered)),
                 "dynamic_sampling/discarded_all_wrong_groups": float(sum(g.p_hat <= 0.0 for g in filtered)),
                 "dynamic_sampling/discarded_surplus_groups": 0.0, "dynamic_sampling/rounds": 1.0,
                 "dynamic_sampling/kept_frac": len(groups) / max(len(generated), 1),
                 "dynamic_sampling/aborted_groups": 0.0, "rollout/consumed_prompts": float(len(generated)),
                 "rollout/async/queued_groups": float(queued), "rollout/async/inflight_groups": float(inflight),
                 **{f"rollout/async/{k}": float(v) for k, v in sorted(counters.items())}}
        stats.update(token_stats(groups, generated))
        weight_step = min(g.weight_step for g in groups)
        # generate / reward: the producer's time waiting for engine calls / scoring since the previous take (beside
        # training, not on the step's critical path); wait_rollout: what the loop waited for this batch
        return StepRollout(groups, generated, stats, weight_step, {**seconds, "wait_rollout": waited})

    def _cut(self) -> int:
        """How many released groups form the next batch: up to and including its B-th kept one."""
        kept = 0
        for i, g in enumerate(self.released):
            kept += self.keeps(g)
            if kept == self.B:
                return i + 1
        raise AssertionError("fewer than B kept groups released")

    def keeps(self, g: B.Group) -> bool:
        """The DAPO filter: 0 < p_hat < 1 (every group without algorithm.filter_groups)."""
        return not self.filter or 0.0 < g.p_hat < 1.0

    def pause(self) -> dict[str, float]:
        """Before a weight sync (and a checkpoint / evaluation): no request runs on the engines when this returns.
        Without partial rollouts every running group is finished (drained); with them they are interrupted, keeping
        their tokens, except those already spanning ``rollout.max_versions_per_response`` versions (drained)."""
        t0 = time.perf_counter()
        with self._cv:
            self._want_pause = True
            self._cv.notify_all()
            while not self._paused and self._error is None:
                self._cv.wait(0.5)
            if self._error is not None:
                raise self._error
        return {"rollout/async/pause_s": time.perf_counter() - t0}

    def resume(self, version: int) -> None:
        """After the sync: the engines hold ``version``; interrupted groups continue first, admission resumes."""
        with self._cv:
            self.version = int(version)
            for p in self.partials.values():
                p.span += 1
            self._waiting = collections.deque(sorted(self.partials))
            self._want_pause = self._paused = False
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=60)

    # ------------------------------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Plain data (``torch.load(weights_only=True)``); only while paused (nothing running)."""
        with self._cv:
            if self._thread.is_alive() and not self._paused:
                raise RuntimeError("AsyncRollout.state_dict while the producer runs (pause() first)")
            return {"next_j": self.next_j, "release_j": self.release_j,
                    "partials": [p.to_dict() for _, p in sorted(self.partials.items())],
                    "decided": [[j, B.group_to_dict(g)] for j, g in sorted(self.decided.items())],
                    "released": [B.group_to_dict(g) for g in self.released],
                    "counters": dict(self.counters)}

    def _load(self, s: dict[str, Any]) -> None:
        self.next_j, self.release_j = int(s["next_j"]), int(s["release_j"])
        self.partials = {int(d["j"]): Partial.from_dict(d) for d in s["partials"]}
        self.decided = {int(j): B.group_from_dict(g) for j, g in s["decided"]}
        self.decided_kept = sum(self.keeps(g) for g in self.decided.values())
        self.released = [B.group_from_dict(g) for g in s["released"]]
        self.released_kept = sum(self.keeps(g) for g in self.released)
        self.counters = collections.Counter(s.get("counters", {}))
        for p in self.partials.values():  # saved after the sync, before resume(): they continue under new weights
            p.span += 1

    # ------------------------------------------------------------------------------------------ the thread
    def _p_max(self) -> int:
        """The largest FIFO position (from the next batch's first) a group admitted now could take."""
        return self.released_kept + self.decided_kept + len(self.partials)

    def _main(self) -> None:
        try:
            self._produce()
        except BaseException as e:  # noqa: BLE001 - re-raised in the loop's thread by take() / pause()
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _produce(self) -> None:
        client, n_eng = self.client, self.client.num_engines
        calls: dict[int, Any] = {}  # engine -> the call in flight (one per engine)
        while True:
            with self._cv:
                while True:
                    if self._stop:
                        return
                    if self._want_pause and not self._paused:
                        break
                    work = {} if self._want_pause else {e: self._submissions(e) for e in range(n_eng)
                                                         if e not in calls}
                    if calls or any(work.values()) or any(self._running):
                        break
                    if self.prompts_exhausted and not self.partials and self.released_kept < self.B:
                        raise DynamicSamplingError(
                            f"the prompt stream ran out with {self.released_kept} of the {self.B} kept groups the "
                            "next batch needs", {"dynamic_sampling/kept_groups": float(self.released_kept)})
                    self._cv.wait(0.5)  # idle: the bound or the prompt stream holds admission
            if self._want_pause and not self._paused:
                self._quiesce(calls)
                calls = {}
                with self._cv:
                    self._paused = True
                    self._cv.notify_all()
                continue
            for e, submit in work.items():
                if submit:
                    calls[e] = client.stream_start(e, submit, self.sampling, None, self.steps_per_call)
                    if any(len(x) > 4 for x in submit):  # continuations now run: tests/test_async_faults.py
                        fault_point("partial_rollout", self.version + 1, self.run)
            for e in range(n_eng):  # keep every engine with running groups stepping
                if e not in calls and self._running[e]:
                    calls[e] = client.stream_start(e, [], self.sampling, None, self.steps_per_call)
            if not calls:
                continue
            t0 = time.perf_counter()
            pos, res = client.stream_wait(pending := list(calls.items()))
            self.seconds["generate"] += time.perf_counter() - t0
            e = pending[pos][0]
            del calls[e]
            self._finished(e, res)

    def _submissions(self, e: int) -> list[tuple]:
        """New and continued groups for engine ``e`` (under the lock): interrupted ones first, then new prompts as
        long as the admission bound and ``rollout.max_inflight_prompts`` allow."""
        out: list[tuple] = []
        while self._waiting and len(self._running[e]) < self.per_engine:  # continuations (on any engine)
            p = self.partials[self._waiting.popleft()]
            seeds = [self.sampling.seed + p.j * p.n + i if self.sampling.seed is not None else None
                     for i in range(p.n)]
            out.append((p.key, self.run.render_prompts([p.example])[0], p.j, p.example.meta.get("max_tokens"),
                        p.continuation(seeds)))
            self._assign(e, p.j)
            self.counters["resumed_groups"] += 1
        while len(self._running[e]) < self.per_engine and not self.prompts_exhausted:
            if self.paced and not admissible(self._p_max(), self.version, self.first_version, self.B, self.k):
                self.counters["admission_waits"] += not self._held  # times admission began to wait (pacing)
                self._held = True
                break
            self._held = False
            examples = self.run.next_prompts(1)
            if not examples:
                self.prompts_exhausted = True
                break
            j, self.next_j = self.next_j, self.next_j + 1
            p = self.partials[j] = Partial(j, examples[0], self.version, self.sampling.n)
            out.append((p.key, self.run.render_prompts([p.example])[0], j, p.example.meta.get("max_tokens")))
            self._assign(e, j)
        return out

    def _assign(self, e: int, j: int) -> None:
        self._running[e].add(j)
        self._engine_of[j] = e

    def _quiesce(self, calls: dict[int, Any]) -> None:
        """Pause: collect the calls in flight, interrupt (partial rollouts) what may be interrupted, drain the rest."""
        client = self.client
        for e, ref in list(calls.items()):
            self._finished(e, client.stream_wait([(e, ref)])[1])
        if self.partial:
            for e in range(client.num_engines):
                keys = [self.partials[j].key for j in sorted(self._running[e])
                        if self.partials[j].span < self.max_versions]
                if keys:
                    res = client.stream_wait([(e, client.stream_start(e, [], self.sampling, None, 0, keys))])[1]
                    self._finished(e, res)
        while any(self._running):  # drain: finish under the current weights
            for e in range(client.num_engines):
                if self._running[e]:
                    self._finished(e, client.stream_wait(
                        [(e, client.stream_start(e, [], self.sampling, None, self.steps_per_call))])[1])

    def _finished(self, e: int, res: dict[str, Any]) -> None:
        """One engine call's result: interrupted segments recorded; finished groups scored, filtered, released."""
        for key, seg in res.get("interrupted", {}).items():
            j = _index(key)
            self.partials[j].add_segment(seg, self.version)
            self._running[e].discard(j)
            self.counters["interrupted_groups"] += 1
        done = [(_index(key), comps) for key, comps in res["finished"]]
        if not done:
            return
        parts = [self.partials[j] for j, _ in done]
        comps = [p.completions(c, self.version) for p, (_, c) in zip(parts, done)]
        t0 = time.perf_counter()
        groups = self.run.score([p.example for p in parts], comps)  # the reward pool, as groups complete
        self.seconds["reward"] += time.perf_counter() - t0
        with self._cv:
            for p, g, cs in zip(parts, groups, comps):
                g.weight_step = p.start_version
                if p.segments:
                    g.token_versions = [c.versions for c in cs]
                    self.counters["resumed_groups_scored"] += 1
                self._running[e].discard(p.j)
                del self.partials[p.j]
                self.decided[p.j] = g
                self.decided_kept += self.keeps(g)
            self._release()
            self._cv.notify_all()

    def _release(self) -> None:
        """Move decided groups to the queue in submission order (under the lock)."""
        while self.decided if self.discard else self.release_j in self.decided:
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


def _index(key: str) -> int:
    """The admission index j of an engine key ``a{j}s{segment}``."""
    return int(key[1:].partition("s")[0])


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
