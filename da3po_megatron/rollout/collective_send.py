"""Sender side of the "collective" weight transport (:mod:`~da3po_megatron.rollout.collective` holds the groups, the
wire format and the packing; :mod:`~da3po_megatron.rollout.collective_receive` the engine workers' side):
:class:`CollectiveSender` is rank 0 of one stage's group (slot j > 0: the owner of EP rank j's experts). It hosts the
group's TCPStore and broadcasts the stage's stream bucket by bucket -- the next bucket packed while the previous one is
in flight, chunk-end headers between the expert layers when ``chunked`` -- then the end marker. Senders live in the
sending process (a policy rank, or the driver in tools and tests) across syncs, registered by group name
(:func:`open_sender`, :func:`get_sender`, :func:`close_sender`), which the driver side
(:mod:`~da3po_megatron.rollout.collective_transport`) calls on every sending rank.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch

from da3po_megatron.rollout.collective import (
    _HEADER_BUCKET,
    _HEADER_CHUNK,
    _HEADER_END,
    BufferPool,
    _chunks,
    broadcast,
    destroy_group,
    group_device,
    iter_flat_buckets,
    make_group,
    node_ip,
)
from da3po_megatron.rollout.types import timed_stream


class CollectiveSender:
    """Rank 0 of one stage's group: hosts the TCPStore, broadcasts buckets. Lives in the sending process (a policy
    rank, or the driver in tools/tests) across syncs, registered under its group name."""

    def __init__(self, name: str, world_size: int, backend: str, timeout_s: float, host: str | None = None,
                 stage: int = 0, slot: int = 0) -> None:
        import torch.distributed as dist

        self.name, self.world_size, self.backend, self.timeout_s = name, world_size, backend, timeout_s
        self.stage, self.slot = stage, slot  # slot: 0 the stage's sender, j > 0 the owner of EP rank j's experts
        self.host = host or node_ip()
        # port 0: the OS picks it as the store binds, so no other process can take it between a probe and the bind
        self.store = dist.TCPStore(self.host, 0, world_size=world_size, is_master=True,
                                   wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
        self.port = int(self.store.port)
        self.pg: Any = None
        self.device = torch.device("cpu")

    def address(self) -> dict:
        return {"name": self.name, "host": self.host, "port": self.port, "world_size": self.world_size,
                "backend": self.backend, "timeout_s": self.timeout_s, "stage": self.stage, "slot": self.slot}

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
             dtype: torch.dtype | None = None, chunked: bool = False) -> dict:
        """Broadcast the stream, bucket by bucket (the next bucket is packed while the previous one is in flight:
        at most two buffers alive), then the end marker. Returns timing and size statistics. A broken broadcast (an
        engine worker gone, ``timeout_s`` passed) raises naming this sender's stage and the bucket. ``chunked``
        (the stages with an EP rank per group, see the module doc): a chunk-end header after chunk 0 and after
        each expert layer (:func:`chunk_key`); a chunk never shares a bucket with the next one."""
        if self.pg is None:
            raise RuntimeError(f"collective sender {self.name}: send before connect")
        stats: dict = {"buckets": 0}
        try:
            return self._send(named_tensors, bucket_bytes, dtype, stats, chunked)
        except Exception as e:
            who = f"PP stage {self.stage}" + (f", EP rank {self.slot}'s experts" if self.slot else "")
            raise RuntimeError(f"collective weight sync: the sender of {who} broke at bucket "
                               f"{stats['buckets']} of that stage (after handing {stats['buckets']} to the "
                               f"{self.backend} group; timeout {self.timeout_s:g} s): {type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}") from e

    def _send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype | None,
              stats: dict, chunked: bool = False) -> dict:
        stats.update({"bytes": 0, "buckets": 0, "tensors": 0, "max_bucket_bytes": 0, "pack_s": 0.0, "transfer_s": 0.0,
                      "export_s": 0.0, "chunks": 0})
        t0 = time.perf_counter()
        in_flight: list[Any] | None = None
        produce_s = 0.0  # export + mapping + packing: the time spent waiting for the next filled buffer
        pool = BufferPool(self.device)
        stream = timed_stream(named_tensors, stats)
        if chunked:
            def events() -> Iterator[tuple[torch.Tensor, list[list]] | None]:  # None: the end of a chunk
                for i, chunk in enumerate(_chunks(stream)):
                    if i:
                        yield None
                    yield from iter_flat_buckets(chunk, bucket_bytes, self.device, dtype, pool=pool)
            buckets: Iterator[Any] = events()
        else:
            buckets = iter_flat_buckets(stream, bucket_bytes, self.device, dtype, pool=pool)
        done = object()
        while True:
            tp = time.perf_counter()
            item = next(buckets, done)
            produce_s += time.perf_counter() - tp
            if item is done:
                break
            tt = time.perf_counter()
            if in_flight is not None:
                in_flight[0].wait()
                in_flight = None
            if item is None:
                broadcast(self.pg, torch.tensor([_HEADER_CHUNK, 0, 0], dtype=torch.int64, device=self.device))
                stats["chunks"] += 1
                stats["transfer_s"] += time.perf_counter() - tt
                continue
            buf, meta = item
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


def open_sender(name: str, world_size: int, backend: str, timeout_s: float, stage: int = 0, slot: int = 0) -> dict:
    """Create (replacing an older one of the same name) this process's sender of PP stage ``stage`` (``slot`` j > 0:
    of EP rank j's experts); returns its address."""
    close_sender(name)
    _SENDERS[name] = CollectiveSender(name, world_size, backend, timeout_s, stage=stage, slot=slot)
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
