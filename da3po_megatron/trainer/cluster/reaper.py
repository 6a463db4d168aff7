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

A process that leaves the tree before a scan sees it is found by its environment instead: :func:`start_reaper` puts
``DA3PO_REAPER_TAG=<uuid>`` into the driver's environment before Ray starts, every process the run starts inherits
it, and once the driver is gone the watcher also kills every process whose ``/proc/<pid>/environ`` carries the tag.
Seen in a fresh-clone CI run (2026-12-05): megatron-core's asynchronous checkpoint save forks a writer from the
policy actor (``ray::PolicyWorker.save``); SIGKILLed within a second of that fork, the writer was never scanned,
became init's child when the actor was killed and outlived the run by more than 30 s.

Not covered: a Ray cluster the driver connects to (``ray.address`` set, e.g. on Slurm): its processes are not the
driver's (``slurm/`` scripts stop them with the job); and a machine whose ``/proc`` is not Linux's (the reaper is not
started).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

WATCHER = r"""
import os, signal, sys, time

driver, interval, tag = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3].encode()

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

def tagged():
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                env = open(f"/proc/{d}/environ", "rb").read()
            except OSError:
                continue
            s = stat(int(d))
            if s is not None and b"DA3PO_REAPER_TAG=" + tag + b"\0" in env + b"\0":
                out[int(d)] = s[1]
    return out

seen = {}
while os.getppid() == driver:
    seen.update(descendants())
    seen = {pid: start for pid, start in seen.items() if stat(pid) is not None}
    time.sleep(interval)
killed = set()
for _ in range(4):  # again after a short wait: a process forked while the others were being killed
    found = 0
    for pid, start in {**seen, **tagged()}.items():
        s = stat(pid)
        if s is not None and s[1] == start and pid not in killed:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
                found += 1
            except OSError:
                pass
    if not found:
        break
    time.sleep(0.2)
killed = len(killed)
if killed and os.environ.get("DA3PO_REAPER_VERBOSE") == "1":
    print(f"da3po reaper: the driver (pid {driver}) is gone; stopped {killed} of its processes", file=sys.stderr)
"""


def start_reaper(interval_s: float = 1.0) -> subprocess.Popen | None:
    """Start the watcher of this process (see the module docstring); None where ``/proc`` is not available. Call it
    before Ray starts, so that Ray's processes inherit the tag."""
    if not os.path.isdir("/proc/self") or sys.platform != "linux":
        return None
    # a new tag per driver, never one inherited from a parent run (its reaper would kill this run's processes)
    tag = os.environ["DA3PO_REAPER_TAG"] = uuid.uuid4().hex
    return subprocess.Popen([sys.executable, "-S", "-c", WATCHER, str(os.getpid()), str(interval_s), tag],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
                            close_fds=True)
