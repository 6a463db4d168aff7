"""The asynchronous writer of the policy's checkpoints: one forked writer process per checkpoint, finalized later.

megatron-core's own mechanism -- ``dist_checkpointing.save(..., async_sharded_save=True)`` returns an ``AsyncRequest``
(0.16.1 ``dist_checkpointing/serialization.py`` 314-437: the plan, the common part and the sharded objects are written
at once; the shards are written by the request, and ``metadata.json`` only by its finalize functions), scheduled on
an ``AsyncCallsQueue`` (``dist_checkpointing/strategies/async_utils.py`` 530-624, non-persistent:
``TemporalAsyncCaller`` forks one writer process per request after staging GPU tensors to host memory, 178-255). The
model and optimizer requests of one checkpoint are merged into ONE request (:func:`_merge_async_requests`): torch_dist's
writers report their results through one process-wide queue (``filesystem_async.py`` 48-56,
``retrieve_write_results`` 424), so two requests in flight at once could read each other's results; one writer process
writing both, in order, keeps them apart. On CPU the fork is the snapshot (copy-on-write: the next step's updates do
not reach the child; ``preload_tensors`` copies nothing there). :func:`finalize_async_save` -- collective, it
all-reduces "done" over the world and gathers the write results -- writes the torch_dist ``.metadata`` and
``metadata.json``; only then is the checkpoint loadable. Works on CPU / gloo (tests/test_operations.py). At most one
asynchronous save per process is in flight (checked by :func:`checkpoint.save_policy`, which makes the requests and
calls :func:`schedule_async_save`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger(__name__)

_ASYNC: dict[str, Any] = {"queue": None, "started": 0.0}


def _async_queue():
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    if _ASYNC["queue"] is None:
        _ASYNC["queue"] = AsyncCallsQueue(persistent=False)  # a forked writer per request (TemporalAsyncCaller)
    return _ASYNC["queue"]


def async_save_in_flight() -> bool:
    """Whether this process has scheduled an asynchronous save that is not finalized yet (not collective)."""
    q = _ASYNC["queue"]
    return q is not None and q.get_num_unfinalized_calls() > 0


def _run_writes(writes: list[tuple[Any, tuple, dict]]) -> None:
    """In the forked writer process: each request's write function, in order (model, then optimizer)."""
    for fn, args, kwargs in writes:
        if fn is not None:
            fn(*args, **kwargs)


def _merge_async_requests(requests: list[Any]) -> Any:
    """One ``AsyncRequest`` doing the writes of ``requests`` in order, then all their finalize functions in order.

    Each request's ``preload_fn`` (GPU -> host staging) runs here, in the training process and before the fork, as
    ``TemporalAsyncCaller.schedule_async_call`` would run it (async_utils.py 198-206): its result replaces the write
    buckets argument (index 1) exactly as there."""
    from functools import partial

    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    writes, finalize = [], []
    for r in requests:
        args = list(r.async_fn_args)
        if r.preload_fn is not None and r.async_fn is not None:
            args[1] = r.preload_fn()
        writes.append((r.async_fn, tuple(args), dict(r.async_fn_kwargs)))
        finalize += list(r.finalize_fns)
    fn = partial(_run_writes, writes) if any(w[0] is not None for w in writes) else None
    return AsyncRequest(fn, (), finalize)


def schedule_async_save(requests: list[Any], started: float) -> None:
    """Schedule the ``AsyncRequest``s of one checkpoint (model, then optimizer) as one forked writer;
    ``started`` (``time.perf_counter()`` when the save began) is what the finalize log line measures from."""
    _ASYNC["started"] = started
    _async_queue().schedule_async_request(_merge_async_requests(requests))


def finalize_async_save(blocking: bool = False) -> bool:
    """Finish the asynchronous save in flight if its writer is done on every rank (``blocking``: wait for it).

    Collective (megatron's ``maybe_finalize_async_calls`` all-reduces "done" over the world, then the finalize
    functions gather the write results and write ``.metadata`` / ``metadata.json``). Returns True when nothing is in
    flight any more (the same on every rank). A writer's failure raises megatron's ``CheckpointException`` on every
    rank."""
    q = _ASYNC["queue"]
    if q is None or q.get_num_unfinalized_calls() == 0:
        return True
    q.maybe_finalize_async_calls(blocking=blocking)
    done = q.get_num_unfinalized_calls() == 0
    if done:
        log.info("asynchronous checkpoint finalized %.2f s after it was scheduled", time.perf_counter()
                 - _ASYNC["started"])
    return done
