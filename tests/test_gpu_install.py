"""The GPU install resolves, from PyPI's metadata alone, to versions that agree with what upstream declares.

No GPU and no multi-GB download: uv resolves setup.py's COMMON + GPU + TEST lists for CPython 3.12 on x86_64 Linux
(tools/dev/gpu_lock.py: uv reads each wheel's METADATA, and transformer-engine-torch's requirements come from its
sdist's PKG-INFO). What must agree is read from the resolved packages' own METADATA on PyPI (PEP 658 ``.metadata``
files): torch, torchvision, torchaudio, flashinfer and transformers against vllm 0.32.0's Requires-Dist;
transformer-engine against megatron-core 0.16.1's tested range (its extra "dev"); triton and the CUDA toolkit against
torch's.

These tests need the package index (CI reaches PyPI). Without it they FAIL with a message that says so: an install
that was not checked is not a pass.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_lock", ROOT / "tools" / "dev" / "gpu_lock.py")
gpu_lock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_lock)


def _resolve(constraints: Path | None = None) -> tuple[dict[str, dict], float]:
    try:
        packages, _, seconds = gpu_lock.resolve(gpu_lock.setup_requirements(), constraints=constraints)
    except gpu_lock.IndexUnreachable as e:
        pytest.fail(f"PyPI is unreachable, so the GPU install could not be checked (this test never skips): {e}")
    print(f"resolved {len(packages)} packages in {seconds:.1f} s")
    return packages, seconds


def _disagreements(versions: dict[str, str]) -> list[str]:
    """Each version in ``versions`` that upstream's METADATA does not accept, as one line naming both sides."""
    bad = []

    def check(pkg: str, req: Requirement, source: str) -> None:
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if name in versions and not req.specifier.contains(versions[name], prereleases=True):
            bad.append(f"{name}=={versions[name]} but {source} requires {req} ({pkg})")
        elif name not in versions:
            bad.append(f"{name} missing from the resolution, {source} requires {req} ({pkg})")

    vllm = gpu_lock.wheel_metadata("vllm", versions["vllm"])
    vllm_reqs = gpu_lock.requires(vllm)
    for name in ("torch", "torchvision", "torchaudio", "flashinfer-python", "transformers", "triton"):
        if name in vllm_reqs:
            check(name, vllm_reqs[name], f"vllm {versions['vllm']}'s METADATA")
    mcore = gpu_lock.wheel_metadata("megatron-core", versions["megatron-core"])
    te = gpu_lock.requires(mcore, extra="dev")["transformer-engine"]  # its tested range
    check("transformer-engine", te, f"megatron-core {versions['megatron-core']}'s METADATA (extra dev)")
    for part in ("transformer-engine-torch", f"transformer-engine-cu{gpu_lock.CUDA_MAJOR}"):
        if versions.get(part) != versions.get("transformer-engine"):
            bad.append(f"{part}=={versions.get(part)} but transformer-engine=={versions.get('transformer-engine')}")
    torch_reqs = gpu_lock.requires(gpu_lock.wheel_metadata("torch", versions["torch"]))
    for name in ("triton", "cuda-toolkit", "nvidia-cudnn-cu13"):
        check(name, torch_reqs[name], f"torch {versions['torch']}'s Linux METADATA")
    return bad


def test_gpu_requirements_resolve_to_versions_upstream_agrees_with() -> None:
    """setup.py's requirements, resolved fresh: torch is vllm's pin, TE inside megatron-core's tested range,
    transformers inside vllm's range (e6f0361's `transformer-engine[pytorch]>=2.6` resolved to 2.20.2)."""
    packages, _ = _resolve()
    versions = {n: p["version"] for n, p in packages.items()}
    bad = _disagreements(versions)
    assert not bad, "the GPU install resolves to versions upstream does not accept:\n  " + "\n  ".join(bad)
    # the setup.py pins themselves say what upstream says (so that a bump of one shows up here, not on a cluster)
    gpu = {Requirement(r).name: Requirement(r) for r in gpu_lock.setup_requirements(("GPU",))}
    assert str(gpu["torch"].specifier) == f"=={versions['torch']}", gpu["torch"]


def test_gpu_lock_is_current_and_installs_from_wheels() -> None:
    """requirements/gpu-py312.lock is what setup.py's requirements resolve to when constrained by it (same names,
    same versions: regenerate with `python tools/dev/gpu_lock.py` otherwise), it agrees with upstream, and everything in
    it but transformer-engine-torch (compiled by scripts/install.sh gpu) has a wheel for the target."""
    assert gpu_lock.LOCK.is_file(), f"{gpu_lock.LOCK} missing: generate it with `python tools/dev/gpu_lock.py`"
    locked = gpu_lock.lock_versions(gpu_lock.LOCK.read_text())
    packages, _ = _resolve(constraints=gpu_lock.LOCK)
    got = {n: p["version"] for n, p in packages.items()}
    assert got == locked, (f"{gpu_lock.LOCK.name} is not current (regenerate: python tools/dev/gpu_lock.py); "
                           f"differs in {sorted(set(got.items()) ^ set(locked.items()))}")
    bad = _disagreements(locked)
    assert not bad, f"{gpu_lock.LOCK.name} disagrees with upstream:\n  " + "\n  ".join(bad)
    no_wheel = sorted(n for n, p in packages.items() if not p.get("wheels"))
    assert no_wheel == [gpu_lock.TE_TORCH], f"packages without a wheel for {gpu_lock.PLATFORM}: {no_wheel}"


def test_gpu_install_refuses_another_python_before_touching_anything(tmp_path: Path) -> None:
    """scripts/install.sh gpu installs the cp312 lock only: any other interpreter is refused, naming the lock."""
    assert sys.version_info[:2] != (3, 12), "this test needs the CPU venv's Python (3.11), not 3.12"
    venv = tmp_path / "gpu-venv"
    proc = subprocess.Popen(["bash", "scripts/install.sh", "gpu", str(venv)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # it went on to install (e6f0361 did, into a --system-site-packages venv)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"scripts/install.sh gpu started installing with Python {sys.version.split()[0]} instead of "
                    f"refusing it (venv created: {venv.exists()})")
    assert proc.returncode != 0 and "3.12" in err and "gpu-py312.lock" in err, err
    assert not venv.exists()


def test_an_unreachable_index_fails_the_check_instead_of_skipping_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the package index the resolution is not checked, and the tests above say so by failing."""
    monkeypatch.setattr(gpu_lock, "INDEX", "http://127.0.0.1:9/simple")  # the discard port: nothing listens there
    gpu_lock.project_files.cache_clear()
    with pytest.raises(pytest.fail.Exception, match="PyPI is unreachable.*never skips.*127.0.0.1:9"):
        _resolve()
    gpu_lock.project_files.cache_clear()
