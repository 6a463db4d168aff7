"""What is resident on one colocated GPU at every event of a run: the device-memory timeline (issue 57, point 1).

On a colocated GPU a policy rank and an engine worker take device memory in turn. :mod:`.memory` estimates the
policy's peak, :func:`.offload.colocated_plan` checks two phases; neither sees the ORDER in which memory is taken and
given back, which is where the shipped colocated recipe fails on a GPU (``notes/gpu-read-2026-12-06.md`` P1, P2, P4).
This module replays a sequence of events (:mod:`.memory_timeline_calls`: the trainer's calls, today's and the fixed
order) against the plan's own figures (:func:`figures_for_config`) and reports, per event, what each side holds,
the peak inside the event and the free memory, and every violation with its phase and the config field to change.
Pure: no device, no process; the same replay checks every event of a recorded CPU run.

The device, per GPU (bytes; one policy rank and one engine worker per GPU, the heaviest PP stage):

- policy: ``runtime`` (CUDA context + NCCL buffers, ``memory.RUNTIME_OVERHEAD``), ``params``, ``grads`` (the fp32 DDP
  buffer), the optimizer split into fp32 ``masters`` (bf16 runs; megatron-core ``distrib_optimizer.py:399``) and Adam
  ``moments`` (created at the first step, TE ``fused_adam.py:539-545``, or by a checkpoint load), ``cached`` blocks of
  the caching allocator (a forward's or step's activations, until ``torch.cuda.empty_cache``: ``release_cached`` or
  an offload, ``offload.py`` ``offload``), and inside a forward / train step ``activations + transient + logits``;
- engine: its own CUDA context and NCCL buffers (``ENGINE_CONTEXT``: created before vLLM measures, outside its
  budget), then ``gpu_memory_utilization x total`` -- vLLM's rule, not x free: ``requested_memory = ceil(total x
  util)`` (``vllm/v1/worker/utils.py:724-726``) holds the weights, the profiled activation peak, the CUDA-graph pool
  (profiled into the budget since 0.21, ``v1/worker/gpu_worker.py:686-700, 715-718``) and the KV cache (the rest,
  ``:715-718``). Sleep (``gpu_worker.py:294-330``) frees weights and KV cache; the context and graph pool stay. A
  wake-up maps the same sizes again.
- vLLM's start-up rule: the worker refuses to start unless the device's free memory, taken after its own context and
  NCCL init, is >= ``util x total`` (``utils.py:761-770``, ``gpu_worker.py:505-537``; free is device-wide,
  ``utils/mem_utils.py:143``, so the policy on the same GPU counts).
- host: pinned buffers as allocated -- torch's caching host allocator rounds every pinned allocation up to a power of
  two and keeps it (``aten/src/ATen/core/CachingHostAllocator.h``, ``PowerOf2Ceil``): one per offloaded storage
  (``offload.py`` ``_Storage``), the async-save staging, a level-1 engine sleep's weight copy (P6).

Left out: fragmentation, vLLM's sampler / workspace buffers outside the profile run, the policy's HF-load and
checkpoint-prewarm transients (released before the engines start). Graph pool and engine context are estimates
(``GRAPH_POOL``, ``ENGINE_CONTEXT``); everything else is the plan's own arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from da3po_megatron.megatron.memory_timeline_calls import (
    kv_bytes_per_sequence,
    model_params,
    pinned_sizes,
    policy_parts,
    pow2ceil,
)
from da3po_megatron.megatron.offload import PARTS, tier_parts

__all__ = ["DeviceTimeline", "Figures", "TimelineError", "figures_for_config", "pow2ceil"]

GiB = 2**30
ENGINE_CONTEXT = int(0.5 * GiB)  # the engine process's CUDA context + NCCL communicator (estimate, not measured)
GRAPH_POOL = 1 * GiB  # vLLM's captured CUDA graphs (estimate; 0 with enforce_eager)
H200 = 143_771 * 2**20  # nvidia-smi's total of an H200 (141 GB HBM3e)
GPU_80GB = 81_559 * 2**20  # nvidia-smi's total of an H100 80 GB


@dataclass(frozen=True)
class Figures:
    """Per-GPU sizes (bytes) the timeline replays; :func:`figures_for_config` fills them from the plan."""

    total: int  # the device's memory
    runtime: int
    params: int
    grads: int
    masters: int
    moments: int
    step_extra: int  # activations + transient + logits of a forward / train step (the estimate's peak beyond static)
    engine_budget: int  # ceil(util x total)
    engine_weights: int  # one engine worker's weights (its TP shard)
    engine_context: int = ENGINE_CONTEXT
    graph_pool: int = GRAPH_POOL
    sync_extra: int = 0  # an IPC sync's bucket + one full tensor beyond the policy's own weights (offload.py)
    tier: str = "none"
    pinned: dict[str, int] = field(default_factory=dict)  # pinned host bytes as allocated per part / "staging"
    gpus_per_node: int = 8
    util: float = 0.0
    receive_extra: int = 0  # a split layout's engine GPU during a collective sync: the receive pool (3 buffers)
    kv_min: int = 0  # the KV cache one request of max_model_len needs on one engine GPU (vLLM's start-up check)

    @property
    def engine_kv(self) -> int:
        return max(0, self.engine_budget - self.engine_weights - self.graph_pool)


class TimelineError(ValueError):
    """A layout that does not fit at some event (the message names the phase, the event and the field)."""


@dataclass
class Violation:
    phase: str
    event: str
    kind: str  # "startup" / "kv" (vLLM's rules), "overflow" (peak > device), "offloaded" (used while offloaded)
    need: int
    have: int
    fix: str

    def __str__(self) -> str:
        g = GiB
        what = {"startup": "vLLM refuses to start: free", "overflow": "device memory exceeded:",
                "offloaded": "used while offloaded:", "kv": "vLLM refuses to start: KV cache"}[self.kind]
        return (f"{self.phase}: {self.event}: {what} {self.have / g:.1f} GiB vs {self.need / g:.1f} GiB needed "
                f"-> {self.fix}")


@dataclass
class Row:
    phase: str
    event: str
    policy: int  # resident after the event (runtime + parts + cached)
    engine: int
    peak: int  # the most the device holds during the event
    free: int  # after the event


class DeviceTimeline:
    """Replays events (``"actor:verb arg"`` strings, :mod:`.memory_timeline_calls`) on one GPU's :class:`Figures`.
    ``phase:NAME`` events set the phase the following rows and violations are named after."""

    def __init__(self, fig: Figures) -> None:
        self.fig = fig
        self.phase = "start-up"
        self.on: dict[str, int] = {}  # policy parts on the device
        self.offloaded: set[str] = set()
        self.cached = 0
        self.engine = "none"  # none | awake | weights (KV asleep) | asleep
        self.host: dict[str, int] = {}  # pinned host bytes as allocated (kept: the allocator caches them)
        self.rows: list[Row] = []
        self.violations: list[Violation] = []

    # ------------------------------------------------------------------ sizes now
    def policy_bytes(self) -> int:
        return (self.fig.runtime + sum(self.on.values()) + self.cached) if self.on else 0

    def engine_bytes(self) -> int:
        f = self.fig
        return {"none": 0, "asleep": f.engine_context + f.graph_pool,
                "weights": f.engine_context + f.graph_pool + f.engine_weights,
                "awake": f.engine_context + f.engine_budget}[self.engine]

    def device_bytes(self) -> int:
        return self.policy_bytes() + self.engine_bytes()

    # ------------------------------------------------------------------ the replay
    def run(self, events: list[str]) -> DeviceTimeline:
        for ev in events:
            self.apply(ev)
        return self

    def apply(self, event: str) -> None:
        actor, _, rest = event.partition(":")
        verb, _, arg = rest.partition(" ")
        if actor == "phase":
            self.phase = verb
            return
        before, seen = self.device_bytes(), len(self.violations)
        handler = getattr(self, f"_{actor}_{verb}", None)
        if handler is None:
            raise ValueError(f"unknown timeline event {event!r} (the vocabulary: megatron/memory_timeline_calls.py)")
        extra = handler(arg) or 0
        # the event's blocks come from the caching allocator's cached ones first, and stay cached after it
        peak = self.device_bytes() - self.cached + max(self.cached, extra)
        if peak > self.fig.total and peak > before and len(self.violations) == seen:  # what this event adds
            self._violate(event, "overflow", peak, self.fig.total)
        self.cached = max(self.cached, extra) if self.on else 0
        self.rows.append(Row(self.phase, event, self.policy_bytes(), self.engine_bytes(), peak,
                             self.fig.total - self.device_bytes()))

    def _violate(self, event: str, kind: str, need: int, have: int) -> None:
        self.violations.append(Violation(self.phase, event, kind, need, have, self._fix(event, kind, need - have)))

    def _fix(self, event: str, kind: str, over: int) -> str:
        f = self.fig
        lower = f"or rollout.gpu_memory_utilization<={max(0.0, math.floor((f.util - over / f.total) * 100) / 100):.2f}"
        if kind == "offloaded":
            return "reload the policy before it is used (PolicyWorker.reload_offloaded; trainer order)"
        if kind == "kv":
            return ("raise rollout.gpu_memory_utilization, or rollout.tensor_parallel_size, or shorten "
                    "rollout.max_prompt_length + max_response_length (one request of max_model_len must fit)")
        if kind == "startup":
            left = [p for p in tier_parts(f.tier) if p not in self.offloaded and self.on.get(_part_key(p))]
            if left:
                return (f"offload actor.offload's tier ({'+'.join(left)}) before the engines start (trainer start "
                        f"order), {lower.removeprefix('or ')}")
            return f"a larger actor.offload tier, {lower.removeprefix('or ')}"
        if event.startswith("policy:reload") and self.engine == "awake":
            return ("the engines must sleep while the policy reloads (save between train_step and the sync, or "
                    f"sleep them around it; a resync reloads params only), {lower}")
        if event.startswith(("policy:train_step", "policy:forward")) and self.engine == "awake":
            return ("the engines must sleep while the policy trains (rollout.weight_transfer=ipc, rollout.staleness=0"
                    f"), {lower}")
        if event.startswith(("policy:train_step", "policy:forward")):
            return "lower actor.max_tokens_per_microbatch, or model.recompute_granularity=full"
        if self.engine != "none" and self.on:
            needed = next((t for t in ("grads", "grads+optimizer", "all") if _tier_rank(t) > _tier_rank(f.tier)
                           and self._resident_at(t) + self.engine_bytes() <= f.total), None)
            if needed:
                return f"actor.offload={needed!r} (configured {f.tier!r}), {lower}"
        return lower.removeprefix("or ")

    def _resident_at(self, tier: str) -> int:
        return self.fig.runtime + sum(v for k, v in self.on.items() if _part_of(k) not in tier_parts(tier))

    # ------------------------------------------------------------------ policy verbs
    def _policy_build(self, _: str) -> None:
        f = self.fig
        self.on = {"params": f.params, "grads": f.grads, "masters": f.masters}

    def _policy_load_hf(self, _: str) -> None:
        return None

    def _policy_release_cached(self, _: str) -> None:
        self.cached = 0

    def _policy_offload(self, arg: str) -> None:
        wanted = [p for p in PARTS if p in tier_parts(self.fig.tier) and p not in self.offloaded
                  and (not arg or p in arg.split("+"))]
        for part in wanted:
            for key in [k for k in self.on if _part_of(k) == part]:
                if part != "grads":  # grads are freed without a copy (megatron-core's own API)
                    self.host[key] = max(self.host.get(key, 0), self.fig.pinned.get(key, pow2ceil(self.on[key])))
                self.on[key] = 0
            self.offloaded.add(part)
        if wanted:
            self.cached = 0  # offload() ends with torch.cuda.empty_cache()

    def _policy_reload(self, arg: str) -> None:
        """``policy:reload`` brings back everything offloaded (``PolicyWorker.reload_offloaded``); ``policy:reload
        params`` only the parameters (what a resync needs)."""
        back = {p for p in self.offloaded if not arg or p in arg.split("+")}
        for key in self.on:
            if _part_of(key) in back:
                self.on[key] = getattr(self.fig, key)
        self.offloaded -= back

    def _require(self, event: str, parts: tuple[str, ...]) -> None:
        out = [p for p in parts if p in self.offloaded]
        if out:
            self._violate(event, "offloaded", 0, 0)

    def _policy_load_checkpoint(self, _: str) -> None:
        self._require("policy:load_checkpoint", PARTS)  # dist_checkpointing loads into the storages as they are
        self.on["moments"] = self.fig.moments

    def _policy_forward(self, _: str) -> int:
        self._require("policy:forward", ("params",))
        return self.fig.step_extra

    def _policy_train_step(self, _: str) -> int:
        self._require("policy:train_step", PARTS)
        self.on["moments"] = self.fig.moments  # Adam's state exists from the first step on
        return self.fig.step_extra

    def _policy_save(self, arg: str) -> None:
        self._require("policy:save", ("params", "optimizer"))
        if arg == "async":
            self.host["staging"] = max(self.host.get("staging", 0), self.fig.pinned.get("staging", 0))

    def _policy_save_hf(self, _: str) -> int:
        self._require("policy:save_hf", ("params",))
        return self.fig.sync_extra

    # ------------------------------------------------------------------ engine verbs
    def _engines_start(self, _: str) -> None:
        free = self.fig.total - self.device_bytes() - self.fig.engine_context  # measured after its own context
        if free < self.fig.engine_budget:
            self._violate("engines:start", "startup", self.fig.engine_budget, free)
        elif self.fig.engine_kv < self.fig.kv_min:  # weights + graph pool leave too little for one request
            self._violate("engines:start", "kv", self.fig.kv_min, self.fig.engine_kv)
        self.engine = "awake"

    def _engines_restart(self, arg: str) -> None:
        self.engine = "none"
        self._engines_start(arg)

    def _engines_sleep(self, arg: str) -> None:
        if arg == "1":
            self.host["engine_weights"] = pow2ceil(self.fig.engine_weights)
        self.engine = "asleep"

    def _engines_wake(self, arg: str) -> None:
        if self.engine == "awake":
            return  # a wake-up of an awake engine is a warning in vLLM (v1/executor/abstract.py:394-397)
        self.engine = "weights" if arg == "weights" else "awake"

    def _engines_generate(self, _: str) -> None:
        return None

    def _sync_receive(self, _: str) -> int:
        """A collective sync's receive pool on an engine GPU, beside the awake engine (outside vLLM's budget)."""
        return self.fig.receive_extra

    def _sync_push(self, _: str) -> int:
        self._require("sync:push", ("params",))
        return self.fig.sync_extra

    # ------------------------------------------------------------------ reports
    def phases(self) -> list[tuple[str, int, int]]:
        """(phase, peak policy+engine bytes, peak free-after) per phase, in first-seen order."""
        out: dict[str, int] = {}
        for r in self.rows:
            out[r.phase] = max(out.get(r.phase, 0), r.peak)
        return [(p, v, self.fig.total - v) for p, v in out.items()]

    def host_pinned(self) -> int:
        return sum(self.host.values())

    def table(self) -> str:
        g, f = GiB, self.fig
        lines = [f"device {f.total / g:.1f} GiB per GPU; engine util x total = {f.engine_budget / g:.1f} GiB "
                 f"(weights {f.engine_weights / g:.1f}, KV {f.engine_kv / g:.1f}, graphs {f.graph_pool / g:.1f}) "
                 f"+ context {f.engine_context / g:.1f}; actor.offload={f.tier}",
                 "| phase | event | policy GiB | engine GiB | peak GiB | free GiB |", "|---|---|---|---|---|---|"]
        for r in self.rows:
            mark = " **over**" if r.peak > f.total else ""
            lines.append(f"| {r.phase} | `{r.event}` | {r.policy / g:.1f} | {r.engine / g:.1f} | "
                         f"{r.peak / g:.1f}{mark} | {r.free / g:.1f} |")
        lines.append(f"host: pinned {self.host_pinned() / g:.1f} GiB per GPU as allocated (power-of-two rounding), "
                     f"{self.host_pinned() * f.gpus_per_node / g:.0f} GiB per node of {f.gpus_per_node} GPUs")
        return "\n".join(lines)

    def refuse(self) -> None:
        """Raise :class:`TimelineError` naming every violation (phase, event, field), if any."""
        if self.violations:
            raise TimelineError("device-memory timeline: " + "; ".join(str(v) for v in self.violations))


def _part_of(key: str) -> str:
    return "optimizer" if key in ("masters", "moments") else key


def _part_key(part: str) -> str:
    return "masters" if part == "optimizer" else part


def _tier_rank(tier: str) -> int:
    return len(tier_parts(tier))


def figures_for_config(cfg: Any, arch: Any, total: int, est: Any, graph_pool: int | None = None,
                       engine_context: int = ENGINE_CONTEXT, gpus_per_node: int = 8) -> Figures:
    """The per-GPU figures of a colocated run config on a device of ``total`` bytes, from the plan's own arithmetic:
    ``est`` (:func:`.memory.estimate_for_config` on CUDA: static parts, step peak, runtime), the engine's ``util x
    total`` and its weights (the model's parameters in the engine's dtype over the engine's TP), the IPC sync's
    bound (:func:`.offload.ipc_sync_extra_bytes`), the pinned host buffers as allocated (``pinned_sizes``); for an
    engine GPU the KV cache one request of max_model_len needs (``kv_bytes_per_sequence``) and, with the collective
    transport, the receive pool: 3 buffers of a bucket or the largest HF tensor (``rollout/collective_receive.py``
    ``BufferPool(keep=3)``; the "bytes" transport receives into host memory)."""
    from da3po_megatron.megatron.offload import ipc_sync_extra_bytes

    pbytes = 2 if cfg.model.params_dtype in ("bfloat16", "float16") else 4
    params, masters, moments = policy_parts(cfg, est)
    c = est.components
    r = cfg.rollout
    ebytes = {"float32": 4, "bfloat16": 2}.get(r.dtype, pbytes)
    eager = r.enforce_eager if getattr(r, "enforce_eager", None) is not None else False
    bucket, full = ipc_sync_extra_bytes(arch, int(r.weight_sync_bucket_mb * 2**20), pbytes)
    piece = ipc_sync_extra_bytes(arch, int(r.weight_sync_bucket_mb * 2**20), ebytes)[0]
    transport = getattr(r, "weight_transfer", "auto")
    receive = 3 * piece if transport == "collective" or (transport == "auto" and not r.colocate) else 0
    fig = Figures(total=int(total), runtime=c.get("runtime", 0), params=params,
                  grads=est.static["grads"], masters=masters, moments=moments,
                  step_extra=c.get("activations", 0) + c.get("transient", 0) + c.get("logits", 0),
                  engine_budget=math.ceil(total * r.gpu_memory_utilization),
                  engine_weights=int(model_params(arch) * ebytes / r.tensor_parallel_size),
                  engine_context=engine_context,
                  graph_pool=(0 if eager else GRAPH_POOL) if graph_pool is None else graph_pool,
                  sync_extra=bucket + full, tier=cfg.actor.offload, gpus_per_node=gpus_per_node,
                  util=float(r.gpu_memory_utilization), receive_extra=receive,
                  kv_min=kv_bytes_per_sequence(arch, r.max_prompt_length + r.max_response_length,
                                               r.tensor_parallel_size, ebytes))
    return replace(fig, pinned=pinned_sizes(cfg, arch, fig, est.async_staging))
