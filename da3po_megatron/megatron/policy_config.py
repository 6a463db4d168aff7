"""What the policy reads of the run config, and the start-up check of that config against the world and the model.

- :func:`loss_setup`: the resolved algorithm fields (ratio level, aggregation, clips: Eq. 4 / 5 / 9 / 11 as the
  registry resolved them at load), the custom loss, the loss backend and the sampling temperature;
- :func:`layout_of`, :func:`sequence_parallel_of`: the process-group layout and sequence parallelism of
  ``cfg.parallel``;
- :func:`validate_config`: refuses, naming the numbers, a config the world or the model cannot run -- before any
  process group exists (each policy rank in ``PolicyWorker.init``; the driver in ``actor_group`` without importing
  megatron-core).

Pure functions of the config (no process group, no model): the policy actor (:mod:`.policy`) and the driver call them.
"""

from __future__ import annotations

from typing import Any

from da3po_megatron.config import Config
from da3po_megatron.kernels import BACKENDS as KERNEL_BACKENDS
from da3po_megatron.megatron.arch import GPTArch
from da3po_megatron.megatron.loss_backends import LOSS_BACKENDS
from da3po_megatron.megatron.model import transformer_config
from da3po_megatron.megatron.runtime import ParallelLayout


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
    backend = "kernel" if b in KERNEL_BACKENDS else b  # a kernel backend's name means the kernel loss backend
    if backend not in LOSS_BACKENDS or backend == "kernel" and b not in KERNEL_BACKENDS:
        names = sorted(set(LOSS_BACKENDS) - {"kernel"}) + list(KERNEL_BACKENDS)
        raise ValueError(f"actor.loss_backend={b!r} is not one of {', '.join(names)}")
    fn = load_function(a.policy_loss_fn, POLICY_LOSS_FN_ARGS, "algorithm.policy_loss_fn") if a.policy_loss_fn else None
    return dict(algorithm=a.name, ratio_level=a.ratio_level, loss_agg_mode=a.loss_agg_mode,
                clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high, policy_loss_fn=fn,
                backend=backend, kernel_backend=b if backend == "kernel" else "auto",
                temperature=cfg.rollout.temperature, entropy=cfg.actor.entropy)


def layout_of(cfg: Config) -> ParallelLayout:
    """The process-group layout of ``cfg.parallel`` (DP follows from the world size)."""
    p = cfg.parallel
    return ParallelLayout(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size,
                          p.expert_model_parallel_size, p.expert_tensor_parallel_size)


def validate_config(cfg: Config, arch: GPTArch, world_size: int, *, megatron_config: bool = True) -> None:
    """Check the run config against the world and the model (``arch``) before any process group exists.

    Raises ValueError naming the numbers: a world that is not ``cfg.policy_world_size``; world not divisible by
    TP x PP (x CP), heads / query groups not divisible by TP, layers not divisible by PP; an invalid loss set-up.
    With ``megatron_config`` (every policy rank, before it joins a group) also megatron-core's own ``TransformerConfig``
    checks (recomputation options and the like). The driver passes False: importing megatron-core costs a process
    ~14 CPU-seconds on our 2-core machines (2026-12-01), which the driver spent next to its starting actors in every
    launch; a config that only megatron-core rejects then fails in the ranks' start-up, with megatron's message.
    """
    if not isinstance(arch, GPTArch):
        raise TypeError(f"the policy is built from a megatron.arch.GPTArch (the bridge's gpt_arch(model_path) gives "
                        f"it), got {type(arch).__name__}")
    layout = layout_of(cfg)
    layout.validate(world_size)
    tp, pp = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
    ep, etp = layout.expert_model_parallel_size, layout.expert_tensor_parallel_size
    arch.check_parallel_sizes(tp, pp, ep, etp)
    if cfg.moe.routing_replay != "none" and not arch.is_moe:
        raise ValueError(f"moe.routing_replay={cfg.moe.routing_replay!r} needs a Mixture-of-Experts model; "
                         f"{cfg.model.path} is dense (no experts: nothing to route); use moe.routing_replay=none")
    sp = sequence_parallel_of(cfg)
    if arch.is_moe and tp > 1 and not sp:
        raise ValueError(f"{cfg.model.path} is a Mixture-of-Experts model: training it at "
                         f"parallel.tensor_model_parallel_size = {tp} needs parallel.sequence_parallel (megatron-core "
                         "0.16.1 transformer/moe/moe_layer.py 379-383 refuses a training forward without it); use "
                         "parallel.sequence_parallel=null (on at TP > 1) or true")
    if megatron_config:
        transformer_config(arch, cfg.model, tp, pp, layout.context_parallel_size, ep, etp, moe=cfg.moe,
                           sequence_parallel=sp)
    if world_size != cfg.policy_world_size:
        p = cfg.parallel
        raise ValueError(f"world size {world_size} != parallel.tensor_model_parallel_size "
                         f"({p.tensor_model_parallel_size}) x pipeline_model_parallel_size "
                         f"({p.pipeline_model_parallel_size}) x context_parallel_size ({p.context_parallel_size}) x "
                         f"data_parallel_size ({p.data_parallel_size}) = {cfg.policy_world_size}")
    loss_setup(cfg)


def sequence_parallel_of(cfg: Config) -> bool:
    """``parallel.sequence_parallel`` as resolved at load (None, in a config built in code and not resolved: on
    whenever TP > 1, the same rule as ``config.resolve``); only ever True with TP > 1."""
    p = cfg.parallel
    sp = p.tensor_model_parallel_size > 1 if p.sequence_parallel is None else bool(p.sequence_parallel)
    return sp and p.tensor_model_parallel_size > 1
