"""What a step moves and stages in host memory, planned before anything starts (issue 46 M3, M7).

Two things the device-memory plan (:mod:`.memory`) does not see:

* **MoE routes** (M3): an engine returns, per completion it was asked routes of, ``[P + R - 1, MoE layers, top_k]``
  small ints (uint8 up to 254 experts, ``rollout/types.route_dtype``) -- 384 B per position for Qwen3-30B-A3B (48
  layers x top-8). They travel engine -> driver -> policy ranks. Routing replay R3 (``moe.routing_replay=rollout``)
  needs every route; the router-agreement metric alone takes ``moe.router_agreement_fraction`` of the completions
  (the engines drop the others' routes in their worker: ``rollout/engine.py``). :func:`route_bytes_per_step` is the
  worst case per step (every kept prompt's n responses at the longest prompt + response; over-sampled generation
  rounds add in proportion); the trainer prints it, and the shipped recipes stay under
  :data:`ROUTE_BUDGET_BYTES` (tests/test_moe_host_memory.py).
* **Asynchronous-save staging** (M7): megatron-core's async save copies every tensor a rank writes -- its weights
  and its distributed-optimizer shard (fp32 main weights and Adam moments) -- to host memory before the writer
  process forks (``dist_checkpointing/strategies/async_utils.py`` 198-206 ``preload_fn``; on GPU pinned host
  memory), and holds it until the write completes. On CPU nothing is copied before the fork, but the next step's
  updates duplicate every page they write (copy-on-write) while the writer runs: up to the same bytes.
  :func:`check_async_save_memory` counts it per node (every policy rank of the node, ``MemoryEstimate.async_staging``)
  against the node's host memory, which the placement probe reports (``trainer/cluster/placement._probe``:
  ``psutil.virtual_memory`` where the rank will run) and, when it does not fit, falls back to synchronous saves with
  a message (``trainer.async_save=false``; a save that blocks the step is slower, not wrong: refusing the run for it
  would be worse). Qwen3-30B-A3B at TP 4 x PP 2 x EP 4: ~53 GB per rank, ~420 GB for a node of 8 ranks.
* **Pinned offload buffers** (issue 57, P6): ``actor.offload`` copies the optimizer's state (and at ``all`` the
  parameters) into page-locked host buffers, one per device storage (``megatron/offload.py``), allocated at the first
  offload -- after the placement probe measured the node's host memory. On GPU both they and the async-save staging
  are pinned through torch's caching host allocator, which rounds every allocation up to a power of two and keeps it
  (``aten/src/ATen/core/CachingHostAllocator.h``: ``PowerOf2Ceil``; :func:`pinned_host_bytes`, the same figures as
  the device timeline's host row). :func:`check_async_save_memory` counts both as allocated: the offload buffers
  first (refused, naming ``actor.offload``, when they alone exceed the node's host memory), the staging in what is
  left. The 8B colocated recipe at ``grads+optimizer``: 11.4 GiB per rank nominal, 15.7 GiB as allocated; its async
  staging 26.7 GiB nominal, 36.5 GiB as allocated -- 418 GiB per node of 8 ranks, not the 214 GiB counted before.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from da3po_megatron.megatron.arch import GPTArch

GiB = 2**30
# What the driver may move for routes per step without R3 (the agreement metric alone): the routes of the 30B
# recipes' paper-size step at the default fraction are ~0.9 GiB; every route would be ~18 GiB.
ROUTE_BUDGET_BYTES = 2 * GiB
# host memory left to everything else of a GPU node (the driver, Ray, the OS, page cache) when async-save staging is
# planned
HOST_RESERVE_FRACTION = 0.1


def route_fraction(moe: Any, streaming: bool = False) -> float:
    """The fraction of completions whose routes the engines return: 1 with R3 (every route is replayed),
    ``moe.router_agreement_fraction`` for the agreement metric alone, 0 when neither reads them (or, without R3,
    the engines stream: the metric's sample is not taken there)."""
    if moe is None:
        return 0.0
    if getattr(moe, "routing_replay", "none") != "none":
        return 1.0
    if not getattr(moe, "router_agreement", False) or streaming:
        return 0.0
    return float(getattr(moe, "router_agreement_fraction", 1.0))


def route_bytes_per_position(arch: GPTArch) -> int:
    """Bytes of one position's routes: MoE layers x top-k x the route dtype (1 byte up to 254 experts, else 2)."""
    if not arch.is_moe:
        return 0
    size = 1 if (arch.num_moe_experts or 0) <= 254 else 2
    return sum(arch.moe_pattern()) * int(arch.moe_router_topk) * size


def route_bytes_per_step(cfg: Any, arch: GPTArch) -> int:
    """Worst-case route bytes of one step's kept batch (module doc): ``data.train_batch_size`` x ``rollout.n``
    completions x ``route_fraction`` x (``max_prompt_length + max_response_length - 1``) positions x
    :func:`route_bytes_per_position`."""
    r = cfg.rollout
    frac = route_fraction(cfg.moe, r.mode == "streaming")
    positions = r.max_prompt_length + r.max_response_length - 1
    return int(cfg.data.train_batch_size * r.n * frac * positions * route_bytes_per_position(arch))


def route_plan_line(cfg: Any, arch: GPTArch, engine_cuda: bool = False) -> str:
    """One line for the memory plan: the routes a step moves, what they are for, and the budget. ``engine_cuda``:
    the engines capture through vLLM's engine-wide switch (``rollout/engine_routes.route_capture``), so for a sample
    they still carry every route of the step in their own processes: said with its size."""
    b = route_bytes_per_step(cfg, arch)
    m = cfg.moe
    why = ("R3 replays every route" if m.routing_replay != "none" else
           f"router agreement on {m.router_agreement_fraction:g} of the completions" if b else "none read")
    inside = ""
    if engine_cuda and 0 < route_fraction(cfg.moe, cfg.rollout.mode == "streaming") < 1:
        every = int(b / route_fraction(cfg.moe))
        inside = (f"; on CUDA vLLM's capture is engine-wide (no per-request switch in 0.32): the engines carry every "
                  f"route, up to {every / GiB:.2f} GiB per step, and drop the unread ones before the driver "
                  "(moe.router_agreement=false turns capture off)")
    return (f"routes: up to {b / GiB:.2f} GiB per step ({why}; {route_bytes_per_position(arch)} B per position, "
            f"{cfg.data.train_batch_size} x {cfg.rollout.n} completions of <= "
            f"{cfg.rollout.max_prompt_length + cfg.rollout.max_response_length} tokens; budget without R3 "
            f"{ROUTE_BUDGET_BYTES / GiB:.0f} GiB){inside}")


def async_save_staging_bytes(cfg: Any, arch: GPTArch, device: str, te: bool = False) -> int:
    """Host bytes one policy rank stages for an asynchronous save (module doc; the heaviest pipeline stage)."""
    from da3po_megatron.megatron.memory import estimate_for_config

    return estimate_for_config(cfg, arch, device=device, te=te).async_staging


def pinned_host_bytes(cfg: Any, arch: GPTArch, device: str, te: bool = False) -> dict[str, int]:
    """Per policy rank, the host bytes pinned on GPU (module doc): "offload" (``actor.offload``'s host copies: the
    optimizer tier's fp32 masters and Adam moments, ``all``'s parameters too; gradients are dropped, not copied) and
    "staging" (an asynchronous save's copies), each as allocated (power-of-two rounded, ``memory_timeline_calls.
    pinned_sizes``) and nominal (``*_nominal``). On CPU nothing is pinned: the nominal bytes, unrounded."""
    from da3po_megatron.megatron.memory import estimate_for_config
    from da3po_megatron.megatron.memory_timeline_calls import pinned_sizes, policy_parts
    from da3po_megatron.megatron.offload import tier_parts

    est = estimate_for_config(cfg, arch, device=device, te=te)
    params, masters, moments = policy_parts(cfg, est)
    parts = tier_parts(getattr(getattr(cfg, "actor", None), "offload", "none"))
    keys = (("masters", "moments") if "optimizer" in parts else ()) + (("params",) if "params" in parts else ())
    nominal = {"params": params, "masters": masters, "moments": moments}
    out = {"offload_nominal": sum(nominal[k] for k in keys), "staging_nominal": est.async_staging}
    if device == "cpu":
        return {**out, "offload": out["offload_nominal"], "staging": out["staging_nominal"]}
    fig = SimpleNamespace(params=params, masters=masters, moments=moments)  # what pinned_sizes reads
    pinned = pinned_sizes(cfg, arch, fig, est.async_staging)
    return {**out, "offload": sum(pinned[k] for k in keys), "staging": pinned["staging"]}


def check_async_save_memory(cfg: Any, arch: GPTArch, ranks_per_node: int, host_available: int | None,
                            device: str, te: bool = False, log: Any = print, policy_bytes_per_rank: int = 0) -> bool:
    """Whether ``trainer.async_save`` can stay on: the staging of ``ranks_per_node`` ranks against the node's
    available host memory (on CPU less what the policy ranks themselves take, ``policy_bytes_per_rank`` each; on
    GPU less :data:`HOST_RESERVE_FRACTION` and less the ranks' pinned offload buffers, both pinned sizes as allocated:
    :func:`pinned_host_bytes`). When it cannot, sets ``cfg.trainer.async_save = False`` and says so. Returns the
    (possibly changed) setting. Unknown host memory (None): left on, with a note. Follows ``actor.memory_check`` as
    the device plan does: "skip" checks nothing, "warn" only says so; "refuse" raises ``MemoryBudgetError`` naming
    ``actor.offload`` when the pinned offload buffers alone exceed the node's host memory (on GPU)."""
    mode = getattr(getattr(cfg, "actor", None), "memory_check", "refuse")
    if mode == "skip":
        return bool(cfg.trainer.async_save)
    pinned = pinned_host_bytes(cfg, arch, device, te)
    offload = pinned["offload"] if device != "cpu" else 0  # on CPU the copies replace the "device" bytes
    if device == "cpu":
        room = None if host_available is None else host_available - ranks_per_node * policy_bytes_per_rank
    else:
        room = None if host_available is None else int(host_available * (1 - HOST_RESERVE_FRACTION))
    if offload:
        line = (f"pinned offload buffers (actor.offload={cfg.actor.offload}) {offload / GiB:.1f} GiB per rank as "
                f"allocated (nominal {pinned['offload_nominal'] / GiB:.1f}: each pinned allocation rounded up to a "
                f"power of two), {offload * ranks_per_node / GiB:.1f} GiB for the node's {ranks_per_node} rank(s)")
        if room is None:
            log(f"memory: host: {line}; the node's host memory is unknown, not checked")
        elif offload * ranks_per_node > room:
            if mode == "refuse":
                from da3po_megatron.megatron.memory import MemoryBudgetError

                raise MemoryBudgetError(f"host memory: {line}: more than the node's {room / GiB:.1f} GiB: lower "
                                        "actor.offload (or fewer ranks per node)")
            log(f"memory: host: {line}: more than the node's {room / GiB:.1f} GiB (actor.memory_check=warn)")
        else:
            log(f"memory: host: {line}, in {room / GiB:.1f} GiB")
    if not cfg.trainer.async_save:
        return False
    per_rank = pinned["staging"]
    need = per_rank * ranks_per_node
    allocated = "" if device == "cpu" else f" as allocated (nominal {pinned['staging_nominal'] / GiB:.1f})"
    if room is None:
        log(f"memory: asynchronous saves stage ~{per_rank / GiB:.1f} GiB per rank{allocated} ({need / GiB:.1f} GiB "
            "per node) in host memory; the node's host memory is unknown, not checked")
        return True
    room -= offload * ranks_per_node
    after = " left after the offload buffers" if offload else ""
    line = (f"asynchronous saves stage ~{per_rank / GiB:.1f} GiB per rank{allocated} (weights + optimizer shard), "
            f"{need / GiB:.1f} GiB for the node's {ranks_per_node} rank(s), in {room / GiB:.1f} GiB of host "
            f"memory{after}")
    if need <= room:
        log(f"memory: {line}")
        return True
    if mode == "warn":
        log(f"memory: {line}: does not fit (actor.memory_check=warn: asynchronous saves stay on)")
        return True
    cfg.trainer.async_save = False
    log(f"memory: {line}: does not fit -- checkpoints are saved SYNCHRONOUSLY (trainer.async_save=false; the save "
        "blocks the step instead). More host memory per node, fewer ranks per node or a larger expert/data-parallel "
        "split brings them back")
    return False
