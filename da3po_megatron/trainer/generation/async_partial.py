"""The asynchronous producer's state (``trainer/generation/async_rollout.py``; docs/async.md): one admitted group as it
runs, is interrupted and continues (:class:`Partial`), the continuation seeds, and the checkpoint snapshot of the whole
producer (:class:`ProducerSnapshot`) -- split from ``async_rollout.py``, which holds the thread and its engines.

Plain data in, plain data out: nothing here locks or talks to an engine; ``async_rollout.py`` calls it under its lock.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from da3po_megatron.rollout.route_refs import is_ref
from da3po_megatron.trainer import batch as B
from da3po_megatron.trainer.generation.collect import token_stats


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


TRACE_ENV = "DA3PO_ASYNC_TRACE"


def trace_batch(step: int, trained: list[B.Group], released: list[B.Group]) -> None:
    """With ``DA3PO_ASYNC_TRACE=<file>`` (``tests/test_async_faults.py``): append one JSON line per batch taken --
    the step, the uids of its trained groups and of every group released into it (kept and filtered) -- so a test
    accounts for each admitted group by uid across kills and resumes. Unset (always, outside tests): nothing."""
    path = os.environ.get(TRACE_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"step": int(step), "trained": [g.example.uid for g in trained],
                                "released": [g.example.uid for g in released]}) + "\n")


def take_stats(groups: list[B.Group], generated: list[B.Group], filter_groups: bool, counters: dict[str, float],
               gauges: dict[str, float]) -> dict[str, float]:
    """The statistics of one batch the producer's ``take`` returns: dynamic sampling over the groups released with
    it (``generated``; ``groups`` = its kept ones), decode tokens, and ``rollout/async/*`` -- the per-take
    ``counters`` and the ``gauges`` (queued and in-flight groups, engine idle fractions)."""
    filtered = [g for g in generated if filter_groups and not 0.0 < g.p_hat < 1.0]
    stats = {"dynamic_sampling/generated_groups": float(len(generated)),
             "dynamic_sampling/kept_groups": float(len(groups)),
             "dynamic_sampling/discarded_all_correct_groups": float(sum(g.p_hat >= 1.0 for g in filtered)),
             "dynamic_sampling/discarded_all_wrong_groups": float(sum(g.p_hat <= 0.0 for g in filtered)),
             "dynamic_sampling/discarded_surplus_groups": 0.0, "dynamic_sampling/rounds": 1.0,
             "dynamic_sampling/kept_frac": len(groups) / max(len(generated), 1),
             "dynamic_sampling/aborted_groups": 0.0, "rollout/consumed_prompts": float(len(generated)),
             **{f"rollout/async/{k}": float(v) for k, v in gauges.items()},
             **{f"rollout/async/{k}": float(v) for k, v in sorted(counters.items())}}
    stats.update(token_stats(groups, generated))
    return stats


def index_of(key: str) -> int:
    """The admission index j of an engine key ``a{j}s{segment}``."""
    return int(key[1:].partition("s")[0])


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
    routes: list[Any] = field(default_factory=list)  # [sample] routed experts of its last segment (MoE), or None

    def __post_init__(self) -> None:
        for name in ("tokens", "logprobs", "versions"):
            if not getattr(self, name):
                setattr(self, name, [[] for _ in range(self.n)])
        self.done = self.done or [False] * self.n
        self.reasons = self.reasons or [""] * self.n
        self.texts = self.texts or [""] * self.n
        self.routes = self.routes or [None] * self.n

    @property
    def key(self) -> str:
        """The group's request key on the engine, new per segment (an aborted request's id is never reused)."""
        return f"a{self.j}s{self.segments}"

    def add_segment(self, seg: dict[str, Any], version: int) -> None:
        """Record an interrupted segment (the engine's ``interrupted[key]``) generated under ``version``. The arrays
        are copied: the engine's came through Ray as views into one buffer (see :func:`batch.own_tensor`)."""
        routes = seg.get("routed_experts")
        for i in range(self.n):
            if self.done[i]:
                continue
            t = np.array(seg["token_ids"][i], dtype=np.int32)
            self.tokens[i].append(t)
            self.logprobs[i].append(np.array(seg["logprobs"][i], dtype=np.float32))
            self.versions[i].append(np.full(len(t), version, dtype=np.int32))
            if routes is not None and routes[i] is not None:  # a RouteRef (rollout/route_refs.py), or an array
                self.routes[i] = routes[i] if is_ref(routes[i]) else np.array(routes[i])
            if seg["finished"][i]:
                self.done[i], self.reasons[i], self.texts[i] = True, seg["reasons"][i], seg["texts"][i]
        self.segments += 1

    def continuation(self, seeds: list[int | None]) -> dict[str, Any]:
        """The ``cont`` of the resubmission (``rollout/stream.py``): the prefix of each sample as an int32 array,
        which are done, and the next segment's seeds (:func:`continuation_seed` of each sample's first seed)."""
        return {"prefix": [np.concatenate(t) if t else np.zeros(0, np.int32) for t in self.tokens],
                "done": list(self.done), "seeds": [continuation_seed(s, self.segments) for s in seeds]}

    def completions(self, final: list[Any], version: int) -> list[Any]:
        """The group's G completions: the segments so far stitched with the final segment ``final`` (the engine's
        Completions of the last, uninterrupted segment, generated under ``version``). Routed experts (MoE): a
        continued sample's final segment ran from prompt + its whole prefix, so its routes cover every position of
        the stitched response (the prefix's as the last version prefilled them); a sample finished in an earlier
        segment keeps that segment's."""
        from da3po_megatron.rollout.types import Completion

        if not self.segments:  # never interrupted: one version for every token (Group.weight_step)
            return final
        out = []
        for i, c in enumerate(final):
            tokens = self.tokens[i] + ([c.token_ids] if not self.done[i] else [])
            lps = self.logprobs[i] + ([c.logprobs] if not self.done[i] else [])
            vers = self.versions[i] + ([np.full(len(c.token_ids), version, np.int32)] if not self.done[i] else [])
            ids = np.concatenate(tokens) if tokens else np.zeros(0, np.int32)
            routes = self.routes[i] if self.done[i] else getattr(c, "routed_experts", None)
            out.append(Completion(
                prompt_index=c.prompt_index, sample_index=c.sample_index, prompt_token_ids=c.prompt_token_ids,
                token_ids=ids, text=self.texts[i] if self.done[i] else c.text,
                logprobs=np.concatenate(lps) if lps else np.zeros(0, np.float32),
                finish_reason=self.reasons[i] if self.done[i] else c.finish_reason, num_tokens=len(ids),
                routed_experts=routes, versions=np.concatenate(vers) if vers else np.zeros(0, np.int32)))
        return out

    def copy(self) -> Partial:
        """A snapshot: the per-sample segment lists copied (the arrays are never written, only appended)."""
        return Partial(self.j, self.example, self.start_version, self.n, [list(x) for x in self.tokens],
                       [list(x) for x in self.logprobs], [list(x) for x in self.versions], list(self.done),
                       list(self.reasons), list(self.texts), self.segments, self.span, list(self.routes))

    def to_dict(self) -> dict[str, Any]:
        t = lambda rows: [[B.own_tensor(a) for a in r] for r in rows]  # noqa: E731
        out = {"j": self.j, "example": B._plain(asdict(self.example)), "start_version": self.start_version,
               "n": self.n, "tokens": t(self.tokens), "logprobs": t(self.logprobs), "versions": t(self.versions),
               "done": list(self.done), "reasons": list(self.reasons), "texts": list(self.texts),
               "segments": self.segments, "span": self.span}
        if any(r is not None for r in self.routes):
            out["routes"] = [r if r is None or is_ref(r) else B.own_tensor(r) for r in self.routes]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Partial:
        from da3po_megatron.data.datasets import Example

        a = lambda rows, dt: [[np.asarray(x, dtype=dt) for x in r] for r in rows]  # noqa: E731
        routes = [r if r is None or is_ref(r) else np.asarray(r) for r in d.get("routes", [])]
        return cls(j=int(d["j"]), example=Example(**d["example"]), start_version=int(d["start_version"]),
                   n=int(d["n"]), tokens=a(d["tokens"], np.int32), logprobs=a(d["logprobs"], np.float32),
                   versions=a(d["versions"], np.int32), done=list(d["done"]), reasons=list(d["reasons"]),
                   texts=list(d["texts"]), segments=int(d["segments"]), span=int(d["span"]), routes=routes)


@dataclass
class ProducerSnapshot:
    """The producer's state at a step's end (taken while paused, O(groups) references, no copy of a token array):
    serialised by :meth:`to_dict` only when a checkpoint is written (``trainer/resume/run_state.py``), not every
    step. ``first_version`` is the version the next batch trains at (a resume checks the bound against it)."""

    next_j: int
    release_j: int
    first_version: int
    partials: list[Partial]
    decided: list[tuple[int, B.Group]]
    released: list[B.Group]
    counters: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        """Plain data (``torch.load(weights_only=True)``)."""
        return {"next_j": self.next_j, "release_j": self.release_j, "first_version": self.first_version,
                "partials": [p.to_dict() for p in self.partials],
                "decided": [[j, B.group_to_dict(g)] for j, g in self.decided],
                "released": [B.group_to_dict(g) for g in self.released], "counters": dict(self.counters)}

    @classmethod
    def from_dict(cls, s: dict[str, Any]) -> ProducerSnapshot:
        """The inverse of :meth:`to_dict` (a checkpoint's ``async_rollout``)."""
        decided = [(int(j), B.group_from_dict(g)) for j, g in s["decided"]]
        return cls(int(s["next_j"]), int(s["release_j"]), int(s.get("first_version", 0)),
                   [Partial.from_dict(d) for d in s["partials"]], decided,
                   [B.group_from_dict(g) for g in s["released"]], dict(s.get("counters", {})))


def plain_state(state: Any) -> Any:
    """A trainer state with any :class:`ProducerSnapshot` in it turned into plain data (at checkpoint time)."""
    if isinstance(state, dict) and isinstance(state.get("async_rollout"), ProducerSnapshot):
        return {**state, "async_rollout": state["async_rollout"].to_dict()}
    return state
