"""The suite leaves the checkout as it found it: a snapshot at session start, compared at session end.

Tests write only under their own temporary directories. A test that launches ``da3po train`` with a recipe's
``trainer.run_dir`` (``runs/...``), or a tool with its default ``--out`` (``outputs/...``), would otherwise write into
the checkout -- and after ``make demo`` it would read the demo's run, e.g. resume it. What is compared:

- every file under the checkout's run and output directories (:data:`WATCHED`, git-ignored, where ``make demo``
  writes): created, deleted or changed;
- every other git-ignored path that appears during the session, except the caches listed in :data:`CACHES` (the
  venv, byte-code, pytest's and ruff's caches, the SmolLM2 model cache ``.cache/``, downloaded wheels);
- with ``DA3PO_TEST_STRICT_CHECKOUT=1`` (``scripts/run_tests.sh`` sets it: ``make test`` and CI), also every tracked
  file that is modified and every untracked file git does not ignore (``git status``): created, deleted or changed.
  It is off for a plain ``pytest`` run, where the developer's own edits during the run would be reported.

The session fails (exit status 1) with the list of paths. Under pytest-xdist only the controller checks (the workers
share its checkout). Used by ``tests/conftest.py``; ``tests/test_hermetic.py`` shows it catching a test that writes
into a checkout.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

WATCHED = ("runs", "outputs")
CACHES = (".venv", ".pytest_cache", ".ruff_cache", ".cache", ".whl", ".devwhl", ".git")
CACHE_SUFFIXES = (".egg-info", "__pycache__")
Snapshot = dict[str, tuple[str, int, int] | None]


def _git(root: Path, *args: str) -> list[str] | None:
    try:
        p = subprocess.run(["git", "-C", str(root), *args], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0:
        return None
    return [x for x in p.stdout.decode("utf-8", "surrogateescape").split("\0") if x]


def _stat(path: Path, status: str = "") -> tuple[str, int, int] | None:
    """``(git status, size, mtime_ns)``; None when the path is gone."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (status, st.st_size, st.st_mtime_ns) if not path.is_dir() else (status, 0, 0)


def _is_cache(rel: str) -> bool:
    parts = rel.rstrip("/").split("/")
    return parts[0] in CACHES or any(p.endswith(CACHE_SUFFIXES) for p in parts)


def snapshot(root: Path, strict: bool = False) -> Snapshot | None:
    """What the session may not change, as ``{relative path: (git status, size, mtime_ns) or None}``; None outside a git
    checkout (nothing to compare against). ``strict``: also the checkout's modified and untracked files."""
    ignored = _git(root, "status", "--porcelain=v1", "-z", "--ignored=matching", "--untracked-files=normal")
    if ignored is None:
        return None
    snap: Snapshot = {}
    if strict:
        changed = _git(root, "status", "--porcelain=v1", "-z", "--untracked-files=all") or []
        for e in changed:
            if len(e) > 3 and e[2] == " ":  # "XY path"; the second path of a rename has no status
                snap[e[3:]] = _stat(root / e[3:], e[:2])
    for e in ignored:
        if e.startswith("!! "):
            rel = e[3:]
            if not _is_cache(rel) and rel.rstrip("/").split("/")[0] not in WATCHED:
                snap["ignored:" + rel] = ("!!", 0, 0)
    for top in WATCHED:
        base = root / top
        if base.is_dir():
            for dirpath, _dirs, files in os.walk(base):
                for f in files:
                    p = Path(dirpath) / f
                    snap[str(p.relative_to(root))] = _stat(p)
    return snap


def differences(before: Snapshot, after: Snapshot) -> list[str]:
    """One line per path created, deleted or changed between the two snapshots."""
    out = []
    for rel in sorted(set(before) | set(after)):
        a, b = before.get(rel, "missing"), after.get(rel, "missing")
        if a == b:
            continue
        name = rel.removeprefix("ignored:")
        if a == "missing" and b is not None and b[0].strip() not in ("", "??", "!!", "A"):
            out.append(f"changed: {name} (git status {b[0].strip()})")  # a tracked file, clean before
        elif a == "missing":
            out.append(f"created: {name}")
        elif b == "missing" or b is None:
            out.append(f"deleted: {name}")
        else:
            out.append(f"changed: {name}")
    return out


class CheckoutGuard:
    """The session hooks: :meth:`start` at ``pytest_sessionstart``, :meth:`finish` at ``pytest_sessionfinish``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.strict = os.environ.get("DA3PO_TEST_STRICT_CHECKOUT") == "1"
        self.before: Snapshot | None = None

    def start(self, config) -> None:
        if hasattr(config, "workerinput") or os.environ.get("DA3PO_TEST_NO_CHECKOUT_GUARD") == "1":
            return  # an xdist worker: the controller checks
        self.before = snapshot(self.root, self.strict)

    def finish(self, session) -> None:
        if self.before is None:
            return
        after = snapshot(self.root, self.strict)
        if after is None:
            return
        diff = differences(self.before, after)
        if not diff:
            return
        lines = [f"the test session changed the checkout {self.root} (tests must write only under their own "
                 "temporary directories: pass trainer.run_dir / --out under tmp_path):"]
        lines += ["  " + d for d in diff[:50]]
        if len(diff) > 50:
            lines.append(f"  ... and {len(diff) - 50} more")
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("")
            for line in lines:
                reporter.write_line(line, red=True, bold=line is lines[0])
        else:
            print("\n".join(lines))
        session.exitstatus = 1
