"""The suite's checkout guard (tests/_hermetic.py) catches a test that writes into the checkout.

Each case builds a small git checkout under tmp_path with a copy of the guard wired as in tests/conftest.py and one
test file, runs pytest on it in a subprocess, and reads its exit status and report: a test writing a run directory
the way ``da3po train`` with the recipe's ``trainer.run_dir`` would (``runs/tiny_cpu_da3po/...``) fails the session
naming the file; after a demo-like run exists there, the same test is caught changing it, and strict mode (what
``make test`` sets) also reports a tracked file edited; a plain pytest run that writes only under tmp_path passes
and does not report the developer's own edits."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CONFTEST = """\
from pathlib import Path
from _hermetic import CheckoutGuard
_G = CheckoutGuard(Path(__file__).resolve().parents[1])
def pytest_sessionstart(session):
    _G.start(session.config)
def pytest_sessionfinish(session, exitstatus):
    _G.finish(session)
"""


def checkout(tmp_path: Path, test_body: str, demo_run: bool = False) -> Path:
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    shutil.copy(HERE / "_hermetic.py", repo / "tests" / "_hermetic.py")
    (repo / "tests" / "conftest.py").write_text(CONFTEST)
    (repo / "tests" / "test_case.py").write_text(test_body)
    (repo / ".gitignore").write_text("runs/\noutputs/\n__pycache__/\n.pytest_cache/\n")
    (repo / "README.md").write_text("a tracked file\n")
    if demo_run:  # what `make demo` leaves behind
        (repo / "runs/tiny_cpu_da3po").mkdir(parents=True)
        (repo / "runs/tiny_cpu_da3po/metrics.jsonl").write_text('{"step": 1}\n')
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "init"], check=True)
    return repo


def pytest_in(repo: Path, strict: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DA3PO_TEST"))}
    if strict:
        env["DA3PO_TEST_STRICT_CHECKOUT"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "tests/test_case.py"], cwd=repo, env=env, capture_output=True, text=True, timeout=120)


WRITES_A_RUN_DIR = """\
from pathlib import Path
def test_trains_in_the_recipes_run_dir():
    run = Path(__file__).resolve().parents[1] / "runs/tiny_cpu_da3po"
    (run / "logs").mkdir(parents=True, exist_ok=True)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 2}\\n')
"""


def test_a_test_writing_the_recipes_run_dir_fails_the_session_naming_the_file(tmp_path):
    p = pytest_in(checkout(tmp_path, WRITES_A_RUN_DIR))
    print(p.stdout[-1500:])
    assert p.returncode == 1, p.stdout + p.stderr
    assert "1 passed" in p.stdout  # the test itself passed: the guard failed the session
    assert "the test session changed the checkout" in p.stdout
    assert "created: runs/tiny_cpu_da3po/metrics.jsonl" in p.stdout


EDITS_README = """\
from pathlib import Path
def test_edits_a_tracked_file(tmp_path):
    (tmp_path / "runs").mkdir()  # its own temporary directory: fine
    (Path(__file__).resolve().parents[1] / "README.md").write_text("edited by a test\\n")
"""


def test_after_a_demo_run_strict_mode_catches_the_demos_metrics_changed_and_a_tracked_file_edited(tmp_path):
    p = pytest_in(checkout(tmp_path, WRITES_A_RUN_DIR + "\n" + EDITS_README, demo_run=True), strict=True)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "2 passed" in p.stdout
    assert "changed: runs/tiny_cpu_da3po/metrics.jsonl" in p.stdout
    assert "created: runs/tiny_cpu_da3po/logs" not in p.stdout  # an empty directory is not a file
    assert "changed: README.md (git status M)" in p.stdout


def test_a_plain_pytest_run_writing_only_under_tmp_path_passes_and_leaves_the_developers_edits_alone(tmp_path):
    p = pytest_in(checkout(tmp_path, EDITS_README))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "changed the checkout" not in p.stdout
