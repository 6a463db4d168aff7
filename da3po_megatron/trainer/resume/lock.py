"""One trainer per run directory: ``run_dir/LOCK``, held with a lease and a heartbeat while a trainer runs.

Two trainers on one ``run_dir`` (a user launching twice; a requeued Slurm job that starts while the old one is still in
its grace period on another node) would prune each other's checkpoints and interleave ``metrics.jsonl``. So
``da3po train`` takes the lock before it reads or writes anything of the run, and a second trainer exits with status
2 within seconds, naming the holder (host, pid, Slurm job, start time, last heartbeat).

The lock file is JSON: ``host``, ``pid``, ``pid_start`` (the process's start time in clock ticks since boot, from
``/proc/PID/stat``, so that a reused pid is not taken for the holder), ``boot_id``, ``slurm_job_id``,
``slurm_restart_count``, ``started``, ``heartbeat`` (wall-clock seconds, rewritten every ``lease_s / 6`` by a daemon
thread) and ``lease_s``. A lock whose holder is gone is taken over, and the takeover is printed:

- same host and the holder's process is dead (its pid is gone, or now belongs to a process started at another time,
  or the machine rebooted): at once -- a SIGKILLed trainer is resumed by the next launch immediately;
- any host: its heartbeat is older than its lease (a node that died or was cut off cannot release anything);
- ``--force-unlock``: at once, whatever the holder (the rare manual case, e.g. a frozen node whose clock is wrong).

A trainer whose lock was taken over (``--force-unlock``, or its heartbeat went stale on a frozen node) learns it at
its next heartbeat and -- sooner -- before each of its writes: :func:`guard` is called before every metrics row and
before a checkpoint save or prune starts (``trainer/run.py``), reads the lock (one small file) and, when it names
another trainer, stops this process (SIGKILL: nothing more is written, no checkpoint pruned) with a message naming
the new holder and how it took over (the new holder records ``took_over`` in its lock: from whom, and why).

A requeued Slurm job keeps its job id: when the holder is the same job (an earlier start of it, still in its grace
period), the new start waits up to one lease for it to release or go stale instead of failing the requeue.

Atomicity. The lock is created by writing a private file and ``link()``-ing it to ``LOCK`` (fails if ``LOCK``
exists; the recipe of ``open(2)`` for NFS, where ``O_EXCL`` was not atomic before NFSv3: a link whose reply was lost
is recognised by the private file's link count). A takeover first renames the stale ``LOCK`` aside and checks that
what it moved is the lock it judged stale (another trainer may have taken over in between; then it puts that one
back). Heartbeats replace the file atomically (``os.replace``) after checking it still names this trainer. What is
assumed of a shared filesystem (NFS v3/v4, Lustre, GPFS): ``link``, ``rename`` and ``unlink`` are atomic on the server
(all three are), close-to-open consistency (a file written and closed on one node is read whole by an ``open`` on
another: NFS's guarantee; Lustre and GPFS are coherent), and node clocks within a small fraction of the lease
(NTP; default lease 120 s). A lock on a filesystem that is not shared between the nodes of two trainers (a node-local
``/tmp``) cannot see the other trainer -- use a shared ``run_dir`` on multi-node runs, as checkpoints need anyway.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOCK = "LOCK"
DEFAULT_LEASE_S = 120.0


class RunDirLocked(RuntimeError):
    """Another trainer holds ``run_dir/LOCK`` (its description is the message)."""


class RunDirLockLost(RuntimeError):
    """This trainer's lock was taken over by another trainer (raised by :func:`guard` when ``on_lost`` returns)."""


_HELD: dict[Path, RunDirLock] = {}  # the locks this process holds, by resolved run directory


def guard(run_dir: str | Path) -> Callable[[], None]:
    """A check to call before each write into ``run_dir``: a no-op when this process holds no lock on it (a test or
    tool driving the trainer without ``da3po train``); otherwise it reads the lock and, when another trainer holds
    it now, calls the lock's ``on_lost`` (default: stop this process) and raises :class:`RunDirLockLost`."""
    key = Path(run_dir).resolve()

    def check() -> None:
        lock = _HELD.get(key)
        if lock is not None and not lock.check():
            raise RunDirLockLost(lock.lost_message or f"{lock.path}: lost")

    return check


def _proc_start(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks after boot (field 22 of /proc/PID/stat); None if it is gone (or
    a zombie: it has exited, its parent has not collected it yet)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def holder_alive_here(info: dict[str, Any]) -> bool:
    """Whether the holder described by ``info`` (a lock of THIS host) still runs: same boot, its pid alive and
    started at the recorded time (a reused pid belongs to another process)."""
    if info.get("boot_id") and info["boot_id"] != _boot_id():
        return False
    pid = int(info.get("pid", -1))
    start = _proc_start(pid) if pid > 0 else None
    if start is None:
        return False
    return info.get("pid_start") is None or int(info["pid_start"]) == start


def describe(info: dict[str, Any], now: float | None = None) -> str:
    """One line naming a holder: host, pid, Slurm job, start time, heartbeat age."""
    now = time.time() if now is None else now
    job = f", Slurm job {info['slurm_job_id']}" if info.get("slurm_job_id") else ""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info.get("started", 0))))
    beat = now - float(info.get("heartbeat", 0))
    return f"host {info.get('host', '?')}, pid {info.get('pid', '?')}{job}, started {started}, last heartbeat " \
           f"{beat:.0f} s ago (lease {float(info.get('lease_s', DEFAULT_LEASE_S)):.0f} s)"


def stale_reason(info: dict[str, Any], host: str, now: float | None = None) -> str | None:
    """Why the lock ``info`` may be taken over (None: its holder is alive, or may be)."""
    now = time.time() if now is None else now
    if info.get("host") == host and not holder_alive_here(info):
        return f"its process (pid {info.get('pid')}) on this host is gone"
    age = now - float(info.get("heartbeat", 0))
    if age > float(info.get("lease_s", DEFAULT_LEASE_S)):
        return f"its heartbeat is {age:.0f} s old, past its lease of {float(info['lease_s']):.0f} s"
    return None


class RunDirLock:
    """``run_dir/LOCK`` held by this process: :meth:`acquire`, then :meth:`release` (or use as a context manager).

    ``on_lost`` runs (on the heartbeat thread) if the file stops naming this process -- another trainer took the lock
    over because this one's heartbeat had stopped (a frozen node); the default prints and SIGKILLs this process, so
    that it writes nothing more into a directory another trainer now owns."""

    def __init__(self, run_dir: str | Path, lease_s: float = DEFAULT_LEASE_S, log: Callable[[str], Any] = print,
                 on_lost: Callable[[str], Any] | None = None) -> None:
        self.path = Path(run_dir) / LOCK
        self.lease_s = float(lease_s)
        self.log = log
        self.on_lost = on_lost or _kill_self
        self.token = uuid.uuid4().hex
        self.host = socket.gethostname()
        self.info: dict[str, Any] = {}
        self.took_over: dict[str, Any] | None = None  # whom this lock was taken from, and why (recorded in LOCK)
        self.lost_message = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ acquire / release
    def _record(self) -> dict[str, Any]:
        now = time.time()
        return {"host": self.host, "pid": os.getpid(), "pid_start": _proc_start(os.getpid()), "boot_id": _boot_id(),
                "slurm_job_id": os.environ.get("SLURM_JOB_ID", ""),
                "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT", ""),
                "started": self.info.get("started", now), "heartbeat": now, "lease_s": self.lease_s,
                "token": self.token, "argv": " ".join(sys.argv)[:300],
                **({"took_over": self.took_over} if self.took_over else {})}

    def _private(self, info: dict[str, Any]) -> Path:
        tmp = self.path.with_name(f".{LOCK}.{self.host}.{os.getpid()}.{self.token[:8]}")
        with open(tmp, "w") as f:
            f.write(json.dumps(info, indent=1) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def _try_create(self) -> bool:
        info = self._record()
        tmp = self._private(info)
        try:
            os.link(tmp, self.path)
            ok = True
        except FileExistsError:
            ok = False
        except OSError:  # NFS: the link may have succeeded although its reply was lost
            ok = tmp.stat().st_nlink == 2
        finally:
            tmp.unlink(missing_ok=True)
        if ok:
            self.info = info
        return ok

    def read(self) -> dict[str, Any] | None:
        """The current lock's contents (None: no lock; {} if it cannot be parsed)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        try:
            return json.loads(text)
        except ValueError:
            return {}

    def _take_over(self, stale: dict[str, Any]) -> bool:
        """Move the stale lock aside, if it is still the one judged stale; True when it was moved."""
        aside = self.path.with_name(f".{LOCK}.stale.{self.token[:8]}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return True  # released meanwhile
        try:
            moved = json.loads(aside.read_text())
        except ValueError:
            moved = {}
        if moved.get("token") != stale.get("token"):  # another trainer replaced it in between: put it back
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
            aside.unlink(missing_ok=True)
            return False
        aside.unlink(missing_ok=True)
        return True

    def acquire(self, force: bool = False, wait_same_job_s: float | None = None) -> RunDirLock:
        """Take the lock, or raise :class:`RunDirLocked` naming the holder. ``force``: take it whatever the holder
        (``--force-unlock``). A holder of the same Slurm job (a requeue) is waited for up to ``wait_same_job_s``
        (default: its lease + 10 s)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = None
        unreadable_since = None
        while True:
            if self._try_create():
                break
            info = self.read()
            if info is None:
                continue  # released between our link and our read: try again
            now = time.time()
            if not info:  # unparsable: being written by an older version, or damaged; judged by the file's age
                unreadable_since = unreadable_since or now
                try:
                    age = now - self.path.stat().st_mtime
                except FileNotFoundError:
                    continue
                if force or age > self.lease_s:
                    self.log(f"run_dir lock: {self.path} is unreadable and {age:.0f} s old: taking it over")
                    self._take_over({})
                    continue
                if now - unreadable_since < 5.0:
                    time.sleep(0.2)
                    continue
                raise RunDirLocked(f"{self.path} exists but cannot be read ({age:.0f} s old; lease {self.lease_s:.0f}"
                                   " s); if no trainer uses this run directory, rerun with --force-unlock")
            reason = "--force-unlock" if force else stale_reason(info, self.host, now)
            if reason is not None:
                if self._take_over(info):
                    self.log(f"run_dir lock: took over {self.path} from {describe(info, now)}: {reason}")
                    self.took_over = {"host": info.get("host"), "pid": info.get("pid"), "token": info.get("token"),
                                      "reason": reason, "at": now}
                continue
            job = os.environ.get("SLURM_JOB_ID", "")
            if job and info.get("slurm_job_id") == job:  # an earlier start of this (requeued) job
                if deadline is None:
                    wait = float(info.get("lease_s", self.lease_s)) + 10.0 if wait_same_job_s is None else \
                        wait_same_job_s
                    deadline = now + wait
                    self.log(f"run_dir lock: held by an earlier start of this Slurm job ({describe(info, now)}); "
                             f"waiting up to {wait:.0f} s for it to finish")
                if now < deadline:
                    time.sleep(1.0)
                    continue
            raise RunDirLocked(
                f"{self.path.parent} is in use by another trainer: {describe(info, now)}. Wait for it to finish or "
                f"stop it, or use another trainer.run_dir; if you are sure it is gone (e.g. a dead node whose lease "
                f"has not expired), rerun with --force-unlock")
        self._stop.clear()
        self.lost_message = ""
        self._thread = threading.Thread(target=self._beat, name="run-dir-lock-heartbeat", daemon=True)
        self._thread.start()
        _HELD[self.path.parent.resolve()] = self
        return self

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it still names this process."""
        self._stop.set()
        if _HELD.get(self.path.parent.resolve()) is self:
            del _HELD[self.path.parent.resolve()]
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        info = self.read()
        if info and info.get("token") == self.token:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunDirLock:
        return self if self._thread is not None else self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

    # ------------------------------------------------------------------ heartbeat
    def _lost(self, info: dict[str, Any] | None) -> bool:
        """The lock no longer names this process: say by whom and how it was taken, call ``on_lost`` (once)."""
        if self.lost_message:
            return False
        if not info:
            how = "the file is gone or unreadable: removed by hand or by another trainer"
            holder = "nobody"
        else:
            holder = describe(info)
            t = info.get("took_over") or {}
            if t.get("token") == self.token and t.get("reason") == "--force-unlock":
                how = "it took this run directory over with --force-unlock"
            elif t.get("token") == self.token:
                how = f"it took this run directory over because {t.get('reason')}"
            else:
                how = "another trainer took this run directory over"
        self.lost_message = f"run_dir lock lost: {self.path} now names {holder}; {how}"
        self.on_lost(self.lost_message)
        return False

    def check(self) -> bool:
        """Whether the lock still names this process (False, and ``on_lost`` once, when it does not)."""
        if self.lost_message:
            return False
        info = self.read()
        return True if info and info.get("token") == self.token else self._lost(info)

    def heartbeat(self) -> bool:
        """Rewrite the lock with a fresh heartbeat; False (and ``on_lost``) when it no longer names this process."""
        if not self.check():
            return False
        tmp = self._private(self._record())
        try:
            os.replace(tmp, self.path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno not in (errno.ENOENT, errno.ESTALE):
                raise
        return True

    def _beat(self) -> None:
        period = max(self.lease_s / 6.0, 0.05)
        while not self._stop.wait(period):
            try:
                if not self.heartbeat():
                    return
            except OSError as e:  # a filesystem hiccup: keep trying until the lease runs out
                self.log(f"warning: run_dir lock heartbeat failed: {e}")


def _kill_self(message: str) -> None:
    print(f"error: {message}; stopping now without writing anything more", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
