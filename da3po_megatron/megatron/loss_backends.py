"""How the policy turns one micro-batch's model output into log-probs and the loss: three backends, one interface.

A :class:`LossBackend` answers, for the response tokens of a micro-batch (``MicroBatch.token_index`` picks the
positions whose output scores them, ``token_targets`` the tokens), two questions:

- :meth:`~LossBackend.logprobs`: vocab-parallel log pi(y_t) (differentiable) and the entropy (detached) of
  softmax(z / T), T the sampling temperature (the distribution the engines sampled from);
- :meth:`~LossBackend.fused_loss`: the token-level clipped surrogate (Eq. 5/11 on the advantages the trainer
  DAA-amplified, Eq. 14) summed over tokens (Eq. 9's numerator) in one fused pass -- only backends with ``fused`` set,
  and only for token-level ratios with token-mean aggregation (DAPO / DA3PO) and the built-in loss.

Backends are registered by name (:data:`LOSS_BACKENDS`, :func:`register_loss_backend`):

- ``"torch"``: Megatron's ``vocab_parallel_cross_entropy`` on float32 logits, the loss from
  :func:`da3po_megatron.algorithms.losses.policy_loss` (every aggregation);
- ``"kernel"``: :mod:`da3po_megatron.kernels` on the logits in the model's dtype (its own backend: auto | triton |
  chunked | reference), the fused DAA-loss kernel for the token-level losses;
- ``"fused_linear"``: the last stage's forward returns the final hidden states (:meth:`forward_context` swaps the
  output layer for a pass-through), and log-probs, entropy and loss come from
  :mod:`da3po_megatron.kernels.fused_linear` with this rank's output-weight shard: no ``[tokens x vocab]`` logits
  tensor at all. With sequence parallelism the final hidden states are sequence-sharded; the pass-through gathers them
  over the sequence first, as the output layer it replaces does (so every backend runs under SP: none is refused).

:func:`microbatch_loss` is what the Megatron schedule calls per micro-batch: the backend's fused loss or its log-probs
+ ``policy_loss`` (or a custom loss), normalised by the GLOBAL token / response count of the mini-batch, plus the
statistics the train step reports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from da3po_megatron.megatron.packing import MicroBatch


@dataclass(frozen=True)
class VocabShard:
    """Where this rank's logit columns sit: rank ``tp_rank`` of ``tp_size`` holds the padded-vocabulary columns
    ``[vocab_start, vocab_start + v_local)``; columns >= ``vocab`` are padding."""

    tp_rank: int
    tp_size: int
    tp_group: Any
    vocab: int
    padded_vocab: int

    @property
    def v_local(self) -> int:
        return self.padded_vocab // self.tp_size

    @property
    def vocab_start(self) -> int:
        return self.tp_rank * self.v_local


LOSS_BACKENDS: dict[str, type[LossBackend]] = {}


def register_loss_backend(name: str) -> Callable[[type[LossBackend]], type[LossBackend]]:
    """Class decorator: make a :class:`LossBackend` subclass available as ``actor.loss_backend`` ``name``."""

    def register(cls: type[LossBackend]) -> type[LossBackend]:
        cls.name = name
        LOSS_BACKENDS[name] = cls
        return cls

    return register


def make_loss_backend(name: str, gpt: torch.nn.Module, shard: VocabShard, temperature: float,
                      kernel_backend: str = "auto") -> LossBackend:
    """The backend registered as ``name`` for this rank's model stage ``gpt`` (the bare GPTModel)."""
    if name not in LOSS_BACKENDS:
        raise ValueError(f"loss backend must be one of {sorted(LOSS_BACKENDS)}, got {name!r}")
    return LOSS_BACKENDS[name](gpt, shard, temperature, kernel_backend)


class LossBackend:
    """One way of computing log-probs (and, with ``fused``, the token-level loss) from a micro-batch's output.

    ``output`` is what the last pipeline stage's forward returned: ``[B, S, V_local]`` logits, or the final hidden
    states ``[B, S, H]`` inside :meth:`forward_context` of a backend that swaps the output layer.
    """

    name: ClassVar[str] = ""
    fused: ClassVar[bool] = False  # has fused_loss

    def __init__(self, gpt: torch.nn.Module, shard: VocabShard, temperature: float, kernel_backend: str = "auto"):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 (the rollout's sampling temperature), got {temperature}")
        self.gpt, self.shard, self.temperature, self.kernel_backend = gpt, shard, temperature, kernel_backend
        self.ran: set[str] = set()  # what actually computed log-probs / losses since the caller last cleared it

    # the implementations :attr:`ran` can name (``PolicyWorker.train_step``'s "loss_backend" metric)
    IMPLEMENTATIONS: ClassVar[tuple[str, ...]] = ("torch", "fused_linear", "kernel:reference", "kernel:chunked",
                                                  "kernel:triton")

    def describe(self, device: torch.device) -> str:
        """What computes the loss here, "auto" resolved (``PolicyWorker.info()['loss_backend']``)."""
        return self.name

    @contextmanager
    def forward_context(self) -> Iterator[None]:
        """Around each forward of the model: nothing by default."""
        yield

    def logprobs(self, output: torch.Tensor, mb: MicroBatch, entropy: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[N]`` log-probs of the response tokens (differentiable) and their entropy (detached) or None."""
        raise NotImplementedError

    def fused_loss(self, output: torch.Tensor, mb: MicroBatch, inputs: Any) -> Any:
        """``kernels.LossOutputs`` of the micro-batch's response tokens for ``kernels.LossInputs`` ``inputs``."""
        raise NotImplementedError(f"loss backend {self.name!r} has no fused loss")

    def response_logits(self, output: torch.Tensor, mb: MicroBatch, float32: bool) -> torch.Tensor:
        """``[N, V_local]`` logits at the positions that score response tokens, divided by the sampling temperature,
        padded vocab columns masked.

        Everything after the gather works in place on its fresh tensor, so no second ``[N, V_local]`` tensor is made:
        under autograd that is exact, because neither the gather, the dtype copy, a division by a constant nor the
        fill needs its own output for its backward. The torch path asks for float32 (the copy Megatron's cross
        entropy would make anyway, made here so that the temperature divides float32 values, as vLLM's sampler
        does); the kernels get the model's dtype (they never upcast a whole ``[N, V]`` tensor), so with bf16 logits
        z / T is rounded to bf16 once more. The fill comes after the division: finfo.min / T would overflow to -inf
        for T < 1, and -inf turns the entropy's 0 * z into NaN.
        """
        flat = output.reshape(-1, output.shape[-1]).index_select(0, mb.token_index)
        if float32:
            flat = flat.float()
        if self.temperature != 1.0:
            flat.div_(self.temperature)
        s = self.shard
        if s.padded_vocab > s.vocab:
            v_local = output.shape[-1]
            cols = torch.arange(v_local, device=flat.device) + s.tp_rank * v_local
            flat.masked_fill_(cols >= s.vocab, torch.finfo(flat.dtype).min)
        return flat

    def logprob_inputs(self, mb: MicroBatch, entropy: bool) -> Any:
        """``kernels.LogprobInputs`` of the micro-batch's response tokens on this rank's vocab shard."""
        from da3po_megatron.kernels import LogprobInputs

        return LogprobInputs(mb.token_targets, self.shard.vocab_start, self.shard.tp_group, entropy)


@register_loss_backend("torch")
class TorchLossBackend(LossBackend):
    """Megatron's vocab-parallel cross entropy on float32 logits; the loss from ``algorithms.losses``."""

    def logprobs(self, output: torch.Tensor, mb: MicroBatch, entropy: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        self.ran.add("torch")
        logits = self.response_logits(output, mb, float32=True)
        ent = vocab_parallel_entropy(logits, self.shard.tp_group) if entropy else None
        # Megatron's cross entropy works in place on float32 logits: ``logits`` is the fresh float32 gather of
        # ``response_logits``, not used after
        return -vocab_parallel_cross_entropy(logits, mb.token_targets), ent


@register_loss_backend("kernel")
class KernelLossBackend(LossBackend):
    """:mod:`da3po_megatron.kernels` on the logits in the model's dtype (Triton on CUDA, chunked torch on CPU)."""

    fused = True

    def describe(self, device: torch.device) -> str:
        from da3po_megatron.kernels import resolve_backend

        return "kernel:" + resolve_backend(self.kernel_backend, torch.empty(0, device=device))

    def logprobs(self, output: torch.Tensor, mb: MicroBatch, entropy: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from da3po_megatron.kernels import vocab_parallel_logprobs

        logits = self.response_logits(output, mb, float32=False)
        lp, ent = vocab_parallel_logprobs(logits, self.logprob_inputs(mb, entropy), backend=self._resolve(logits))
        return lp, None if ent is None else ent.detach()

    def fused_loss(self, output: torch.Tensor, mb: MicroBatch, inputs: Any) -> Any:
        from da3po_megatron.kernels import daa_policy_loss

        logits = self.response_logits(output, mb, float32=False)
        return daa_policy_loss(logits, inputs, backend=self._resolve(logits))

    def _resolve(self, logits: torch.Tensor) -> str:
        """The kernel backend that runs on ``logits`` ("auto" resolved for their device), recorded in :attr:`ran`."""
        from da3po_megatron.kernels import resolve_backend

        name = resolve_backend(self.kernel_backend, logits)
        self.ran.add("kernel:" + name)
        return name


@register_loss_backend("fused_linear")
class FusedLinearLossBackend(LossBackend):
    """:mod:`da3po_megatron.kernels.fused_linear` from the final hidden states: no logits tensor exists."""

    fused = True

    @contextmanager
    def forward_context(self) -> Iterator[None]:
        """Make this forward of the last stage return the final hidden states.

        GPTModel's ``_postprocess`` ends in ``self.output_layer(hidden_states, weight=..., runtime_gather_output=...)``
        on the final-normed hidden states and returns its output transposed to [B, S, ...]; with the output layer
        swapped for :class:`_PassThroughOutputLayer` for the duration of the call, that output is the hidden states
        [B, S, H], laid out like the logits (the same ``token_index`` gathers them), and no logits are computed. The
        real layer is put back right after, so parameters, checkpoints and export never see the swap. Other stages:
        nothing changes.
        """
        gpt = self.gpt
        if not gpt.post_process:
            yield
            return
        layer = gpt.output_layer
        gpt.output_layer = _PassThroughOutputLayer(layer.weight, self._sequence_parallel())
        try:
            yield
        finally:
            gpt.output_layer = layer

    def output_layer(self) -> Any:
        """This rank's output-weight shard [V_local, H] as the fused-linear functions apply it
        (``kernels.OutputLayer``): divided by the sampling temperature, padded vocab columns left out.

        The weight is the one Megatron's output layer would use: with tied embeddings the word-embedding weight (or
        its last-stage copy when PP > 1), else the output layer's own. Without sequence parallelism the hidden states
        are replicated over the TP group and each rank's shard sees only its part of their gradient:
        ``reduce_hidden_grad`` sums it, what the output layer's ``copy_to_tensor_model_parallel_region`` does on the
        logits path. With it, the pass-through's gather already sums them in its backward (a reduce-scatter), as
        ``ColumnParallelLinear`` with ``sequence_parallel`` does instead of that copy (megatron-core 0.16.1
        ``tensor_parallel/layers.py`` ``ColumnParallelLinear.forward``), so no second sum here.
        """
        from da3po_megatron.kernels import OutputLayer

        gpt = self.gpt
        weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights \
            else gpt.output_layer.weight
        return OutputLayer(weight, temperature=self.temperature, vocab_limit=self.shard.vocab,
                           reduce_hidden_grad=not self._sequence_parallel())

    def _sequence_parallel(self) -> bool:
        return bool(getattr(self.gpt.config, "sequence_parallel", False)) and self.shard.tp_size > 1

    @staticmethod
    def response_hidden(output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """``[N, H]`` final hidden states at the positions that score response tokens."""
        return output.reshape(-1, output.shape[-1]).index_select(0, mb.token_index)

    def logprobs(self, output: torch.Tensor, mb: MicroBatch, entropy: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from da3po_megatron.kernels import fused_linear_vocab_parallel_logprobs

        self.ran.add("fused_linear")
        lp, ent = fused_linear_vocab_parallel_logprobs(self.response_hidden(output, mb), self.output_layer(),
                                                       self.logprob_inputs(mb, entropy))
        return lp, None if ent is None else ent.detach()

    def fused_loss(self, output: torch.Tensor, mb: MicroBatch, inputs: Any) -> Any:
        from da3po_megatron.kernels import fused_linear_daa_policy_loss

        self.ran.add("fused_linear")
        return fused_linear_daa_policy_loss(self.response_hidden(output, mb), self.output_layer(), inputs)


class _PassThroughOutputLayer(torch.nn.Module):
    """Stands in for GPTModel's ColumnParallelLinear ``output_layer`` (same call signature, same (output, bias)
    return): hands the final hidden states through, so that the fused_linear loss gets them instead of logits.

    It exposes the real layer's ``weight``, because ``GPTModel.shared_embedding_or_output_weight()`` reads
    ``output_layer.weight`` during the forward on a last pipeline stage with tied embeddings (PP > 1). With
    ``sequence_parallel`` it all-gathers the sequence-sharded [S / TP, b, H] hidden states over the TP group (backward:
    reduce-scatter), the step ``ColumnParallelLinear`` takes before its matmul under sequence parallelism
    (``gather_from_sequence_parallel_region(..., tensor_parallel_output_grad=True)``).
    """

    def __init__(self, weight: torch.Tensor | None, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.weight = weight
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=True)
        return hidden_states, None


def vocab_parallel_entropy(logits: torch.Tensor, tp_group, chunk: int = 4096) -> torch.Tensor:
    """Entropy of softmax over the TP-split vocabulary, ``[N, V_local]`` -> ``[N]`` (no gradient, chunked)."""
    out = []
    with torch.no_grad():
        for z in logits.split(chunk, dim=0):
            z = z.float()
            m = z.max(dim=-1).values
            if tp_group is not None and dist.get_world_size(tp_group) > 1:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
            e = torch.exp(z - m.unsqueeze(-1))
            s = torch.stack([e.sum(-1), (e * z).sum(-1)])
            if tp_group is not None and dist.get_world_size(tp_group) > 1:
                dist.all_reduce(s, group=tp_group)
            out.append(torch.log(s[0]) + m - s[1] / s[0])
    return torch.cat(out) if out else logits.new_zeros((0,), dtype=torch.float32)


def microbatch_loss(backend: LossBackend, p: dict[str, Any], mb: MicroBatch, output: torch.Tensor, *, entropy: bool,
                    num_microbatches: int, dp: int, global_tokens: torch.Tensor, global_seqs: torch.Tensor
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one micro-batch as Megatron's schedule wants it, and its statistics.

    ``p``: the resolved loss settings (``ratio_level``, ``loss_agg_mode``, ``clip_ratio_low/high``, optionally a
    custom ``policy_loss_fn``). The backend's fused loss runs for token-level ratios with token-mean aggregation and
    the built-in loss; otherwise its log-probs go to ``policy_loss`` (or the custom loss). Per-token weights
    (``MicroBatch.token_weights``, TIS) scale each token's advantage in both paths. The loss is normalised by the
    GLOBAL count of the mini-batch (response tokens, or responses, summed over DP ranks) so that the gradient does
    not depend on how the mini-batch is split (the contract in ``algorithms/losses.py``).

    Returns (loss, {"stats": [loss, clip-low count, clip-high count, k3-KL sum, entropy sum, token count]}).
    """
    from da3po_megatron.algorithms.losses import policy_loss

    custom = p.get("policy_loss_fn")
    n = mb.num_response_tokens
    device = mb.old_logprobs.device
    old_flat = mb.old_logprobs[mb.token_seq, mb.token_pos]
    if backend.fused and p["ratio_level"] == "token" and p["loss_agg_mode"] == "token-mean" and custom is None:
        from da3po_megatron.kernels import LossInputs

        adv_flat = mb.advantages[mb.token_seq]
        if mb.token_weights is not None:  # w > 0: w min(r A, clip(r) A) = min(r wA, clip(r) wA)
            adv_flat = adv_flat * mb.token_weights[mb.token_seq, mb.token_pos]
        inputs = LossInputs(
            mb.token_targets, vocab_start=backend.shard.vocab_start, tp_group=backend.shard.tp_group,
            compute_entropy=entropy, old_logprobs=old_flat, advantages=adv_flat, mask=torch.ones_like(old_flat),
            clip_ratio_low=p["clip_ratio_low"], clip_ratio_high=p["clip_ratio_high"])
        loss_sum, lp, ent, km = backend.fused_loss(output, mb, inputs)
        loss = loss_sum / global_tokens.clamp_min(1)
        clip_low, clip_high = km["clip_low_count"], km["clip_high_count"]
        ent = None if ent is None else ent.detach()
    else:
        lp, ent = backend.logprobs(output, mb, entropy)
        adv = mb.advantages if mb.token_weights is None else mb.advantages.unsqueeze(1) * mb.token_weights
        loss, m = (custom or policy_loss)(
            logprobs=mb.unflatten(lp), old_logprobs=mb.old_logprobs, advantages=adv, mask=mb.response_mask,
            clip_ratio_low=p["clip_ratio_low"], clip_ratio_high=p["clip_ratio_high"],
            ratio_level=p["ratio_level"], loss_agg_mode=p["loss_agg_mode"],
            global_num_tokens=global_tokens, global_num_seqs=global_seqs)
        clip_low, clip_high = m.get("clipfrac_low", 0.0) * n, m.get("clipfrac_high", 0.0) * n
    lp = lp.detach()
    if n == 0:  # no response token: keep the graph connected for Megatron's backward
        loss = loss + 0.0 * output.sum()
    with torch.no_grad():
        log_ratio = (lp.float() - old_flat).clamp(-20.0, 20.0)
        kl_sum = ((log_ratio.exp() - 1.0) - log_ratio).sum()  # Schulman's k3 estimator of KL(pi_old||pi)
        stats = torch.stack([
            loss.detach().float().reshape(()),
            torch.as_tensor(clip_low, dtype=torch.float32, device=device).reshape(()),
            torch.as_tensor(clip_high, dtype=torch.float32, device=device).reshape(()),
            kl_sum.float(),
            ent.float().sum() if ent is not None else torch.zeros((), device=device),
            torch.tensor(float(n), device=device),
        ])
    # Megatron divides a 2-tuple loss by num_microbatches and DDP averages gradients over DP: undo both so the
    # summed gradient is that of the globally normalised mini-batch loss (losses.py's contract)
    return loss * num_microbatches * dp, {"stats": stats}
