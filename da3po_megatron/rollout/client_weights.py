"""The weight-update half of :class:`~da3po_megatron.rollout.client.RolloutClient` (split from client.py, which had
grown past 500 lines): a session opened on every engine, HF-named tensors streamed in bounded buckets (one flat
``ray.put`` buffer per bucket shared by all engines, the next packed while the engines load the current one), the
session closed with the strict check, and the bucket refs a restarted engine replays. A mixin: the client supplies
``engines``, ``mode``, ``restart_on_failure``, ``num_engines``, ``_call`` and ``_gather``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from da3po_megatron.rollout.buckets import iter_buckets_marked, pack_bucket
from da3po_megatron.rollout.types import RolloutError, timed_stream

MiB = 1 << 20


class WeightUpdates:
    """Bucketed weight updates into the client's engines (see the module docstring)."""

    mode: str
    restart_on_failure: bool
    weights_version: int
    _last_update_refs: list[Any]
    _pending_refs: list[Any]

    def begin_weight_update(self) -> None:
        """Open a weight-update session on every engine (layerwise reload). Generation must wait until finish."""
        self._gather([(i, self._call(i, "begin_bucket_update")) for i in range(self.num_engines)], "weight update")
        self._pending_refs = []

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_mb: float = 256,
                     dtype: torch.dtype | None = None, session: bool = False, strict: bool = True) -> dict:
        """Group HF-named tensors into buckets of at most ``bucket_mb`` MiB and load each into every engine.

        Between :meth:`begin_weight_update` and :meth:`finish_weight_update`; may be called several times and, with
        Ray, from other processes holding a copy of this client (e.g. one policy rank per pipeline stage). With Ray,
        each bucket is packed into one flat buffer (:func:`pack_bucket`), ``ray.put`` once and shared by all engines;
        the next bucket is packed while the engines load the current one (at most two buckets alive). In-process
        engines get the tensors themselves. ``dtype`` casts floating tensors before sending.

        ``session=True`` (the only sender of a sync): the session is opened by the first bucket's load call and
        closed (``strict`` check, prefix caches reset) by the last one's, instead of two calls of their own -- a
        one-bucket sync is one call per engine. The engines' weights version moves on; the caller's copy of this
        client learns it through :meth:`note_weight_update`. No tensors: RolloutError.
        Returns ``{"seconds", "bytes", "buckets", "tensors", "max_bucket_bytes"}`` (tensor bytes per engine) and the
        split of ``seconds``: ``export_s`` (producing the stream: export + HF mapping), ``pack_s`` (bucket copies,
        packing, ``ray.put``), ``engine_s`` (waiting for the engines' loads beyond what packing hid), and of that
        ``engine_call_s``: the time inside the slowest engine's load calls (the rest is the calls' transport: Ray's
        dispatch and the object-store fetch).
        """
        t0 = time.perf_counter()
        n_bytes = n_buckets = n_tensors = max_bucket = 0
        pending: list[tuple[int, Any]] = []
        refs: list[Any] = []
        split = {"export_s": 0.0, "pack_s": 0.0, "engine_s": 0.0, "engine_call_s": 0.0}
        buckets = iter_buckets_marked(timed_stream(named_tensors, split), int(bucket_mb * MiB), dtype)
        tp = time.perf_counter()
        for bucket, last in buckets:
            size = sum(t.numel() * t.element_size() for t in bucket.values())
            flags = {"begin": session and n_buckets == 0, "finish": session and last, "strict": strict}
            n_bytes += size
            n_buckets += 1
            n_tensors += len(bucket)
            max_bucket = max(max_bucket, size)
            if self.mode == "ray":
                import ray

                ref = ray.put(pack_bucket(bucket))
                del bucket
                if self.restart_on_failure:
                    refs.append(ref)
                split["pack_s"] += time.perf_counter() - tp
                tw = time.perf_counter()
                self._note_calls(split, self._gather(pending, "weight update"))  # previous bucket: <= 2 alive
                pending = [(i, self._call(i, "load_bucket", ref, **flags)) for i in range(self.num_engines)]
                split["engine_s"] += time.perf_counter() - tw
            else:  # same address space: the engine reads the tensors themselves
                split["pack_s"] += time.perf_counter() - tp
                tw = time.perf_counter()
                self._note_calls(split, [self._call(i, "load_bucket", bucket, **flags)
                                         for i in range(self.num_engines)])
                split["engine_s"] += time.perf_counter() - tw
            tp = time.perf_counter()
        tw = time.perf_counter()
        self._note_calls(split, self._gather(pending, "weight update"))
        split["engine_s"] += time.perf_counter() - tw
        split["pack_s"] = max(split["pack_s"] - split["export_s"], 0.0)  # the stream is pulled inside the bucketing
        if session and n_buckets == 0:
            raise RolloutError("weight update got no tensors")
        if session:  # this call was the whole sync: its buckets are what a restarted engine replays
            self.note_weight_update(refs if self.mode == "ray" and self.restart_on_failure else [])
        elif self.mode == "ray" and self.restart_on_failure:
            self._pending_refs.extend(refs)
        return {"seconds": time.perf_counter() - t0, "bytes": n_bytes, "buckets": n_buckets, "tensors": n_tensors,
                "max_bucket_bytes": max_bucket, **split}

    @staticmethod
    def _note_calls(split: dict[str, float], reports: list[Any]) -> None:
        """Add the slowest engine's in-actor time of one bucket's load calls to ``split["engine_call_s"]``."""
        split["engine_call_s"] += max((r.get("call_s", 0.0) for r in reports if isinstance(r, dict)), default=0.0)

    def note_weight_update(self, refs: list[Any] | None = None) -> None:
        """Record a completed update on this copy of the client (its weights version; ``refs``: the buckets a
        restarted engine can replay, or none -- then :attr:`resync` or an EngineDeadError after a restart)."""
        self.weights_version += 1
        self._last_update_refs = list(refs or [])
        self._pending_refs = []

    def finish_weight_update(self, strict: bool = True) -> list[dict]:
        """Close the session on every engine (``strict``: every engine parameter must have been written, else
        RolloutError naming the missing ones) and reset the prefix caches. Returns each engine's report."""
        reports = self._gather([(i, self._call(i, "finish_bucket_update", strict)) for i in range(self.num_engines)],
                               "weight update")
        # replay material for restarted engines exists only when every bucket went through this client object
        self.note_weight_update(self._pending_refs)
        return reports

    def abort_weight_update(self) -> None:
        """Close an open session after a failure (engines keep whatever was loaded; sync again before generating)."""
        for i in range(self.num_engines):
            try:
                self._gather([(i, self._call(i, "abort_bucket_update"))], "abort weight update")
            except Exception:  # noqa: BLE001 - the original error matters more
                pass
        self._pending_refs = []

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_mb: float = 256,
                       dtype: torch.dtype | None = None, strict: bool = True) -> dict:
        """begin + push + finish: stream HF-named tensors to every engine in bounded buckets; reset prefix caches.

        Returns ``{"seconds", "bytes", "buckets", "tensors", "max_bucket_bytes"}`` (bytes = one engine's payload).
        """
        t0 = time.perf_counter()
        try:
            stats = self.push_weights(named_tensors, bucket_mb=bucket_mb, dtype=dtype, session=True, strict=strict)
        except BaseException:
            self.abort_weight_update()
            raise
        stats["seconds"] = time.perf_counter() - t0
        return stats

    def reload_from_path(self, path: str) -> float:
        """Every engine reloads all weights from an HF checkpoint directory (benchmark baseline); seconds."""
        t0 = time.perf_counter()
        self._gather([(i, self._call(i, "reload_from_path", str(path))) for i in range(self.num_engines)], "reload")
        return time.perf_counter() - t0

