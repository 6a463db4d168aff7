"""The collective receive's stream discipline and its failure behaviour, on a real gloo group in this process (a
sender thread broadcasting to the loading thread), no engine.

CUDA streams cannot run here, so the stream rule is checked as a *structure*: a recording stand-in for CUDA streams
and events (:class:`RecordingOrder`, the same interface as ``stream_order.CudaOrder``) is injected into the same
receive code (``collective_receive.receive_stage``) and logs, per thread, which stream each broadcast, load and event
was issued on. The rule it checks (docs/rollout.md, "Streams"): every receive runs on the stream the loading thread
had current (vLLM's dedicated stream, not the receiving thread's default one); a reused bucket buffer is received
into only after waiting for an event recorded after the last load that read it. The same run checks that receive
and load still overlap and that every tensor arrives exactly.

Also: the NCCL weight-sync groups are built in blocking-wait mode (a stand-in for ProcessGroupNCCL records what the
constructor saw), and a receiver that goes away mid-sync makes the sender raise naming its stage and bucket.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

from da3po_megatron.rollout.collective import destroy_group, make_group
from da3po_megatron.rollout.collective_receive import receive_stage
from da3po_megatron.rollout.collective_send import CollectiveSender
from da3po_megatron.rollout.stream_order import DeviceOrder


class RecordingOrder(DeviceOrder):
    """A stand-in for CUDA streams and events: streams are names, a thread's current stream is tracked per thread
    (the default until a ``use`` block), events are numbers; every call is logged as (thread, what, ...)."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self._tls = threading.local()
        self._lock = threading.Lock()
        self.events = 0

    def stream_of_this_thread(self) -> str:
        return getattr(self._tls, "stream", f"default@{threading.current_thread().name}")

    def set_stream(self, stream: str) -> None:  # what vLLM's patched torch.cuda.set_stream does in its thread
        self._tls.stream = stream

    def note(self, *what) -> None:
        with self._lock:
            self.log.append((threading.current_thread().name, *what))

    def current_stream(self):
        return self.stream_of_this_thread()

    def use(self, stream):
        order = self

        class _Use:
            def __enter__(self):
                self.prev = order.stream_of_this_thread()
                order._tls.stream = stream

            def __exit__(self, *exc):
                order._tls.stream = self.prev

        return _Use()

    def record(self, stream):
        with self._lock:
            self.events += 1
            event = self.events
        self.note("record", event, stream)
        return event

    def wait(self, stream, event) -> None:
        self.note("wait", event, stream)


class LoggedGroup:
    """The real gloo group, with each broadcast logged (buffer address, the calling thread's stream) first."""

    def __init__(self, pg, order: RecordingOrder) -> None:
        self.pg, self.order = pg, order

    def broadcast(self, tensors, opts):
        self.order.note("broadcast", tensors[0].data_ptr(), tensors[0].numel(), self.order.stream_of_this_thread())
        return self.pg.broadcast(tensors, opts)


def _pair(name: str, timeout_s: float = 30.0):
    """A real 2-rank gloo group in this process: a CollectiveSender (rank 0) and the receiving side (rank 1)."""
    sender = CollectiveSender(name, 2, "gloo", timeout_s, host="127.0.0.1")
    joined = threading.Thread(target=sender.connect)
    joined.start()
    _, pg = make_group("127.0.0.1", sender.port, 1, 2, backend="gloo", local_ip="127.0.0.1", timeout_s=timeout_s,
                       name=name)
    joined.join()
    return sender, pg


def test_receive_runs_on_the_loader_stream_and_reuse_waits_for_the_last_load_with_a_stand_in_for_cuda_streams():
    g = torch.Generator().manual_seed(0)
    named = [(f"t{i}", torch.randn(int(n), generator=g)) for i, n in enumerate(torch.randint(20, 100, (60,),
                                                                                               generator=g))]
    sender, pg = _pair("streams")
    order = RecordingOrder()
    order.set_stream("vllm-stream")  # the loading thread's current stream, as vLLM's current_stream() sets it
    got: dict[str, torch.Tensor] = {}
    held: list[dict] = []  # views kept one load longer, like vLLM's layerwise reload for a straddling layer

    def load(tensors: dict[str, torch.Tensor]) -> None:
        time.sleep(0.02)  # a slow load: the next bucket must arrive meanwhile
        order.note("load", next(iter(tensors.values())).untyped_storage().data_ptr(), order.stream_of_this_thread())
        for old in held:  # the delayed copies from a buffer of an earlier bucket
            order.note("load", next(iter(old.values())).untyped_storage().data_ptr(), order.stream_of_this_thread())
        held.clear()
        got.update({k: v.clone() for k, v in tensors.items()})
        if len(got) % 3 == 0:
            held.append(tensors)

    out: dict = {}
    send = threading.Thread(target=lambda: out.update(sender.send(iter(named), 1024)), name="sender")
    send.start()
    stats = {"bytes": 0, "buckets": 0, "transfer_s": 0.0, "load_s": 0.0, "fresh_buffers": 0, "overlapped_buckets": 0}
    try:
        receive_stage(LoggedGroup(pg, order), torch.device("cpu"), load, 0, stats, order=order)
    finally:
        send.join()
        sender.close()
        destroy_group(pg)
    print(f"stats {stats}; {len(order.log)} logged calls")

    for n, t in named:  # exact
        assert torch.equal(got[n], t)
    assert stats["buckets"] == out["buckets"] >= 8
    assert stats["overlapped_buckets"] >= 1  # bucket k+1 had arrived before bucket k finished loading

    fetcher = {e[0] for e in order.log if e[1] == "broadcast"}
    assert len(fetcher) == 1 and fetcher != {threading.current_thread().name}  # received in another thread...
    assert {e[-1] for e in order.log if e[1] == "broadcast"} == {"vllm-stream"}  # ...on the loader's stream
    assert {(e[0], e[-1]) for e in order.log if e[1] == "load"} == {(threading.current_thread().name, "vllm-stream")}
    assert {e[-1] for e in order.log if e[1] in ("record", "wait")} == {"vllm-stream"}

    # every receive into a buffer that held an earlier bucket waited for an event recorded after its last load
    last_read: dict[int, int] = {}  # buffer address -> log position of the last load that read it
    recorded: dict[int, int] = {}  # event -> log position
    waited: list[tuple[int, int]] = []  # (event, log position) not yet consumed by a broadcast
    buckets_seen: set[int] = set()
    reused = calls = 0
    for pos, (_, what, *rest) in enumerate(order.log):
        if what == "load":
            last_read[rest[0]] = pos
        elif what == "record":
            recorded[rest[0]] = pos
        elif what == "wait":
            waited.append((rest[0], pos))
        elif what == "broadcast":
            calls += 1
            if calls % 3:  # per bucket: the header, the metadata, then the bucket buffer
                continue
            ptr = rest[0]
            if ptr in buckets_seen:
                reused += 1
                assert waited, f"log {pos}: receive into reused buffer {ptr:#x} without waiting for an event"
                event, _ = waited.pop()
                assert last_read[ptr] < recorded[event] < pos, (
                    f"log {pos}: reused buffer {ptr:#x} waited for event {event} recorded at {recorded[event]}, "
                    f"but its last load was at {last_read[ptr]}")
            waited.clear()
            buckets_seen.add(ptr)
    assert reused >= 3 and stats["fresh_buffers"] < stats["buckets"]  # the pool cycled: the check above ran


def test_nccl_weight_groups_are_built_in_blocking_wait_mode_replacing_a_value_set_at_process_start_with_a_stand_in_for_process_group_nccl(  # noqa: E501
        monkeypatch):
    """torch reads TORCH_NCCL_BLOCKING_WAIT in each ProcessGroupNCCL's constructor: set there (no watchdog that tears
    the process down; wait() raises in the caller on a timeout), the timeout per group -- without changing the shape
    of the C environment while other threads may read it (issue 34, item 5): the actors have the name from process
    start (engines: their runtime_env, ``client.actor_env``; policy ranks: ``actor_group``), so building the group only
    replaces its value in place (glibc: one pointer of ``environ``, old string kept) and restores it; the array and
    its names stay exactly as they were while a second thread reads it. A process without the name (a tool) gets it
    added once with a warning and keeps it. On 27dab78 the name was added and removed again around every group."""
    import ctypes
    import os
    import warnings

    import torch.distributed as dist

    from da3po_megatron.rollout import collective
    from da3po_megatron.rollout.client import actor_env
    from da3po_megatron.rollout.types import EngineConfig

    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    environ = ctypes.POINTER(ctypes.c_char_p).in_dll(libc, "environ")

    def c_environ() -> tuple[int, list[bytes]]:  # the array getenv walks: its address and its names, in order
        names, i = [], 0
        while environ[i] is not None:
            names.append(environ[i].split(b"=", 1)[0])
            i += 1
        return ctypes.cast(environ, ctypes.c_void_p).value, names

    seen = {}

    class StandInProcessGroupNCCL:
        class Options:
            _timeout = None

        def __init__(self, store, rank, size, opts):
            seen.update(env=libc.getenv(b"TORCH_NCCL_BLOCKING_WAIT"), timeout=opts._timeout, rank=rank, size=size)

    monkeypatch.setattr(dist, "ProcessGroupNCCL", StandInProcessGroupNCCL, raising=False)
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    assert actor_env(EngineConfig("/m"))["TORCH_NCCL_BLOCKING_WAIT"] == "0"  # what an engine actor starts with
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "0")  # ... this process, as such an actor, from its start
    stop, reads = threading.Event(), set()

    def reader() -> None:  # another thread reading the C environment meanwhile (NCCL's, Ray's threads may)
        while not stop.is_set():
            reads.add(libc.getenv(b"TORCH_NCCL_BLOCKING_WAIT"))

    other = threading.Thread(target=reader)
    other.start()
    before = c_environ()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            collective.nccl_group(store=None, rank=1, world_size=3, timeout=timedelta(seconds=42))
        after = c_environ()
    finally:
        stop.set()
        other.join()
    print(f"constructor saw {seen['env']}; environ array {before[0]:#x} -> {after[0]:#x}, "
          f"{len(before[1])} -> {len(after[1])} names; the other thread read {sorted(reads)}")
    assert seen == {"env": b"1", "timeout": timedelta(seconds=42), "rank": 1, "size": 3}
    assert after == before and os.environ["TORCH_NCCL_BLOCKING_WAIT"] == "0"  # same array, same names, value back
    assert reads <= {b"0", b"1"}
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT")  # a process that did not get it at start
    with pytest.warns(UserWarning, match=r"\['TORCH_NCCL_BLOCKING_WAIT'\] not in this process's environment at start"):
        collective.nccl_group(store=None, rank=0, world_size=2, timeout=timedelta(seconds=1))
    assert seen["env"] == b"1" and os.environ["TORCH_NCCL_BLOCKING_WAIT"] == "0"  # kept: never removed again


def test_a_receiver_gone_mid_sync_makes_the_sender_raise_naming_its_stage_and_bucket():
    named = [(f"t{i}", torch.full((256,), float(i))) for i in range(30)]  # 1 KiB each, 1 KiB buckets
    sender, pg = _pair("gone", timeout_s=2.0)
    sender.stage = 1

    def receive_two_buckets_then_leave() -> None:
        from da3po_megatron.rollout.collective import broadcast

        for _ in range(2):
            header = torch.empty(3, dtype=torch.int64)
            broadcast(pg, header)
            broadcast(pg, torch.empty(int(header[1]), dtype=torch.uint8))
            broadcast(pg, torch.empty(int(header[2]), dtype=torch.uint8))
        destroy_group(pg)  # the worker leaves (its process died, its group timed out)

    leaving = threading.Thread(target=receive_two_buckets_then_leave)
    leaving.start()
    try:
        with pytest.raises(RuntimeError, match=r"the sender of PP stage 1 broke at bucket \d+ of that stage") as e:
            sender.send(iter(named), 1024)
        print(e.value)
        assert int(str(e.value).split("bucket ")[1].split()[0]) >= 2  # the two received buckets went through
    finally:
        leaving.join()
        sender.close()


def test_a_failed_load_leaves_no_receiving_thread_alive_and_the_pool_freed():
    """A load that raises in the middle of a stream (here bucket 1 of 30: a stand-in load, the group and the receive
    code are real): receive_stage raises naming stage and bucket, and by the time it has returned its receiving
    thread has ended and the stream's buffer pool holds nothing. On 27dab78 the thread got one slot back, received one
    more bucket and then waited forever for the next slot, holding the pool's buffers (one more per failed sync)."""
    import gc

    from da3po_megatron.rollout.collective import BufferPool

    named = [(f"t{i}", torch.full((256,), float(i))) for i in range(30)]  # 1 KiB each, 1 KiB buckets
    sender, pg = _pair("failed-load", timeout_s=2.0)
    sent: dict = {}

    def send() -> None:
        try:
            sent["stats"] = sender.send(iter(named), 1024)
        except Exception as e:  # noqa: BLE001 - the receiver gave up: the sender's broadcast fails
            sent["error"] = e

    sending = threading.Thread(target=send, name="sender")
    sending.start()
    loads: list[int] = []

    def load(tensors: dict[str, torch.Tensor]) -> None:
        loads.append(len(tensors))
        if len(loads) == 2:
            raise ValueError("a stand-in load that raises")

    stats: dict = {}
    try:
        with pytest.raises(RuntimeError, match=r"from PP stage 0 broke at bucket 1 .*ValueError: a stand-in load"):
            receive_stage(pg, torch.device("cpu"), load, 0, stats)
        alive = [t.name for t in threading.enumerate() if t.name.startswith("da3po-recv-stage")]
        gc.collect()
        held = [len(p._bufs) for p in gc.get_objects() if type(p) is BufferPool and p.keep == 3]
        print(f"after the failed load: receiving threads alive {alive}, receiving pools' buffers {held}")
        assert alive == [] and not any(held)
    finally:
        destroy_group(pg)  # the worker's group goes (the engine's teardown after a failed sync)
        sending.join()
        sender.close()


def test_a_stage_with_two_ep_ranks_is_received_chunk_by_chunk_each_layers_experts_from_both_before_the_next():
    """The collective transport with experts, on real gloo pairs without an engine: EP rank 0's sender (the stage's
    sender: non-expert tensors, then its experts layer by layer) and EP rank 1's (its experts only) each broadcast
    on a group of their own; the receiver reads the two groups round-robin one chunk at a time, so it loads the
    non-expert tensors, then layer 0's experts from both ranks, then layer 1's -- vLLM's FusedMoE of a layer is
    complete before the next layer's experts arrive. A stream out of that order is refused naming the tensor."""
    from da3po_megatron.rollout.collective import _chunks, chunk_key

    g = torch.Generator().manual_seed(3)

    def t() -> torch.Tensor:
        return torch.randn(64, 16, generator=g)  # 4 KiB: several tensors per 8 KiB bucket

    def experts(layer: int, ids: range) -> list:
        return [(f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight", t()) for e in ids for p in ("gate", "up")]

    dense = [("model.embed_tokens.weight", t()), ("model.layers.0.self_attn.q_proj.weight", t()),
             ("model.layers.1.self_attn.q_proj.weight", t()), ("lm_head.weight", t())]
    streams = [dense + experts(0, range(0, 2)) + experts(1, range(0, 2)),
               experts(0, range(2, 4)) + experts(1, range(2, 4))]
    pairs = [_pair(f"ep_chunks_{i}") for i in range(2)]
    out: list[dict] = [{}, {}]
    senders = [threading.Thread(target=lambda i=i: out[i].update(pairs[i][0].send(iter(streams[i]), 8192,
                                                                                   chunked=True)), name=f"ep{i}")
               for i in range(2)]
    for s in senders:
        s.start()
    loaded: list[tuple[str, torch.Tensor]] = []
    stats: dict = {}
    receive_stage([pairs[0][1], pairs[1][1]], torch.device("cpu"),
                  lambda tensors: loaded.extend((k, v.clone()) for k, v in tensors.items()), 0, stats)
    for s in senders:
        s.join(timeout=30)
    try:
        order = [(chunk_key(n), int(n.split(".")[5]) // 2 if chunk_key(n) >= 0 else -1) for n, _ in loaded]
        # (chunk, EP rank) in the order loaded: every non-expert tensor, then per layer rank 0's then rank 1's
        runs = [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k]
        assert runs == [(-1, -1), (0, 0), (0, 1), (1, 0), (1, 1)], runs
        sent = dict(streams[0] + streams[1])
        assert sorted(n for n, _ in loaded) == sorted(sent)
        assert all(torch.equal(v, sent[n]) for n, v in loaded)
        assert out[0]["chunks"] == out[1]["chunks"] == 2 and out[1]["buckets"] >= 2
    finally:
        for sender, pg in pairs:
            sender.close()
            destroy_group(pg)
    with pytest.raises(ValueError, match=r"'x' \(chunk -1\) after chunk 0: the stream must give every non-expert "
                                         r"tensor first"):
        list(list(c) for c in _chunks([("model.layers.0.mlp.experts.1.up_proj.weight", None), ("x", None)]))
