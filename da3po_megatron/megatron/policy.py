"""The megatron-core policy actor: one rank of the training world (set-up, the RL update, checkpoints).

:class:`PolicyWorker` is one rank of the training world. It is a plain class: a ``torchrun`` process builds one
directly, :mod:`da3po_megatron.megatron.actor_group` wraps one per rank in a Ray actor. Every public method is
collective (called on ALL ranks in lock-step with the same arguments) and returns the same result on every rank; the
driver reads rank 0's. It is configured by the run config's own sections (:class:`da3po_megatron.config.Config`).

One concern per module (paper equations as in DESIGN.md):

- the run config as the policy reads it, and its start-up check against the world and the model
  (:mod:`.policy_config`: ``loss_setup``, ``validate_config``);
- set-up (here): process groups (:mod:`.runtime`), the GPTModel stage of the caller's :class:`~.arch.GPTArch`
  (:mod:`.model`; randomly initialised, the HF weights come through the bridge), then Megatron DDP + distributed
  Adam + the LR schedule (:mod:`.optimizer`);
- the forward schedule (:mod:`.schedule`): this rank's DP shard (token-balanced) in micro-batches by token budget
  (packed sequences, :mod:`.batching`) through Megatron's pipeline schedule; ``compute_logprobs``: log pi(o_t | q,
  o_<t) of every response token, forward-only, vocab-parallel, gathered back in batch order;
- log-probs and the loss (:mod:`.loss_backends`): "torch" (Megatron's ``vocab_parallel_cross_entropy`` +
  ``algorithms.losses``), "kernel" (the fused DAA-loss kernel on the logits) and "fused_linear" (from the final
  hidden states, no ``[tokens x vocab]`` logits), registered by name behind one interface and chosen by
  ``actor.loss_backend`` (:func:`.policy_config.loss_setup`). Sampling temperature (``rollout.temperature``): pi is
  softmax(z / T), the distribution the engines sample from, in log-probs, entropy and loss alike (as verl and slime
  do);
- ``train_step`` (here): one RL update, the clipped surrogate of Eq. 5/11 with the algorithm's aggregation (GRPO
  Eq. 4, DAPO / DA3PO token-level Eq. 9, GSPO sequence ratio). DAA (Eq. 14) is applied by the trainer to the
  advantages it sends; the policy does not amplify again. Optional per-token weights (``PolicyBatch.token_weights``,
  the TIS correction of ``algorithms.rollout_correction``) scale each token's advantage. The batch is split into
  mini-batches (one optimizer step each, ``actor.ppo_epochs`` passes), each over DP ranks and into micro-batches. The
  loss uses the GLOBAL normaliser of the mini-batch (its response tokens, or responses, summed over DP ranks first),
  so the gradient does not depend on how the mini-batch is split (the contract in ``losses.py``; verl's
  ``global_batch_info``, NeMo-RL's ``global_valid_toks``);
- ``save`` / ``load``: :mod:`.checkpoint` (model resharding-safe across TP/PP; optimizer at the same TP x PP).
- No HF names and no HF config here: the architecture comes in as a ``GPTArch`` (the bridge reads config.json), and
  HF weights go in and out through the bridge (``da3po_megatron.bridge.export``: ``load_policy_hf``,
  ``export_policy``), which the trainer, the weight sync and tests run on every rank with :meth:`PolicyWorker.execute`.

Left out: context parallelism (refused by config validation: sequences are not split across CP ranks), virtual
pipeline stages, KL-to-reference and entropy bonus terms (DAPO / DA3PO use neither), dual-clip PPO.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from da3po_megatron.config import AlgorithmConfig, Config, to_dict
from da3po_megatron.megatron import cpu_compat, policy_config
from da3po_megatron.megatron.arch import GPTArch
from da3po_megatron.megatron.batching import PolicyBatch
from da3po_megatron.megatron.loss_backends import (
    LossBackend,
    VocabShard,
    make_loss_backend,
    microbatch_loss,
)
from da3po_megatron.megatron.model import build_gpt_model, use_te
from da3po_megatron.megatron.optimizer import build_ddp_optimizer
from da3po_megatron.megatron.runtime import bind_rendezvous, init_parallel, join_rendezvous, node_ip
from da3po_megatron.megatron.schedule import ForwardSchedule
from da3po_megatron.megatron.update_guard import check_finite_weights, guarded_step
from da3po_megatron.ranges import ranged

log = logging.getLogger(__name__)


class PolicyWorker:
    """One rank of the policy world, configured by the run config's own sections (``da3po_megatron.config.Config``):
    ``model``, ``parallel``, ``optim``, ``actor``, the resolved ``algorithm`` fields, ``rollout.temperature`` /
    ``rollout.n`` and ``trainer.seed``, and the model's architecture (a :class:`~.arch.GPTArch`, which the caller
    gets from the bridge: ``da3po_megatron.bridge.hf_config.gpt_arch(cfg.model.path)``). Use
    ``PolicyWorker().init(cfg, arch, rank=..., ...)`` or ``PolicyWorker(cfg, arch, ...)``."""

    def __init__(self, cfg: Config | None = None, arch: GPTArch | None = None, **init_kwargs: Any) -> None:
        from da3po_megatron.megatron.runtime import ignore_job_sigterm

        ignore_job_sigterm()  # under Slurm: outlive the job-wide SIGTERM until the driver has checkpointed
        self.cfg: Config | None = None
        self.step = 0
        self._rendezvous: Any = None  # rank 0's bound store, between rendezvous_address() and init()
        if cfg is not None:
            self.init(cfg, arch, **init_kwargs)

    # ------------------------------------------------------------------ set-up
    def rendezvous_address(self) -> tuple[str, int]:
        """(address, port) of the world's rendezvous, as seen from other nodes; called on rank 0, which binds the
        store here (a port the OS picks) and serves it from :meth:`init` on: no other process can take the port
        between the probe and the bind (``runtime.bind_rendezvous``, issue 55)."""
        self._rendezvous = bind_rendezvous()
        return node_ip(), self._rendezvous.port

    def init(self, cfg: Config, arch: GPTArch, *, rank: int | None = None, world_size: int | None = None,
             master_addr: str | None = None, master_port: int | None = None,
             store: Any = None) -> dict[str, Any]:
        """Join the world, build the model stage of ``arch`` (randomly initialised: the HF weights come through the
        bridge's ``load_policy_hf``), wrap in DDP, build optimizer and LR schedule. ``store``: the world's rendezvous,
        already joined by every rank (``runtime.join_rendezvous`` to a store a parent process bound first)."""
        import os

        from da3po_megatron.megatron.model import import_megatron_core

        import_megatron_core(require_te=cfg.model.use_transformer_engine is True)  # before megatron-core is imported
        from megatron.core import parallel_state as ps

        world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        policy_config.validate_config(cfg, arch, world_size)
        self.cfg, self.arch = cfg, arch
        self.loss_params = policy_config.loss_setup(cfg)
        if store is None:
            store = self._rendezvous if rank == 0 else None
        if store is None and master_port and world_size > 1:  # a port handed over without rendezvous_address()
            store = (bind_rendezvous(port=master_port) if rank == 0
                     else join_rendezvous(master_addr or "127.0.0.1", master_port))
        init_parallel(policy_config.layout_of(cfg), rank=rank, world_size=world_size, master_addr=master_addr,
                      master_port=master_port, store=store, seed=cfg.trainer.seed)
        self._rendezvous = None  # the world's default group holds the store from here on
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.dp = ps.get_data_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.cp_rank = ps.get_context_parallel_rank()  # the weight-sync sender rule (rollout/weight_sync.sender_stage)
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.is_last_stage = ps.is_pipeline_last_stage()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
        self.vocab, self.padded_vocab = arch.vocab_sizes(self.tp, cfg.model.make_vocab_size_divisible_by)
        self.te = use_te(cfg.model)
        self.thd = self.te and cfg.actor.packing
        self.pad_id = arch.pad_token_id

        self.sequence_parallel = policy_config.sequence_parallel_of(cfg)
        model = self._gpt = build_gpt_model(arch, cfg.model, moe=cfg.moe, sequence_parallel=self.sequence_parallel)
        self.model, self.optimizer, self.scheduler = build_ddp_optimizer(
            model, cfg.optim, total_steps=cfg.optimizer_steps, lr_decay_style=cfg.optim.lr_schedule)
        from da3po_megatron.megatron.model import routes_wanted

        columns = None
        if arch.is_moe and routes_wanted(cfg.moe):
            from da3po_megatron.megatron.moe import stage_moe_columns

            columns = stage_moe_columns(model, arch.moe_pattern())
        self.schedule = ForwardSchedule(self.model, self.device, self.te, self.thd, self.pad_id, self.dp,
                                        self.dp_rank, self.tp_rank, moe_columns=columns,
                                        moe_layers=sum(arch.moe_pattern()) if columns is not None else 0,
                                        replay=cfg.moe.routing_replay == "rollout", tp=self.tp,
                                        sequence_parallel=self.sequence_parallel)
        self.loss_backend = self._make_loss_backend()
        from da3po_megatron.megatron.offload import PolicyOffload

        self.offloader = PolicyOffload(self.model, self.optimizer, cfg.actor.offload)  # actor.offload tiers
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
        self.loss_params = policy_config.loss_setup(cfg)
        self.cfg = cfg
        self.loss_backend = self._make_loss_backend()

    def offload_state(self, parts: tuple[str, ...] | None = None) -> dict[str, int]:
        """Release ``parts`` of ``actor.offload``'s tier (default all of it) from the device (:mod:`.offload`); the
        bytes released per part. ``reload_offloaded`` brings them back."""
        return self.offloader.offload(parts)

    def reload_offloaded(self, parts: tuple[str, ...] | None = None) -> list[str]:
        """Bring ``parts`` (default: everything offloaded) back to the device; the parts reloaded."""
        return self.offloader.reload(parts)

    def _make_loss_backend(self) -> LossBackend:
        """The loss backend ``policy_config.loss_setup`` named, for this rank's model stage and vocab shard."""
        p = self.loss_params
        shard = VocabShard(self.tp_rank, self.tp, self.tp_group, self.vocab, self.padded_vocab)
        return make_loss_backend(p["backend"], self._gpt, shard, p["temperature"], p["kernel_backend"])

    def info(self) -> dict[str, Any]:
        """Where this rank sits and what it holds."""
        n_params = sum(p.numel() for p in self._bare.parameters())
        return {
            "rank": dist.get_rank(), "world_size": dist.get_world_size(), "tp_rank": self.tp_rank,
            "pp_rank": self.pp_rank, "dp_rank": self.dp_rank, "tp": self.tp, "pp": self.pp, "dp": self.dp,
            "local_params": n_params, "vocab_size": self.vocab, "padded_vocab_size": self.padded_vocab,
            "device": str(self.device), "thd": self.thd, "step": self.step,
            "loss_backend": self.loss_backend_name(), "sequence_parallel": self.sequence_parallel,
        }

    def loss_backend_name(self) -> str:
        """What computes the policy loss here, with "auto" resolved: e.g. "kernel:triton" on a GPU where the Triton
        kernels compile, "kernel:chunked" on CPU, "torch" (Megatron's vocab-parallel cross-entropy + algorithms/),
        "fused_linear" (kernels/fused_linear.py from the final hidden states)."""
        return self.loss_backend.describe(self.device)

    @property
    def _bare(self) -> torch.nn.Module:
        """This rank's GPTModel stage, without the DDP wrapper."""
        return self._gpt

    # ------------------------------------------------------------------ log-probs
    @ranged("logprobs")
    def compute_logprobs(self, batch: PolicyBatch, return_entropy: bool = False, packing: bool | None = None,
                         as_arrays: bool = False) -> Any:
        """Per-token log-probs of each response given its prompt (and entropies with ``return_entropy``).

        ``packing`` overrides ``actor.packing`` for this call (packed and padded give the same values). Lists of
        floats, or with ``as_arrays`` a float32 ``batching.Ragged`` (the driver's path). ``batch`` may be this
        rank's data-parallel share (``PolicyBatch.share``).
        """
        cpu_compat.apply_if_needed()
        a = self.cfg.actor
        return self.schedule.logprobs(
            batch, self.loss_backend, max_tokens=a.logprob_max_tokens_per_microbatch or 2 * a.max_tokens_per_microbatch,
            packing=a.packing if packing is None else packing, return_entropy=return_entropy, as_arrays=as_arrays)

    def routing_stats(self) -> dict[str, float]:
        """Router agreement with the engines over the forwards since the last call (collective; {} without routed
        micro-batches): ``router_agreement`` -- the fraction of (token, MoE layer) pairs with an engine route whose
        experts used by the forward have the engine's top-k set (1.0 under replay, R3); ``router_agreement_own`` --
        the same for the experts the router chose itself (what it would use without replay); ``route_pairs``; and
        both per MoE layer c (``..._layer{c}``: layer c's router input depends on the experts earlier layers used)."""
        counts = self.schedule.take_route_counts().to(self.device)
        dist.all_reduce(counts)
        (used, own, pairs), layers = counts[0].tolist(), counts[1:].tolist()
        if not pairs:
            return {}
        out = {"router_agreement": used / pairs, "router_agreement_own": own / pairs, "route_pairs": pairs}
        for c, (u, o, n) in enumerate(layers):
            if n:
                out.update({f"router_agreement_layer{c}": u / n, f"router_agreement_own_layer{c}": o / n})
        return out

    # ------------------------------------------------------------------ training
    @ranged("train")
    def train_step(self, batch: PolicyBatch) -> dict[str, float]:
        """One RL update on ``batch`` (mini-batches x epochs optimizer steps); returns metrics (same on all ranks)."""
        cpu_compat.apply_if_needed()
        self.offloader.require("train_step")
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
        self.loss_backend.ran.clear()  # the step reports what computed its losses (``loss_backend`` below)
        self.schedule.take_route_counts()  # the router agreement below counts this step's forwards only
        t0 = time.perf_counter()
        stats = torch.zeros(6, dtype=torch.float64, device=self.device)
        grad_norms: list[float] = []  # of every update whose gradient was finite (applied or refused for its size)
        ratios: list[float] = []  # ||delta theta|| / ||theta|| of every update it was computed for (update_guard.py)
        applied = 0
        n_mb = 0
        skipped = trailing = 0
        nonfinite = {"loss": 0, "grad": 0, "update_ratio": 0}
        for _ in range(b.ppo_epochs):
            for rows in minis:
                shard = self.schedule.dp_shard(batch, rows)
                mbs = self.schedule.microbatches(batch, shard, b.max_tokens_per_microbatch, b.packing)
                counts = torch.tensor(
                    [sum(len(batch.response_ids[i]) for i in shard),
                     sum(1 for i in shard if len(batch.response_ids[i]))], dtype=torch.float32, device=self.device)
                dist.all_reduce(counts, group=self.dp_group)
                self.model.zero_grad_buffer()
                self.optimizer.zero_grad()
                loss = partial(microbatch_loss, self.loss_backend, self.loss_params,
                               entropy=self.loss_params["entropy"], num_microbatches=len(mbs), dp=self.dp,
                               global_tokens=counts[0], global_seqs=counts[1])
                out = self.schedule.run(mbs, loss, self.loss_backend, forward_only=False)
                self.scheduler.step(1)
                lr = float(self.optimizer.param_groups[0]["lr"])
                u = guarded_step(self.optimizer, [d["stats"][0] for d in out], self.cfg.trainer.max_update_ratio,
                                 self.device)  # non-finite or too large: refused on all ranks (update_guard.py)
                nonfinite.update({k: nonfinite[k] + 1 for k in u.refused if k in nonfinite})
                ok = u.applied
                if ok:
                    applied += 1
                    check_finite_weights(self.model, f"{self.step + 1}.{applied}", self.device)
                skipped, trailing = skipped + (not ok), 0 if ok else trailing + 1
                grad_norms += [u.grad_norm] if math.isfinite(u.grad_norm) else []
                ratios += [u.update_ratio] if not math.isnan(u.update_ratio) else []
                n_mb += len(mbs)
                if ok and self.is_last_stage and self.tp_rank == 0:
                    for d in out:
                        stats += d["stats"].double()
        elapsed = time.perf_counter() - t0
        dist.all_reduce(stats)  # only last-stage TP-rank-0 ranks contributed: sums over DP ranks
        ran = self._loss_implementations_ran()
        # MoE with engine routes: the training forwards' router agreement (dense: nothing, no collective)
        routing = self.routing_stats() if self.schedule.moe_columns is not None else {}
        updates = len(minis) * b.ppo_epochs
        n_tok = max(stats[5].item(), 1.0)
        self.step += 1
        total_tokens = sum(lengths) * b.ppo_epochs
        return {
            "loss": stats[0].item() / (updates - skipped) if updates > skipped else float("nan"),
            "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
            "lr": lr,
            "clipfrac_low": stats[1].item() / n_tok,
            "clipfrac_high": stats[2].item() / n_tok,
            "approx_kl": stats[3].item() / n_tok,
            "entropy": stats[4].item() / n_tok if self.loss_params["entropy"] else float("nan"),
            "response_tokens": stats[5].item() / b.ppo_epochs,
            "tokens_per_s": total_tokens / elapsed if elapsed > 0 else float("inf"),
            "num_microbatches": n_mb,
            "num_updates": updates,
            "update_ratio": max(ratios) if ratios else float("nan"),  # the step's largest ||delta theta||/||theta||
            "skipped_updates": skipped,  # non-finite loss / grads, too large (update_guard.py), or fp16 found_inf
            "nonfinite_loss_updates": nonfinite["loss"],
            "nonfinite_grad_updates": nonfinite["grad"],
            "update_ratio_refused_updates": nonfinite["update_ratio"],
            "trailing_skipped_updates": trailing,
            "step": self.step,
            "time_s": elapsed,
            "loss_backend": ran,  # what computed the loss in this step ("auto" resolved), e.g. "kernel:triton"
            **routing,
        }

    def _loss_implementations_ran(self) -> str:
        """What computed log-probs and losses on any rank since the last call (collective; the last stage is the one
        that computes them), joined by "+", e.g. "kernel:triton"; clears the record."""
        names = self.loss_backend.IMPLEMENTATIONS
        flags = torch.tensor([float(n in self.loss_backend.ran) for n in names], device=self.device)
        self.loss_backend.ran.clear()
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return "+".join(n for n, f in zip(names, flags.tolist()) if f) or "none"

    # ------------------------------------------------------------------ checkpoints
    @ranged("checkpoint")
    def save(self, path: str | Path, fully_parallel: bool = False, async_save: bool = False) -> None:
        """Model + optimizer + scheduler + RNG via ``dist_checkpointing`` (see :mod:`.checkpoint`). ``async_save``: the
        shards are written in the background; :meth:`finalize_save` completes the checkpoint."""
        from da3po_megatron.megatron.checkpoint import save_policy

        with self.offloader.resident():
            save_policy(path, self.model, self.optimizer, self.scheduler, step=self.step,
                        hf_dir=self.cfg.model.path,
                        extra={"run_config": _jsonable(to_dict(self.cfg)), "arch": self.arch.to_dict(),
                               "vocab_size": self.vocab, "padded_vocab_size": self.padded_vocab},
                        fully_parallel=fully_parallel, async_save=async_save)

    def finalize_save(self, blocking: bool = False) -> bool:
        """Finish an asynchronous save whose writer is done on every rank (``blocking``: wait for it); True when
        none is in flight any more (collective; :func:`.checkpoint_async.finalize_async_save`)."""
        from da3po_megatron.megatron.checkpoint_async import finalize_async_save

        return finalize_async_save(blocking)

    def prewarm_checkpointing(self, directory: str | Path) -> float:
        """The first save's one-time start-up, done ahead (:func:`checkpoint.prewarm_writer`; collective); seconds."""
        from da3po_megatron.megatron.checkpoint import prewarm_writer

        return prewarm_writer(directory)

    def load(self, path: str | Path, load_optimizer: bool | None = None, fully_parallel: bool = False
             ) -> dict[str, Any]:
        """Load a checkpoint saved at any TP x PP (optimizer: same TP x PP only; see :func:`checkpoint.load_policy`)."""
        from da3po_megatron.megatron.checkpoint import load_policy

        with self.offloader.resident():  # never into released storages (the trainer loads before it offloads)
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


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj if not (isinstance(obj, float) and math.isnan(obj)) else None
    return str(obj)
