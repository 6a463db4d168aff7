"""The megatron-core policy actor: log-probs, the DA3PO train step, Megatron DDP + distributed optimizer, checkpoints.

:class:`PolicyWorker` is one rank of the training world. It is a plain class: a ``torchrun`` process builds one
directly, :mod:`da3po_megatron.megatron.actor_group` wraps one per rank in a Ray actor. Every public method is
collective (called on ALL ranks in lock-step with the same arguments) and returns the same result on every rank; the
driver reads rank 0's.

What it implements (paper equations as in DESIGN.md):

- ``compute_logprobs``: log pi(o_t | q, o_<t) of every response token, forward-only through Megatron's pipeline
  schedule, vocab-parallel (logits stay split over TP ranks: Megatron's ``vocab_parallel_cross_entropy`` or the
  project's fused kernel); responses are sharded over DP ranks and the results gathered back in batch order.
- Sampling temperature (``rollout.temperature``): pi is softmax(z / T), the
  distribution the engines sample from, in log-probs, entropy and loss alike (as verl and slime do); otherwise the
  ratio pi_theta / pi_old and the rollout-vs-policy comparison would score a distribution nobody sampled from.
- ``train_step``: one RL update, the clipped surrogate of Eq. 5/11 with the algorithm's aggregation (GRPO Eq. 4,
  DAPO / DA3PO token-level Eq. 9, GSPO sequence ratio; :func:`da3po_megatron.algorithms.losses.policy_loss`, or the
  fused DAA-loss kernel for the token-level losses). DAA (Eq. 14) is applied by the trainer to the advantages it
  sends; the policy does not amplify again. Optional per-token weights (``PolicyBatch.token_weights``, the TIS
  correction of ``algorithms.rollout_correction``) scale each token's advantage, in both loss paths. The batch is
  split into ``ppo_mini_batch_size`` mini-batches (one optimizer step each, ``ppo_epochs`` passes), each mini-batch
  over DP ranks (token-balanced) and into micro-batches by token budget (packed sequences, :mod:`.batching`). The
  loss uses the GLOBAL normaliser of the mini-batch (its response tokens, or responses, summed over DP ranks first),
  so the gradient does not depend on how the mini-batch is split (the contract in ``losses.py``; verl's
  ``global_batch_info``, NeMo-RL's ``global_valid_toks``).
- Megatron ``DistributedDataParallel`` (fp32 gradient reduction) + ``get_megatron_optimizer`` (Adam, distributed
  optimizer; bf16 params with fp32 master weights on GPU, fp32 on CPU), gradient clipping by global norm.
- LR schedule: Megatron's ``OptimizerParamScheduler``, stepped once per optimizer step (as Megatron-LM does), just
  BEFORE it: optimizer step k (1-based) uses lr * k / warmup during warmup, then constant or cosine decay to
  ``min_lr`` at ``total_steps``. Weight decay is constant (Megatron's ``wd_mult`` keeps it off biases and norms).
- ``save`` / ``load``: :mod:`.checkpoint` (model resharding-safe across TP/PP; optimizer at the same TP x PP).
- No HF names here: HF weights go in and out through the bridge (``da3po_megatron.bridge.export``: ``load_policy_hf``,
  ``export_policy``), which the trainer, the weight sync and tests run on every rank with :meth:`PolicyWorker.execute`.
- Fused linear loss (``actor.loss_backend = "fused_linear"``): the last stage runs GPTModel with its output layer
  swapped for a pass-through, so the forward returns the final hidden states (after the final norm) instead of
  logits, and log-probs, entropy and loss come from :mod:`da3po_megatron.kernels.fused_linear` with this rank's
  output-weight shard: no ``[tokens x vocab]`` logits tensor exists at all, at the price of one more matmul per
  chunk in backward. Not with sequence parallelism (the hidden states are sequence-sharded there).

Left out: context parallelism (refused by config validation: sequences are not split across CP ranks), virtual
pipeline stages, KL-to-reference and entropy bonus terms (DAPO / DA3PO use neither), dual-clip PPO.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from da3po_megatron.config import AlgorithmConfig, Config, to_dict
from da3po_megatron.megatron import cpu_compat
from da3po_megatron.megatron.batching import MicroBatch, PolicyBatch, balance_across_dp, microbatches
from da3po_megatron.megatron.model import (
    build_gpt_model,
    load_hf_config,
    transformer_config,
    use_te,
    vocab_sizes,
)
from da3po_megatron.megatron.runtime import ParallelLayout, free_port, init_parallel, node_ip

log = logging.getLogger(__name__)

KERNEL_BACKENDS = ("auto", "triton", "chunked", "reference")  # actor.loss_backend values that mean the kernel


def loss_setup(cfg: Config) -> dict[str, Any]:
    """What the loss code reads, derived from the run config (nothing here has a default of its own).

    The resolved algorithm fields (``ratio_level``, ``loss_agg_mode``, ``clip_ratio_low/high``; the registry filled
    them at load), the custom loss ``algorithm.policy_loss_fn`` imported (None = ``losses.policy_loss``), and which
    implementation computes log-probs and loss from ``actor.loss_backend``: "torch" (Megatron's vocab-parallel cross
    entropy + ``losses.policy_loss``), "fused_linear" (from the final hidden states, no logits tensor), otherwise
    "kernel" with that kernel backend (auto | triton | chunked | reference). ``rollout.temperature`` divides every
    logit (the distribution the engines sampled from); ``actor.entropy`` turns the entropy metric on.
    """
    from da3po_megatron.algorithms.registry import POLICY_LOSS_FN_ARGS, load_function

    a, b = cfg.algorithm, cfg.actor.loss_backend
    unset = [k for k in ("ratio_level", "loss_agg_mode", "clip_ratio_low", "clip_ratio_high") if getattr(a, k) is None]
    if unset:
        raise ValueError(f"algorithm.{', algorithm.'.join(unset)} unset: resolve the run config first "
                         "(da3po_megatron.config.load_config or resolve)")
    if not cfg.rollout.temperature > 0:
        raise ValueError(f"rollout.temperature must be > 0 (the sampling temperature), got {cfg.rollout.temperature}")
    backend = b if b in ("torch", "fused_linear") else "kernel"
    if backend == "kernel" and b not in KERNEL_BACKENDS:
        raise ValueError(f"actor.loss_backend={b!r} is not one of torch, fused_linear, {', '.join(KERNEL_BACKENDS)}")
    fn = load_function(a.policy_loss_fn, POLICY_LOSS_FN_ARGS, "algorithm.policy_loss_fn") if a.policy_loss_fn else None
    return dict(algorithm=a.name, ratio_level=a.ratio_level, loss_agg_mode=a.loss_agg_mode,
                clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high, policy_loss_fn=fn,
                backend=backend, kernel_backend=b if backend == "kernel" else "auto",
                temperature=cfg.rollout.temperature, entropy=cfg.actor.entropy)


def layout_of(cfg: Config) -> ParallelLayout:
    """The process-group layout of ``cfg.parallel`` (DP follows from the world size)."""
    p = cfg.parallel
    return ParallelLayout(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size)


def validate_config(cfg: Config, world_size: int) -> None:
    """Check the run config against the world and the model before any process group exists.

    Raises ValueError naming the numbers: a world that is not ``cfg.policy_world_size``; world not divisible by
    TP x PP (x CP), heads / KV heads not divisible by TP, layers not divisible by PP; an invalid loss set-up.
    """
    layout = layout_of(cfg)
    layout.validate(world_size)
    hf = load_hf_config(cfg.model.path)
    tconf = transformer_config(hf, cfg.model, layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size,
                               layout.context_parallel_size)
    if world_size != cfg.policy_world_size:
        p = cfg.parallel
        raise ValueError(f"world size {world_size} != parallel.tensor_model_parallel_size "
                         f"({p.tensor_model_parallel_size}) x pipeline_model_parallel_size "
                         f"({p.pipeline_model_parallel_size}) x context_parallel_size ({p.context_parallel_size}) x "
                         f"data_parallel_size ({p.data_parallel_size}) = {cfg.policy_world_size}")
    setup = loss_setup(cfg)
    if setup["backend"] == "fused_linear" and tconf.sequence_parallel:
        raise ValueError("actor.loss_backend='fused_linear' does not support sequence_parallel=True: the final hidden "
                         "states are sharded over the sequence there; use a kernel backend or 'torch'")


class PolicyWorker:
    """One rank of the policy world, configured by the run config's own sections (``da3po_megatron.config.Config``):
    ``model``, ``parallel``, ``optim``, ``actor``, the resolved ``algorithm`` fields, ``rollout.temperature`` /
    ``rollout.n`` and ``trainer.seed``. Use ``PolicyWorker().init(cfg, rank=..., ...)`` or
    ``PolicyWorker(cfg, ...)``."""

    def __init__(self, cfg: Config | None = None, **init_kwargs: Any) -> None:
        self.cfg: Config | None = None
        self.step = 0
        if cfg is not None:
            self.init(cfg, **init_kwargs)

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def rendezvous_address() -> tuple[str, int]:
        """(address, port) for the world's rendezvous, as seen from other nodes; called on rank 0's host."""
        return node_ip(), free_port()

    def init(self, cfg: Config, *, rank: int | None = None, world_size: int | None = None,
             master_addr: str | None = None, master_port: int | None = None) -> dict[str, Any]:
        """Join the world, build the model stage (randomly initialised: the HF weights come through the bridge's
        ``load_policy_hf``), wrap in DDP, build optimizer and LR schedule."""
        import os

        from megatron.core import parallel_state as ps
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        validate_config(cfg, world_size)
        self.cfg = cfg
        self.loss_params = loss_setup(cfg)
        init_parallel(layout_of(cfg), rank=rank, world_size=world_size, master_addr=master_addr,
                      master_port=master_port, seed=cfg.trainer.seed)
        self.hf = load_hf_config(cfg.model.path)
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.dp = ps.get_data_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.is_last_stage = ps.is_pipeline_last_stage()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
        self.vocab, self.padded_vocab = vocab_sizes(self.hf, self.tp, cfg.model.make_vocab_size_divisible_by)
        self.te = use_te(cfg.model)
        self.thd = self.te and cfg.actor.packing
        pad = self.hf.get("pad_token_id")
        self.pad_id = int(pad) if isinstance(pad, int) else 0

        model = self._gpt = build_gpt_model(self.hf, cfg.model)
        dtype = model.config.params_dtype
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=cfg.optim.use_distributed_optimizer,
        )
        self.model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
        o = cfg.optim
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2,
            adam_eps=o.adam_eps,
            clip_grad=o.clip_grad,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            use_distributed_optimizer=o.use_distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(opt_config, [self.model])
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if o.lr_warmup_steps > 0 else o.lr,
            max_lr=o.lr,
            min_lr=o.min_lr,
            lr_warmup_steps=o.lr_warmup_steps,
            lr_decay_steps=cfg.optimizer_steps,
            lr_decay_style=o.lr_schedule,
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=cfg.optimizer_steps,
            wd_incr_style="constant",
        )
        config = model.config
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = self.model.no_sync
        config.grad_scale_func = self.optimizer.scale_loss
        self.step = 0
        return self.info()

    def execute(self, fn, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(self, *args, **kwargs)`` on this rank (how a Ray driver runs e.g. the weight-sync push).

        Collective when ``fn`` is (e.g. the bridge's ``export_policy``, whose TP gathers are collective).
        """
        cpu_compat.apply_if_needed()  # Ray may run actor methods on another thread than init's
        return fn(self, *args, **kwargs)

    def set_loss(self, algorithm: AlgorithmConfig | None = None, loss_backend: str | None = None,
                 temperature: float | None = None) -> None:
        """Switch the policy loss between steps, e.g. for ablations: a resolved ``algorithm`` section (see
        ``config.algorithm_config``), ``actor.loss_backend``, ``rollout.temperature``; None keeps the current one."""
        cfg = self.cfg
        if algorithm is not None:
            cfg = replace(cfg, algorithm=algorithm)
        if loss_backend is not None:
            cfg = replace(cfg, actor=replace(cfg.actor, loss_backend=loss_backend))
        if temperature is not None:
            cfg = replace(cfg, rollout=replace(cfg.rollout, temperature=temperature))
        self.loss_params = loss_setup(cfg)
        self.cfg = cfg

    def info(self) -> dict[str, Any]:
        """Where this rank sits and what it holds."""
        n_params = sum(p.numel() for p in self._bare.parameters())
        return {
            "rank": dist.get_rank(), "world_size": dist.get_world_size(), "tp_rank": self.tp_rank,
            "pp_rank": self.pp_rank, "dp_rank": self.dp_rank, "tp": self.tp, "pp": self.pp, "dp": self.dp,
            "local_params": n_params, "vocab_size": self.vocab, "padded_vocab_size": self.padded_vocab,
            "device": str(self.device), "thd": self.thd, "step": self.step,
            "loss_backend": self.loss_backend_name(),
        }

    def loss_backend_name(self) -> str:
        """What computes the policy loss here, with "auto" resolved: e.g. "kernel:triton" on a GPU where the Triton
        kernels compile, "kernel:chunked" on CPU, "torch" (Megatron's vocab-parallel cross-entropy + algorithms/),
        "fused_linear" (kernels/fused_linear.py from the final hidden states)."""
        backend = self.loss_params["backend"]
        if backend != "kernel":
            return backend
        from da3po_megatron.kernels import resolve_backend

        return "kernel:" + resolve_backend(self.loss_params["kernel_backend"], torch.empty(0, device=self.device))

    @property
    def _bare(self) -> torch.nn.Module:
        """This rank's GPTModel stage, without the DDP wrapper."""
        return self._gpt

    # ------------------------------------------------------------------ the Megatron schedule
    def _run_schedule(self, mbs: list[MicroBatch], loss_builder, forward_only: bool) -> list:
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
            with self._final_hidden_states_as_output():
                output = model(mb.tokens, mb.position_ids, mask, **kwargs)
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

    @contextmanager
    def _final_hidden_states_as_output(self) -> Iterator[None]:
        """With the fused_linear loss, make this forward of the last stage return the final hidden states.

        GPTModel's ``_postprocess`` ends in ``self.output_layer(hidden_states, weight=..., runtime_gather_output=...)``
        on the final-normed hidden states and returns its output transposed to [B, S, ...]; with the output layer
        swapped for :class:`_PassThroughOutputLayer` for the duration of the call, that output is the hidden states
        [B, S, H], laid out like the logits (the same ``token_index`` gathers them), and no logits are computed. The
        real layer is put back right after, so parameters, checkpoints and export never see the swap. Other stages
        and backends: nothing changes.
        """
        gpt = self._gpt
        if self.loss_params["backend"] != "fused_linear" or not gpt.post_process:
            yield
            return
        layer = gpt.output_layer
        gpt.output_layer = _PassThroughOutputLayer(layer.weight)
        try:
            yield
        finally:
            gpt.output_layer = layer

    def _output_weight(self) -> torch.Tensor:
        """This rank's output-weight shard [V_local, H], the weight Megatron's output layer would use: with tied
        embeddings the word-embedding weight (or its last-stage copy when PP > 1), else the output layer's own."""
        gpt = self._gpt
        if gpt.share_embeddings_and_output_weights:
            return gpt.shared_embedding_or_output_weight()
        return gpt.output_layer.weight

    def _fused_linear_args(self, weight: torch.Tensor) -> dict[str, Any]:
        """The vocab-parallel arguments of the fused-linear functions for this rank's output-weight shard.

        The hidden states are replicated over the TP group (no sequence parallelism) and each rank's shard sees only
        its part of their gradient: ``reduce_hidden_grad`` sums it, what the output layer's
        ``copy_to_tensor_model_parallel_region`` does on the logits path.
        """
        return dict(vocab_start=self.tp_rank * weight.shape[0], tp_group=self.tp_group,
                    temperature=self.loss_params["temperature"], vocab_limit=self.vocab, reduce_hidden_grad=True)

    @staticmethod
    def _response_hidden(output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """``[N, H]`` final hidden states at the positions that score response tokens (fused_linear backend)."""
        return output.reshape(-1, output.shape[-1]).index_select(0, mb.token_index)

    def _token_logprobs(self, output: torch.Tensor, mb: MicroBatch, entropy: bool
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (differentiable) and entropy (detached) of the response tokens of one micro-batch's output."""
        if self.loss_params["backend"] != "fused_linear":
            return self._logprobs(self._response_logits(output, mb), mb.token_targets, entropy)
        from da3po_megatron.kernels import fused_linear_vocab_parallel_logprobs

        weight = self._output_weight()
        lp, ent = fused_linear_vocab_parallel_logprobs(self._response_hidden(output, mb), weight, mb.token_targets,
                                                       compute_entropy=entropy, **self._fused_linear_args(weight))
        return lp, None if ent is None else ent.detach()

    def _response_logits(self, output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """``[N, V_local]`` logits at the positions that score response tokens, divided by the sampling temperature,
        padded vocab columns masked.

        Everything after the gather works in place on its fresh tensor, so no second ``[N, V_local]`` tensor is made:
        under autograd that is exact, because neither the gather, the dtype copy, a division by a constant nor the
        fill needs its own output for its backward. The torch loss path gets float32 (the copy Megatron's cross
        entropy would make anyway, made here so that the temperature divides float32 values, as vLLM's sampler
        does); the kernels get the model's dtype (they never upcast a whole ``[N, V]`` tensor), so with bf16 logits
        z / T is rounded to bf16 once more. The fill comes after the division: finfo.min / T would overflow to -inf
        for T < 1, and -inf turns the entropy's 0 * z into NaN.
        """
        flat = output.reshape(-1, output.shape[-1]).index_select(0, mb.token_index)
        if self.loss_params["backend"] == "torch":
            flat = flat.float()
        t = self.loss_params["temperature"]
        if t != 1.0:
            flat.div_(t)
        if self.padded_vocab > self.vocab:
            v_local = output.shape[-1]
            cols = torch.arange(v_local, device=flat.device) + self.tp_rank * v_local
            flat.masked_fill_(cols >= self.vocab, torch.finfo(flat.dtype).min)
        return flat

    def _logprobs(self, logits: torch.Tensor, targets: torch.Tensor, entropy: bool
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Vocab-parallel log-probs (differentiable) and entropy (detached) of ``[N, V_local]`` logits."""
        if self.loss_params["backend"] == "kernel":
            from da3po_megatron.kernels import vocab_parallel_logprobs

            lp, ent = vocab_parallel_logprobs(logits, targets, self.tp_rank * logits.shape[-1], self.tp_group,
                                              compute_entropy=entropy, backend=self.loss_params["kernel_backend"])
            return lp, None if ent is None else ent.detach()
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        ent = _vocab_parallel_entropy(logits, self.tp_group) if entropy else None
        # Megatron's cross entropy works in place on float32 logits: ``logits`` is the fresh float32 gather of
        # ``_response_logits``, not used after
        lp = -vocab_parallel_cross_entropy(logits, targets)
        return lp, ent

    # ------------------------------------------------------------------ log-probs
    def compute_logprobs(self, batch: PolicyBatch, return_entropy: bool = False, packing: bool | None = None
                         ) -> list[list[float]] | tuple[list[list[float]], list[list[float]]]:
        """Per-token log-probs of each response given its prompt (and entropies with ``return_entropy``).

        ``packing`` overrides ``actor.packing`` for this call (packed and padded give the same values).
        """
        cpu_compat.apply_if_needed()
        a = self.cfg.actor
        packing = a.packing if packing is None else packing
        budget = a.logprob_max_tokens_per_microbatch or 2 * a.max_tokens_per_microbatch
        offsets = [0]
        for r in batch.response_ids:
            offsets.append(offsets[-1] + len(r))
        total = offsets[-1]
        out_lp = torch.zeros(total, dtype=torch.float32, device=self.device)
        out_ent = torch.zeros(total if return_entropy else 0, dtype=torch.float32, device=self.device)
        shard = balance_across_dp(batch.lengths(), self.dp)[self.dp_rank]
        thd = self.thd and packing
        mbs = microbatches(batch, shard, budget, packing=packing, thd=thd, pad_id=self.pad_id,
                           row_capacity=None if thd else 0) if shard else []

        def collect(mb: MicroBatch, output: torch.Tensor, non_loss_data: bool = False):
            lp, ent = self._token_logprobs(output, mb, return_entropy)
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
                self._run_schedule(mbs, collect, forward_only=True)
        # exactly one rank (last stage, TP rank 0 of the owning DP rank) holds each value: the sum is exact
        packed = torch.cat([out_lp, out_ent])
        dist.all_reduce(packed)
        lps = packed[:total].tolist()
        result = [lps[offsets[i]:offsets[i + 1]] for i in range(len(batch))]
        if not return_entropy:
            return result
        ents = packed[total:].tolist()
        return result, [ents[offsets[i]:offsets[i + 1]] for i in range(len(batch))]

    # ------------------------------------------------------------------ training
    def _loss(self, mb: MicroBatch, output: torch.Tensor, *, num_microbatches: int, global_tokens: torch.Tensor,
              global_seqs: torch.Tensor):
        from da3po_megatron.algorithms.losses import policy_loss

        p = self.loss_params
        entropy = self.loss_params["entropy"]
        backend = self.loss_params["backend"]
        n = mb.num_response_tokens
        old_flat = mb.old_logprobs[mb.token_seq, mb.token_pos]
        fused = backend != "torch" and p["ratio_level"] == "token" and p["loss_agg_mode"] == "token-mean" and \
            p["policy_loss_fn"] is None
        if fused:
            from da3po_megatron.kernels import daa_policy_loss, fused_linear_daa_policy_loss

            adv_flat = mb.advantages[mb.token_seq]
            if mb.token_weights is not None:  # w > 0: w min(r A, clip(r) A) = min(r wA, clip(r) wA)
                adv_flat = adv_flat * mb.token_weights[mb.token_seq, mb.token_pos]
            common = dict(clip_ratio_low=p["clip_ratio_low"], clip_ratio_high=p["clip_ratio_high"],
                          compute_entropy=entropy)
            if backend == "fused_linear":
                weight = self._output_weight()
                loss_sum, lp, ent, km = fused_linear_daa_policy_loss(
                    self._response_hidden(output, mb), weight, mb.token_targets, old_flat, adv_flat,
                    torch.ones_like(old_flat), **common, **self._fused_linear_args(weight))
            else:
                logits = self._response_logits(output, mb)
                loss_sum, lp, ent, km = daa_policy_loss(
                    logits, mb.token_targets, old_flat, adv_flat, torch.ones_like(old_flat), **common,
                    vocab_start=self.tp_rank * logits.shape[-1], tp_group=self.tp_group,
                    backend=self.loss_params["kernel_backend"])
            loss = loss_sum / global_tokens.clamp_min(1)
            clip_low, clip_high = km["clip_low_count"], km["clip_high_count"]
            lp = lp.detach()
            ent = None if ent is None else ent.detach()
        else:
            lp, ent = self._token_logprobs(output, mb, entropy)
            adv = mb.advantages if mb.token_weights is None else mb.advantages.unsqueeze(1) * mb.token_weights
            loss, m = (p["policy_loss_fn"] or policy_loss)(
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
                torch.as_tensor(clip_low, dtype=torch.float32, device=self.device).reshape(()),
                torch.as_tensor(clip_high, dtype=torch.float32, device=self.device).reshape(()),
                kl_sum.float(),
                ent.float().sum() if ent is not None else torch.zeros((), device=self.device),
                torch.tensor(float(n), device=self.device),
            ])
        # Megatron divides a 2-tuple loss by num_microbatches and DDP averages gradients over DP: undo both so the
        # summed gradient is that of the globally normalised mini-batch loss (losses.py's contract)
        return loss * num_microbatches * self.dp, {"stats": stats}

    def train_step(self, batch: PolicyBatch) -> dict[str, float]:
        """One RL update on ``batch`` (mini-batches x epochs optimizer steps); returns metrics (same on all ranks)."""
        cpu_compat.apply_if_needed()
        if batch.old_logprobs is None or batch.advantages is None:
            raise ValueError("train_step needs PolicyBatch.old_logprobs and PolicyBatch.advantages")
        if batch.token_weights is not None and self.loss_params["ratio_level"] != "token":
            raise ValueError(f"PolicyBatch.token_weights scale per-token surrogate terms; the "
                             f"{self.loss_params['algorithm']} loss has one ratio per sequence, to which they do not "
                             "apply")
        b = self.cfg.actor
        n = len(batch)
        size = self.cfg.ppo_mini_batch_responses  # actor.ppo_mini_batch_size prompts x rollout.n responses
        minis = [list(range(s, min(s + size, n))) for s in range(0, n, size)]
        for rows in minis:
            if len(rows) < self.dp:
                raise ValueError(f"a mini-batch of {len(rows)} responses cannot be split over {self.dp} data-parallel "
                                 f"ranks (batch {n}, actor.ppo_mini_batch_size {b.ppo_mini_batch_size} x "
                                 f"rollout.n {self.cfg.rollout.n} = {size} responses per mini-batch)")
        lengths = batch.lengths()
        self.model.train()
        t0 = time.perf_counter()
        stats = torch.zeros(6, dtype=torch.float64, device=self.device)
        grad_norms: list[float] = []
        n_mb = 0
        skipped = 0
        for _ in range(b.ppo_epochs):
            for rows in minis:
                shard = [rows[k] for k in balance_across_dp([lengths[i] for i in rows], self.dp)[self.dp_rank]]
                mbs = microbatches(batch, shard, b.max_tokens_per_microbatch, packing=b.packing, thd=self.thd,
                                   pad_id=self.pad_id, row_capacity=None if self.thd else 0)
                counts = torch.tensor(
                    [sum(len(batch.response_ids[i]) for i in shard),
                     sum(1 for i in shard if batch.response_ids[i])], dtype=torch.float32, device=self.device)
                dist.all_reduce(counts, group=self.dp_group)
                self.model.zero_grad_buffer()
                self.optimizer.zero_grad()
                out = self._run_schedule(mbs, partial(self._loss, num_microbatches=len(mbs),
                                                      global_tokens=counts[0], global_seqs=counts[1]),
                                         forward_only=False)
                self.scheduler.step(1)
                lr = float(self.optimizer.param_groups[0]["lr"])
                ok, grad_norm, _ = self.optimizer.step()
                skipped += 0 if ok else 1
                grad_norms.append(float(grad_norm) if grad_norm is not None else float("nan"))
                n_mb += len(mbs)
                if self.is_last_stage and self.tp_rank == 0:
                    for d in out:
                        stats += d["stats"].double()
        elapsed = time.perf_counter() - t0
        dist.all_reduce(stats)  # only last-stage TP-rank-0 ranks contributed: sums over DP ranks
        updates = len(minis) * b.ppo_epochs
        n_tok = max(stats[5].item(), 1.0)
        self.step += 1
        total_tokens = sum(lengths) * b.ppo_epochs
        return {
            "loss": stats[0].item() / updates,
            "grad_norm": sum(grad_norms) / len(grad_norms),
            "lr": lr,
            "clipfrac_low": stats[1].item() / n_tok,
            "clipfrac_high": stats[2].item() / n_tok,
            "approx_kl": stats[3].item() / n_tok,
            "entropy": stats[4].item() / n_tok if self.loss_params["entropy"] else float("nan"),
            "response_tokens": stats[5].item() / b.ppo_epochs,
            "tokens_per_s": total_tokens / elapsed if elapsed > 0 else float("inf"),
            "num_microbatches": n_mb,
            "num_updates": updates,
            "skipped_updates": skipped,
            "step": self.step,
            "time_s": elapsed,
        }

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str | Path, fully_parallel: bool = False) -> None:
        """Model + optimizer + scheduler + RNG via ``dist_checkpointing`` (see :mod:`.checkpoint`)."""
        from da3po_megatron.megatron.checkpoint import save_policy

        save_policy(path, self.model, self.optimizer, self.scheduler, step=self.step, hf_dir=self.cfg.model.path,
                    extra={"run_config": _jsonable(to_dict(self.cfg)), "vocab_size": self.vocab,
                           "padded_vocab_size": self.padded_vocab},
                    fully_parallel=fully_parallel)

    def load(self, path: str | Path, load_optimizer: bool | None = None, fully_parallel: bool = False
             ) -> dict[str, Any]:
        """Load a checkpoint saved at any TP x PP (optimizer: same TP x PP only; see :func:`checkpoint.load_policy`)."""
        from da3po_megatron.megatron.checkpoint import load_policy

        meta = load_policy(path, self.model, self.optimizer, self.scheduler, load_optimizer=load_optimizer,
                           fully_parallel=fully_parallel)
        self.step = int(meta.get("step", 0))
        return {k: meta[k] for k in ("step", "layout", "loaded_optimizer", "restored_rng")}

    def save_model(self, path: str | Path) -> None:
        """The model part only (what the bridge's converter writes/reads)."""
        from da3po_megatron.megatron.checkpoint import save_model

        save_model(self._bare, path)

    def load_model(self, path: str | Path) -> None:
        from da3po_megatron.megatron.checkpoint import load_model

        load_model(self._bare, path)
        self.optimizer.reload_model_params()

    def shutdown(self) -> None:
        from da3po_megatron.megatron.runtime import destroy_parallel

        destroy_parallel()


class _PassThroughOutputLayer(torch.nn.Module):
    """Stands in for GPTModel's ColumnParallelLinear ``output_layer`` (same call signature, same (output, bias)
    return): hands the final hidden states through, so that the fused_linear loss gets them instead of logits.

    It exposes the real layer's ``weight``, because ``GPTModel.shared_embedding_or_output_weight()`` reads
    ``output_layer.weight`` during the forward on a last pipeline stage with tied embeddings (PP > 1).
    """

    def __init__(self, weight: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        return hidden_states, None


def _vocab_parallel_entropy(logits: torch.Tensor, tp_group, chunk: int = 4096) -> torch.Tensor:
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


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj if not (isinstance(obj, float) and math.isnan(obj)) else None
    return str(obj)
