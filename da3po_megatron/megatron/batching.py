"""The policy's batch format and its split over data-parallel ranks.

What the RL loop hands the policy is a :class:`PolicyBatch`: per response its prompt token ids, response token ids,
the old log-probs pi_old of the response tokens (paper Eq. 5/11, the denominator of the ratio), its advantage (Eq. 3,
already DAA-amplified by the trainer, Eq. 14) and, optionally, per-token weights of the surrogate (truncated importance
sampling for the rollout / training mismatch, ``algorithms.rollout_correction``) and the engines' routed experts
(MoE). :func:`balance_across_dp` gives each data-parallel rank a shard of the responses with nearly equal token counts
(greedy longest-processing-time, the same idea as verl's sequence-length balancing); :func:`dp_shares` is the split
the driver computes to send each rank only its rows.

Micro-batching by token budget and sequence packing (:func:`plan_microbatches`, :func:`build_microbatch`,
:class:`MicroBatch`, :func:`microbatches`) live in :mod:`.packing`, above this module (it takes a
:class:`PolicyBatch`); import them from there.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(eq=False)
class Ragged:
    """Rows of different lengths in one flat array: row ``i`` is ``values[offsets[i]:offsets[i + 1]]`` (a view).
    ``values`` may have further axes after the token axis (routed experts: ``[tokens, layers, top_k]``).

    What travels from the engines to the policy: token ids as int32, log-probs / weights as float32, one array per
    payload, so pickling (Ray's serializer sends numpy buffers out of band) costs a memcpy and the driver holds no
    Python object per token. A *share* (``rows`` set) holds only those rows of a batch of ``size`` rows and is indexed
    by the batch's row numbers, so a data-parallel rank that received its share runs the same code as one that holds
    the whole batch; asking it for a row it does not hold is an error naming the row.
    """

    values: np.ndarray
    offsets: np.ndarray
    rows: np.ndarray | None = None
    size: int | None = None
    _lookup: Any = field(default=None, repr=False)

    @classmethod
    def from_rows(cls, rows: Any, dtype: Any) -> Ragged:
        """From a Ragged (cast to ``dtype``), or a sequence of rows (lists or arrays)."""
        if isinstance(rows, Ragged):
            return rows if rows.values.dtype == dtype else Ragged(rows.values.astype(dtype), rows.offsets, rows.rows,
                                                                  rows.size)
        rows = list(rows)
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([len(r) for r in rows], out=offsets[1:])
        values = np.concatenate([np.asarray(r, dtype=dtype) for r in rows]) if rows else \
            np.zeros(0, dtype=dtype)  # first axis = tokens (a per-token array may have more axes: experts)
        return cls(values.astype(dtype, copy=False), offsets)

    def __post_init__(self) -> None:
        self.offsets = np.asarray(self.offsets, dtype=np.int64)
        if self.offsets.ndim != 1 or len(self.offsets) < 1 or self.offsets[-1] != len(self.values):
            raise ValueError(f"Ragged: offsets (last {self.offsets[-1] if len(self.offsets) else None}) do not "
                             f"cover the {len(self.values)} values")

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_lookup": None}  # rebuilt on demand by the receiver

    def _local(self, i: int) -> int:
        if self.rows is None:
            return i
        if self._lookup is None:
            self._lookup = np.full(int(self.size), -1, dtype=np.int64)
            self._lookup[self.rows] = np.arange(len(self.rows))
        k = int(self._lookup[i]) if -int(self.size) <= i < int(self.size) else -1
        if k < 0:
            raise KeyError(f"row {i} is not in this share of the batch (it holds {len(self.rows)} of {self.size} "
                           "rows: the driver's split and this rank's disagree)")
        return k

    def __len__(self) -> int:
        return int(self.size) if self.rows is not None else len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        k = self._local(int(i))
        return self.values[self.offsets[k]:self.offsets[k + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        if self.rows is not None:
            raise TypeError("a share of a batch cannot be iterated over all rows")
        for k in range(len(self.offsets) - 1):
            yield self.values[self.offsets[k]:self.offsets[k + 1]]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Ragged):
            return (np.array_equal(self.offsets, other.offsets) and np.array_equal(self.values, other.values)
                    and (self.rows is None) == (other.rows is None)
                    and (self.rows is None or np.array_equal(self.rows, other.rows)))
        if isinstance(other, list | tuple):
            return self.tolist() == [list(r) for r in other]
        return NotImplemented

    def lengths(self) -> np.ndarray:
        """Length of each held row (int64)."""
        return np.diff(self.offsets)

    def tolist(self) -> list[list]:
        return [r.tolist() for r in self]

    def take(self, indices: Sequence[int] | np.ndarray) -> Ragged:
        """The given rows (batch row numbers), in that order, as a new Ragged (one vectorised gather)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if self.rows is not None:
            idx = np.array([self._local(int(i)) for i in idx], dtype=np.int64)
        starts, ends = self.offsets[idx], self.offsets[idx + 1]
        offsets = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(ends - starts, out=offsets[1:])
        # one memcpy per row (no int64 index per token); O(rows) Python
        values = np.concatenate([self.values[a:b] for a, b in zip(starts.tolist(), ends.tolist())]) if len(idx) \
            else self.values[:0].copy()
        return Ragged(values, offsets)

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes + self.offsets.nbytes + (0 if self.rows is None else self.rows.nbytes))


def _ragged(rows: Any, dtype: Any) -> Ragged | None:
    return None if rows is None else Ragged.from_rows(rows, dtype)


@dataclass(eq=False)
class PolicyBatch:
    """What the RL loop sends to the policy ranks (picklable: it travels through Ray).

    Per-token payloads are :class:`Ragged` arrays (token ids int32, log-probs and weights float32); lists of lists are
    accepted and converted. Row ``i`` of a field is ``batch.<field>[i]`` (a numpy view).

    Attributes:
        prompt_ids: per response, the prompt's token ids (at least one token: the first response token is predicted
            from the last prompt token).
        response_ids: per response, the sampled token ids (may be empty: it then has no log-probs and no loss).
        old_logprobs: per response, log pi_old of each response token (Eq. 5/11). Needed by :meth:`train_step`.
        advantages: per response, its (DAA-amplified, Eq. 14) advantage, the same for every token (Eq. 3); float64,
            one per row of the whole batch (also in a share: 8 bytes a response).
        token_weights: per response, a weight >= 0 of each response token's surrogate term (TIS weights); the policy
            multiplies the token's advantage by it, which equals weighting the term only for weights >= 0 (not
            checked: a per-token scan would cost more than the step's bookkeeping). None = all ones (no extra work).
        row_lengths: a share only (:meth:`share`): ``[n, 2]`` prompt and response lengths of every row of the whole
            batch, so a rank plans the same mini-batches and DP split as the driver did.
        routed_experts: MoE, per response, the experts the engine routed each position of the sequence to
            (``Completion.routed_experts``: ``[P + R - 1, MoE layers, k]`` small ints; routing replay R3 and the
            router-agreement metric); None for dense models or without route capture. From engines in Ray actors
            these are refs into the object store (``rollout/route_refs.RouteRefs``, duck-typed here: ``lengths``,
            ``take``, ``share``, ``fetch``), resolved by each rank for its share (``actor_group._on_share``).
    """

    prompt_ids: Any
    response_ids: Any
    old_logprobs: Any = None
    advantages: Any = None
    token_weights: Any = None
    row_lengths: np.ndarray | None = None
    routed_experts: Any = None

    def __post_init__(self) -> None:
        self.prompt_ids = Ragged.from_rows(self.prompt_ids, np.int32)
        if self.routed_experts is not None and not hasattr(self.routed_experts, "lengths"):  # (Ragged, RouteRefs)
            rows = list(self.routed_experts)
            self.routed_experts = Ragged.from_rows(rows, rows[0].dtype if rows else np.uint8)
        self.response_ids = Ragged.from_rows(self.response_ids, np.int32)
        self.old_logprobs = _ragged(self.old_logprobs, np.float32)
        self.token_weights = _ragged(self.token_weights, np.float32)
        if self.advantages is not None:
            self.advantages = np.asarray(self.advantages, dtype=np.float64).reshape(-1)
        n = len(self.prompt_ids)
        if len(self.response_ids) != n:
            raise ValueError(f"PolicyBatch: {n} prompt_ids but {len(self.response_ids)} response_ids")
        if self.row_lengths is not None:
            return  # a share: validated as a whole batch before it was split
        empty = np.flatnonzero(self.prompt_ids.lengths() == 0)
        if len(empty):
            raise ValueError(f"PolicyBatch: prompt_ids[{empty[0]}] is empty (need at least one prompt token)")
        rlen = self.response_ids.lengths()
        for name in ("old_logprobs", "token_weights"):
            rows = getattr(self, name)
            if rows is None:
                continue
            if len(rows) != n:
                raise ValueError(f"PolicyBatch: {n} responses but {len(rows)} {name} rows")
            bad = np.flatnonzero(rows.lengths() != rlen)
            if len(bad):
                i = int(bad[0])
                raise ValueError(f"PolicyBatch: {name}[{i}] has {len(rows[i])} values for {rlen[i]} response tokens")
        if self.advantages is not None and len(self.advantages) != n:
            raise ValueError(f"PolicyBatch: {n} responses but {len(self.advantages)} advantages")
        if self.routed_experts is not None:
            want = self.prompt_ids.lengths() + rlen - 1  # every position that was an input of the engine
            got = self.routed_experts.lengths()
            bad = np.flatnonzero(got != want) if len(got) == n else [0]
            if len(bad):
                i = int(bad[0])
                raise ValueError(f"PolicyBatch: routed_experts[{i}] has {got[i] if len(got) == n else len(got)} "
                                 f"positions for {want[i]} (prompt + response - 1)")

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PolicyBatch):
            return NotImplemented

        def same(a: Any, b: Any) -> bool:
            if a is None or b is None:
                return a is None and b is None
            return bool(a == b) if isinstance(a, Ragged) else np.array_equal(a, b)

        return all(same(getattr(self, k), getattr(other, k)) for k in
                   ("prompt_ids", "response_ids", "old_logprobs", "advantages", "token_weights", "row_lengths",
                    "routed_experts"))

    @property
    def held_rows(self) -> np.ndarray | None:
        """The batch rows this object holds (a share), or None (all of them)."""
        return self.response_ids.rows

    def response_lengths(self) -> np.ndarray:
        """Response tokens of every row of the batch (int64)."""
        return self.row_lengths[:, 1].astype(np.int64) if self.row_lengths is not None else \
            self.response_ids.lengths()

    def lengths(self) -> list[int]:
        """Total tokens (prompt + response) of each sequence of the batch."""
        if self.row_lengths is not None:
            return self.row_lengths.astype(np.int64).sum(axis=1).tolist()
        return (self.prompt_ids.lengths() + self.response_ids.lengths()).tolist()

    def num_response_tokens(self) -> int:
        return int(self.response_lengths().sum())

    def select(self, indices: Sequence[int]) -> PolicyBatch:
        """The sub-batch of the given rows, in that order (a whole batch of its own)."""
        idx = np.asarray(list(indices), dtype=np.int64)
        return PolicyBatch(
            prompt_ids=self.prompt_ids.take(idx), response_ids=self.response_ids.take(idx),
            old_logprobs=None if self.old_logprobs is None else self.old_logprobs.take(idx),
            advantages=None if self.advantages is None else self.advantages[idx],
            token_weights=None if self.token_weights is None else self.token_weights.take(idx),
            routed_experts=None if self.routed_experts is None else self.routed_experts.take(idx))

    def share(self, rows: Sequence[int]) -> PolicyBatch:
        """What one data-parallel rank needs: the per-token arrays of ``rows`` only, still indexed by batch row
        (:class:`Ragged` shares), with every row's lengths (to plan the same mini-batches and split) and every
        row's advantage."""
        idx = np.asarray(sorted(rows), dtype=np.int64)
        n = len(self)

        def part(r: Any) -> Any:
            if r is None:
                return None
            if not isinstance(r, Ragged):  # routes by reference (rollout/route_refs.RouteRefs): the share's refs
                return r.share(idx, n)
            t = r.take(idx)
            return Ragged(t.values, t.offsets, idx, n)

        return PolicyBatch(prompt_ids=part(self.prompt_ids), response_ids=part(self.response_ids),
                           old_logprobs=part(self.old_logprobs), advantages=self.advantages,
                           token_weights=part(self.token_weights), routed_experts=part(self.routed_experts),
                           row_lengths=np.stack([self.prompt_ids.lengths(), self.response_ids.lengths()],
                                                axis=1).astype(np.int32))

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays (what a serialization of it moves, give or take a few hundred)."""
        parts = [self.prompt_ids, self.response_ids, self.old_logprobs, self.token_weights, self.routed_experts]
        return sum(p.nbytes for p in parts if p is not None) + sum(
            a.nbytes for a in (self.advantages, self.row_lengths) if a is not None)


def balance_across_dp(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Split row indices over ``dp_size`` ranks with nearly equal token sums; each rank's list is in ascending order.

    Greedy LPT: longest sequence first, to the rank with the fewest tokens so far (ties: fewer rows, then the lower
    rank; a heap, O(n log dp)). Deterministic, so every rank computes the same split from the same batch without
    communication, and the driver computes it too, to send each rank only its rows (:func:`dp_shares`).
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    lengths = [int(x) for x in lengths]
    shards: list[list[int]] = [[] for _ in range(dp_size)]
    heap = [(0, 0, k) for k in range(dp_size)]
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        load, count, r = heapq.heappop(heap)
        shards[r].append(i)
        heapq.heappush(heap, (load + lengths[i], count + 1, r))
    return [sorted(s) for s in shards]


def dp_shares(lengths: Sequence[int], dp_size: int, mini_batch: int | None = None) -> list[list[int]]:
    """The rows each data-parallel rank works on in one call: ``compute_logprobs`` splits the whole batch
    (``mini_batch`` None), ``train_step`` each mini-batch of ``mini_batch`` consecutive rows
    (``PolicyWorker.train_step``); the same split the ranks compute (``ForwardSchedule.dp_shard``)."""
    lengths = list(lengths)
    n = len(lengths)
    if mini_batch is None:
        return balance_across_dp(lengths, dp_size)
    out: list[list[int]] = [[] for _ in range(dp_size)]
    for s in range(0, n, mini_batch):
        rows = list(range(s, min(s + mini_batch, n)))
        for d, part in enumerate(balance_across_dp([lengths[i] for i in rows], dp_size)):
            out[d] += [rows[k] for k in part]
    return out
