"""Dynamic micro-batching by token budget and sequence packing: the tensors of one Megatron micro-batch.

Split out of :mod:`.batching`, which keeps the batch format (:class:`~.batching.PolicyBatch` / ``Ragged``) and the
data-parallel split; this module sits above it and its importers name it directly:

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

Sequence parallelism (``parallel.sequence_parallel``) splits every row's S positions over the TP ranks, so S must be
a multiple of TP: ``pad_to`` right-pads every row (dense and THD alike) with padding positions that attend only to
themselves, carry label 0 and score nothing (with THD the padding is one more segment of ``cu_seqlens``).

Every micro-batch also carries where each response token's log-prob comes from: the logit at position ``t`` predicts
token ``t + 1``, so response token ``j`` of a sequence starting at ``s`` with prompt length ``P`` is scored at position
``s + P - 1 + j``. Prompt tokens, padding and tokens of other sequences never enter the loss (``response_mask``).

Left out: context-parallel sharding of sequences (CP needs CUDA and is not wired here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from da3po_megatron.megatron.batching import PolicyBatch, Ragged


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
                     pad_id: int = 0, row_capacity: int | None = None, pad_to: int = 1) -> MicroBatch:
    """The tensors of one micro-batch holding ``rows`` of ``batch`` (see :class:`MicroBatch`).

    ``row_capacity`` (packing with a dense mask only): instead of one row, pack into several rows of at most
    ``max(row_capacity, longest sequence)`` tokens (0 = the longest sequence). Attention with a dense mask costs
    rows x row_length^2 instead of (all tokens)^2; the values are the same.
    ``pad_to``: the row length S is right-padded to a multiple of this (sequence parallelism: TP; module doc).
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
    if pad_to < 1:
        raise ValueError(f"build_microbatch: pad_to must be >= 1, got {pad_to}")
    s_len = -(-s_len // pad_to) * pad_to
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
    longest = max(lens)
    if thd:
        attention_mask = None
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        if cu[-1] < s_len:  # sequence-parallel padding: one more segment, scored by nothing
            cu.append(s_len)
        longest = max(b_ - a_ for a_, b_ in zip(cu, cu[1:]))
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
        max_seqlen=longest,
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
                 thd: bool = False, pad_id: int = 0, row_capacity: int | None = None, pad_to: int = 1
                 ) -> list[MicroBatch]:
    """Plan and build the micro-batches of ``rows`` of ``batch`` (the rows of each keep their batch indices; rows
    right-padded to a multiple of ``pad_to``, :func:`build_microbatch`)."""
    rows = list(rows)
    lengths = [len(batch.prompt_ids[i]) + len(batch.response_ids[i]) for i in rows]
    plan = plan_microbatches(lengths, max_tokens, packing=packing)
    return [build_microbatch(batch, [rows[k] for k in group], packing=packing, thd=thd, pad_id=pad_id,
                             row_capacity=row_capacity, pad_to=pad_to) for group in plan]
