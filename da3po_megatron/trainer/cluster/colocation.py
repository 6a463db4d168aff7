"""Colocated start-up on CUDA: the engines start only once the policy on the same GPUs has finished allocating.

Why. A colocated engine shares its GPU with policy rank i (``trainer/cluster/placement.py``) and sizes its KV cache from
what its memory profile sees on the whole device. vLLM 0.32 charges every byte of device-wide free memory that
disappears between its start and the end of its profile run to its own non-KV memory (``total_consumed =
before_create.free_memory - after_profile.free_memory``, ``vllm/utils/mem_utils.py:309-321``) and takes the KV cache
from what is left of ``gpu_memory_utilization`` (``vllm/v1/worker/gpu_worker.py:740-744``); it also asserts that no
other process freed device memory meanwhile ("Error in memory profiling ... other processes sharing the same
container release GPU memory", ``gpu_worker.py:717-731``). The policy's build, its HF load and the checkpoint writer's
prewarm allocate -- and free -- in that window when both sides start together (the default, which is right when the
engines have GPUs of their own), so the engines get a much smaller KV cache, or fail to start.

So, colocated on CUDA (:func:`engines_after_policy`): policy build -> HF load -> checkpoint prewarm -> the policy
returns its cached blocks (:func:`~da3po_megatron.rollout.ipc.release_cached_memory`, ``torch.cuda.empty_cache``)
-> the engines start and profile a device whose other tenant no longer changes (:func:`start_engines_after_policy`).
The same release runs before the engines wake from sleep at every step boundary (``rollout/ipc.py: ipc_sync``).
Without CUDA (the CPU tests, a CPU cluster) the KV cache is a fixed ``rollout.kv_cache_memory_bytes`` and both sides
still start side by side. The price on GPU: the engines' start-up no longer overlaps the policy's, once per launch
(not measured here: no GPU has run it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from da3po_megatron.megatron.offload import PARTS, TIERS


def engines_after_policy(colocate: bool, engine_cuda: bool) -> bool:
    """Whether the engines must wait for the policy: colocated, and the engines see CUDA (what engine bundle 0's
    probe reported, ``placement_ray.probe_devices``), so their KV cache is sized from free device memory."""
    return bool(colocate and engine_cuda)


def start_engines_after_policy(policy: Any, prewarmed: Callable[[], Any], start_engines: Callable[[], Any]) -> Any:
    """The colocated tail of the start-up, after the policy's build (``policy.wait_ready()``) and HF load: wait for
    the checkpoint prewarm (``prewarmed``, the waiter of ``policy.start("prewarm_checkpointing", ...)``), have every
    policy rank return its cached device blocks, then start the engines (``start_engines``: builds the
    :class:`~da3po_megatron.rollout.RolloutClient`, not waiting for it). Returns the client; the caller waits for it
    (``wait_ready``)."""
    from da3po_megatron.rollout.ipc import release_cached_memory

    prewarmed()
    policy.run_on_all(release_cached_memory)
    return start_engines()


def engine_slots(plan: Any, policy: Any) -> dict[str, Any]:
    """The ``RolloutClient.ray`` arguments that seat colocated engines of TP > 1 on their policy ranks' GPUs (issue
    49): engine i in bundle i x TP of the policy's placement group, with ``CUDA_VISIBLE_DEVICES`` = the GPU ids Ray
    gave ranks i x TP .. i x TP + TP - 1 (asked of the started policy actors: ``placement.colocated_engine_envs``).
    ``{}`` otherwise (one bundle per engine, Ray's own GPU assignment)."""
    if not plan.need.colocate or plan.need.engine_tp == 1:
        return {}
    from da3po_megatron.trainer.cluster.placement import colocated_engine_envs
    from da3po_megatron.trainer.cluster.placement_ray import actor_location

    envs = colocated_engine_envs(plan, policy.run_on_all(actor_location)) if plan.need.device == "gpu" else []
    return {"placement_bundle_stride": plan.engine_bundle_stride, "engine_envs": envs}


class OffloadCycle:
    """The driver's side of ``actor.offload`` (tiers in ``megatron/offload.py``): when each part of the policy leaves
    the device and comes back, against the engines' sleep and wake (NeMo-RL's order, issue 49):

    1. the engines finished generating and sleep (``Run.engines_idle``) -> :meth:`engines_asleep`: every policy rank
       reloads what it offloaded, before its next forward (old log-probs, then the training step);
    2. the step boundary (``Run.sync_weights``): :meth:`before_wake` offloads gradients and optimizer state (a
       pending asynchronous checkpoint was staged when it was scheduled, ``megatron/checkpoint.py``), the engines
       wake their weights, the policy pushes the new weights, :meth:`after_push` offloads the parameters, the
       engines wake their KV cache and generate beside the offloaded policy;
    3. a checkpoint save between 2 and 1 runs inside :meth:`resident` (reloaded, saved, offloaded again).

    ``effective``: ``actor.offload`` is not "none" and the engines sleep (``weight_transfer == "ipc"``) or
    ``actor.offload_without_sleep`` applies the cycle anyway (CPU). ``calls`` records the cycle, in order, beside
    the engines' ``sleep`` / ``wake_up`` (``record``), for tests and the docs.
    """

    def __init__(self, policy: Any, tier: str, engines_sleep: bool, without_sleep: bool = False,
                 staleness: int = 0) -> None:
        self.policy, self.tier = policy, tier
        # staleness >= 1: the engines generate while the policy trains (they never sleep; config/checks.py refuses it)
        self.effective = tier != "none" and (engines_sleep or without_sleep) and staleness == 0
        self.offloaded = False
        self.calls: list[str] = []
        self.seconds = {"offload_s": 0.0, "reload_s": 0.0}  # the last cycle's, logged as sync/offload_s, sync/reload_s
        if tier != "none":
            why = "the engines sleep" if engines_sleep else "actor.offload_without_sleep" if without_sleep else ""
            print(f"actor.offload={tier}: " + (f"{', '.join(PARTS[:TIERS.index(tier)])} leave the device while the "
                                               f"engines generate ({why})" if self.effective else
                                               "inactive (the engines do not sleep: rollout.staleness > 0 or not "
                                               "colocated on CUDA; actor.offload_without_sleep applies it anyway)"),
                  flush=True)

    def record(self, event: str) -> None:
        self.calls.append(event)

    def _offload(self, parts: tuple[str, ...]) -> None:
        if self.effective:
            t0 = time.perf_counter()
            self.policy.call_all("offload_state", parts)
            self.seconds["offload_s"] += time.perf_counter() - t0
            self.offloaded = True
            self.record("policy:offload " + "+".join(parts))

    def before_wake(self) -> None:
        """Gradients and optimizer state off the device, before the engines' weights wake up."""
        self._offload(("grads", "optimizer"))

    def after_push(self) -> None:
        """The parameters off the device, once the engines hold the new weights (before their KV cache wakes)."""
        self._offload(("params",))

    def around_sync(self, push: Callable[..., Any], inside: bool) -> Any:
        """The step boundary: ``push(before_wake, before_kv_wake)`` with the offload steps passed in (``inside``:
        the "ipc" transport, which wakes the engines itself, ``rollout/ipc.py`` ipc_sync), else around a plain
        ``push()`` (``actor.offload_without_sleep``: the same order without wake-ups). A resync while offloaded (an
        engine restarted) reloads the policy first."""
        self.engines_asleep()
        self.seconds["offload_s"] = 0.0
        if inside:
            stats = push(self.before_wake, self.after_push)
        else:
            self.before_wake()
            try:
                stats = push()
            finally:
                self.after_push()
        return {**stats, **self.seconds} if self.effective else stats

    def engines_asleep(self, slept: bool = False) -> None:
        """Everything back on the device before the policy's next forward (``slept``: the engines were just put to
        sleep, recorded first)."""
        if slept:
            self.record("engines:sleep")
        if self.effective and self.offloaded:
            t0 = time.perf_counter()
            self.policy.call_all("reload_offloaded")
            self.seconds["reload_s"] = time.perf_counter() - t0
            self.offloaded = False
            self.record("policy:reload")

    @contextmanager
    def resident(self) -> Iterator[None]:
        """The policy reloaded inside (a checkpoint, an HF export), offloaded again after."""
        was = self.offloaded
        self.engines_asleep()
        try:
            yield
        finally:
            if was:
                self.before_wake()
                self.after_push()


def push_weights(cluster: Any, before_wake: Callable[[], Any] | None = None,
                 before_kv_wake: Callable[[], Any] | None = None) -> dict[str, float]:
    """``Run.sync_weights``'s push through the transport chosen at start-up (``cluster.weight_transfer``; ``cluster``:
    bring-up's :class:`~da3po_megatron.trainer.cluster.bringup.Cluster`): "collective" (one
    :class:`~da3po_megatron.rollout.collective_transport.CollectiveTransport` kept on the cluster), "ipc" (with the
    offload steps ``before_wake`` / ``before_kv_wake`` inside ``ipc_sync``), else "bytes"."""
    from da3po_megatron.rollout.weight_sync import sync_policy_group_to_engines

    r, p = cluster.cfg.rollout, cluster.cfg.parallel
    if cluster.weight_transfer == "collective":
        from da3po_megatron.rollout.collective_transport import CollectiveTransport

        if cluster.transport is None:
            cluster.transport = CollectiveTransport(cluster.policy.run_on_all, p.pipeline_model_parallel_size,
                                                    backend="nccl" if cluster.devices["policy"]["cuda"] else "gloo",
                                                    timeout_s=r.weight_sync_timeout_s,
                                                    expert_parallel=p.expert_model_parallel_size)
        return cluster.transport.sync(cluster.rollout, bucket_mb=r.weight_sync_bucket_mb)
    if cluster.weight_transfer == "ipc":
        from da3po_megatron.rollout.ipc import ipc_sync

        return ipc_sync(cluster.policy, cluster.rollout, bucket_mb=r.weight_sync_bucket_mb, before_wake=before_wake,
                        before_kv_wake=before_kv_wake)
    return sync_policy_group_to_engines(cluster.policy, cluster.rollout, bucket_mb=r.weight_sync_bucket_mb)
