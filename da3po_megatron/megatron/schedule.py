"""The policy's forward schedule: micro-batches of this rank's data-parallel shard through Megatron's pipeline schedule.

:class:`ForwardSchedule` holds where this rank sits (DP / TP rank, device, attention layout) and runs
``get_forward_backward_func`` (1F1B over the pipeline stages, or a plain loop without PP) on micro-batches built by
:mod:`.batching`: packed sequences with a block-diagonal mask on the local layer spec, one THD row described by
``cu_seqlens`` with Transformer Engine (``thd``), or padded rows. Each micro-batch's forward runs inside the loss
backend's ``forward_context`` (the fused-linear backend swaps the output layer there), and the schedule hands the last
stage's output to a per-micro-batch callback: the loss (:func:`.loss_backends.microbatch_loss`) when training, the
log-prob collection of :meth:`ForwardSchedule.logprobs` forward-only.

:meth:`ForwardSchedule.logprobs` is ``compute_logprobs``: log pi(o_t | q, o_<t) of every response token, responses
sharded over DP ranks (token-balanced), values gathered back in batch order with one all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from da3po_megatron.megatron.batching import PolicyBatch, Ragged, balance_across_dp
from da3po_megatron.megatron.loss_backends import LossBackend
from da3po_megatron.megatron.packing import MicroBatch, microbatches


@dataclass
class ForwardSchedule:
    """Megatron's schedule for this rank. ``model``: the DDP-wrapped model stage; ``te``: Transformer-Engine layer
    spec (causal attention by type); ``thd``: packed micro-batches as one THD row (TE + packing)."""

    model: Any
    device: torch.device
    te: bool
    thd: bool
    pad_id: int
    dp: int
    dp_rank: int
    tp_rank: int
    moe_columns: list[int] | None = None
    """MoE with route handling (``model.routes_wanted``): this stage's columns of the engines' route arrays
    (``moe.stage_moe_columns``); None: micro-batches' routes are ignored (dense model, or routes off)."""
    moe_layers: int = 0
    """All the model's MoE layers (the route counts are kept per layer: ``moe.route_counts``)."""
    replay: bool = False
    """``moe.routing_replay=rollout``: the forwards use the engine's routes (R3), else they only compare."""
    tp: int = 1
    sequence_parallel: bool = False
    """``parallel.sequence_parallel`` (with TP > 1): rows are padded to a multiple of TP, and each TP rank's routers
    see (and get the routes of) only its 1/TP of every micro-batch's positions (:meth:`tp_slice`)."""

    def __post_init__(self) -> None:
        # moe.route_counts summed since the last take, on the device: read once per step (routing_stats), not per
        # micro-batch (issue 46 M6)
        self.route_counts = self._zero_counts()

    def _zero_counts(self) -> torch.Tensor:
        return torch.zeros((1 + self.moe_layers, 3), dtype=torch.float64, device=self.device)

    def take_route_counts(self) -> torch.Tensor:
        """The route counts summed since the last call, this rank's share of a sum over the world: with sequence
        parallelism each TP rank counts its own slice of the positions (summed over TP), without it TP ranks route
        every position alike and TP rank 0 alone counts."""
        out, self.route_counts = self.route_counts, self._zero_counts()
        return out if self.sequence_parallel or self.tp_rank == 0 else torch.zeros_like(out)

    def tp_slice(self, n: int) -> slice:
        """This TP rank's part of a micro-batch's ``n`` router tokens (s-major, ``MicroBatch.routes``): with sequence
        parallelism the decoder runs on positions ``[r S / TP, (r + 1) S / TP)`` of every row (megatron-core's
        ``scatter_to_sequence_parallel_region`` splits dim 0 of [S, b, H]: ``tensor_parallel/mappings.py``
        ``_split_along_first_dim``), i.e. the contiguous flat range ``[r n / TP, (r + 1) n / TP)``; all of them
        without."""
        if not self.sequence_parallel:
            return slice(0, n)
        if n % self.tp:
            raise ValueError(f"a micro-batch of {n} router tokens cannot be split over {self.tp} TP ranks (rows must "
                             "be padded to a multiple of TP: packing.build_microbatch pad_to)")
        k = n // self.tp
        return slice(self.tp_rank * k, (self.tp_rank + 1) * k)

    def dp_shard(self, batch: PolicyBatch, rows: Sequence[int] | None = None) -> list[int]:
        """This DP rank's responses among ``rows`` (all of the batch by default), token-balanced over DP ranks."""
        rows = list(range(len(batch))) if rows is None else list(rows)
        lengths = batch.lengths()
        return [rows[k] for k in balance_across_dp([lengths[i] for i in rows], self.dp)[self.dp_rank]]

    def microbatches(self, batch: PolicyBatch, rows: Sequence[int], max_tokens: int, packing: bool
                     ) -> list[MicroBatch]:
        """Micro-batches of ``rows`` within the token budget (THD rows only with TE and packing)."""
        thd = self.thd and packing
        return microbatches(batch, rows, max_tokens, packing=packing, thd=thd, pad_id=self.pad_id,
                            row_capacity=None if thd else 0, pad_to=self.tp if self.sequence_parallel else 1)

    def run(self, mbs: list[MicroBatch], loss_builder: Callable, backend: LossBackend, forward_only: bool) -> list:
        """Forward (and backward unless ``forward_only``) of every micro-batch; ``loss_builder(mb, output)`` is called
        on the last stage. Returns what Megatron's schedule returns (the per-micro-batch loss dicts on the last stage).
        """
        from megatron.core.packed_seq_params import PackedSeqParams
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            mb = next(data_iterator).to(self.device)
            kwargs = {}
            mask = mb.attention_mask
            if mb.cu_seqlens is not None:
                kwargs["packed_seq_params"] = PackedSeqParams(
                    qkv_format="thd", cu_seqlens_q=mb.cu_seqlens, cu_seqlens_kv=mb.cu_seqlens,
                    max_seqlen_q=mb.max_seqlen, max_seqlen_kv=mb.max_seqlen)
            elif self.te:
                mask = None  # TE attention is causal by type; right-padded rows need nothing more
            routed = mb.routes is not None and bool(self.moe_columns)
            if routed:  # R3 replay, or only the router-agreement count (megatron/moe.py)
                from da3po_megatron.megatron import moe

                part = self.tp_slice(mb.routes.shape[0])
                moe.use_routes(model, mb.routes[part, self.moe_columns, :], mb.route_mask[part], self.replay)
            with backend.forward_context():
                output = model(mb.tokens, mb.position_ids, mask, **kwargs)
            if routed:
                self.route_counts += moe.route_counts(model, self.replay, self.moe_columns,
                                                      self.moe_layers).to(self.device)
            return output, partial(loss_builder, mb)

        fb = get_forward_backward_func()
        return fb(
            forward_step_func=forward_step,
            data_iterator=iter(mbs),
            model=[self.model],
            num_microbatches=len(mbs),
            seq_length=max(mb.tokens.shape[1] for mb in mbs),
            micro_batch_size=max(mb.tokens.shape[0] for mb in mbs),
            forward_only=forward_only,
            collect_non_loss_data=forward_only,
        )

    def logprobs(self, batch: PolicyBatch, backend: LossBackend, *, max_tokens: int, packing: bool,
                 return_entropy: bool = False, as_arrays: bool = False) -> Any:
        """Per-token log-probs of each response given its prompt (and entropies with ``return_entropy``); collective,
        the same result on every rank: lists of floats, or with ``as_arrays`` one float32 :class:`Ragged` (what the
        driver's :class:`PolicyGroup` asks for). ``batch`` may be this rank's share (:meth:`PolicyBatch.share`)."""
        lens = batch.response_lengths()
        offsets = [0] + np.cumsum(lens).tolist()
        total = offsets[-1]
        out_lp = torch.zeros(total, dtype=torch.float32, device=self.device)
        out_ent = torch.zeros(total if return_entropy else 0, dtype=torch.float32, device=self.device)
        shard = self.dp_shard(batch)
        mbs = self.microbatches(batch, shard, max_tokens, packing) if shard else []

        def collect(mb: MicroBatch, output: torch.Tensor, non_loss_data: bool = False):
            lp, ent = backend.logprobs(output, mb, return_entropy)
            if self.tp_rank == 0:
                dest = torch.tensor([offsets[mb.rows[s]] for s in mb.token_seq.tolist()], dtype=torch.long,
                                    device=self.device) + mb.token_pos
                out_lp[dest] = lp.float()
                if ent is not None:
                    out_ent[dest] = ent.float()
            return None

        self.model.eval()
        with torch.no_grad():
            if mbs:
                self.run(mbs, collect, backend, forward_only=True)
        # exactly one rank (last stage, TP rank 0 of the owning DP rank) holds each value: the sum is exact
        packed = torch.cat([out_lp, out_ent])
        dist.all_reduce(packed)
        if as_arrays:
            flat = packed.cpu().numpy()
            lp = Ragged(flat[:total].copy(), np.asarray(offsets, dtype=np.int64))
            return (lp, Ragged(flat[total:].copy(), lp.offsets)) if return_entropy else lp
        lps = packed[:total].tolist()
        result = [lps[offsets[i]:offsets[i + 1]] for i in range(len(batch))]
        if not return_entropy:
            return result
        ents = packed[total:].tolist()
        return result, [ents[offsets[i]:offsets[i + 1]] for i in range(len(batch))]
