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

from da3po_megatron.megatron.offload import PARTS, TIERS, tier_parts


def engines_after_policy(colocate: bool, engine_cuda: bool, offload_first: bool = False) -> bool:
    """Whether the engines must wait for the policy: colocated, and the engines see CUDA (what engine bundle 0's
    probe reported, ``placement_ray.probe_devices``), so their KV cache is sized from free device memory -- or
    ``offload_first``: the ``actor.offload`` cycle is on (:attr:`OffloadCycle.effective`, also on CPU with
    ``actor.offload_without_sleep``), so the policy offloads its tier before the engines start (issue 57, P1)."""
    return bool(colocate and (engine_cuda or offload_first))


def engines_will_sleep(weight_transfer: str, has_cuda: bool, colocate: bool) -> bool:
    """Whether the engines will sleep between generations, known before they start: the transport will be "ipc"
    (``rollout.weight_sync.choose_transport``: "ipc", or "auto" colocated on CUDA; "collective" is refused there
    and "bytes" never sleeps). ``has_cuda``: policy rank 0's and engine 0's probes both saw CUDA."""
    return bool(has_cuda and colocate and weight_transfer in ("ipc", "auto"))


def start_engines_after_policy(policy: Any, prewarmed: Callable[[], Any], start_engines: Callable[[], Any],
                               offload: Callable[[], Any] | None = None) -> Any:
    """The colocated tail of the start-up, after the policy's build (``policy.wait_ready()``), HF load and a
    resume's checkpoint load: wait for the checkpoint prewarm (``prewarmed``, the waiter of
    ``policy.start("prewarm_checkpointing", ...)``), offload ``actor.offload``'s tier (``offload``:
    :meth:`OffloadCycle.offload_before_start`; vLLM 0.32 refuses to start unless the device's free memory is at least
    ``gpu_memory_utilization x total``, ``vllm/v1/worker/utils.py:724-726, 761-770``, and that free memory is
    device-wide, ``vllm/utils/mem_utils.py:143``, so the policy on the same GPU counts: issue 57, P1), have every
    policy rank return its cached device blocks, then start the engines (``start_engines``: builds the
    :class:`~da3po_megatron.rollout.RolloutClient`, not waiting for it). Returns the client; the caller waits for it
    (``wait_ready``)."""
    from da3po_megatron.rollout.ipc import release_cached_memory

    prewarmed()
    if offload is not None:
        offload()
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
    the device and comes back, against the engines' sleep and wake (NeMo-RL's order, issue 49; issue 57 P1, P2:
    nothing is reloaded beside an awake KV cache):

    0. start-up (``Cluster.start``): after the HF load and a resume's checkpoint load, :meth:`offload_before_start`
       offloads the tier, the policy releases its cached blocks, then the engines start (vLLM's start-up rule);
    1. the engines finished generating and sleep (``Run.engines_idle``) -> :meth:`engines_asleep`: every policy rank
       reloads what it offloaded, before its next forward (old log-probs, then the training step);
    2. the step boundary (``Run.sync_weights``): :meth:`before_wake` offloads gradients and optimizer state (a
       pending asynchronous checkpoint was staged when it was scheduled, ``megatron/checkpoint.py``), the engines
       wake their weights, the policy pushes the new weights, :meth:`after_push` offloads the parameters, the
       engines wake their KV cache and generate beside the offloaded policy. A resync after an engine restart
       (awake engines, policy offloaded) reloads the parameters only, and only when the tier offloaded them, with
       the engines asleep (level 1) first;
    3. a checkpoint save (or HF export) between 2 and 1 runs inside :meth:`resident`: awake engines sleep (level 1:
       weights kept in host memory, ``vllm/v1/worker/gpu_worker.py:294-330``), the policy reloads, saves, offloads its
       tier again and releases its cached blocks, then the engines wake their weights and KV cache.

    ``effective``: ``actor.offload`` is not "none" and the engines sleep (``engines_sleep``: the "ipc" transport) or
    ``actor.offload_without_sleep`` applies the cycle anyway (CPU: the engines do not sleep, so the sleep and
    wake-up calls are skipped; the recorded sequence is the same). ``engines``: the
    :class:`~da3po_megatron.rollout.RolloutClient`, set by bring-up once the engines exist. ``calls`` records the
    run's calls that change what a GPU holds, in order, in the device-memory timeline's vocabulary
    (``megatron/memory_timeline_calls.py``; bring-up records its start-up steps with :meth:`record`), so a test
    replays a real run's sequence through ``megatron/memory_timeline.py``.
    """

    def __init__(self, policy: Any, tier: str, engines_sleep: bool, without_sleep: bool = False,
                 staleness: int = 0) -> None:
        self.policy, self.tier, self.engines_sleep = policy, tier, engines_sleep
        self.engines: Any = None
        self.log: str | None = None
        # staleness >= 1: the engines generate while the policy trains (they never sleep; config/checks.py refuses it)
        self.effective = tier != "none" and (engines_sleep or without_sleep) and staleness == 0
        self.offloaded = False
        self.awake = False  # the engines hold their KV cache (started, or woken by a sync)
        self.calls: list[str] = []
        self.seconds = {"offload_s": 0.0, "reload_s": 0.0}  # the last cycle's, logged as sync/offload_s, sync/reload_s
        if tier != "none":
            why = "the engines sleep" if engines_sleep else "actor.offload_without_sleep" if without_sleep else ""
            print(f"actor.offload={tier}: " + (f"{', '.join(PARTS[:TIERS.index(tier)])} leave the device while the "
                                               f"engines generate ({why})" if self.effective else
                                               "inactive (the engines do not sleep: rollout.staleness > 0 or not "
                                               "colocated on CUDA; actor.offload_without_sleep applies it anyway)"),
                  flush=True)

    WATCHED = {"compute_logprobs": "policy:forward", "train_step": "policy:train_step",
               "generate": "engines:generate", "restart": "engines:restart"}

    def watch(self, policy: Any, engines: Any) -> None:
        """Record also the calls the loop makes outside the cycle: the policy's forwards and training steps
        (``PolicyGroup._call_sharded``) and the engines' generation rounds and restarts (``RolloutClient``), through
        their ``on_call`` hooks, so a run's record carries every event the device-memory timeline replays."""
        def hook(method: str) -> None:
            if method in self.WATCHED:
                self.record(self.WATCHED[method])

        policy.on_call = engines.on_call = hook

    def record(self, event: str) -> None:
        """One event of the run's calls (``calls``); with ``log`` (a path: bring-up sets it from
        ``$DA3PO_MEMORY_CALLS``), also appended there, one a line, for a test or a GPU run to replay."""
        self.calls.append(event)
        if self.log is not None:
            with open(self.log, "a") as fh:
                fh.write(event + "\n")

    def _offload(self, parts: tuple[str, ...]) -> None:
        if self.effective:
            t0 = time.perf_counter()
            self.policy.call_all("offload_state", parts)
            self.seconds["offload_s"] += time.perf_counter() - t0
            self.offloaded = True
            self.record("policy:offload " + "+".join(parts))

    def _reload(self, parts: tuple[str, ...] | None = None) -> None:
        """Every offloaded part back on the device, or only ``parts`` (the rest stays offloaded)."""
        t0 = time.perf_counter()
        if parts is None:
            self.policy.call_all("reload_offloaded")
            self.offloaded = False
            self.record("policy:reload")
        else:
            self.policy.call_all("reload_offloaded", parts)
            self.record("policy:reload " + "+".join(parts))
        self.seconds["reload_s"] = time.perf_counter() - t0

    def _release_cached(self) -> None:
        from da3po_megatron.rollout.ipc import release_cached_memory

        self.policy.run_on_all(release_cached_memory)
        self.record("policy:release_cached")

    def _sleep(self, level: int) -> None:
        if self.engines_sleep:
            self.engines.sleep(level=level)
        self.awake = False
        self.record(f"engines:sleep {level}")

    def _wake(self, tag: str) -> None:
        if self.engines_sleep:
            self.engines.wake_up(tags=[tag])
        self.record(f"engines:wake {tag}")

    def offload_before_start(self) -> None:
        """Start-up: the tier off the device before the engines start (issue 57, P1); the first
        :meth:`engines_asleep` reloads it. The caller releases the cached blocks and starts the engines."""
        self._offload(tier_parts(self.tier))

    def engines_started(self) -> None:
        self.awake = True
        self.record("engines:start")

    def before_wake(self) -> None:
        """Gradients and optimizer state off the device, before the engines' weights wake up."""
        self._offload(("grads", "optimizer"))

    def after_push(self) -> None:
        """The parameters off the device, once the engines hold the new weights (before their KV cache wakes)."""
        self._offload(("params",))

    def around_sync(self, push: Callable[..., Any], inside: bool) -> Any:
        """The step boundary: ``push(before_wake, before_kv_wake)`` with the offload steps passed in (``inside``:
        the "ipc" transport, which wakes the engines itself, ``rollout/ipc.py`` ipc_sync: the policy's cached
        blocks released before each wake-up), else around a plain ``push()`` (``actor.offload_without_sleep``: the
        same order without wake-ups). A resync while offloaded (an engine restarted; the engines awake) reloads the
        parameters only, and only when the tier offloaded them, with the engines asleep first (level 1)."""
        self.record("phase:resync" if self.awake else "phase:sync")  # awake: an engine restarted, or a resume
        if self.effective and self.offloaded and "params" in tier_parts(self.tier):
            if self.awake:
                self._sleep(1)
            self._reload(("params",))
        self.seconds["offload_s"] = 0.0

        def wake_weights() -> None:
            self.before_wake()
            if self.effective:
                self.record("policy:release_cached")
                self.record("engines:wake weights")

        def wake_kv() -> None:
            if self.effective:
                self.record("sync:push")
            self.after_push()
            if self.effective:
                self.record("policy:release_cached")
                self.record("engines:wake kv_cache")

        if inside:  # ipc_sync: before_wake, release, wake weights, push, before_kv_wake, release, wake KV cache
            stats = push(wake_weights, wake_kv)
        else:
            wake_weights()
            try:
                stats = push()
            finally:
                wake_kv()
        self.awake = True
        self.record("phase:generate")
        return {**stats, **self.seconds} if self.effective else stats

    def engines_asleep(self, slept: bool = False) -> None:
        """Everything back on the device before the policy's next forward (``slept``: the engines were just put to
        sleep at level 2, ``Run.engines_idle``; recorded first, also where the cycle skips the call on CPU)."""
        if slept or self.effective:
            self.awake = False
            self.record("engines:sleep 2")
        if self.effective and self.offloaded:
            self._reload()
        self.record("phase:train")  # the old log-probs' forward and the training step follow

    @contextmanager
    def resident(self) -> Iterator[None]:
        """The policy reloaded inside (a checkpoint, an HF export), offloaded again after -- never beside an awake
        KV cache (issue 57, P2): awake engines sleep first (level 1 keeps their weights in host memory), and wake
        their weights and KV cache once the policy has offloaded its tier and released its cached blocks. Nothing
        happens when nothing is offloaded."""
        if not (self.effective and self.offloaded):
            yield
            return
        slept = self.awake
        self.record("phase:save")
        if slept:
            self._sleep(1)
        self._reload()
        try:
            yield
        finally:
            self._offload(tier_parts(self.tier))
            self._release_cached()
            if slept:
                self._wake("weights")
                self._wake("kv_cache")
                self.awake = True
            self.record("phase:generate")


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
