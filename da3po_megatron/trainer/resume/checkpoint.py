"""Atomic, verified, resumable run checkpoints: ``run_dir/checkpoints/step_000020/`` + a ``latest`` pointer.

A checkpoint is written into a temporary directory (``.tmp-step_000020``), given a ``MANIFEST.json`` (every file with
its size and CRC-32) and a ``COMPLETE`` marker, renamed into place, and only then is ``latest`` updated
(write-then-``os.replace``, atomic on POSIX). A run killed at any moment therefore leaves either the previous complete
checkpoint as ``latest`` or the new one, never a half-written one, and a restart with the same command resumes from
it. Old checkpoints are deleted only after a newer one is complete (the last ``trainer.keep_last`` are kept), and never
those named by ``protect()`` (the best checkpoint, :mod:`da3po_megatron.trainer.resume.best`).

Integrity: ``COMPLETE`` says the save finished, the manifest says what it wrote. Resume verifies the checkpoint it is
about to load (sizes and checksums: it reads every file once); a damaged one -- a truncated shard, a file changed or
missing -- is named, moved aside to ``damaged-step_000020`` (never deleted), and the newest intact checkpoint is used
instead, with ``latest`` pointed at it. ``da3po checkpoint verify DIR`` runs the same check on demand. A failed save
(e.g. the disk is full) removes its temporary directory and raises :class:`CheckpointWriteError`; the previous
checkpoint and ``latest`` are untouched.

Contents: ``policy/`` (model + optimizer + scheduler + RNG of every policy rank, Megatron dist_checkpointing, written by
the policy ranks; a shared filesystem is assumed on multi-node runs, as on any Slurm cluster) and ``trainer_state.pt``
(step, data position, dynamic-sampling buffer, driver RNG, cumulative counters: tensors and plain values only, read
with ``torch.load(weights_only=True)``, see :func:`da3po_megatron.megatron.checkpoint.safe_load`).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import sys
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from da3po_megatron.rollout.route_refs import read_routes, write_routes

COMPLETE = "COMPLETE"
MANIFEST = "MANIFEST.json"


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the previous one and ``latest`` are intact."""


class NoIntactCheckpointError(RuntimeError):
    """Checkpoints exist but none of them passes verification."""


def _crc32(path: Path, chunk: int = 1 << 22) -> str:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def write_manifest(directory: Path) -> None:
    """Record every file under ``directory`` (relative path, size, CRC-32) in ``directory/MANIFEST.json``."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name not in (MANIFEST, COMPLETE))
    entries = {str(p.relative_to(directory)): {"size": p.stat().st_size, "crc32": _crc32(p)} for p in files}
    (directory / MANIFEST).write_text(json.dumps({"format": "da3po-manifest/1", "files": entries}, indent=1))


def verify_checkpoint(directory: str | Path) -> list[str]:
    """What is wrong with the checkpoint at ``directory`` (each problem names the file); empty = intact.

    A checkpoint of an older version without a manifest is checked for its ``COMPLETE`` marker only."""
    d = Path(directory)
    if not d.is_dir():
        return [f"{d}: not a directory"]
    if not (d / COMPLETE).exists():
        return [f"{d / COMPLETE}: missing (the save did not finish)"]
    if not (d / MANIFEST).exists():
        return []
    try:
        files = json.loads((d / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError) as e:
        return [f"{d / MANIFEST}: unreadable ({e})"]
    problems = []
    for rel, want in files.items():
        p = d / rel
        if not p.is_file():
            problems.append(f"{p}: missing")
        elif p.stat().st_size != want["size"]:
            problems.append(f"{p}: {p.stat().st_size} bytes, the manifest says {want['size']}")
        elif _crc32(p) != want["crc32"]:
            problems.append(f"{p}: checksum {_crc32(p)}, the manifest says {want['crc32']} (contents changed)")
    return problems


# how a full disk reads after it went through torch.save (PytorchStreamWriter: "unexpected pos 704 vs 598", "file
# write failed") or a policy rank (the rank's OSError as text inside PolicyGroupError)
_DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "[Errno 28]", "[Errno 122]", "unexpected pos",
                   "file write failed")
_DISK_FULL_FREE = 64 * 2**20  # less free than this when a write failed: the disk is full, whatever the message


def _is_disk_full(e: BaseException, free_bytes: int | None = None) -> bool:
    chain: list[BaseException] = []
    while e is not None and e not in chain:  # the error and what caused it
        chain.append(e)
        e = e.__cause__ or e.__context__
    return any((isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT))
               or any(t in str(x) for t in _DISK_FULL_TEXT) for x in chain) or \
        (free_bytes is not None and free_bytes < _DISK_FULL_FREE)


def _free(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


@dataclass(frozen=True)
class PendingCheckpoint:
    """A checkpoint :meth:`CheckpointManager.start` began: its step, temporary and final directories."""

    step: int
    tmp: Path
    final: Path


class CheckpointManager:
    def __init__(self, run_dir: str | Path, keep_last: int = 3,
                 protect: Callable[[], Iterable[str]] = lambda: ()) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last
        self.protect = protect  # names of step directories that pruning keeps, besides the last keep_last
        self.before_write: Callable[[], Any] = lambda: None  # before a save or prune (trainer/resume/lock.py's guard)
        self.in_flight: Path | None = None  # the temporary directory of a started, unfinished checkpoint

    def latest(self, verify: bool = True, log: Callable[[str], Any] = print) -> Path | None:
        """The newest intact checkpoint (None when there is none yet). The one ``latest`` points to is verified;
        if damaged it is moved aside (named ``damaged-...``) and the next newest intact one is used and pointed to."""
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        path = self.root / pointer.read_text().strip()
        problems = verify_checkpoint(path) if verify else ([] if (path / COMPLETE).exists() else ["incomplete"])
        if not problems:
            return path
        log(f"warning: checkpoint {path} is damaged: " + "; ".join(problems))
        self._move_aside(path, log)
        candidates = sorted((p for p in self.root.glob("step_*") if p.is_dir()), reverse=True)
        for cand in candidates:
            bad = verify_checkpoint(cand) if verify else []
            if not bad:
                self._point_latest(cand.name)
                log(f"falling back to the newest intact checkpoint {cand}")
                return cand
            log(f"warning: checkpoint {cand} is damaged too: " + "; ".join(bad))
            self._move_aside(cand, log)
        raise NoIntactCheckpointError(
            f"no intact checkpoint under {self.root} (damaged ones were moved aside as damaged-*); set "
            "trainer.resume=false or another trainer.run_dir to start over")

    def _move_aside(self, path: Path, log: Callable[[str], Any]) -> None:
        if not path.exists():
            return
        dest, k = self.root / f"damaged-{path.name}", 1
        while dest.exists():
            dest, k = self.root / f"damaged-{path.name}.{k}", k + 1
        os.replace(path, dest)
        log(f"moved {path} aside to {dest} (kept for inspection, never deleted)")

    def _point_latest(self, name: str) -> None:
        pointer_tmp = self.root / "latest.tmp"
        pointer_tmp.write_text(name + "\n")
        os.replace(pointer_tmp, self.root / "latest")

    def save(self, step: int, save_policy: Callable[[Path], Any], trainer_state: dict[str, Any]) -> Path:
        """Write checkpoint ``step`` atomically; returns its final path. On failure (e.g. disk full) the temporary
        directory is removed and :class:`CheckpointWriteError` raised; ``latest`` keeps pointing to the previous."""
        return self.finish(self.start(step, save_policy, trainer_state))

    def start(self, step: int, save_policy: Callable[[Path], Any], trainer_state: dict[str, Any]) -> PendingCheckpoint:
        """The first half of :meth:`save`: ``save_policy(tmp / "policy")`` (which may only schedule an asynchronous
        write) and the trainer state into the temporary directory. Nothing is complete, ``latest`` is unchanged;
        :meth:`finish` completes it, :meth:`abandon` drops it. Errors as in :meth:`save`."""
        self.before_write()
        self.root.mkdir(parents=True, exist_ok=True)
        name = f"step_{step:06d}"
        tmp = self.root / f".tmp-{name}"
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            self.in_flight = tmp
            save_policy(tmp / "policy")
            # MoE routes by reference: written to routes.npz by a Ray actor (route_refs.RouteFiles), placeholders
            # in the state (issue 60)
            torch.save(write_routes(trainer_state, tmp), tmp / "trainer_state.pt")
        except Exception as e:
            self.in_flight = None
            raise self._write_failed(step, tmp, e) from e
        return PendingCheckpoint(step, tmp, self.root / name)

    def finish(self, pending: PendingCheckpoint, wait: Callable[[], Any] | None = None) -> Path:
        """The second half of :meth:`save`: ``wait()`` (an asynchronous policy write: until it is complete on every
        rank), then the manifest (sizes + CRC-32 of every file), ``COMPLETE``, the atomic rename, ``latest``, pruning.
        ``latest`` moves only here, after the write is complete and its checksums are recorded."""
        step, tmp, final = pending.step, pending.tmp, pending.final
        name = final.name
        try:
            if wait is not None:
                wait()
            write_manifest(tmp)
            (tmp / COMPLETE).write_text(f"{step}\n")
        except Exception as e:
            raise self._write_failed(step, tmp, e) from e
        finally:
            self.in_flight = None
        if final.exists():  # the same step saved again: keep the old one aside until the new one is in place
            os.replace(final, self.root / f".old-{name}")
        os.replace(tmp, final)
        self._point_latest(name)
        shutil.rmtree(self.root / f".old-{name}", ignore_errors=True)
        self._prune(keep=final)
        return final

    def abandon(self, pending: PendingCheckpoint) -> None:
        """Drop a started checkpoint that will not be finished (its temporary directory is removed)."""
        self.in_flight = None
        shutil.rmtree(pending.tmp, ignore_errors=True)

    def _write_failed(self, step: int, tmp: Path, e: BaseException) -> CheckpointWriteError:
        """Remove the partial write; the error to raise (what failed, free space, where ``latest`` points)."""
        free_at_failure = _free(self.root)
        shutil.rmtree(tmp, ignore_errors=True)
        prev = self.root / "latest"
        prev_name = prev.read_text().strip() if prev.exists() else "none"
        total = shutil.disk_usage(self.root).total
        free = f"free: {(free_at_failure or 0) / 2**20:.0f} MiB of {total / 2**30:.1f} GiB when it failed, " \
            f"{shutil.disk_usage(self.root).free / 2**20:.0f} MiB now"
        what = f"the disk is full (No space left on device, ENOSPC, on the filesystem of {self.root})" \
            if _is_disk_full(e, free_at_failure) else f"{type(e).__name__}"
        return CheckpointWriteError(
            f"writing checkpoint step {step} to {tmp} failed: {what} ({free}); the partial write was removed, and "
            f"{self.root / 'latest'} still points to the previous checkpoint ({prev_name}). Detail: "
            f"{str(e).strip().splitlines()[-1] if str(e).strip() else e!r}")

    def load_trainer_state(self, path: Path) -> dict[str, Any]:
        from da3po_megatron.megatron.checkpoint import safe_load

        return read_routes(safe_load(path / "trainer_state.pt"), path)  # routes: refs again (route_refs.py)

    def prune(self) -> None:
        """Delete complete checkpoints beyond the last ``keep_last`` (protected ones excepted) and stale temporaries."""
        self._prune(keep=None)

    def _prune(self, keep: Path | None) -> None:
        self.before_write()
        protected = set(self.protect())
        steps = sorted(p for p in self.root.glob("step_*") if (p / COMPLETE).exists())
        for old in steps[:-self.keep_last]:
            if old != keep and old.name not in protected:
                shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".tmp-step_*"):
            if stale != self.in_flight:  # never the one being written (asynchronously)
                shutil.rmtree(stale, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """`da3po checkpoint verify DIR`: check a run directory's, a ``checkpoints/`` directory's or one step's files
    against their manifests; exit 0 when every checkpoint is intact, 1 otherwise (each bad file named)."""
    ap = argparse.ArgumentParser(prog="da3po checkpoint", description=main.__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="action", required=True)
    v = sub.add_parser("verify", help="verify checkpoints against their manifests")
    v.add_argument("dir", help="run_dir, run_dir/checkpoints, or one step_N directory")
    args = ap.parse_args(argv)
    d = Path(args.dir)
    if (d / "checkpoints").is_dir():
        d = d / "checkpoints"
    steps = [d] if (d / COMPLETE).exists() or (d / MANIFEST).exists() or (d / "policy").exists() else \
        sorted(p for p in d.glob("step_*") if p.is_dir())
    if not steps:
        print(f"error: no checkpoint under {args.dir}", file=sys.stderr)
        return 2
    bad = 0
    for s in steps:
        problems = verify_checkpoint(s)
        legacy = "" if (s / MANIFEST).exists() else " (no manifest: written by an older version, marker checked only)"
        print(f"{s}: " + ("OK" + legacy if not problems else "DAMAGED\n  " + "\n  ".join(problems)))
        bad += bool(problems)
    pointer = d / "latest"
    if pointer.exists():
        print(f"latest -> {pointer.read_text().strip()}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
