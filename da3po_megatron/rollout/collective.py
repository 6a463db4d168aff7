"""The "collective" weight transport: a private process group between the policy's sending ranks and every engine
worker, flat bucket buffers broadcast from the sender (gloo on CPU, NCCL on CUDA -- the same code, another backend).

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

Failure: a broken stream (a sender died, a timeout) raises on the worker naming the stage and the bucket; the engine
then closes the session and marks itself stale -- it refuses to generate until the next complete sync (it does not
keep the old weights: that would need a second copy of the model in engine memory).

Follows vLLM's own ``distributed/weight_transfer`` (NCCL engine: rank offsets, packed buffers, layerwise reload) and
the NeMo-RL / verl refit design (one broadcast group per refit, built once), with our own code.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch

from da3po_megatron.rollout.types import checked_weights, timed_stream

ALIGN = 64
_HEADER_BUCKET, _HEADER_END = 1, 0


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
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
    else:
        raise ValueError(f"collective weight transport: unknown backend {backend!r} (expected 'gloo' or 'nccl')")
    return store, pg


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
    Otherwise a fresh buffer is allocated (and pooled while fewer than ``keep`` are). At most ``keep`` buffers are
    pooled; the pool, and its memory, goes with the stream.
    """

    def __init__(self, device: torch.device, keep: int = 2) -> None:
        self.device, self.keep = device, keep
        self._bufs: list[torch.Tensor] = []
        self.fresh = self.reused = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of exactly ``nbytes`` (a view of a pooled buffer at least that large, when one is free)."""
        free = [i for i, b in enumerate(self._bufs) if _storage_refs(b) == 1]
        fit = next((i for i in free if self._bufs[i].numel() >= nbytes), None)
        if fit is not None:
            self.reused += 1
            return self._bufs[fit][:nbytes]
        self.fresh += 1
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if _storage_refs(buf) is None:
            return buf
        if len(self._bufs) < self.keep:
            self._bufs.append(buf)
        elif free:  # a free buffer too small for this size: replaced (its memory is released)
            self._bufs[free[0]] = buf
        return buf[:nbytes]


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
    if buf is not None and meta:
        yield buf[:off], meta


def unpack_flat(buf: torch.Tensor, meta: list[list]) -> dict[str, torch.Tensor]:
    """Views of the tensors of one received buffer."""
    return {n: buf[off:off + nb].view(getattr(torch, dt)).view(shape) for n, dt, shape, off, nb in meta}


# ------------------------------------------------------------------------------------------------ sender
class CollectiveSender:
    """Rank 0 of one stage's group: hosts the TCPStore, broadcasts buckets. Lives in the sending process (a policy
    rank, or the driver in tools/tests) across syncs, registered under its group name."""

    def __init__(self, name: str, world_size: int, backend: str, timeout_s: float, host: str | None = None) -> None:
        import torch.distributed as dist

        self.name, self.world_size, self.backend, self.timeout_s = name, world_size, backend, timeout_s
        self.host = host or node_ip()
        self.port = free_port("" if self.host != "127.0.0.1" else "127.0.0.1")
        self.store = dist.TCPStore(self.host, self.port, world_size=world_size, is_master=True,
                                   wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
        self.pg: Any = None
        self.device = torch.device("cpu")

    def address(self) -> dict:
        return {"name": self.name, "host": self.host, "port": self.port, "world_size": self.world_size,
                "backend": self.backend, "timeout_s": self.timeout_s}

    def connect(self) -> float:
        """Join the group (blocks until every engine worker joined). Returns seconds."""
        t0 = time.perf_counter()
        self.device = group_device(self.backend)
        _, self.pg = make_group(self.host, self.port, 0, self.world_size, backend=self.backend, local_ip=self.host,
                                timeout_s=self.timeout_s, store=self.store, name=self.name)
        return time.perf_counter() - t0

    def _send_bucket(self, buf: torch.Tensor, meta: list[list]) -> list[Any]:
        blob = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8).to(self.device)
        header = torch.tensor([_HEADER_BUCKET, blob.numel(), buf.numel()], dtype=torch.int64, device=self.device)
        broadcast(self.pg, header)
        broadcast(self.pg, blob)
        return [broadcast(self.pg, buf, wait=False), buf]

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
             dtype: torch.dtype | None = None) -> dict:
        """Broadcast the stream, bucket by bucket (the next bucket is packed while the previous one is in flight:
        at most two buffers alive), then the end marker. Returns timing and size statistics."""
        if self.pg is None:
            raise RuntimeError(f"collective sender {self.name}: send before connect")
        stats = {"bytes": 0, "buckets": 0, "tensors": 0, "max_bucket_bytes": 0, "pack_s": 0.0, "transfer_s": 0.0,
                 "export_s": 0.0}
        t0 = time.perf_counter()
        in_flight: list[Any] | None = None
        produce_s = 0.0  # export + mapping + packing: the time spent waiting for the next filled buffer
        pool = BufferPool(self.device)
        buckets = iter_flat_buckets(timed_stream(named_tensors, stats), bucket_bytes, self.device, dtype, pool=pool)
        while True:
            tp = time.perf_counter()
            item = next(buckets, None)
            produce_s += time.perf_counter() - tp
            if item is None:
                break
            buf, meta = item
            tt = time.perf_counter()
            if in_flight is not None:
                in_flight[0].wait()
            in_flight = self._send_bucket(buf, meta)
            stats["transfer_s"] += time.perf_counter() - tt
            stats["bytes"] += sum(r[4] for r in meta)
            stats["buckets"] += 1
            stats["tensors"] += len(meta)
            stats["max_bucket_bytes"] = max(stats["max_bucket_bytes"], buf.numel())
            del buf, item
        stats["pack_s"] = max(produce_s - stats["export_s"], 0.0)
        tt = time.perf_counter()
        if in_flight is not None:
            in_flight[0].wait()
        broadcast(self.pg, torch.tensor([_HEADER_END, 0, 0], dtype=torch.int64, device=self.device))
        stats["transfer_s"] += time.perf_counter() - tt
        stats["fresh_buffers"] = pool.fresh
        stats["seconds"] = time.perf_counter() - t0
        return stats

    def send_raw(self, buf: torch.Tensor) -> float:
        """One broadcast of a single buffer (the link-bandwidth reference of the benchmark); seconds."""
        t0 = time.perf_counter()
        broadcast(self.pg, buf)
        return time.perf_counter() - t0

    def close(self) -> None:
        destroy_group(self.pg)
        self.pg = None
        self.store = None


_SENDERS: dict[str, CollectiveSender] = {}


def open_sender(name: str, world_size: int, backend: str, timeout_s: float) -> dict:
    """Create (replacing an older one of the same name) this process's sender; returns its address."""
    close_sender(name)
    _SENDERS[name] = CollectiveSender(name, world_size, backend, timeout_s)
    return _SENDERS[name].address()


def get_sender(name: str) -> CollectiveSender:
    if name not in _SENDERS:
        raise RuntimeError(f"no collective sender {name!r} in process {os.getpid()} (group not built)")
    return _SENDERS[name]


def close_sender(name: str | None = None) -> None:
    for key in [name] if name is not None else list(_SENDERS):
        s = _SENDERS.pop(key, None) if key is not None else None
        if s is not None:
            s.close()


# ------------------------------------------------------------------------------------------------ receiver
def _receive_stream(pg: Any, dev: torch.device, out: Any, stats: dict, slots: Any) -> None:
    """Receiving thread of one stage's stream: put ``(buffer, meta)`` per bucket, then None; an error is put as is.
    ``slots`` (a semaphore of 2) bounds the buffers in hand: one being loaded, one being received. The buffers come
    from a :class:`BufferPool` of three: vLLM's layerwise reload keeps the tensors of a layer whose tensors straddle
    two buckets until the second one is loaded, so while bucket k+1 loads and k+2 arrives, bucket k's buffer is often
    still held; from bucket k+3 on the pool cycles through the three (one still held is never reused)."""
    pool = BufferPool(dev, keep=3)
    try:
        while True:
            slots.acquire()
            t0 = time.perf_counter()
            header = torch.empty(3, dtype=torch.int64, device=dev)
            broadcast(pg, header)
            kind, n_meta, n_buf = (int(x) for x in header.tolist())
            if kind == _HEADER_END:
                stats["transfer_s"] += time.perf_counter() - t0
                stats["fresh_buffers"] = stats.get("fresh_buffers", 0) + pool.fresh
                out.put(None)
                return
            blob = torch.empty(n_meta, dtype=torch.uint8, device=dev)
            broadcast(pg, blob)
            meta = json.loads(bytes(blob.cpu().numpy().tobytes()).decode())
            buf = pool.take(n_buf)
            broadcast(pg, buf)
            stats["transfer_s"] += time.perf_counter() - t0
            out.put((buf, meta))
            del buf
    except BaseException as e:  # noqa: BLE001 - handed to the loading thread, which raises it with the bucket
        out.put(e)


class CollectiveReceiverMixin:
    """Worker-extension half (mixed into :class:`~da3po_megatron.rollout.worker_ext.WeightSyncExtension`): join the
    stage groups, receive streams into the open layerwise-reload session, leave."""

    def da3po_collective_join(self, groups: list[dict], rank_offset: int, local_ip: str) -> dict:
        """Join every stage's group as rank ``rank_offset + parallel_config.rank`` (stage order: all engines join in
        the same order, each join blocks until its group is complete)."""
        self.da3po_collective_leave()
        t0 = time.perf_counter()
        rank = rank_offset + int(self.vllm_config.parallel_config.rank)
        pgs = []
        for g in groups:
            _, pg = make_group(g["host"], g["port"], rank, g["world_size"], backend=g["backend"], local_ip=local_ip,
                               timeout_s=g["timeout_s"], name=g["name"])
            pgs.append(pg)
        self._da3po_groups = pgs
        self._da3po_group_device = group_device(groups[0]["backend"]) if groups else torch.device("cpu")
        return {"rank": rank, "groups": len(pgs), "seconds": time.perf_counter() - t0}

    def da3po_collective_receive(self, begin: bool = False, finish: bool = False, strict: bool = True) -> dict:
        """Receive every stage's stream (stage order) into the open session; a receiving thread fetches bucket k+1
        while this thread loads bucket k (at most two buffers alive). Raises naming the stage and bucket.
        ``begin`` / ``finish``: open the session first / close it (``strict`` check) after the last stream, in this
        same call (the driver then needs no calls of its own for them)."""
        pgs = getattr(self, "_da3po_groups", None)
        if not pgs:
            raise RuntimeError("collective weight sync: this worker has not joined the transfer group")
        if begin:
            self.da3po_begin_weight_update()
        stats = self._da3po_receive_streams(pgs)
        if finish:
            t0 = time.perf_counter()
            self.da3po_finish_weight_update(strict=strict)
            stats["finish_s"] = time.perf_counter() - t0  # finalize: the layers' weight post-processing
        return stats

    def _da3po_receive_streams(self, pgs: list[Any]) -> dict:
        import queue
        import threading

        dev = self._da3po_group_device
        stats = {"bytes": 0, "buckets": 0, "transfer_s": 0.0, "load_s": 0.0}
        for stage, pg in enumerate(pgs):
            received: queue.Queue = queue.Queue()
            slots = threading.Semaphore(2)
            fetcher = threading.Thread(target=_receive_stream, args=(pg, dev, received, stats, slots), daemon=True,
                                       name=f"da3po-recv-stage{stage}")
            fetcher.start()
            bucket = 0
            names: list[str] = []
            try:
                while True:
                    item = received.get()
                    if item is None:
                        break
                    if isinstance(item, BaseException):
                        raise item
                    buf, meta = item
                    names = [r[0] for r in meta]
                    t1 = time.perf_counter()
                    self.da3po_load_bucket(unpack_flat(buf, meta))
                    stats["load_s"] += time.perf_counter() - t1
                    stats["bytes"] += sum(r[4] for r in meta)
                    stats["buckets"] += 1
                    bucket += 1
                    del buf, item
                    slots.release()
            except Exception as e:
                raise RuntimeError(f"collective weight sync from PP stage {stage} broke at bucket {bucket} of that "
                                   f"stage ({bucket} complete; last tensors {names[:3]}): {type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''}") from e
            finally:
                slots.release()  # a fetcher waiting for a slot after a failure gets one and ends with the broken group
                fetcher.join(timeout=5)
        return stats

    def da3po_collective_recv_raw(self, nbytes: int) -> float:
        """Receive one raw broadcast of ``nbytes`` on stage 0's group (the benchmark's link reference); seconds. The
        buffer is written once before the clock starts, so first-touch page faults are not counted as link time."""
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=self._da3po_group_device)
        t0 = time.perf_counter()
        broadcast(self._da3po_groups[0], buf)
        return time.perf_counter() - t0

    def da3po_collective_leave(self) -> None:
        for pg in getattr(self, "_da3po_groups", None) or []:
            destroy_group(pg)
        self._da3po_groups = []
