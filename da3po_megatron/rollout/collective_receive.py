"""Worker side of the "collective" weight transport (:mod:`~da3po_megatron.rollout.collective` holds the groups, the
wire format and the packing, :mod:`~da3po_megatron.rollout.collective_send` the sender): a vLLM worker joins each PP
stage's group (one per EP rank of the stage with expert parallelism) and receives the stages' streams into its open
layerwise-reload session, a receiving thread fetching bucket k+1 while the worker's thread loads bucket k -- both on
the worker thread's current CUDA stream (:mod:`~da3po_megatron.rollout.stream_order`), and a pooled buffer reused
only after an event recorded behind its last load.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from da3po_megatron.rollout.collective import (
    _HEADER_CHUNK,
    _HEADER_END,
    BufferPool,
    broadcast,
    destroy_group,
    group_device,
    make_group,
    unpack_flat,
)
from da3po_megatron.rollout.stream_order import DeviceOrder, order_for


# ------------------------------------------------------------------------------------------------ receiver
def _receive_stream(pgs: list[Any], dev: torch.device, out: Any, stats: dict, slots: Any, pool: BufferPool,
                    order: DeviceOrder, loader_stream: Any, stop: threading.Event) -> None:
    """Receiving thread of one stage's stream: put ``(buffer, meta, seconds when received)`` per bucket, then None;
    an error is put as is. ``pgs``: the stage's groups, one per EP rank (one for a dense model), read round-robin one
    chunk at a time (a chunk ends with a chunk header or the group's end marker; see the wire format in
    :mod:`~da3po_megatron.rollout.collective`) until every group has sent its end marker.

    ``slots`` (a semaphore of 2) bounds the buffers in hand: one being loaded, one being received. The buffers come
    from ``pool`` (three, released by the loading thread): vLLM's layerwise reload keeps the tensors of a layer whose
    tensors straddle two buckets until the second one is loaded, so while bucket k+1 loads and k+2 arrives, bucket
    k's buffer is often still held; from bucket k+3 on the pool cycles through the three.

    Everything here -- allocations, broadcasts, the header's copy to the host -- runs on ``loader_stream``, the
    loading thread's current stream (``order.use``): see :mod:`~da3po_megatron.rollout.stream_order`.

    ``stop`` (set by the loading thread when it gives up: a failed load) ends the thread at its next slot or its next
    received bucket, whichever comes first, instead of waiting forever for a slot nobody will release."""
    try:
        with order.use(loader_stream):
            open_groups = list(range(len(pgs)))
            turn = 0  # index into open_groups: the group whose chunk is being read
            slots.acquire()
            while True:
                if stop.is_set():
                    return
                t0 = time.perf_counter()
                pg = pgs[open_groups[turn]]
                header = torch.empty(3, dtype=torch.int64, device=dev)
                broadcast(pg, header)
                kind, n_meta, n_buf = (int(x) for x in header.tolist())
                if kind in (_HEADER_END, _HEADER_CHUNK):
                    stats["transfer_s"] += time.perf_counter() - t0
                    if kind == _HEADER_END:
                        open_groups.pop(turn)
                    else:
                        turn += 1
                    if not open_groups:
                        out.put(None)
                        return
                    turn %= len(open_groups)
                    continue
                blob = torch.empty(n_meta, dtype=torch.uint8, device=dev)
                broadcast(pg, blob)
                meta = json.loads(bytes(blob.cpu().numpy().tobytes()).decode())
                buf = pool.take(n_buf)
                broadcast(pg, buf)
                stats["transfer_s"] += time.perf_counter() - t0
                if stop.is_set():
                    return
                out.put((buf, meta, time.perf_counter()))
                del buf
                slots.acquire()
    except BaseException as e:  # noqa: BLE001 - handed to the loading thread, which raises it with the bucket
        out.put(e)


def receive_stage(pg: Any, dev: torch.device, load: Callable[[dict[str, torch.Tensor]], Any], stage: int,
                  stats: dict, order: DeviceOrder | None = None, join_s: float = 5.0) -> None:
    """Receive one stage's stream and ``load`` each bucket's tensors, in the calling (loading) thread. ``pg``: the
    stage's group, or its list of groups (one per EP rank, read chunk by chunk round-robin). A receiving
    thread fetches bucket k+1 while this thread loads bucket k (at most two buffers in hand), on this thread's
    current stream. Raises naming the stage and the bucket. ``stats`` gains bytes, buckets, transfer_s, load_s,
    fresh_buffers and overlapped_buckets (buckets that had fully arrived before the previous one finished loading:
    the receive and the load did overlap).

    On a failure (a load that raises, a broken stream) the receiving thread is stopped and the pool emptied before
    this returns: the thread ends at its next slot (released here) or as soon as the broadcast it is in returns --
    joined for up to ``join_s``; a broadcast still waiting then ends with the group (the sender's next bucket, or the
    group's timeout / teardown) -- and neither it nor a queued bucket keeps device buffers alive. (On 27dab78 it
    waited forever for a slot, holding up to 3 x ``rollout.weight_sync_bucket_mb``, one more thread per failure.)"""
    import queue

    for key in ("bytes", "buckets", "fresh_buffers", "overlapped_buckets"):
        stats.setdefault(key, 0)
    for key in ("transfer_s", "load_s"):
        stats.setdefault(key, 0.0)
    order = order or order_for(dev)
    loader_stream = order.current_stream()  # captured here, in the loading thread: vLLM's current stream
    pool = BufferPool(dev, keep=3, order=order, stream=loader_stream)
    received: queue.Queue = queue.Queue()
    slots = threading.Semaphore(2)
    stop = threading.Event()
    args = (list(pg) if isinstance(pg, (list, tuple)) else [pg], dev, received, stats, slots, pool, order,
            loader_stream, stop)
    fetcher = threading.Thread(target=_receive_stream, args=args, daemon=True, name=f"da3po-recv-stage{stage}")
    fetcher.start()
    bucket = 0
    names: list[str] = []
    loaded_at = 0.0
    try:
        while True:
            item = received.get()
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            buf, meta, arrived = item
            if bucket and arrived < loaded_at:
                stats["overlapped_buckets"] += 1
            names = [r[0] for r in meta]
            t1 = time.perf_counter()
            load(unpack_flat(buf, meta))
            loaded_at = time.perf_counter()
            stats["load_s"] += loaded_at - t1
            stats["bytes"] += sum(r[4] for r in meta)
            stats["buckets"] += 1
            bucket += 1
            del buf, item
            pool.mark_released(lambda: order.record(loader_stream))
            slots.release()
    except Exception as e:
        raise RuntimeError(f"collective weight sync from PP stage {stage} broke at bucket {bucket} of that "
                           f"stage ({bucket} complete; last tensors {names[:3]}): {type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}") from e
    finally:
        stop.set()  # a no-op after the end marker (the thread has returned); after a failure it ends the thread
        slots.release()  # a fetcher waiting for a slot gets one, sees ``stop`` and returns
        fetcher.join(timeout=join_s)
        while not received.empty():  # buckets received but never loaded: drop their buffers
            received.get_nowait()
        stats["fresh_buffers"] += pool.fresh
        pool.clear()


class CollectiveReceiverMixin:
    """Worker-extension half (mixed into :class:`~da3po_megatron.rollout.worker_ext.WeightSyncExtension`): join the
    stage groups, receive streams into the open layerwise-reload session, leave."""

    def da3po_collective_join(self, groups: list[dict], rank_offset: int, local_ip: str) -> dict:
        """Join every stage's group(s) as rank ``rank_offset + parallel_config.rank`` (stage order, EP slot order
        within a stage: all engines join in the same order, each join blocks until its group is complete)."""
        self.da3po_collective_leave()
        t0 = time.perf_counter()
        rank = rank_offset + int(self.vllm_config.parallel_config.rank)
        pgs, stages = [], []
        for g in groups:
            _, pg = make_group(g["host"], g["port"], rank, g["world_size"], backend=g["backend"], local_ip=local_ip,
                               timeout_s=g["timeout_s"], name=g["name"])
            pgs.append(pg)
            stages.append(int(g.get("stage", len(stages))))
        self._da3po_groups = pgs
        self._da3po_group_stages = stages
        self._da3po_group_device = group_device(groups[0]["backend"]) if groups else torch.device("cpu")
        return {"rank": rank, "groups": len(pgs), "seconds": time.perf_counter() - t0}

    def da3po_collective_receive(self, begin: bool = False, finish: bool = False, strict: bool = True) -> dict:
        """Receive every stage's stream (stage order) into the open session (:func:`receive_stage`: bucket k+1
        arrives while bucket k loads, both on this thread's stream). Raises naming the stage and bucket.
        ``begin`` / ``finish``: open the session first / close it (``strict`` check) after the last stream, in this
        same call (the driver then needs no calls of its own for them)."""
        pgs = getattr(self, "_da3po_groups", None)
        if not pgs:
            raise RuntimeError("collective weight sync: this worker has not joined the transfer group")
        if begin:
            self.da3po_begin_weight_update()
        stats = {"bytes": 0, "buckets": 0, "transfer_s": 0.0, "load_s": 0.0, "fresh_buffers": 0,
                 "overlapped_buckets": 0}
        stages = getattr(self, "_da3po_group_stages", None) or list(range(len(pgs)))
        for stage in sorted(set(stages)):  # a stage's groups (one per EP rank) together, chunk by chunk
            of_stage = [pg for pg, s in zip(pgs, stages) if s == stage]
            receive_stage(of_stage, self._da3po_group_device, self.da3po_load_bucket, stage, stats)
        if finish:
            t0 = time.perf_counter()
            self.da3po_finish_weight_update(strict=strict)
            stats["finish_s"] = time.perf_counter() - t0  # finalize: the layers' weight post-processing
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
        self._da3po_group_stages = []
