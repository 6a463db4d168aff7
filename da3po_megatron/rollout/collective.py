"""The "collective" weight transport: a private process group between the policy's sending ranks and every engine
worker, flat bucket buffers broadcast from the sender (gloo on CPU, NCCL on CUDA -- the same code, another backend).

This module holds what both sides share: the groups, the wire format and the packing. The sender is
:mod:`~da3po_megatron.rollout.collective_send`, the engine workers' side
:mod:`~da3po_megatron.rollout.collective_receive`, the driver's :mod:`~da3po_megatron.rollout.collective_transport`.

Layout. One group per pipeline stage ``s``: rank 0 is the stage's sender (the TP-rank-0 rank of DP replica 0 of that
stage), ranks ``1 + e * engine_tp + w`` are worker ``w`` of engine ``e`` (vLLM's ``parallel_config.rank``; vLLM's NCCL
engine offsets its workers the same way, ``rank_offset`` 1). Each stage's sender broadcasts its own tensors, nobody
relays: a relay would move 1/PP of the model once more over the policy's link and hold it in the relay's memory, and
in one shared group every sender would have to take part in (receive) the other stages' broadcasts. Engine workers
receive the stages one after the other (stage 0's stream, then stage 1's...), in the same order on every engine, so
the stages' senders never wait on each other in a cycle: stage 1's sender packs its first bucket and blocks in its
broadcast until the engines are done with stage 0.

Every group is built with its own ``TCPStore`` (the sender is its master) and ``ProcessGroupGloo`` /
``ProcessGroupNCCL`` constructed directly -- never ``init_process_group``, so neither Megatron's default group on the
policy side nor vLLM's on the engine side is touched (the functional ``dist.broadcast(group=...)`` refuses such an
unregistered group; the method ``pg.broadcast([t], opts)`` works, see the shared notes). Groups live across steps;
after an engine restart (``RolloutClient.restarts`` changes) or a failed sync they are torn down and rebuilt.

Wire format of one stage's stream (self-describing, so the engines need no metadata through Ray and one
``collective_rpc`` per stage and sync): for each bucket, a header ``int64[3] = (1, meta_bytes, buffer_bytes)``, the
JSON metadata ``[[hf_name, dtype, shape, offset, nbytes], ...]`` as a uint8 tensor, then the flat uint8 buffer of at
most ``rollout.weight_sync_bucket_mb`` (a larger tensor travels alone; offsets 64-byte aligned); the stream ends with
the header ``(0, 0, 0)``. The receiving worker views the tensors in the buffer and loads them into the open
layerwise-reload session of :mod:`~da3po_megatron.rollout.worker_ext` (``da3po_load_bucket``), the same session the
"bytes" transport uses; ``da3po_finish_weight_update`` closes it.

Streams (CUDA): a worker receives and loads every bucket on one stream, its loading thread's current stream, and a
pooled buffer is reused only after an event recorded behind its last load (:mod:`~da3po_megatron.rollout.stream_order`
says why and cites vLLM; on CPU those calls are no-ops).

Experts (MoE with EP > 1). Each EP rank sends the experts it owns, on a group of its own: a stage has one group per
EP rank, slot 0 the stage's sender (TP rank 0 of DP replica 0, which owns EP rank 0's experts), slot j the rank
that owns EP rank j's (its expert-TP rank 0 in expert-data-parallel replica 0). Nobody gathers a layer's experts
and no fused [E x ...] tensor exists on any sender; the policy's stream yields the experts after every other tensor
(``export_policy``: ``iter_model(experts_last=True)``). The stream of one stage is cut into *chunks*: chunk 0 is
the non-expert tensors (empty on slots j > 0), then one chunk per MoE layer, in layer order (:func:`chunk_key`);
a header ``(2, 0, 0)`` ends a chunk. A worker reads the stage's groups round-robin, one chunk each (slot 0's chunk
0, slot 1's, ..., then every slot's first MoE layer, ...): vLLM's layerwise reload completes a layer's FusedMoE once
every EP rank's experts of it arrived, so a worker holds at most about one layer's experts beyond its weights,
instead of every expert but the last sender's (reading the groups one after the other). Why this cannot deadlock
although a sender blocks in its broadcast until the workers read its group: slot j's rank may be in slot 0's TP
group (TP 2 x EP 2: rank 1), but every collective of the export that pairs senders -- the TP gathers -- lies in
chunk 0, and slot j's chunk 0 is empty, so it goes through all of them before its first broadcast; the experts'
collectives are ETP gathers with ranks that send nothing.

Failure: a broken stream (a sender died, a timeout) raises on the worker naming the stage and the bucket, and on the
sender naming its stage and bucket; the engine then closes the session and marks itself stale -- it refuses to
generate until the next complete sync (it does not keep the old weights: that would need a second copy of the model
in engine memory). On NCCL the groups are built in blocking-wait mode (:func:`nccl_group`) so that a timeout raises in
the waiting thread instead of NCCL's watchdog taking the process down.

Follows vLLM's own ``distributed/weight_transfer`` (NCCL engine: rank offsets, packed buffers, layerwise reload) and
the NeMo-RL / verl refit design (one broadcast group per refit, built once), with our own code.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch

from da3po_megatron.rollout.stream_order import DeviceOrder
from da3po_megatron.rollout.types import checked_weights

ALIGN = 64
_HEADER_BUCKET, _HEADER_END, _HEADER_CHUNK = 1, 0, 2
_EXPERT_LAYER = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.\d+\.")


# ------------------------------------------------------------------------------------------------ group plumbing
def free_port(host: str = "") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def node_ip() -> str:
    """This node's address for the group: Ray's node IP inside Ray (127.0.0.1 for a local Ray), else VLLM_HOST_IP or
    the address the hostname resolves to."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:  # pragma: no cover
        pass
    return os.environ.get("VLLM_HOST_IP") or socket.gethostbyname(socket.gethostname())


def group_device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def make_group(host: str, port: int, rank: int, world_size: int, *, backend: str, local_ip: str, timeout_s: float,
               store: Any = None, name: str = "da3po_weights") -> tuple[Any, Any]:
    """A private process group (own TCPStore; rank 0 is the store's master). Blocks until all ``world_size`` ranks
    have joined. Returns ``(store, process_group)``."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world_size=world_size, is_master=(rank == 0), wait_for_workers=False,
                              timeout=timeout)
    prefix = dist.PrefixStore(f"{name}/", store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_ip)]
        pg = dist.ProcessGroupGloo(prefix, rank, world_size, opts)
    elif backend == "nccl":
        pg = nccl_group(prefix, rank, world_size, timeout)
    else:
        raise ValueError(f"collective weight transport: unknown backend {backend!r} (expected 'gloo' or 'nccl')")
    return store, pg


NCCL_GROUP_ENV = {"TORCH_NCCL_BLOCKING_WAIT": "1"}
"""Read by each ``ProcessGroupNCCL`` when it is constructed; set only while the weight-sync groups are built."""
NCCL_ENV_AT_START = {"TORCH_NCCL_BLOCKING_WAIT": "0"}
"""In the environment of every process that builds weight-sync groups before it starts (the engine actors'
``runtime_env``: :func:`~da3po_megatron.rollout.engine_setup.engine_env`; the policy actors':
``megatron/actor_group.py``): torch's own default (0: no blocking wait), so Megatron's and vLLM's groups keep their
mode, and the name is in the C environment from the first instruction on -- :func:`scoped_env` then only ever
replaces its value, never adds or removes it (why that matters: :func:`scoped_env`)."""
_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def scoped_env(overrides: dict[str, str]) -> Iterator[None]:
    """Set ``overrides`` in ``os.environ`` for the ``with`` block, then restore what was there (one at a time).

    Thread safety. This runs in processes with other threads (Ray's, NCCL's, vLLM's), and glibc's ``getenv`` takes no
    lock. ``os.environ[k] = v`` is ``setenv(k, v, 1)``; for a name already in the environment glibc replaces one
    pointer of the ``environ`` array in place and never frees the old string ("we can never free the strings",
    ``__add_to_environ`` in glibc ``stdlib/setenv.c``: ``*ep = np``), so a concurrent ``getenv`` reads the old or the
    new value, both valid. A name not yet there makes glibc ``realloc`` the array (a concurrent reader may walk freed
    memory: the segfault torch's ProcessGroupNCCL warns of), and ``unsetenv`` shifts the array under a reader. So the
    project's actors get every overridden name at process start (:data:`NCCL_ENV_AT_START`) and here a name is only
    ever replaced; one that is missing (a tool's or test's own process) is added with a warning, and then kept, set
    to its previous default, rather than removed again."""
    with _ENV_LOCK:
        missing = [k for k in overrides if k not in os.environ]
        if missing:
            import warnings

            warnings.warn(f"scoped_env: {missing} not in this process's environment at start (the project's actors get "
                          f"them through NCCL_ENV_AT_START): added now, while other threads may run", stacklevel=3)
        saved = {k: os.environ.get(k, NCCL_ENV_AT_START.get(k, "")) for k in overrides}
        os.environ.update(overrides)
        try:
            yield
        finally:
            os.environ.update(saved)  # value replacements only: the names stay


def nccl_group(store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
    """A weight-sync ``ProcessGroupNCCL`` in blocking-wait mode with a per-group timeout. GPU-only
    (docs/gpu_only.md, "weight sync").

    Why (torch 2.13): every ``ProcessGroupNCCL`` reads ``TORCH_NCCL_BLOCKING_WAIT`` and
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` in its constructor (``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp``,
    the constructor's ``getCvarBool(TORCH_NCCL_BLOCKING_WAIT, false)`` / ``getCvarInt(..., 3 /*SkipCleanUp*/)``; the
    variables and modes: the installed ``include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp:59-69, 160-176``).
    By default (3, SkipCleanUp) the group's watchdog thread, on a collective past ``Options._timeout`` or a NCCL
    error, re-throws in that thread (``Watchdog::runLoop`` -> ``work.handleException(asyncErrorHandling_)``) and the
    process dies: an engine actor or the sending policy rank, instead of a failed sync. With blocking wait "NO
    watchdog thread is created" for the group, and ``work.wait()`` blocks the calling thread until the collective
    completes or the timeout passes, then aborts the group's communicators and raises ``DistBackendError`` there
    (``WorkNCCL::wait``: ``abort(); handleException(TearDown)`` from the caller's thread). The variable is set only
    while this group is constructed (:func:`scoped_env`): Megatron's and vLLM's own groups keep their modes. The
    group is dead after such an error; the driver tears the groups down and rebuilds them at the next sync.
    """
    import torch.distributed as dist

    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    with scoped_env(NCCL_GROUP_ENV):
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)


def broadcast(pg: Any, tensor: torch.Tensor, root: int = 0, wait: bool = True) -> Any:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = root
    work = pg.broadcast([tensor], opts)
    if wait:
        work.wait()
    return work


def destroy_group(pg: Any) -> None:
    if pg is None:
        return
    try:
        pg.shutdown() if hasattr(pg, "shutdown") else None
    except Exception:  # noqa: BLE001 - a broken group may refuse a clean shutdown
        pass


# ------------------------------------------------------------------------------------------------ packing
def _storage_refs(t: torch.Tensor) -> int | None:
    """How many tensors (views included, wherever they are held) share ``t``'s memory, or None where this torch has
    no way to tell (then :class:`BufferPool` never reuses a buffer)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    return int(count(t.untyped_storage()._cdata)) - 1  # minus the temporary storage object of this call


class BufferPool:
    """Flat uint8 bucket buffers reused within one stream (a sender's sync, a worker's receive of one stage).

    Why: fresh host memory is slow to fill -- the first write to every page faults. Measured on our 2-core CPU
    machine: a fresh 64 MiB ``torch.empty`` + ``copy_`` runs at 1.5 GB/s, the same copy into a buffer written before
    at 7.6-8.0 GB/s; glibc returns buffers this large to the OS on free, so a stream that allocates each bucket anew
    pays the faults on every bucket of every sync. (CUDA's caching allocator already reuses device memory: there the
    pool changes nothing but is harmless.)

    Safety: a buffer is handed out again only when nothing else holds its memory -- the storage's use count says
    whether a view of it is still alive anywhere: the receiving worker's loaded tensors that vLLM's layerwise reload
    keeps until their layer is complete (a layer whose tensors straddle two buckets), a broadcast still in flight.
    With an ``order`` (the receiving worker), that is not enough: on CUDA the device may still be reading a buffer
    whose last view is gone, so a buffer also needs its release marked by the consumer (:meth:`mark_released`, after
    each load: an event recorded behind the loads queued so far), and :meth:`take` makes ``stream`` wait for that
    event before handing it out. Otherwise a fresh buffer is allocated (and pooled while fewer than ``keep`` are).
    At most ``keep`` buffers are pooled; the pool, and its memory, goes with the stream.
    """

    def __init__(self, device: torch.device, keep: int = 2, order: DeviceOrder | None = None,
                 stream: Any = None) -> None:
        self.device, self.keep, self.order, self.stream = device, keep, order, stream
        self._bufs: list[torch.Tensor] = []
        self._released: list[tuple[Any] | None] = []  # per buffer: (event,) once released by the consumer
        self._lock = threading.Lock()
        self.fresh = self.reused = 0

    def _free(self, i: int) -> bool:
        return _storage_refs(self._bufs[i]) == 1 and (self.order is None or self._released[i] is not None)

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of exactly ``nbytes`` (a view of a pooled buffer at least that large, when one is free)."""
        with self._lock:
            free = [i for i in range(len(self._bufs)) if self._free(i)]
            fit = next((i for i in free if self._bufs[i].numel() >= nbytes), None)
            if fit is not None:
                self.reused += 1
                released, self._released[fit] = self._released[fit], None
                if self.order is not None and released is not None:
                    self.order.wait(self.stream, released[0])  # the device finished its last load first
                return self._bufs[fit][:nbytes]
            self.fresh += 1
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            if _storage_refs(buf) is None:
                return buf
            if len(self._bufs) < self.keep:
                self._bufs.append(buf)
                self._released.append(None)
            elif free:  # a free buffer too small for this size: replaced (its memory is released)
                self._bufs[free[0]], self._released[free[0]] = buf, None
            return buf[:nbytes]

    def clear(self) -> None:
        """Drop every pooled buffer (the end of a stream, or a failed one: its memory goes once no view is left)."""
        with self._lock:
            self._bufs, self._released = [], []

    def mark_released(self, record: Callable[[], Any]) -> int:
        """Called by the consumer after each load (the loading thread, after dropping its views): every handed-out
        buffer no view of which is left gets ``record()`` -- an event behind everything queued so far, its last
        load included. Returns how many were released."""
        n = 0
        with self._lock:
            for i, buf in enumerate(self._bufs):
                if self._released[i] is None and _storage_refs(buf) == 1:
                    self._released[i] = (record(),)
                    n += 1
        return n


def iter_flat_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, device: torch.device,
                      dtype: torch.dtype | None = None,
                      pool: BufferPool | None = None) -> Iterator[tuple[torch.Tensor, list[list]]]:
    """Pack (name, tensor) pairs into flat uint8 buffers on ``device`` of at most ``bucket_bytes`` (a larger tensor
    travels alone in a buffer of its size) with ``[name, dtype, shape, offset, nbytes]`` rows (64-byte aligned
    offsets). Each tensor is copied into the buffer as it arrives, so the stream's tensors are not kept. With a
    ``pool`` the buffers come from it (a buffer comes back once the caller dropped every view of it); without one,
    every bucket gets fresh memory (the IPC sender: an engine maps each bucket's memory by handle)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be > 0 bytes, got {bucket_bytes}")
    buf: torch.Tensor | None = None
    meta: list[list] = []
    off = 0
    for name, t in checked_weights(named_tensors, dtype):
        nb = t.numel() * t.element_size()
        if buf is not None and off + nb > buf.numel():
            yield buf[:off], meta
            buf, meta, off = None, [], 0
        if buf is None:
            size = max(bucket_bytes, nb)
            buf = pool.take(size) if pool is not None else torch.empty(size, dtype=torch.uint8, device=device)
        buf[off:off + nb].view(t.dtype).view(t.shape).copy_(t)
        meta.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), off, nb])
        off = min(-(-(off + nb) // ALIGN) * ALIGN, buf.numel())
        del t  # packed: not held while the next tensor is produced
    if buf is not None and meta:
        yield buf[:off], meta


def unpack_flat(buf: torch.Tensor, meta: list[list]) -> dict[str, torch.Tensor]:
    """Views of the tensors of one received buffer."""
    return {n: buf[off:off + nb].view(getattr(torch, dt)).view(shape) for n, dt, shape, off, nb in meta}


def chunk_key(hf_name: str) -> int:
    """The chunk of the wire format an HF tensor belongs to: -1 for every non-expert tensor, the layer number for
    an expert's (``model.layers.N.mlp.experts.E.*``)."""
    m = _EXPERT_LAYER.match(hf_name)
    return int(m.group(1)) if m else -1


def _chunks(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Iterable[tuple[str, torch.Tensor]]]:
    """The stream cut into its chunks, lazily (each chunk must be consumed before the next is asked for): chunk 0,
    the non-expert tensors (empty when the stream starts with an expert), then one per expert layer in increasing
    layer order. A stream out of that order raises naming the tensor: the workers read the EP ranks' groups chunk
    by chunk and would otherwise pair different layers."""
    current: int | None = None
    for key, items in itertools.groupby(named_tensors, key=lambda item: chunk_key(item[0])):
        if current is None and key != -1:
            yield ()  # chunk 0 of a rank that owns experts only
        elif current is not None and key <= current:
            first = next(items)[0]
            raise ValueError(f"collective weight sync: {first!r} (chunk {key}) after chunk {current}: the stream must "
                             "give every non-expert tensor first, then the experts layer by layer (export_policy: "
                             "iter_model(experts_last=True))")
        current = key
        yield items  # noqa: B031 - consumed once, by the caller, before the next chunk is asked for
    if current is None:
        yield ()
