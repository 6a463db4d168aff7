"""The driver's own processes end with the driver, also when it is SIGKILLed: a small watcher process (the reaper).

When ``da3po train`` starts a local Ray head itself (``ray.address=local``), the GCS, the raylet and its per-node
agents are descendants of the driver. Ray makes the head processes share the driver's fate, but not the raylet's
agents: ``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent`` poll their parent raylet, and when it is gone they report
its unexpected death to the (dead) GCS before exiting -- ``ray._private.process_watcher.report_raylet_error_logs`` ->
``ray._private.utils.publish_error_to_driver``, whose GCS call has a fixed 60 s timeout (Ray 2.60,
``_private/utils.py`` ~178, ``_private/process_watcher.py`` ~78-150). After a ``kill -9`` of the driver they lingered
35-60 s (issue 35: in 2 of 4 kills). Nothing in a SIGKILLed process can act, so a separate one does:

:func:`start_reaper` starts ``python -c <watcher>`` in its own session (a ``kill -9`` of the driver's process group
does not reach it). It records the driver's descendants (pid and start time, from ``/proc``) every
``interval_s``, and once its parent -- the driver -- is gone (its parent pid changes), it SIGKILLs those that still
run with the same start time (a reused pid is left alone), then exits. After a normal exit Ray has stopped them
already and it finds nothing to do. Cost: one small process per run and a ``/proc`` scan every second.

Not covered: a Ray cluster the driver connects to (``ray.address`` set, e.g. on Slurm): its processes are not the
driver's (``slurm/`` scripts stop them with the job); and a machine whose ``/proc`` is not Linux's (the reaper is not
started).
"""

from __future__ import annotations

import os
import subprocess
import sys

WATCHER = r"""
import os, signal, sys, time

driver, interval = int(sys.argv[1]), float(sys.argv[2])

def stat(pid):
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), fields[19]  # parent pid, start time

def descendants():
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            s = stat(int(d))
            if s is not None:
                parent[int(d)] = s
    out, todo = {}, [driver]
    while todo:
        p = todo.pop()
        for pid, (ppid, start) in parent.items():
            if ppid == p and pid not in out and pid != os.getpid():
                out[pid] = start
                todo.append(pid)
    return out

seen = {}
while os.getppid() == driver:
    seen.update(descendants())
    seen = {pid: start for pid, start in seen.items() if stat(pid) is not None}
    time.sleep(interval)
killed = 0
for pid, start in seen.items():
    s = stat(pid)
    if s is not None and s[1] == start:
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except OSError:
            pass
if killed and os.environ.get("DA3PO_REAPER_VERBOSE") == "1":
    print(f"da3po reaper: the driver (pid {driver}) is gone; stopped {killed} of its processes", file=sys.stderr)
"""


def start_reaper(interval_s: float = 1.0) -> subprocess.Popen | None:
    """Start the watcher of this process (see the module docstring); None where ``/proc`` is not available."""
    if not os.path.isdir("/proc/self") or sys.platform != "linux":
        return None
    return subprocess.Popen([sys.executable, "-S", "-c", WATCHER, str(os.getpid()), str(interval_s)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
                            close_fds=True)
