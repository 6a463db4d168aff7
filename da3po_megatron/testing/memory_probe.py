"""Peak-memory probe shared by the measurements and GPU checks (``tools/measure/expert_sync_memory.py``,
``tools/gpu/check_moe_gpu.py``): a package module, so Ray pickles it by reference into the policy ranks."""

from __future__ import annotations

from typing import Any


def traced(worker: Any, fn: Any, *args: Any) -> dict:
    """Run ``fn(worker, *args)`` under torch's CPU memory profiler; its result and the peak allocated bytes above
    the start (runs inside a policy rank)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn(worker, *args)
    events = []
    for e in prof.events():
        if e.name == "[memory]":
            events.append((e.time_range.start, e.cpu_memory_usage))
        elif e.self_cpu_memory_usage:
            events.append((e.time_range.start, e.self_cpu_memory_usage))
    cur = peak = 0
    for _, delta in sorted(events, key=lambda x: x[0]):
        cur += delta
        peak = max(peak, cur)
    return {"result": out, "peak_bytes": int(peak), "rank": int(getattr(worker, "rank", -1))}
