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

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class PolicyBatch:
    """What the RL loop sends to every policy rank (picklable: it travels through Ray).

    Attributes:
        prompt_ids: per response, the prompt's token ids (at least one token: the first response token is predicted
            from the last prompt token).
        response_ids: per response, the sampled token ids (may be empty: it then has no log-probs and no loss).
        old_logprobs: per response, log pi_old of each response token (Eq. 5/11). Needed by :meth:`train_step`.
        advantages: per response, its (DAA-amplified, Eq. 14) advantage, the same for every token (Eq. 3).
        token_weights: per response, a weight >= 0 of each response token's surrogate term (TIS weights); the policy
            multiplies the token's advantage by it, which equals weighting the term only for weights >= 0 (not
            checked: a per-token scan would cost more than the step's bookkeeping). None = all ones (no extra work).
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    old_logprobs: list[list[float]] | None = None
    advantages: list[float] | None = None
    token_weights: list[list[float]] | None = None

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
        if len(self.response_ids) != n:
            raise ValueError(f"PolicyBatch: {n} prompt_ids but {len(self.response_ids)} response_ids")
        for i, p in enumerate(self.prompt_ids):
            if len(p) == 0:
                raise ValueError(f"PolicyBatch: prompt_ids[{i}] is empty (need at least one prompt token)")
        for name in ("old_logprobs", "token_weights"):
            rows = getattr(self, name)
            if rows is None:
                continue
            if len(rows) != n:
                raise ValueError(f"PolicyBatch: {n} responses but {len(rows)} {name} rows")
            for i, (r, vals) in enumerate(zip(self.response_ids, rows)):
                if len(r) != len(vals):
                    raise ValueError(f"PolicyBatch: {name}[{i}] has {len(vals)} values for {len(r)} response tokens")
        if self.advantages is not None and len(self.advantages) != n:
            raise ValueError(f"PolicyBatch: {n} responses but {len(self.advantages)} advantages")

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def lengths(self) -> list[int]:
        """Total tokens (prompt + response) of each sequence."""
        return [len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids)]

    def num_response_tokens(self) -> int:
        return sum(len(r) for r in self.response_ids)

    def select(self, indices: Sequence[int]) -> PolicyBatch:
        """The sub-batch of the given rows, in that order."""
        return PolicyBatch(
            prompt_ids=[self.prompt_ids[i] for i in indices],
            response_ids=[self.response_ids[i] for i in indices],
            old_logprobs=None if self.old_logprobs is None else [self.old_logprobs[i] for i in indices],
            advantages=None if self.advantages is None else [self.advantages[i] for i in indices],
            token_weights=None if self.token_weights is None else [self.token_weights[i] for i in indices],
        )


def balance_across_dp(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Split row indices over ``dp_size`` ranks with nearly equal token sums; each rank's list is in ascending order.

    Greedy LPT: longest sequence first, to the rank with the fewest tokens so far (ties: the lower rank). Deterministic,
    so every rank computes the same split from the same batch without communication.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    loads = [0] * dp_size
    shards: list[list[int]] = [[] for _ in range(dp_size)]
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        r = min(range(dp_size), key=lambda k: (loads[k], len(shards[k]), k))
        shards[r].append(i)
        loads[r] += lengths[i]
    return [sorted(s) for s in shards]


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
    seqs = [list(batch.prompt_ids[i]) + list(batch.response_ids[i]) for i in rows]
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
    for k, (seq, (row, start)) in enumerate(zip(seqs, starts)):
        n = len(seq)
        t = torch.tensor(seq, dtype=torch.long)
        tokens[row, start:start + n] = t
        position_ids[row, start:start + n] = torch.arange(n)
        labels[row, start:start + n - 1] = t[1:]
        segment[row, start:start + n] = k + 1
        p = len(batch.prompt_ids[rows[k]])
        for j, target in enumerate(batch.response_ids[rows[k]]):
            tok_index.append(row * s_len + start + p - 1 + j)
            tok_target.append(target)
            tok_seq.append(k)
            tok_pos.append(j)
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
    resp_len = [len(batch.response_ids[i]) for i in rows]
    r_max = max(max(resp_len), 1)
    response_mask = torch.zeros((len(rows), r_max))
    for k, n in enumerate(resp_len):
        response_mask[k, :n] = 1.0
    old = None if batch.old_logprobs is None else _per_token_rows(batch.old_logprobs, rows, resp_len, r_max)
    weights = None if batch.token_weights is None else _per_token_rows(batch.token_weights, rows, resp_len, r_max)
    adv = None
    if batch.advantages is not None:
        adv = torch.tensor([float(batch.advantages[i]) for i in rows], dtype=torch.float32)
    return MicroBatch(
        rows=rows,
        tokens=tokens,
        position_ids=position_ids,
        labels=labels,
        attention_mask=attention_mask,
        cu_seqlens=cu_seqlens,
        max_seqlen=max(lens),
        token_index=torch.tensor(tok_index, dtype=torch.long),
        token_targets=torch.tensor(tok_target, dtype=torch.long),
        token_seq=torch.tensor(tok_seq, dtype=torch.long),
        token_pos=torch.tensor(tok_pos, dtype=torch.long),
        response_len=torch.tensor(resp_len, dtype=torch.long),
        response_mask=response_mask,
        old_logprobs=old,
        advantages=adv,
        token_weights=weights,
    )


def _per_token_rows(values: Sequence[Sequence[float]], rows: Sequence[int], resp_len: Sequence[int], r_max: int
                    ) -> torch.Tensor:
    """``[n, r_max]`` float32 of the per-response-token ``values`` of ``rows``, zero-padded."""
    out = torch.zeros((len(rows), r_max), dtype=torch.float32)
    for k, i in enumerate(rows):
        if resp_len[k]:
            out[k, :resp_len[k]] = torch.tensor(values[i], dtype=torch.float32)
    return out


def microbatches(batch: PolicyBatch, rows: Sequence[int], max_tokens: int, packing: bool = True,
                 thd: bool = False, pad_id: int = 0, row_capacity: int | None = None) -> list[MicroBatch]:
    """Plan and build the micro-batches of ``rows`` of ``batch`` (the rows of each keep their batch indices)."""
    rows = list(rows)
    lengths = [len(batch.prompt_ids[i]) + len(batch.response_ids[i]) for i in rows]
    plan = plan_microbatches(lengths, max_tokens, packing=packing)
    return [build_microbatch(batch, [rows[k] for k in group], packing=packing, thd=thd, pad_id=pad_id,
                             row_capacity=row_capacity) for group in plan]
