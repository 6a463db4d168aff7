"""The events that drive :mod:`.memory_timeline`, and the colocated trainer's call order written as them.

The vocabulary is the trainer's own calls, one event per call that changes what a GPU holds (``actor:verb arg``):

| event | the trainer's call (on every policy rank / every engine) |
|---|---|
| ``phase:NAME`` | a phase starts (start-up, resume-load, generate, old-logprobs, train, sync, save, resync...) |
| ``policy:build`` | the policy actors build model, DDP buffers and optimizer (``Cluster.start`` -> ``wait_ready``) |
| ``policy:load_hf`` | HF weights into the built model |
| ``policy:release_cached`` | ``rollout.ipc.release_cached_memory`` (``torch.cuda.empty_cache``) |
| ``policy:offload PARTS`` | ``PolicyWorker.offload_state(parts)`` (``OffloadCycle.before_wake`` / ``after_push``) |
| ``policy:reload [PARTS]`` | ``PolicyWorker.reload_offloaded`` (``OffloadCycle.engines_asleep``); PARTS: partial |
| ``policy:load_checkpoint`` | ``PolicyWorker.load`` (``Cluster.start(checkpoint=)``; before: ``RunState.restore``) |
| ``policy:forward`` | the old log-probs' forward (``trainer/old_logprobs.py``) |
| ``policy:train_step`` | ``PolicyWorker.train_step`` |
| ``policy:save [async]`` | ``PolicyWorker.save`` (``RunState.save_checkpoint``, inside ``OffloadCycle.resident``) |
| ``policy:save_hf`` | ``bridge.save_hf.save_policy_hf`` (``trainer.save_hf_every``) |
| ``engines:start`` / ``restart`` | the engines start (vLLM's start-up rule) / one restarts (``RolloutClient``) |
| ``engines:sleep LEVEL`` | ``RolloutClient.sleep(level)``: 2 ``Run.engines_idle``, 1 ``OffloadCycle.resident`` |
| ``engines:wake TAG`` | ``wake_up(tags=[TAG])``, TAG weights or kv_cache (``rollout.ipc.ipc_sync``) |
| ``engines:generate`` | a generation round or an evaluation |
| ``sync:push`` | the IPC buckets of one sync (``ipc_sync`` -> ``_ipc_push``); a split layout's sender alike |
| ``sync:receive`` | a split layout's engine GPU receiving one sync (``collective_receive.receive_stage``: its pool) |

:func:`call_sequence` writes the trainer's order before the fixes of issue 57 (``order="today"``: the engines start
beside the resident policy, a resume loads after they started, a save and a resync reload everything beside the
awake engines) and the order the trainer makes now (``order="fixed"``, :data:`TRAINER_ORDER`; read from
``trainer/cluster/bringup.py`` ``Cluster.start``, ``trainer/run.py``, ``trainer/cluster/colocation.py``
``OffloadCycle``, ``trainer/resume/run_state.py``, ``trainer/loop.py``): a resume's checkpoint loaded after the HF
load, the tier offloaded and the cached blocks released before the engines start; every checkpoint save (where the
loop makes it, after the sync and the evaluation) with the awake engines asleep at level 1 around the reload, the save
and the offload; a resync (and a resume's sync) that reloads the parameters only, and only when the tier offloaded
them. ``OffloadCycle.calls`` records a real run's calls in these strings (the loop's generation rounds, forwards,
training steps and engine restarts through ``OffloadCycle.watch``). :func:`split_sequences` writes a
non-colocated layout's two kinds of GPU: a policy GPU (no engine) and an engine GPU (no policy rank).
"""

from __future__ import annotations

from typing import Any

from da3po_megatron.megatron.offload import tier_parts

TRAINER_ORDER = "fixed"
"""The order the trainer makes its calls in now (``memory.check_policy_memory`` replays it): "fixed" since the
trainer offloads before the engines start, loads a resume's checkpoint before that, saves with the engines asleep and
reloads only the parameters for a resync (issue 57, P1 and P2: ``trainer/cluster/bringup.py`` ``Cluster.start``,
``trainer/cluster/colocation.py`` ``OffloadCycle``). "today" is the order before those fixes (kept: the test that
names P1 and P2 replays it)."""


def pow2ceil(n: int) -> int:
    """The bytes torch's caching host allocator takes for a pinned allocation of ``n`` bytes."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


def _sync(order: str, tier: str, offloaded: bool) -> list[str]:
    """One step boundary (``Run.sync_weights`` -> ``OffloadCycle.around_sync`` -> ``ipc_sync``)."""
    head = ["policy:reload"] if order == "today" and offloaded else []  # around_sync -> engines_asleep
    if order == "fixed" and "params" in tier_parts(tier) and offloaded:
        head = ["engines:sleep 1", "policy:reload params"]  # tier all: the push needs the parameters back
    return head + ["policy:offload grads+optimizer", "policy:release_cached", "engines:wake weights", "sync:push",
                   "policy:offload params", "policy:release_cached", "engines:wake kv_cache"]


def _save(order: str, tier: str, resident_cycle: bool, async_save: bool, hf: bool) -> list[str]:
    """A checkpoint save (``RunState.save_checkpoint``); ``resident_cycle``: inside ``OffloadCycle.resident`` with the
    policy offloaded (fixed: the awake engines sleep at level 1 first and wake after the tier is offloaded again)."""
    save = ["policy:save async" if async_save else "policy:save"] + (["policy:save_hf"] if hf else [])
    if not resident_cycle:
        return save
    if order == "today":  # resident(): engines_asleep() reloads beside the awake engines, offloads after
        return ["policy:reload", *save, "policy:offload grads+optimizer", "policy:offload params"]
    return ["engines:sleep 1", "policy:reload", *save, f"policy:offload {'+'.join(tier_parts(tier))}",
            "policy:release_cached", "engines:wake weights", "engines:wake kv_cache"]


def call_sequence(order: str = "today", tier: str = "grads+optimizer", steps: int = 2, save_steps: tuple = (2,),
                  eval_steps: tuple = (2,), resume: bool = False, restart_at: int | None = None,
                  async_save: bool = False, hf: bool = False, final_save: bool = True) -> list[str]:
    """The events of a colocated run on CUDA ("ipc", staleness 0) for ``steps`` steps: start-up (and a resume's
    load and sync), then per step generate, engines asleep, old log-probs, train, sync, evaluation and checkpoint;
    ``restart_at``: an engine restarted during that step's generation and resynced; ``final_save``: the end of the
    run's save (``trainer/loop.py`` ``train``: already saved steps are a no-op, so it is an out-of-cycle save only
    when the last step is not a save step)."""
    if order not in ("today", "fixed"):
        raise ValueError(f"order must be 'today' or 'fixed', got {order!r}")
    off = tier != "none"
    ev = ["phase:start-up", "policy:build", "policy:load_hf"]
    if order == "fixed":
        if resume:
            ev += ["phase:resume-load", "policy:load_checkpoint", "phase:start-up"]
        ev += [f"policy:offload {'+'.join(tier_parts(tier))}"] if off else []
    ev += ["policy:release_cached", "engines:start"]
    offloaded = order == "fixed" and off
    if resume:
        if order == "today":
            ev += ["phase:resume-load", "policy:load_checkpoint"]
        ev += ["phase:resume-sync", *_sync(order, tier, offloaded)]
        offloaded = off
    for step in range(1, steps + 1):
        ev += ["phase:generate", "engines:generate"]
        if restart_at == step:
            ev += ["phase:resync", "engines:restart", *_sync(order, tier, offloaded), "phase:generate",
                   "engines:generate"]
            offloaded = off
        ev += ["engines:sleep 2"] + (["policy:reload"] if offloaded else [])
        offloaded = False
        ev += ["phase:old-logprobs", "policy:forward", "phase:train", "policy:train_step"]
        ev += ["phase:sync", *_sync(order, tier, offloaded)]
        offloaded = off
        if step in eval_steps:
            ev += ["phase:evaluate", "engines:generate"]
        if step in save_steps:
            ev += ["phase:save", *_save(order, tier, offloaded, async_save, hf)]
    if final_save and steps not in save_steps:
        ev += ["phase:final-save", *_save(order, tier, offloaded, async_save, hf)]
    return ev


def split_sequences(steps: int = 2, save_steps: tuple = (2,), eval_steps: tuple = (2,), resume: bool = False,
                    restart_at: int | None = None, async_save: bool = False, hf: bool = False,
                    final_save: bool = True) -> dict[str, list[str]]:
    """The events of a split (non-colocated) layout, per kind of GPU (the same run as :func:`call_sequence`): a
    policy GPU builds, loads (a resume's checkpoint), and per step runs the old log-probs' forward, the training
    step, the sync's sender side (``sync:push``: a bucket and one full tensor beyond its weights) and the saves; an
    engine GPU starts its engine (vLLM's rules), generates, receives every sync beside its awake KV cache
    (``sync:receive``), restarts and resyncs, and evaluates. Nothing is offloaded and no engine sleeps."""
    pol = ["phase:start-up", "policy:build", "policy:load_hf"]
    eng = ["phase:start-up", "engines:start"]
    if resume:
        pol += ["phase:resume-load", "policy:load_checkpoint", "phase:resume-sync", "sync:push"]
        eng += ["phase:resume-sync", "sync:receive"]
    save = ["policy:save async" if async_save else "policy:save"] + (["policy:save_hf"] if hf else [])
    for step in range(1, steps + 1):
        eng += ["phase:generate", "engines:generate"]
        if restart_at == step:
            pol += ["phase:resync", "sync:push"]
            eng += ["phase:resync", "engines:restart", "sync:receive", "phase:generate", "engines:generate"]
        pol += ["phase:old-logprobs", "policy:forward", "phase:train", "policy:train_step", "phase:sync", "sync:push"]
        eng += ["phase:sync", "sync:receive"]
        if step in eval_steps:
            eng += ["phase:evaluate", "engines:generate"]
        if step in save_steps:
            pol += ["phase:save", *save]
    if final_save and steps not in save_steps:
        pol += ["phase:final-save", *save]
    return {"policy": pol, "engine": eng}


# ---------------------------------------------------------------------------------------------- sizes (pure)
def _tensors(arch: Any, tp: int = 1, pp: int = 1, ep: int = 1, etp: int = 1) -> list[float]:
    """Element counts of the parameter tensors of the first (heaviest: it holds the embedding) PP stage of one
    rank, one entry per tensor as megatron-core holds them (fused QKV, fused gate-up)."""
    h, f, a, g, d = arch.hidden_size, arch.ffn_hidden_size, arch.num_attention_heads, arch.num_query_groups, \
        arch.kv_channels
    pattern = arch.moe_pattern()
    out = [arch.vocab_size * h / tp] + ([arch.vocab_size * h / tp] if pp == 1 and
                                        not arch.share_embeddings_and_output_weights else []) + [h]
    for layer in range(arch.num_layers // pp):
        out += [h, h, h * (a + 2 * g) * d / tp, a * d * h / tp] + ([d, d] if arch.qk_layernorm else [])
        if pattern[layer]:
            fe = arch.moe_ffn_hidden_size
            out += [arch.num_moe_experts * h] + [2 * fe * h / etp, fe * h / etp] * (arch.num_moe_experts // ep)
        else:
            out += [2 * f * h / tp, f * h / tp]
    return out


def model_params(arch: Any) -> int:
    """The model's parameter count (every layer, embedding and output layer: what one engine holds)."""
    return int(sum(_tensors(arch)))


def kv_bytes_per_sequence(arch: Any, tokens: int, tp: int, dtype_bytes: int, block: int = 16) -> int:
    """The KV cache one request of ``tokens`` positions needs on one engine GPU: every layer's keys and values for
    the positions rounded up to whole blocks (vLLM's default block of 16), the GPU's share of the KV heads (heads are
    replicated when TP exceeds them). vLLM refuses to start an engine whose KV cache cannot hold one request of
    ``max_model_len`` (``vllm/v1/core/kv_cache_utils.py:1003-1040``, from ``check_enough_kv_cache_memory``, 1104)."""
    heads = max(1, arch.num_query_groups // max(1, tp))
    return int(-(-tokens // block) * block * arch.num_layers * 2 * heads * arch.kv_channels * dtype_bytes)


def policy_parts(cfg: Any, est: Any) -> tuple[int, int, int]:
    """(parameters, fp32 master weights, Adam moments) bytes per rank from the plan's static parts (``est``:
    :func:`.memory.estimate_for_config`): with bf16 parameters the masters are separate fp32 shards, a third of
    Adam's 12 B per parameter; with fp32 parameters they are views of the parameters (none of their own)."""
    opt = est.static["optimizer"]
    masters = opt // 3 if cfg.model.params_dtype in ("bfloat16", "float16") else 0
    return est.static["params"], masters, opt - masters


def pinned_sizes(cfg: Any, arch: Any, fig: Any, async_staging: int) -> dict[str, int]:
    """Pinned host bytes as torch's caching host allocator allocates them (each allocation rounded up to a power
    of two) for one policy rank: the parameters in one contiguous DDP buffer (distributed optimizer), the optimizer
    one buffer per storage (``offload.py`` ``_Storage``: every parameter's fp32 master shard and each Adam moment is
    its own storage, distrib_optimizer.py:399, 440-444) of about ``numel / DP`` elements each, and the async-save
    staging one buffer per tensor written. Scaled to the plan's totals (``fig``), so only the rounding is added."""
    p = cfg.parallel
    dp = p.data_parallel_size if cfg.optim.use_distributed_optimizer else 1
    tensors = _tensors(arch, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                       getattr(p, "expert_model_parallel_size", 1), getattr(p, "expert_tensor_parallel_size", 1) or 1)
    shard = [max(1, int(-(-n // dp))) * 4 for n in tensors]  # fp32 bytes of each parameter's shard on this rank

    def rounded(sizes: list[int], nominal: int) -> int:
        raw = sum(sizes)
        return int(sum(pow2ceil(s) for s in sizes) * nominal / raw) if raw and nominal else 0

    weights = [int(n) * (fig.params // max(1, int(sum(tensors)))) for n in tensors]
    return {"params": pow2ceil(fig.params), "masters": rounded(shard, fig.masters),
            "moments": 2 * rounded(shard, fig.moments // 2),
            "staging": rounded(weights + shard * (3 if fig.masters else 2), async_staging)}
