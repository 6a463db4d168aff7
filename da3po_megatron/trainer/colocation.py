"""Colocated start-up on CUDA: the engines start only once the policy on the same GPUs has finished allocating.

Why. A colocated engine shares its GPU with policy rank i (``trainer/placement.py``) and sizes its KV cache from
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

from collections.abc import Callable
from typing import Any


def engines_after_policy(colocate: bool, engine_cuda: bool) -> bool:
    """Whether the engines must wait for the policy: colocated, and the engines see CUDA (what engine bundle 0's
    probe reported, ``placement.probe_devices``), so their KV cache is sized from free device memory."""
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
