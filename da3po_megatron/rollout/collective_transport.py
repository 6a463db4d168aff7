"""Driver side of the "collective" weight transport (:mod:`da3po_megatron.rollout.collective` holds the groups, the wire
format and the packing, :mod:`~da3po_megatron.rollout.collective_send` the sender and
:mod:`~da3po_megatron.rollout.collective_receive` the worker-side receiver): :class:`CollectiveTransport` builds one
group per PP stage (per PP stage and EP rank with expert parallelism) from the senders to every engine worker, runs a
sync (engines receive in Ray calls while the senders broadcast), rebuilds the groups after an engine restart or a
failed sync, and measures the link for the benchmark.

The senders are reached through a :data:`SendersFn` -- ``PolicyGroup.run_on_all`` for the policy ranks (each rank
decides with :func:`sender_slot` whether and on which group it sends), :meth:`StreamSender.run`
for an HF stream in this process (tools, tests).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from da3po_megatron.rollout.collective_send import _SENDERS, close_sender, get_sender, open_sender


class StreamSender:
    """A sender that is not a policy rank: ``make_stream()`` gives a fresh HF-named stream per sync (an HF model's
    ``hf_state_tensors``; tools and tests). ``run`` is the :data:`SendersFn` that calls functions on it in this
    process (the driver then blocks in the broadcast while the engine actors receive)."""

    dp_rank = tp_rank = 0

    def __init__(self, make_stream: Callable[[], Iterable[tuple[str, torch.Tensor]]], pp_rank: int = 0) -> None:
        self.make_stream = make_stream
        self.pp_rank = pp_rank

    def hf_stream(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.make_stream()

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        return [fn(self, *args)]


# ------------------------------------------------------------------------------------------------ driver side
SendersFn = Callable[..., list[Any]]
"""How the driver runs a function on the senders: ``run(fn, *args)`` calls ``fn(worker, *args)`` in every sending
process and returns all results (``PolicyGroup.run_on_all``; tools pass a local equivalent)."""


def sender_slot(worker: Any) -> tuple[int, int] | None:
    """(PP stage, slot) of the group this rank sends on, or None: slot 0 is the stage's sender
    (:func:`~da3po_megatron.rollout.weight_sync.sender_stage`, which also owns EP rank 0's experts), slot j > 0 the
    rank that sends EP rank j's experts (:func:`~da3po_megatron.rollout.weight_sync.sends_experts`)."""
    from da3po_megatron.rollout.weight_sync import sender_stage, sends_experts

    stage = sender_stage(worker)
    if stage is not None:
        return stage, 0
    if sends_experts(worker):
        from megatron.core import parallel_state as ps

        return int(getattr(worker, "pp_rank", 0)), int(ps.get_expert_model_parallel_rank())
    return None


def _group_name(prefix: str, stage: int, slot: int) -> str:
    return f"{prefix}/stage{stage}" + (f"/ep{slot}" if slot else "")


def _sender_open(worker: Any, prefix: str, world_size: int, backend: str, timeout_s: float) -> dict | None:
    where = sender_slot(worker)
    if where is None:
        return None
    stage, slot = where
    return open_sender(_group_name(prefix, stage, slot), world_size, backend, timeout_s, stage=stage, slot=slot)


def _sender_sees_cuda(_worker: Any) -> bool:
    return torch.cuda.is_available()


def _sender_connect(worker: Any, prefix: str) -> float:
    where = sender_slot(worker)
    return 0.0 if where is None else get_sender(_group_name(prefix, *where)).connect()


def _sender_push(worker: Any, prefix: str, bucket_bytes: int, dtype: torch.dtype | None,
                 chunked: bool = False) -> dict:
    from da3po_megatron.rollout.weight_sync import policy_hf_stream

    where = sender_slot(worker)
    stream = policy_hf_stream(worker)
    if where is None:
        for _ in stream:  # take part in the export's collectives, send nothing
            pass
        return {"bytes": 0, "buckets": 0, "tensors": 0, "max_bucket_bytes": 0}
    return get_sender(_group_name(prefix, *where)).send(stream, bucket_bytes, dtype, chunked=chunked)


def _sender_close(worker: Any, prefix: str) -> None:  # noqa: ARG001
    for name in [n for n in _SENDERS if n.startswith(prefix + "/")]:
        close_sender(name)


class CollectiveTransport:
    """Driver-side owner of the stage groups: builds them (lazily, again after an engine restart or a failed sync),
    runs one sync, tears them down. ``run_senders`` is how functions reach the sending processes (see
    :data:`SendersFn`); ``num_stages`` the number of pipeline stages; ``expert_parallel`` the policy's EP size: a
    stage has one sender (and group) per EP rank, each sending the experts it owns (:mod:`.collective`)."""

    def __init__(self, run_senders: SendersFn, num_stages: int, *, backend: str | None = None,
                 timeout_s: float = 600.0, name: str | None = None, expert_parallel: int = 1) -> None:
        self.run_senders = run_senders
        self.num_stages = num_stages
        self.expert_parallel = int(expert_parallel)
        self.backend = backend  # None: what the senders see, asked at the first group build (never the driver's CUDA)
        self.timeout_s = timeout_s
        self.prefix = name or f"da3po_weights_{os.getpid()}_{id(self):x}"
        self.generation = 0
        self._built_for: tuple | None = None  # (client id, restarts, engines) the groups were built for
        self.last_build_seconds = 0.0

    # ------------------------------------------------------------------ group life cycle
    def _key(self, client: Any) -> tuple:
        return (id(client), client.restarts, client.num_engines, tuple(id(e) for e in client.engines))

    def ensure_group(self, client: Any) -> bool:
        """Build the groups unless they exist for exactly these engines. Returns True when it (re)built them."""
        if self._built_for == self._key(client):
            return False
        self.teardown(client)
        t0 = time.perf_counter()
        self.generation += 1
        prefix = f"{self.prefix}/g{self.generation}"
        tp = client.config.tensor_parallel_size
        world = 1 + client.num_engines * tp
        if self.backend is None:
            self.backend = "nccl" if all(self.run_senders(_sender_sees_cuda)) else "gloo"
        opened = [a for a in self.run_senders(_sender_open, prefix, world, self.backend, self.timeout_s) if a]
        slots = sorted((a["stage"], a["slot"]) for a in opened)
        want = [(s, j) for s in range(self.num_stages) for j in range(self.expert_parallel)]
        if slots != want:
            raise RuntimeError(f"collective weight transport: expected one sender per PP stage 0..{self.num_stages - 1}"
                               f" and EP rank 0..{self.expert_parallel - 1}, got senders for (stage, EP rank) "
                               f"{slots}")
        groups = [next(a for a in opened if (a["stage"], a["slot"]) == w) for w in want]
        joins = [(i, client._call(i, "collective_join", groups, 1 + i * tp)) for i in range(client.num_engines)]
        try:
            self.run_senders(_sender_connect, prefix)
            client._gather(joins, "collective weight transport: group set-up")
        except BaseException:
            self._built_for = None
            self._close_senders(prefix)
            raise
        self._prefix_now = prefix
        self._built_for = self._key(client)
        self.last_build_seconds = time.perf_counter() - t0
        return True

    def _close_senders(self, prefix: str) -> None:
        try:
            self.run_senders(_sender_close, prefix)
        except Exception:  # noqa: BLE001 - a dead sender has nothing left to close
            pass

    def teardown(self, client: Any | None = None) -> None:
        """Leave the groups on every engine (best effort) and close the senders' stores."""
        prefix = getattr(self, "_prefix_now", None)
        if prefix is None:
            return
        if client is not None:
            for i in range(client.num_engines):
                try:
                    client._gather([(i, client._call(i, "collective_leave"))], "collective leave")
                except Exception:  # noqa: BLE001 - dead engines have left already
                    pass
        self._close_senders(prefix)
        self._prefix_now = None
        self._built_for = None

    # ------------------------------------------------------------------ one sync
    def sync(self, client: Any, bucket_mb: float, dtype: torch.dtype | None = None, strict: bool = True) -> dict:
        """One call per engine -- open the session, receive while the senders broadcast, close it (strict check,
        prefix caches reset) -- and one per sender. On failure the engines close their sessions and refuse to
        generate, the groups are torn down (rebuilt next time) and a RolloutError names the engine, stage and
        bucket."""
        from da3po_megatron.rollout.types import RolloutError

        t0 = time.perf_counter()
        built = self.ensure_group(client)
        t_group = time.perf_counter() - t0
        prefix = self._prefix_now
        receives = [(i, client._call(i, "collective_receive", True, True, strict)) for i in range(client.num_engines)]
        sender_error: BaseException | None = None
        parts: list[Any] = []
        try:
            parts = self.run_senders(_sender_push, prefix, int(bucket_mb * 2**20), dtype, self.expert_parallel > 1)
        except BaseException as e:  # noqa: BLE001 - report together with what the engines saw
            sender_error = e
        engine_reports, engine_errors = [], []
        for i, ref in receives:
            try:
                engine_reports.append(client._gather([(i, ref)], "collective weight sync")[0])
            except Exception as e:  # noqa: BLE001
                engine_errors.append(e)
        if sender_error is not None or engine_errors:
            client.abort_weight_update()
            self._built_for = None  # broken streams leave the groups unusable: rebuild next time
            self.teardown(client)
            what = "; ".join(str(e) for e in engine_errors) or "no engine reported an error"
            cause = sender_error or engine_errors[0]
            head = (f"sender failed ({type(sender_error).__name__}: {str(sender_error).splitlines()[0][:300]}); "
                    if sender_error is not None else "")
            raise RolloutError(f"collective weight sync failed: {head}{what}. Engines hold partially updated "
                               "weights and refuse to generate until the next complete sync.") from cause
        client.note_weight_update()
        sent = [p for p in parts if p and p.get("buckets")]
        stats: dict[str, float] = {k: float(sum(p.get(k, 0) for p in sent))
                                   for k in ("bytes", "buckets", "tensors", "chunks")}
        stats["max_bucket_bytes"] = float(max((p["max_bucket_bytes"] for p in sent), default=0))
        stats["pushing_ranks"] = float(len(sent))
        for k in ("export_s", "pack_s", "transfer_s"):
            stats[k] = float(max((p.get(k, 0.0) for p in sent), default=0.0))
        stats["engine_load_s"] = float(max((r.get("load_s", 0.0) for r in engine_reports), default=0.0))
        stats["engine_recv_s"] = float(max((r.get("transfer_s", 0.0) for r in engine_reports), default=0.0))
        stats["engine_finish_s"] = float(max((r.get("finish_s", 0.0) for r in engine_reports), default=0.0))
        # bucket buffers allocated anew (the rest reused from the stream's BufferPool): sender, and the worst worker
        stats["fresh_buffers"] = float(max((p.get("fresh_buffers", 0) for p in sent), default=0))
        stats["engine_fresh_buffers"] = float(max((r.get("fresh_buffers", 0) for r in engine_reports), default=0))
        # buckets a worker had received in full before its previous bucket finished loading (receive || load)
        stats["engine_overlapped_buckets"] = float(min((r.get("overlapped_buckets", 0) for r in engine_reports),
                                                       default=0))
        stats["group_setup_s"] = t_group if built else 0.0
        stats["seconds"] = time.perf_counter() - t0
        stats["gbps"] = stats["bytes"] / max(stats["seconds"], 1e-9) / 1e9
        return stats

    def link_bandwidth(self, client: Any, nbytes: int) -> float:
        """Seconds of one broadcast of a single ``nbytes`` buffer from stage 0's sender to every engine worker (the
        link reference of da3po_megatron/bench/weight_sync.py)."""
        self.ensure_group(client)
        refs = [(i, client._call(i, "collective_recv_raw", nbytes)) for i in range(client.num_engines)]
        seconds = self.run_senders(_sender_raw, self._prefix_now, nbytes)
        client._gather(refs, "raw broadcast")
        return float(max(s for s in seconds if s is not None))


def _sender_raw(worker: Any, prefix: str, nbytes: int) -> float | None:
    if sender_slot(worker) != (0, 0):
        return None
    s = get_sender(f"{prefix}/stage0")
    return s.send_raw(torch.ones(nbytes, dtype=torch.uint8, device=s.device))
