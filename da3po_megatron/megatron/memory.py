"""Peak memory of one policy rank during a train step, estimated from shapes before anything starts.

``da3po train`` prints :func:`estimate_policy_memory` for the configured model, parallel layout, micro-batch token
budget (``actor.max_tokens_per_microbatch``), layer spec, activation recomputation and loss backend, and refuses to
start (or lowers the budget, ``actor.auto_fit_microbatch=true``) when it exceeds what the device has
(:func:`device_memory_bytes`). A pure function of shapes: no model, no process group, no tensor is built.

What is counted, per rank, on the pipeline stage with the largest total (bytes = elements x element size):

* **static**: this rank's parameters (its TP shard of its PP stage's layers, + embedding on the first stage, + output
  layer on the last, a second copy of a tied embedding when PP > 1), Megatron DDP's fp32 gradient buffer
  (``grad_reduce_in_fp32``), Adam's two fp32 moments and, for bf16 parameters, the fp32 master copy -- the last three
  divided over DP ranks by the distributed optimizer (ZeRO-1).
* **activations** kept for backward in one micro-batch of T tokens, per layer (Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models", Sec. 4, re-derived for RMSNorm + GQA + SwiGLU and counted in
  elements rather than their fp16 bytes): ``T * (6h + (2a + 3g) d / t + a d / t + 3f / t)`` for the norms, QKV,
  rotary copies, attention output, residuals and the SwiGLU MLP, plus the attention probabilities of Megatron's local
  layer spec, which materialises ``[rows, a / t, S, S]`` (packed rows of the longest sequence S: ~T * S * a / t) --
  the term that made 4096-token micro-batches of a 135M model take 19 GB on CPU. The Transformer-Engine spec
  (flash / fused attention) keeps no S^2 term. Under 1F1B the first stage holds PP micro-batches in flight.
* **recomputation** (``recompute_granularity``): "selective" drops the S^2 attention term (recomputed in backward);
  "full" keeps only each layer's input (``T h``) plus one layer's activations recomputed at a time.
* **logits** on the last stage: ``T x V / t`` fp32 tensors -- the output, the temperature-scaled copy, the loss
  backend's own tensors and the gradient: ~5 for "torch" (Megatron's vocab-parallel softmax, entropy), ~3 for the
  kernel backends (they never materialise more than the logits and their gradient, plus the scaled copy), ~0 for
  "fused_linear" (chunks of ``chunk x V / t``).
* **transient** peak inside the layer being processed: a second attention-score tensor (the scores before softmax /
  the gradient) and one layer's MLP intermediates.

Mixture-of-Experts (``arch.is_moe``): an MoE layer's parameters are its router (``E x h``, replicated) plus the
``E / EP`` experts this rank owns, each split over ETP ranks (``3 h f_e / etp``); dense layers as above. Expert
gradients and Adam state are divided over the *expert* data-parallel ranks (``DP x TP / (EP x ETP)``) by the
distributed optimizer, the rest over DP. Activations of an MoE layer replace the dense MLP's ``3 f / t`` per token by
the routed tokens' expert intermediates (``k x 3 f_e / etp``), plus the dispatcher's buffers: the permuted
hidden states sent and received by the all-to-all (``2 x k x h`` per token, each kept for backward) and the
routing map / probabilities (``3 E`` per token, fp32). The estimate assumes balanced routing times
``moe_imbalance`` (default 1.5: the most tokens one rank's experts receive, relative to balanced).

Calibration: the per-term constants above were checked against the measured peak RSS of single-rank train steps
(``tools/measure/policy_memory.py``; numbers and error in docs/real_model.md). Left out: the engine's KV cache (its own
budget, ``rollout.kv_cache_memory_bytes``), the allocator's fragmentation beyond what the measurements absorbed, CUDA
context and NCCL buffers (``runtime_overhead_bytes``) and context parallelism. Sequence parallelism divides the
TP-replicated activations by TP (``sequence_parallel`` of :func:`estimate_policy_memory`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from da3po_megatron.megatron.arch import GPTArch

__all__ = ["MemoryBudgetError", "MemoryEstimate", "check_policy_memory", "device_memory_bytes",
           "estimate_for_config", "estimate_policy_memory", "fit_microbatch_tokens"]

GiB = 2**30
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# fp32 [T x V/t] tensors alive at the peak of the last stage, per loss backend (see the module doc)
_LOGIT_COPIES = {"torch": 5.0, "kernel": 3.0, "fused_linear": 0.0}
_LOGIT_COPIES_FORWARD = {"torch": 3.0, "kernel": 2.0, "fused_linear": 0.0}
# Process baseline that is not the model: torch + megatron-core + gloo on CPU (measured RSS after imports and
# parallel init, before the model is built), the CUDA context + NCCL on GPU.
RUNTIME_OVERHEAD = {"cpu": 1.0 * GiB, "cuda": 2.0 * GiB}


class MemoryBudgetError(ValueError):
    """The configured policy would not fit in the device's memory (the message says by how much and what to change)."""


@dataclass
class MemoryEstimate:
    """The estimate for the heaviest pipeline stage of one rank; all sizes in bytes."""

    total: int
    components: dict[str, int] = field(default_factory=dict)
    stage: int = 0
    inputs: dict[str, Any] = field(default_factory=dict)
    static: dict[str, int] = field(default_factory=dict)  # params / grads / optimizer bytes (megatron/offload.py)
    async_staging: int = 0  # host copy of what this rank's checkpoint writes (weights + optimizer shard), memory_host

    def summary(self) -> str:
        parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.components.items() if v)
        return (f"policy peak memory per rank ~{self.total / GiB:.2f} GiB (stage {self.stage}: {parts} GiB; "
                f"micro-batch {self.inputs.get('max_tokens_per_microbatch')} tokens, sequences <= "
                f"{self.inputs.get('max_seq_len')}, {self.inputs.get('layer_spec')} spec, recompute "
                f"{self.inputs.get('recompute_granularity') or 'off'}, loss {self.inputs.get('loss_backend')})")


def _shape(arch: GPTArch) -> dict[str, int]:
    return {"h": arch.hidden_size, "f": arch.ffn_hidden_size, "a": arch.num_attention_heads,
            "g": arch.num_query_groups, "L": arch.num_layers, "d": arch.kv_channels, "V": arch.vocab_size,
            "tied": int(arch.share_embeddings_and_output_weights)}


def _layer_params(s: dict[str, int], tp: int, qk_norm: bool, qkv_bias: bool, mlp: bool = True) -> float:
    h, f, a, g, d = s["h"], s["f"], s["a"], s["g"], s["d"]
    p = 2 * h  # input_layernorm + pre_mlp_layernorm (replicated over TP)
    p += h * (a + 2 * g) * d / tp + a * d * h / tp  # QKV + output projection
    p += (h * 2 * f / tp + f * h / tp) if mlp else 0  # SwiGLU fc1 (gate + up) + fc2 (dense layers)
    p += 2 * d if qk_norm else 0
    p += (a + 2 * g) * d / tp if qkv_bias else 0
    return p


def moe_layer_params(arch: GPTArch, ep: int = 1, etp: int = 1) -> tuple[float, float]:
    """(router parameters, expert parameters) of one MoE layer on one rank: the router ``E x h`` (replicated) and the
    rank's ``E / EP`` experts, each ``3 h f_e / ETP`` (SwiGLU fc1 gate + up, fc2)."""
    if not arch.is_moe:
        return 0.0, 0.0
    e, fe, h = arch.num_moe_experts, arch.moe_ffn_hidden_size, arch.hidden_size
    return float(e * h), (e / ep) * 3 * h * fe / etp


def estimate_policy_memory(
    arch: GPTArch,
    *,
    max_tokens_per_microbatch: int,
    max_seq_len: int,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    params_dtype: str = "float32",
    layer_spec: str = "local",
    recompute_granularity: str | None = None,
    loss_backend: str = "torch",
    distributed_optimizer: bool = True,
    temperature_scaled: bool = True,
    device: str = "cpu",
    logprob_max_tokens_per_microbatch: int | None = None,
    ep: int = 1,
    etp: int | None = None,
    moe_imbalance: float = 1.5,
    sequence_parallel: bool = False,
) -> MemoryEstimate:
    """Estimated peak bytes of one policy rank in a train step (see the module doc for every term).

    ``arch``: the model's architecture. ``max_seq_len``: the longest prompt + response (the packed rows' length S).
    ``layer_spec``: "local" (Megatron's local spec: dense attention, the CPU path) or "te" (Transformer-Engine).
    ``loss_backend``: "torch" | "kernel" | "fused_linear" (a kernel name such as "chunked" counts as "kernel").
    ``logprob_max_tokens_per_microbatch``: the forward-only pi_old pass's budget (the policy's default: 2 x the train
    budget); its peak (no activations kept, logits of twice the tokens) is taken when it is the larger one.
    ``ep`` / ``etp``: expert model / tensor parallel sizes (MoE; ``etp`` defaults to ``tp``); ``moe_imbalance``: the
    most tokens one rank's experts receive, relative to balanced routing. ``sequence_parallel`` (with ``tp`` > 1):
    the parts of a layer's activations that TP alone keeps whole on every rank -- norms, residuals, dropout (``6h``
    per token), a "full"-recomputed layer's input (``h``), the MoE router and dispatcher buffers (each TP rank routes
    only its 1/t of the tokens) -- are divided by t (Korthikanti et al. 2022, Sec. 4.2.2: ``34 s b h / t`` instead of
    ``s b h (10 + 24 / t)``).
    """
    if max_tokens_per_microbatch < 1 or max_seq_len < 1:
        raise ValueError(f"need max_tokens_per_microbatch >= 1 and max_seq_len >= 1, got "
                         f"{max_tokens_per_microbatch}, {max_seq_len}")
    if layer_spec not in ("local", "te"):
        raise ValueError(f"layer_spec must be 'local' or 'te', got {layer_spec!r}")
    if recompute_granularity not in (None, "selective", "full"):
        raise ValueError(f"recompute_granularity must be None, 'selective' or 'full', got {recompute_granularity!r}")
    backend = loss_backend if loss_backend in _LOGIT_COPIES else "kernel"
    s = _shape(arch)
    h, f, a, g, d, L = s["h"], s["f"], s["a"], s["g"], s["d"], s["L"]
    pbytes = _DTYPE_BYTES.get(params_dtype, 4)
    T = int(max_tokens_per_microbatch)
    S = min(int(max_seq_len), T)
    vocab = math.ceil(s["V"] / tp) * tp
    layers = L // pp
    etp = tp if etp is None else etp
    pattern = arch.moe_pattern()
    # static bytes per parameter: weight + fp32 grad buffer + (Adam moments + fp32 master for 16-bit) / DP
    opt_bytes = 8 + (4 if pbytes < 4 else 0)
    static_per_param = pbytes + 4 + opt_bytes / (dp if distributed_optimizer else 1)
    edp = max(1, dp * tp // (ep * etp))  # expert data-parallel ranks: the experts' optimizer state is split over them
    static_per_expert_param = pbytes + 4 + opt_bytes / (edp if distributed_optimizer else 1)
    router_p, expert_p = moe_layer_params(arch, ep, etp)
    k, E = arch.moe_router_topk, arch.num_moe_experts or 0
    fe = arch.moe_ffn_hidden_size or 0
    # per token of an MoE layer: routed expert intermediates (k tokens x SwiGLU, x imbalance) + dispatcher buffers
    # (permuted hidden states out and back, each kept for backward) + routing map / probabilities / logits
    sp = tp if sequence_parallel and tp > 1 else 1  # what sequence parallelism divides (the TP-replicated parts)
    if sp > 1:  # each TP rank routes T / t tokens; its experts compute the k T / t routed ones over ETP ranks
        moe_lin = (k * 3 * fe / tp + 2 * k * h / sp) * moe_imbalance + 3 * E / sp
    else:
        moe_lin = (k * 3 * fe / etp + 2 * k * h) * moe_imbalance + 3 * E

    lin = 6 * h / sp + (2 * a + 3 * g) * d / tp + a * d / tp + 3 * f / tp  # per token, per layer (elements)
    attn = S * a / tp if layer_spec == "local" else 0.0  # per token, per layer: softmax output [rows, a/t, S, S]
    act_bytes = 4  # CPU computes in float32; bf16 halves activations on GPU
    if params_dtype != "float32":
        act_bytes = 2

    best: MemoryEstimate | None = None
    dense_layer = _layer_params(s, tp, qk_norm=arch.qk_layernorm, qkv_bias=arch.add_qkv_bias)
    moe_layer = _layer_params(s, tp, qk_norm=arch.qk_layernorm, qkv_bias=arch.add_qkv_bias, mlp=False)
    for stage in range(pp):
        first, last = stage == 0, stage == pp - 1
        n_moe = sum(pattern[stage * layers:(stage + 1) * layers])
        params = (layers - n_moe) * dense_layer + n_moe * (moe_layer + router_p)
        experts = n_moe * expert_p
        # activations: an MoE layer trades the dense MLP's 3f/t for its experts' and dispatcher's terms
        lin_stage = lin + (n_moe * (moe_lin - 3 * f / tp) / layers if layers else 0.0)
        params += vocab * h / tp if first else 0
        params += vocab * h / tp if last and (not s["tied"] or pp > 1) else 0
        params += h if last else 0  # final norm
        in_flight = min(pp - stage, pp)  # 1F1B: stage i holds (pp - i) micro-batches' activations
        if recompute_granularity == "full":
            kept = T * h / sp * layers + T * (lin_stage + attn) if layers else 0  # inputs + one layer recomputed
        elif recompute_granularity == "selective":
            kept = T * lin_stage * layers
        else:
            kept = T * (lin_stage + attn) * layers
        mask = T * S / 4 if layer_spec == "local" else 0  # bool [rows, 1, S, S] in fp32-element units
        transient = T * attn + T * (max(3 * f / tp, moe_lin) if n_moe else 3 * f / tp)  # scores; one layer's MLP
        logits = T * vocab / tp * _LOGIT_COPIES[backend] if last else 0.0
        if temperature_scaled is False and last and backend != "fused_linear":
            logits -= T * vocab / tp
        comps = {
            "weights+grads+optimizer": int(params * static_per_param),
            "experts+grads+optimizer": int(experts * static_per_expert_param),
            "activations": int((kept * in_flight + mask) * act_bytes),
            "transient": int(transient * act_bytes),
            "logits": int(max(logits, 0.0) * 4),
            "runtime": int(RUNTIME_OVERHEAD["cuda" if device == "cuda" else "cpu"]),
        }
        # the forward-only pi_old pass: nothing kept between layers, logits of its (larger) micro-batch
        T2 = int(logprob_max_tokens_per_microbatch or 2 * T)
        S2 = min(int(max_seq_len), T2)
        fwd_act = (T2 * (2 * S2 * a / tp if layer_spec == "local" else 0.0) + T2 * (lin_stage + 3 * f / tp)
                   + T2 * S2 / 4)
        fwd_logits = T2 * vocab / tp * _LOGIT_COPIES_FORWARD[backend] if last else 0.0
        fwd = fwd_act * act_bytes + fwd_logits * 4
        if fwd > comps["activations"] + comps["transient"] + comps["logits"]:
            comps.update(activations=int(fwd_act * act_bytes), transient=0, logits=int(fwd_logits * 4))
        staging = params * (static_per_param - 4) + experts * (static_per_expert_param - 4)  # no grad buffer
        div, ediv = (dp, edp) if distributed_optimizer else (1, 1)
        static = {"params": int((params + experts) * pbytes), "grads": int((params + experts) * 4),
                  "optimizer": int(params * opt_bytes / div + experts * opt_bytes / ediv)}
        est = MemoryEstimate(total=sum(comps.values()), components=comps, stage=stage, async_staging=int(staging),
                             static=static)
        if best is None or est.total > best.total:
            best = est
    assert best is not None
    best.inputs = {"max_tokens_per_microbatch": T, "max_seq_len": int(max_seq_len), "tp": tp, "pp": pp, "dp": dp,
                   "ep": ep, "etp": etp, "sequence_parallel": sp > 1,
                   "params_dtype": params_dtype, "layer_spec": layer_spec,
                   "recompute_granularity": recompute_granularity, "loss_backend": loss_backend}
    return best


def estimate_for_config(cfg: Any, arch: GPTArch, max_tokens_per_microbatch: int | None = None,
                        device: str | None = None, te: bool | None = None) -> MemoryEstimate:
    """:func:`estimate_policy_memory` for a run config (``da3po_megatron.config.Config``). ``device`` / ``te``:
    what a policy rank sees (the trainer asks one, ``trainer/cluster/placement.py: probe_devices``); None = this
    process's view (standalone tools and tests; the trainer's driver always passes them and never touches CUDA)."""
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if te is None:
        from da3po_megatron.megatron.model import use_te

        te = use_te(cfg.model) if device == "cuda" else False
    te = te and device == "cuda"
    p, a = cfg.parallel, cfg.actor
    backend = a.loss_backend if a.loss_backend in ("torch", "fused_linear") else "kernel"
    return estimate_policy_memory(
        arch, max_tokens_per_microbatch=max_tokens_per_microbatch or a.max_tokens_per_microbatch,
        max_seq_len=cfg.rollout.max_prompt_length + cfg.rollout.max_response_length,
        tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size, dp=p.data_parallel_size,
        params_dtype=cfg.model.params_dtype if device == "cuda" else "float32",
        layer_spec="te" if te else "local", recompute_granularity=cfg.model.recompute_granularity,
        loss_backend=backend, distributed_optimizer=cfg.optim.use_distributed_optimizer,
        temperature_scaled=cfg.rollout.temperature != 1.0, device=device,
        logprob_max_tokens_per_microbatch=getattr(a, "logprob_max_tokens_per_microbatch", 0) or None,
        ep=getattr(p, "expert_model_parallel_size", 1), etp=getattr(p, "expert_tensor_parallel_size", None),
        sequence_parallel=p.tensor_model_parallel_size > 1 if getattr(p, "sequence_parallel", None) is None
        else bool(p.sequence_parallel))


def device_memory_bytes(device: str | None = None) -> tuple[int, str]:
    """(bytes one policy rank may use, how it was found): free memory of GPU 0, or on CPU the host's available
    memory (``psutil.virtual_memory().available``) -- on CPU every local rank and engine shares it."""
    import torch

    if (device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda":
        free, total = torch.cuda.mem_get_info()
        return int(free), f"free memory of cuda:{torch.cuda.current_device()} ({total / GiB:.1f} GiB total)"
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.available), f"available host memory ({vm.total / GiB:.1f} GiB total)"


def fit_microbatch_tokens(estimate_at: Any, budget_bytes: int, start: int, minimum: int) -> int | None:
    """The largest micro-batch token budget in [minimum, start] whose estimate fits ``budget_bytes`` (halving, then
    a binary search), or None when even ``minimum`` does not fit. ``estimate_at(tokens) -> MemoryEstimate``."""
    if estimate_at(minimum).total > budget_bytes:
        return None
    lo, hi = minimum, start
    if estimate_at(hi).total <= budget_bytes:
        return hi
    while hi - lo > max(1, minimum // 16):
        mid = (lo + hi) // 2
        if estimate_at(mid).total <= budget_bytes:
            lo = mid
        else:
            hi = mid
    return lo


def engines_sleep_while_training(cfg: Any) -> bool:
    """Whether colocated engines sleep while the policy trains: only with the "ipc" transport ("auto" picks it when
    colocated on CUDA) at staleness 0 without partial rollouts (``Run.engines_idle``); otherwise an awake engine
    holds ``gpu_memory_utilization x total`` beside the training step (issue 57, P4)."""
    r = cfg.rollout
    return bool(r.colocate and r.weight_transfer in ("ipc", "auto") and r.staleness == 0
                and not getattr(r, "partial_rollouts", False))


def _colocated_timeline(cfg: Any, arch: GPTArch, est: MemoryEstimate, total: int, log: Any, mode: str) -> None:
    """The device-memory timeline (:mod:`.memory_timeline`) of one colocated GPU of ``total`` bytes, replayed with
    the trainer's call order (a resume, an engine restart and a save included): its peak per phase printed, a
    :class:`MemoryBudgetError` naming phase, event and field when it does not fit (``actor.memory_check=refuse``)."""
    from da3po_megatron.megatron.memory_timeline import DeviceTimeline, TimelineError, figures_for_config
    from da3po_megatron.megatron.memory_timeline_calls import TRAINER_ORDER, call_sequence

    events = call_sequence(TRAINER_ORDER, cfg.actor.offload, resume=True, restart_at=1,
                           async_save=bool(cfg.trainer.async_save), hf=bool(cfg.trainer.save_hf_every))
    tl = DeviceTimeline(figures_for_config(cfg, arch, total, est)).run(events)
    log(f"memory: device timeline per GPU ({TRAINER_ORDER} call order, peak per phase of {total / GiB:.1f} GiB): "
        + ", ".join(f"{p} {peak / GiB:.1f}" for p, peak, _ in tl.phases())
        + f"; pinned host {tl.host_pinned() / GiB:.1f} GiB per GPU as allocated")
    if mode == "refuse":
        try:
            tl.refuse()
        except TimelineError as e:
            raise MemoryBudgetError(str(e)) from None


def check_policy_memory(cfg: Any, arch: GPTArch, available: int | None = None, where: str = "",
                        log: Any = print, device: str | None = None, te: bool | None = None,
                        local_ranks: int | None = None, total: int | None = None) -> int:
    """Estimate the policy's peak per rank for the run config, print it, and compare it with the device.

    On CPU every local policy rank and engine shares the host's memory: the budget is the available host memory minus
    each engine's weights (fp32) and KV cache (``rollout.kv_cache_memory_bytes``), divided over the local policy ranks
    (all ranks when ``ray.address == "local"``). On GPU one rank per device: its free memory, less what a colocated
    engine takes (``rollout.gpu_memory_utilization``). ``actor.memory_check``: "refuse" raises
    :class:`MemoryBudgetError` when the estimate exceeds the budget; "fit" lowers ``actor.max_tokens_per_microbatch``
    to the largest budget that fits (at least one longest sequence) and returns it; "warn" only prints.
    Returns the (possibly lowered) micro-batch token budget.

    ``device`` / ``available`` / ``where`` / ``te``: what one policy rank sees (its device, free memory and layer
    spec: the trainer asks one, ``trainer/cluster/placement.py: probe_devices``); None = this process's own view.
    ``local_ranks``: policy ranks sharing one node's host memory on CPU (None: all of them with a local Ray, else 1).
    ``total``: the device's whole memory (the probe's ``total_bytes``); colocated on CUDA the engine's share is then
    ``gpu_memory_utilization x total`` (vLLM's rule, ``vllm/v1/worker/utils.py:724-726``) and the device-memory
    timeline is replayed (:func:`_colocated_timeline`). Colocated engines that do not sleep while the policy trains
    (:func:`engines_sleep_while_training`) leave the policy ``available - util x total`` (P4).
    """
    mode = getattr(cfg.actor, "memory_check", "refuse")
    tokens = int(cfg.actor.max_tokens_per_microbatch)
    if mode == "skip":
        return tokens
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if available is None:
        available, where = device_memory_bytes(device)
    world = int(cfg.policy_world_size)
    if device == "cpu":
        s = _shape(arch)
        params = s["L"] * _layer_params(s, 1, False, False) + s["V"] * s["h"] * (2 - s["tied"])
        if arch.is_moe:  # the engine holds every expert (and no dense MLP in MoE layers)
            params += sum(arch.moe_pattern()) * (sum(moe_layer_params(arch)) - 3 * s["h"] * s["f"])
        engines = int(cfg.rollout.num_engines) * (4 * params + int(cfg.rollout.kv_cache_memory_bytes))
        if local_ranks is None:
            local_ranks = world if cfg.ray.address == "local" else 1
        budget = max(0, available - engines) // max(1, local_ranks)
        share = (f"{where} {available / GiB:.1f} GiB - {cfg.rollout.num_engines} engine(s) {engines / GiB:.1f} GiB, "
                 f"over {local_ranks} local rank(s)")
    else:
        budget = int(available)  # colocated: training runs beside the sleeping engine (time-multiplexed plan below)
        share = f"{where}" + (", colocated: the engine sleeps while the policy trains" if cfg.rollout.colocate else "")
        if cfg.rollout.colocate and not engines_sleep_while_training(cfg):  # P4: an awake engine beside the step
            budget = max(0, int(available) - math.ceil((total or available) * cfg.rollout.gpu_memory_utilization))
            share = f"{where}, colocated beside an awake engine (rollout.staleness > 0 or weight_transfer not ipc)"
    est = estimate_for_config(cfg, arch, tokens, device, te)
    log(f"memory: {est.summary()}; budget per rank {budget / GiB:.2f} GiB ({share})")
    if device == "cuda" and engines_sleep_while_training(cfg):  # time-multiplexed: generation beside the policy
        from da3po_megatron.megatron.offload import colocated_plan, ipc_sync_extra_bytes

        sync = ipc_sync_extra_bytes(arch, int(cfg.rollout.weight_sync_bucket_mb * 2**20),
                                    2 if cfg.model.params_dtype == "bfloat16" else 4)
        device_bytes = int(total or available)
        plan = colocated_plan(est.static, est.components.get("runtime", 0), est.total, device_bytes,
                              math.ceil(device_bytes * cfg.rollout.gpu_memory_utilization), cfg.actor.offload, sync)
        log(f"memory: {plan['message']}")
        if plan["train_fits"] and not plan["fits"] and mode == "refuse":
            raise MemoryBudgetError(f"{plan['message']}: set actor.offload={plan['needed']!r}" if plan["needed"]
                                    else plan["message"])
        if total:
            _colocated_timeline(cfg, arch, est, int(total), log, mode)
    if est.total <= budget or mode == "warn":
        return tokens
    longest = int(cfg.rollout.max_prompt_length + cfg.rollout.max_response_length)
    fit = fit_microbatch_tokens(lambda t: estimate_for_config(cfg, arch, t, device, te), budget, tokens, longest)
    if mode == "fit" and fit is not None:
        log(f"memory: lowering actor.max_tokens_per_microbatch {tokens} -> {fit} (estimate "
            f"{estimate_for_config(cfg, arch, fit, device, te).total / GiB:.2f} GiB; actor.memory_check=fit)")
        return fit
    hint = (f"set actor.max_tokens_per_microbatch<={fit} (or actor.memory_check=fit to do so automatically)"
            if fit is not None else "no micro-batch of one longest sequence fits: use more ranks (TP/PP"
            + (", or a larger parallel.expert_model_parallel_size: the experts, their gradients and Adam state "
               "divide over EP" if arch.is_moe else "") + ")")
    raise MemoryBudgetError(
        f"the policy needs ~{est.total / GiB:.2f} GiB per rank at actor.max_tokens_per_microbatch={tokens} but "
        f"{budget / GiB:.2f} GiB are available per rank ({share}); {hint}. Other levers: "
        f"model.recompute_granularity=selective|full, actor.loss_backend=fused_linear, actor.memory_check=warn")
