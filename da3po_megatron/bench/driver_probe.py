"""What the control-plane bench measures in the driver process (split out of ``bench/control_plane.py``): wall and
CPU seconds per phase, bytes Ray's serializer produces for a payload, the driver's peak RSS, the object store's peak,
and -- the check of issue 60 -- the bytes the driver *deserialises* (:class:`DriverIntake`: every object ``ray.get``
brings into this process, counted where Ray unpickles it)."""

from __future__ import annotations

import resource
import threading
import time
from typing import Any


class StorePoll(threading.Thread):
    """Object-store bytes in use, polled from the raylet; ``peak`` is the largest value seen."""

    def __init__(self, period_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.period_s, self.peak, self._halt = period_s, 0, threading.Event()
        self.cpu_s = 0.0  # this thread's own CPU time, subtracted from the phases' driver CPU (it is measurement)

    def sample(self) -> int:
        from ray._private.internal_api import get_memory_info_reply, get_state_from_address

        try:
            import ray

            reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
            return int(reply.store_stats.object_store_bytes_used)
        except Exception:  # noqa: BLE001 - a missed sample only lowers the peak
            return 0

    def run(self) -> None:
        c0 = time.thread_time()
        while not self._halt.is_set():
            self.peak = max(self.peak, self.sample())
            self.cpu_s = time.thread_time() - c0
            self._halt.wait(self.period_s)

    def stop(self) -> int:
        self._halt.set()
        self.join()
        return self.peak


def ray_bytes(obj: Any) -> int:
    """Bytes Ray's serializer produces for ``obj`` (in-band pickle + out-of-band buffers)."""
    import ray

    ctx = ray._private.worker.global_worker.get_serialization_context()
    return int(ctx.serialize(obj).total_bytes)


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Phases:
    """Wall and driver-process CPU seconds per phase (all threads of the driver: Ray's too; the store poller's own
    CPU is subtracted), bytes moved and RSS after it."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, float]] = {}
        self.poll: StorePoll | None = None

    def _poll_cpu(self) -> float:
        return self.poll.cpu_s if self.poll is not None else 0.0

    def __call__(self, name: str):
        phases = self

        class _Ctx:
            def __enter__(self):
                self.w, self.c, self.p = time.perf_counter(), time.process_time(), phases._poll_cpu()

            def __exit__(self, *exc):
                r = phases.rows.setdefault(name, {"wall_s": 0.0, "cpu_s": 0.0, "bytes": 0.0})
                r["wall_s"] += time.perf_counter() - self.w
                r["cpu_s"] += time.process_time() - self.c - (phases._poll_cpu() - self.p)
                r["rss_mb"] = rss_mb()

        return _Ctx()

    def add_bytes(self, name: str, n: float) -> None:
        self.rows.setdefault(name, {"wall_s": 0.0, "cpu_s": 0.0, "bytes": 0.0})["bytes"] += n


class DriverIntake:
    """Counts the bytes this process deserialises from Ray (every ``ray.get`` here: results of the engines, of the
    ranks, of tasks) while active: ``SerializationContext.deserialize_objects`` (``ray/_private/serialization.py``)
    wrapped, each object's serialized size added to ``bytes`` (in-band pickle and out-of-band buffers together)."""

    def __init__(self) -> None:
        self.bytes, self.objects = 0, 0
        self._ctx: Any = None
        self._orig: Any = None

    def __enter__(self) -> DriverIntake:
        import ray

        self._ctx = ray._private.worker.global_worker.get_serialization_context()
        orig = self._orig = self._ctx.deserialize_objects

        def counted(serialized, object_refs, *args, **kwargs):
            for item in serialized:
                data = item[0]
                self.bytes += len(data) if data is not None else 0
                self.objects += 1
            return orig(serialized, object_refs, *args, **kwargs)

        self._ctx.deserialize_objects = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        del self._ctx.deserialize_objects  # the class's method again
