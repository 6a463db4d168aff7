"""Which CUDA stream the weight-sync tensors live on, and who waits for whom: one small interface, a CUDA
implementation and a CPU no-op one, so the receive code is the same on both devices and its structure can be checked
on CPU (tests/test_weight_sync_streams.py injects a recording stand-in into the same code path).

The rule (docs/rollout.md, "Streams"): **a bucket is received and loaded on one stream -- the loading thread's
current stream.** In a vLLM worker that thread is the one that runs the RPCs, and its current stream is not the
default stream: vLLM 0.32 creates a dedicated stream for each thread on that thread's first ``current_stream()`` call
and makes it current with ``torch.cuda.set_stream`` (``vllm/utils/torch_utils.py:818-857``; the cache is a
``threading.local``, line 803, and the patched ``set_stream`` at 806-808 records per thread -- its comment says "per
process", but every thread that asks gets its own), and captures and replays its CUDA graphs on it
(``vllm/compilation/cuda_graph.py:314-318``). The worker runs the model and our RPCs in one thread (the
multiprocessing executor's ``worker_busy_loop``, ``vllm/v1/executor/multiproc_executor.py:1037``), so the loading
thread's current stream is the model's. A second Python thread starts on the default stream (or, should it call
vLLM's ``current_stream()``, on a new stream of its own), and a NCCL ``work.wait()`` there orders only *that*
thread's stream after the broadcast -- so the receiving thread enters the loader's stream (:meth:`CudaOrder.use`)
before it allocates or broadcasts anything: ProcessGroupNCCL makes its NCCL stream wait for the caller's current
stream when a collective is issued, and ``wait()`` makes the caller's current stream wait for the NCCL stream, so a
broadcast into a buffer is ordered after every load queued before it and every load from it is ordered after the
broadcast. vLLM's own NCCL weight-transfer engine receives the same way, in the loading thread on its current stream
(``vllm/distributed/weight_transfer/nccl_engine.py:216-229``; its packed consumer receives and loads each buffer on
one stream and synchronizes that stream before reusing the buffer, ``packed_tensor.py:233-299``).

Buffer reuse does not rest on the stream order alone: a pooled buffer is handed out again only after its last load
is known to be queued and an event recorded after it (:meth:`BufferPool.mark_released
<da3po_megatron.rollout.collective.BufferPool.mark_released>` in the loading thread), and the next receive into it
waits for that event on the device first (:meth:`DeviceOrder.wait`) -- Python reference counts say when no view is
left, the event says when the device has finished reading it.

On CPU (gloo, host tensors) every operation is synchronous on the host: :class:`DeviceOrder` does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class DeviceOrder:
    """CPU: no streams and no events; every method is a no-op (host tensors are ordered by the host)."""

    kind = "cpu"

    def current_stream(self) -> Any:
        """The calling thread's current stream (called in the loading thread); None on CPU."""
        return None

    def use(self, stream: Any) -> contextlib.AbstractContextManager:
        """Make ``stream`` (and its device) current in the calling thread for the ``with`` block."""
        return contextlib.nullcontext()

    def record(self, stream: Any) -> Any:
        """An event recorded on ``stream`` now (everything queued on it so far); None on CPU."""
        return None

    def wait(self, stream: Any, event: Any) -> None:
        """``stream`` waits on the device for ``event`` (the host does not block)."""


class CudaOrder(DeviceOrder):
    """CUDA streams and events. GPU-only (docs/gpu_only.md, "weight sync"); the calls, all torch 2.13 public API:
    ``torch.cuda.current_stream`` (the thread's current stream -- the one vLLM's patched ``set_stream`` made current,
    ``vllm/utils/torch_utils.py:805-810``), ``torch.cuda.device`` + ``torch.cuda.stream`` (a new thread starts on
    device 0 and the default stream), ``torch.cuda.Event.record`` / ``Stream.wait_event``."""

    kind = "cuda"

    def current_stream(self) -> Any:
        return torch.cuda.current_stream()

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            yield

    def record(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        if event is not None:
            stream.wait_event(event)


def order_for(device: torch.device) -> DeviceOrder:
    """The stream discipline for tensors on ``device``: :class:`CudaOrder` on CUDA, the no-op one elsewhere."""
    return CudaOrder() if device.type == "cuda" else DeviceOrder()
