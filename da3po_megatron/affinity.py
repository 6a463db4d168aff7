"""CPU placement: pin a process (all its threads) to a set of cores, so engines and policy ranks that should overlap
(``rollout.staleness=1``) never share a core (``ray.engine_cpus`` / ``ray.policy_cpus``). Linux only."""

from __future__ import annotations

import os


def parse_cpu_list(spec: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8] (Linux cpu-list syntax); '' -> [] (no pinning). ValueError on bad syntax."""
    cores: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad cpu list entry {part!r} (want e.g. '0-3,8')")
        cores.update(range(int(lo), int(hi if sep else lo) + 1))
    return sorted(cores)


def pin_process(spec: str) -> list[int]:
    """Pin every thread of this process to the cores of ``spec`` (threads started later inherit it); returns the
    cores now allowed. '' changes nothing. Cores this machine does not have are an error naming them."""
    cores = parse_cpu_list(spec)
    if not cores:
        return sorted(os.sched_getaffinity(0))
    have = set(range(os.cpu_count() or 1))
    if not set(cores) <= have:
        raise ValueError(f"cpu list {spec!r} names cores {sorted(set(cores) - have)} this machine does not have "
                         f"(it has 0-{max(have)})")
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that just ended
            pass
    return sorted(os.sched_getaffinity(0))
