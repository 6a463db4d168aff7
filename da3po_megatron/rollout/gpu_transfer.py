"""GPU weight transports through vLLM's weight-transfer API (CUDA only): CUDA IPC when colocated, NCCL otherwise.

vLLM 0.32 ships both halves: worker-side engines (``weight_transfer_config={"backend": "ipc" | "nccl"}`` on the
``LLM``; :class:`~da3po_megatron.rollout.engine.VLLMEngine` sets it from ``EngineConfig.weight_transfer_backend``) and
trainer-side engines (``WeightTransferTrainerFactory.trainer_init``), driven through a control-plane client --
``vllm.distributed.weight_transfer.RayVLLMWeightSyncClient`` over our engine actors, whose method names match.

- "ipc" (policy and engine share GPUs; verl's / slime's colocated mode): the trainer rank exports CUDA-IPC handles of
  each HF tensor (packed into bounded buffers), the engine maps them and loads in a layerwise-reload session. The
  engine sleeps while the policy trains and wakes its weights before the transfer, its KV cache after
  (:func:`colocated_sync`).
- "nccl" (disaggregated engines): one NCCL group of the sender (rank 0) and every engine worker; weights are
  broadcast in packed buffers. Each engine's workers take ranks ``1 + engine_index * tensor_parallel_size + ...``
  (:meth:`VLLMEngine.init_weight_transfer_engine` offsets them; vLLM's trainer gives every engine offset 1).

The sending side runs in the policy process (it owns the CUDA tensors). :func:`make_source` adapts the policy's
collective export (Megatron names -> HF names through the bridge) to vLLM's ``WeightSource``; vLLM's trainer engines
have a single sender, so this covers PP = 1 (every stage's tensors on the sender); with PP > 1 use the "bytes"
transport (:func:`~da3po_megatron.rollout.weight_sync.push_policy_weights`), which takes pushes from every stage.

Nothing here runs on CPU: every entry point checks ``torch.cuda.is_available()`` and says so. Not tested on this
project's CPU machines; the CPU path (``bytes``) is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from da3po_megatron.rollout.types import RolloutError


def require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs CUDA (vLLM's IPC / NCCL weight transfer is CUDA-only); on CPU use "
                           "EngineConfig.weight_transfer_backend='bytes' and RolloutClient.update_weights")


def make_source(make_iter: Callable[[], Iterator[tuple[str, torch.Tensor]]]) -> Any:
    """A re-iterable vLLM ``WeightSource``: ``make_iter()`` gives a fresh HF-named stream each round (e.g.
    ``lambda: export_policy(worker)``, the bridge's one export). ``metadata()`` runs one pass to learn
    names/dtypes/shapes and caches it (a collective pass for a Megatron export, on every rank alike)."""
    from vllm.distributed.weight_transfer import ParamMeta, WeightSource

    class HFExportSource(WeightSource):
        def __init__(self) -> None:
            self._meta: list | None = None

        def metadata(self) -> list:
            if self._meta is None:
                self._meta = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in make_iter()]
            return self._meta

        def __iter__(self):
            yield from make_iter()

    return HFExportSource()


def open_trainer_transfer(backend: str, engine_handles: list[Any], source: Any, *, rank: int = 0,
                          engines_tp_size: int = 1, master_address: str | None = None,
                          master_port: int | None = None, packed: bool = True,
                          packed_buffer_mb: float | None = None) -> Any:
    """Rendezvous the trainer side with the engines; returns vLLM's trainer engine (call ``.send_weights()``).

    ``rank``: this policy rank (0 sends; the others only take part in the export collectives). "nccl" needs
    ``master_address`` / ``master_port`` of the sender; the group holds ``1 + len(engine_handles) * engines_tp_size``
    ranks.
    """
    require_cuda(f"weight transfer backend {backend!r}")
    from vllm.distributed.weight_transfer import RayVLLMWeightSyncClient, WeightTransferTrainerFactory

    extra: dict[str, Any] = {}
    if packed_buffer_mb is not None:
        extra["packed_buffer_size_bytes"] = int(packed_buffer_mb * 2**20)
    client = RayVLLMWeightSyncClient(list(engine_handles))
    if backend == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        info = IPCTrainerInitInfo(rank=rank, packed=packed, **extra)
    elif backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        if master_address is None or master_port is None:
            raise ValueError("the nccl weight transfer needs master_address and master_port (the sender's)")
        info = NCCLTrainerInitInfo(rank=rank, master_address=master_address, master_port=int(master_port),
                                   world_size=1 + len(engine_handles) * engines_tp_size, packed=packed, **extra)
    else:
        raise ValueError(f"unknown GPU weight transfer backend {backend!r}; expected 'ipc' or 'nccl'")
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def colocated_sync(client: Any, transfer: Any) -> None:
    """Colocated (IPC) step boundary: wake engine weights, send, wake the KV cache. The RL loop calls
    ``client.sleep()`` before training so the policy gets the memory back."""
    require_cuda("colocated weight sync")
    client.wake_up(tags=["weights"])
    try:
        transfer.send_weights()
    except Exception as e:
        raise RolloutError(f"GPU weight transfer failed: {type(e).__name__}: {e}") from e
    client.wake_up(tags=["kv_cache"])
