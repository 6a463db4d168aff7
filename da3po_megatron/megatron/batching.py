"""The policy's batch format and dynamic micro-batching by token budget (sequence packing).

What the RL loop hands the policy is a :class:`PolicyBatch`: per response its prompt token ids, response token ids,
the old log-probs pi_old of the response tokens (paper Eq. 5/11, the denominator of the ratio), its advantage (Eq. 3,
already DAA-amplified by the trainer, Eq. 14) and, optionally, per-token weights of the surrogate (truncated importance
sampling for the rollout / training mismatch, ``algorithms.rollout_correction``). This module turns it into Megatron
micro-batches:

- :func:`balance_across_dp` gives each data-parallel rank a shard of the responses with nearly equal token counts
  (greedy longest-processing-time, the same idea as verl's sequence-length balancing);
- :func:`plan_microbatches` groups a shard into micro-batches whose work is bounded by ``max_tokens_per_microbatch``
  (first-fit decreasing bin packing, as verl's dynamic batching / NeMo-RL's sequence packing do);
- :func:`build_microbatch` builds the tensors of one micro-batch, either

  * **packed** (default): the sequences of the micro-batch concatenated in a row, position ids restarting at 0 for
    every sequence, and a dense block-diagonal causal attention mask ``[b, 1, S, S]`` (Megatron convention: True =
    masked). Megatron's local layer spec (the CPU path) rejects THD ``packed_seq_params`` (its
    ``DotProductAttention`` asserts ``packed_seq_params is None``), so on the local spec the mask is dense, and the
    sequences are packed into several rows as long as the longest sequence (``row_capacity``): dense attention costs
    rows x S^2, far less than one row of all tokens. With the Transformer-Engine spec (GPU) all sequences form ONE row
    described by ``cu_seqlens`` (THD format, ``PackedSeqParams``) and no dense mask is built (``thd=True``);
  * **padded**: one sequence per row, right-padded to the longest sequence of the micro-batch, ``[b, S]``, with the
    same (then just causal) mask. Kept as the simple reference that packed batches must reproduce.

Every micro-batch also carries where each response token's log-prob comes from: the logit at position ``t`` predicts
token ``t + 1``, so response token ``j`` of a sequence starting at ``s`` with prompt length ``P`` is scored at position
``s + P - 1 + j``. Prompt tokens, padding and tokens of other sequences never enter the loss (``response_mask``).

Left out: context-parallel sharding of sequences (CP needs CUDA and is not wired here) and padding rows to the
multiples that sequence parallelism needs (sequence parallelism does not run on CPU).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


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
            router-agreement metric); None for dense models or without route capture.
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
        if self.routed_experts is not None and not isinstance(self.routed_experts, Ragged):
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

        def part(r: Ragged | None) -> Ragged | None:
            if r is None:
                return None
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


def plan_microbatches(lengths: Sequence[int], max_tokens: int, packing: bool = True) -> list[list[int]]:
    """Group positions ``0..len(lengths)-1`` into micro-batches of at most ``max_tokens`` tokens of work.

    Packed: the sum of the lengths of a micro-batch is <= ``max_tokens``. Padded: rows x longest row <= ``max_tokens``.
    First-fit decreasing; micro-batches are returned in the order they were opened, each with ascending positions.
    A single sequence longer than ``max_tokens`` is an error (the budget is a hard bound on memory).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_microbatch must be >= 1, got {max_tokens}")
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(f"sequence {i} has {n} tokens (prompt + response), more than max_tokens_per_microbatch "
                             f"= {max_tokens}; raise the budget")
    bins: list[list[int]] = []
    sums: list[int] = []
    longest: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        n = lengths[i]
        for b in range(len(bins)):
            fits = (sums[b] + n <= max_tokens) if packing else ((len(bins[b]) + 1) * max(longest[b], n) <= max_tokens)
            if fits:
                bins[b].append(i)
                sums[b] += n
                longest[b] = max(longest[b], n)
                break
        else:
            bins.append([i])
            sums.append(n)
            longest.append(n)
    return [sorted(b) for b in bins]


@dataclass
class MicroBatch:
    """Tensors of one micro-batch (CPU tensors; the policy moves them to the device).

    Attributes:
        rows: the batch rows (positions in the batch given to :func:`build_microbatch`) of the sequences, in order.
        tokens / position_ids / labels: ``[b, S]`` int64; labels[t] = tokens[t + 1] inside a sequence, else 0.
        attention_mask: ``[b, 1, S, S]`` bool, True = masked (block-diagonal causal); None when ``thd``.
        cu_seqlens: ``[n + 1]`` int32 cumulative sequence lengths in the packed row (THD); None otherwise.
        max_seqlen: the longest sequence.
        token_index: ``[N]`` flat positions (into ``[b * S]``) whose logits score a response token.
        token_targets: ``[N]`` the response token scored there.
        token_seq / token_pos: ``[N]`` which sequence of this micro-batch (0..n-1) and which response token.
        response_len: ``[n]`` response lengths.
        old_logprobs: ``[n, R]`` (R = longest response) or None; advantages: ``[n]`` or None.
        response_mask: ``[n, R]`` float, 1 on response tokens.
        token_weights: ``[n, R]`` (0 on padding) or None (all ones).
        routes / route_mask: MoE with engine routes: ``[b * S, MoE layers, k]`` int16 in the router's token order
            (s-major: position s of row r is ``s * b + r``, megatron ``router.py`` 550) and ``[b * S]`` bool, True
            where the engine ran the position (not padding, not a sequence's last token); else None.
    """

    rows: list[int]
    tokens: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    max_seqlen: int
    token_index: torch.Tensor
    token_targets: torch.Tensor
    token_seq: torch.Tensor
    token_pos: torch.Tensor
    response_len: torch.Tensor
    response_mask: torch.Tensor
    old_logprobs: torch.Tensor | None
    advantages: torch.Tensor | None
    token_weights: torch.Tensor | None = None
    routes: torch.Tensor | None = None
    route_mask: torch.Tensor | None = None

    @property
    def num_sequences(self) -> int:
        return len(self.rows)

    @property
    def num_response_tokens(self) -> int:
        return int(self.token_index.numel())

    @property
    def num_tokens(self) -> int:
        """Tokens of work (packed: real tokens; padded: rows x S)."""
        return int(self.tokens.numel())

    def to(self, device: torch.device | str) -> MicroBatch:
        moved = {}
        for k, v in self.__dict__.items():
            moved[k] = v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        return MicroBatch(**moved)

    def unflatten(self, per_token: torch.Tensor) -> torch.Tensor:
        """``[N]`` per-response-token values -> ``[n, R]`` padded with zeros (differentiable)."""
        n, r = self.response_mask.shape
        out = per_token.new_zeros((n, r))
        return out.index_put((self.token_seq, self.token_pos), per_token)


def _pack_rows(lens: Sequence[int], capacity: int) -> list[tuple[int, int]]:
    """(row, start) of each sequence: first-fit decreasing into rows of ``capacity`` tokens."""
    fill: list[int] = []
    starts: list[tuple[int, int]] = [(0, 0)] * len(lens)
    for k in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        for r, used in enumerate(fill):
            if used + lens[k] <= capacity:
                starts[k] = (r, used)
                fill[r] += lens[k]
                break
        else:
            starts[k] = (len(fill), 0)
            fill.append(lens[k])
    return starts


def build_microbatch(batch: PolicyBatch, rows: Sequence[int], packing: bool = True, thd: bool = False,
                     pad_id: int = 0, row_capacity: int | None = None) -> MicroBatch:
    """The tensors of one micro-batch holding ``rows`` of ``batch`` (see :class:`MicroBatch`).

    ``row_capacity`` (packing with a dense mask only): instead of one row, pack into several rows of at most
    ``max(row_capacity, longest sequence)`` tokens (0 = the longest sequence). Attention with a dense mask costs
    rows x row_length^2 instead of (all tokens)^2; the values are the same.
    """
    rows = list(rows)
    if not rows:
        raise ValueError("build_microbatch: no rows")
    if thd and not packing:
        raise ValueError("build_microbatch: thd=True needs packing=True")
    if thd and row_capacity is not None:
        raise ValueError("build_microbatch: thd=True packs one row (cu_seqlens); row_capacity must be None")
    prompts = [batch.prompt_ids[i] for i in rows]
    responses = [batch.response_ids[i] for i in rows]
    seqs = [torch.from_numpy(np.concatenate([p, r]).astype(np.int64)) for p, r in zip(prompts, responses)]
    lens = [len(s) for s in seqs]
    if packing and row_capacity is not None:
        starts = _pack_rows(lens, max(row_capacity, max(lens)))
        b = 1 + max(r for r, _ in starts)
        s_len = max(start + n for (_, start), n in zip(starts, lens))
    elif packing:
        b, s_len = 1, sum(lens)
        starts = [(0, sum(lens[:k])) for k in range(len(rows))]
    else:
        b, s_len = len(rows), max(lens)
        starts = [(k, 0) for k in range(len(rows))]
    tokens = torch.full((b, s_len), pad_id, dtype=torch.long)
    position_ids = torch.zeros((b, s_len), dtype=torch.long)
    labels = torch.zeros((b, s_len), dtype=torch.long)
    segment = torch.zeros((b, s_len), dtype=torch.long)  # 0 = padding, k + 1 = k-th sequence
    tok_index, tok_target, tok_seq, tok_pos = [], [], [], []
    for k, (t, (row, start)) in enumerate(zip(seqs, starts)):
        n = len(t)
        tokens[row, start:start + n] = t
        position_ids[row, start:start + n] = torch.arange(n)
        labels[row, start:start + n - 1] = t[1:]
        segment[row, start:start + n] = k + 1
        p, r = len(prompts[k]), len(responses[k])
        pos = torch.arange(r, dtype=torch.long)
        tok_index.append(pos + (row * s_len + start + p - 1))
        tok_target.append(t[p:])
        tok_seq.append(torch.full((r,), k, dtype=torch.long))
        tok_pos.append(pos)
    if thd:
        attention_mask = None
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        cu_seqlens = torch.tensor(cu, dtype=torch.int32)
    else:
        cu_seqlens = None
        same = segment.unsqueeze(2) == segment.unsqueeze(1)  # [b, S, S]
        causal = torch.ones((s_len, s_len), dtype=torch.bool).tril()
        allowed = same & causal & (segment.unsqueeze(2) > 0)
        allowed |= torch.eye(s_len, dtype=torch.bool)  # padding attends to itself: no fully masked row
        attention_mask = (~allowed).unsqueeze(1)
    resp_len = [len(r) for r in responses]
    r_max = max(max(resp_len), 1)
    response_mask = torch.zeros((len(rows), r_max))
    for k, n in enumerate(resp_len):
        response_mask[k, :n] = 1.0
    old = None if batch.old_logprobs is None else _per_token_rows(batch.old_logprobs, rows, resp_len, r_max)
    weights = None if batch.token_weights is None else _per_token_rows(batch.token_weights, rows, resp_len, r_max)
    adv = None
    if batch.advantages is not None:
        adv = torch.tensor([float(batch.advantages[i]) for i in rows], dtype=torch.float32)
    routes = route_mask = None
    if batch.routed_experts is not None:
        routes, route_mask = _route_rows(batch.routed_experts, rows, starts, b, s_len)
    return MicroBatch(
        rows=rows,
        tokens=tokens,
        position_ids=position_ids,
        labels=labels,
        attention_mask=attention_mask,
        cu_seqlens=cu_seqlens,
        max_seqlen=max(lens),
        token_index=torch.cat(tok_index),
        token_targets=torch.cat(tok_target),
        token_seq=torch.cat(tok_seq),
        token_pos=torch.cat(tok_pos),
        response_len=torch.tensor(resp_len, dtype=torch.long),
        response_mask=response_mask,
        old_logprobs=old,
        advantages=adv,
        token_weights=weights,
        routes=routes,
        route_mask=route_mask,
    )


def _route_rows(routed: Ragged, rows: Sequence[int], starts: Sequence[tuple[int, int]], b: int, s_len: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's routes of ``rows`` laid out like the router's tokens (``MicroBatch.routes``): sequence k at
    (row, start) puts its position t at flat index ``(start + t) * b + row``. Positions marked missing by the
    engine (``rollout.types.route_missing``) stay out of the mask."""
    first = routed[rows[0]]
    out = np.zeros((b * s_len, *first.shape[1:]), dtype=np.int16)
    mask = np.zeros(b * s_len, dtype=bool)
    missing = 255 if routed.values.dtype == np.uint8 else -1  # rollout.types.route_missing (no import upwards)
    for i, (row, start) in zip(rows, starts):
        r = routed[i]
        flat = (start + np.arange(len(r))) * b + row
        out[flat] = r
        mask[flat] = r[:, 0, 0] != missing if r.ndim == 3 and r.shape[1] else True
    return torch.from_numpy(out), torch.from_numpy(mask)


def _per_token_rows(values: Sequence[Sequence[float]], rows: Sequence[int], resp_len: Sequence[int], r_max: int
                    ) -> torch.Tensor:
    """``[n, r_max]`` float32 of the per-response-token ``values`` of ``rows``, zero-padded."""
    out = torch.zeros((len(rows), r_max), dtype=torch.float32)
    for k, i in enumerate(rows):
        if resp_len[k]:
            out[k, :resp_len[k]] = torch.from_numpy(np.asarray(values[i], dtype=np.float32))
    return out


def microbatches(batch: PolicyBatch, rows: Sequence[int], max_tokens: int, packing: bool = True,
                 thd: bool = False, pad_id: int = 0, row_capacity: int | None = None) -> list[MicroBatch]:
    """Plan and build the micro-batches of ``rows`` of ``batch`` (the rows of each keep their batch indices)."""
    rows = list(rows)
    lengths = [len(batch.prompt_ids[i]) + len(batch.response_ids[i]) for i in rows]
    plan = plan_microbatches(lengths, max_tokens, packing=packing)
    return [build_microbatch(batch, [rows[k] for k in group], packing=packing, thd=thd, pad_id=pad_id,
                             row_capacity=row_capacity) for group in plan]
