"""The GPU install's lock, requirements/gpu-py312.lock: the whole GPU install resolved from PyPI, from metadata only.

    python tools/dev/gpu_lock.py          # rewrite the lock from setup.py's COMMON + GPU + TEST lists (needs uv, PyPI)
    python tools/dev/gpu_lock.py --check  # resolve with the lock as constraints; exit 1 if the lock is not what results

The target is the one GPU install of docs/install.md: CPython 3.12 on x86_64 Linux with glibc >= 2.31 (uv's
``--python-platform x86_64-manylinux_2_31``: llguidance 1.7.6, which vllm 0.32.0 requires on x86_64, has no Linux
x86_64 wheel for an older glibc). uv resolves from each wheel's METADATA (PEP 658, or an HTTP range read of the wheel)
and never builds anything, with one exception handled here: ``transformer-engine-torch`` is published as an sdist only,
and its requirements are computed by its setup.py when it is built (``Dynamic: requires-dist`` in its PKG-INFO): they
are ``install_requirements()`` plus ``transformer_engine_cu{major}==<version>``, ``major`` being the CUDA major version
of the torch it is built against (TransformerEngine v2.11 ``transformer_engine/pytorch/setup.py``, the lines after
"Setup version and requirements"). The sdist's PKG-INFO was written on a CUDA-12 build machine and names
``transformer_engine_cu12``; for our torch (PyPI's 2.13.0 Linux wheel is the CUDA 13.0 build) it is ``cu13``. This
module reads the PKG-INFO of every transformer-engine-torch sdist the requirements allow, switches the core wheel to
cu13, and hands that to uv as static ``dependency-metadata``, so the resolution needs neither a build nor a GPU.

uv ignores pip's configuration (pip.conf, PIP_* variables); the index is given explicitly (``--index-url``, PyPI) and
uv's own configuration files and UV_* variables are not read (``--config-file`` with our file only, a clean env).
"""

from __future__ import annotations

import argparse
import ast
import email.parser
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements" / "gpu-py312.lock"
INDEX = "https://pypi.org/simple"
PYTHON_VERSION = "3.12"
PLATFORM = "x86_64-manylinux_2_31"
# the marker environment of that target, for evaluating upstream Requires-Dist markers
TARGET_ENV = {"python_version": PYTHON_VERSION, "python_full_version": f"{PYTHON_VERSION}.0",
              "platform_machine": "x86_64", "platform_system": "Linux", "sys_platform": "linux", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
CUDA_MAJOR = 13  # PyPI's torch 2.13.0 Linux wheel: cuda-toolkit==13.0.3 (its METADATA)
TE_TORCH = "transformer-engine-torch"
SETUP_LISTS = ("COMMON", "GPU", "TEST")


class IndexUnreachable(RuntimeError):
    """PyPI could not be reached: the GPU-install resolution needs the package index (CI reaches it)."""


def setup_requirements(names: tuple[str, ...] = SETUP_LISTS, setup_py: Path = ROOT / "setup.py") -> list[str]:
    """The requirement strings of setup.py's module-level lists ``names`` (read with ast: setup.py calls setup())."""
    lists: dict[str, list[str]] = {}
    for node in ast.parse(setup_py.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in names:
                lists[node.targets[0].id] = ast.literal_eval(node.value)
    missing = [n for n in names if n not in lists]
    if missing:
        raise ValueError(f"{setup_py}: no list named {missing}")
    return [r for n in names for r in lists[n]]


def _get(url: str, accept: str | None = None, timeout: float = 60.0) -> bytes:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.read()
    except urllib.error.HTTPError:
        raise
    except (urllib.error.URLError, OSError) as e:
        raise IndexUnreachable(f"cannot reach the package index for {url}: {e}. The GPU-install resolution "
                               f"(tools/dev/gpu_lock.py, tests/test_gpu_install.py) needs {INDEX}; CI reaches it."
                               ) from e


@cache
def project_files(name: str) -> tuple[dict, ...]:
    """The files of ``name`` on PyPI (PEP 691 JSON simple API)."""
    data = json.loads(_get(f"{INDEX}/{name}/", accept="application/vnd.pypi.simple.v1+json"))
    return tuple(data["files"])


class _HttpRangeFile(io.RawIOBase):
    """A read-only, seekable view of a remote file through HTTP range requests (what uv does for a wheel whose
    METADATA the index does not serve separately): zipfile reads the central directory and one member, a few KiB."""

    def __init__(self, url: str, size: int) -> None:
        self.url, self.size, self.pos = url, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + offset
        return self.pos

    def readinto(self, buf) -> int:
        n = min(len(buf), self.size - self.pos)
        if n <= 0:
            return 0
        req = urllib.request.Request(self.url, headers={"Range": f"bytes={self.pos}-{self.pos + n - 1}"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                data = resp.read()
        except (urllib.error.URLError, OSError) as e:
            raise IndexUnreachable(f"cannot read {self.url}: {e}") from e
        if len(data) != n:
            raise OSError(f"{self.url}: asked for {n} bytes at {self.pos}, got {len(data)} (no range support?)")
        buf[:n] = data
        self.pos += n
        return n


@cache
def wheel_metadata(name: str, version: str) -> email.message.Message:
    """The METADATA of one wheel of ``name==version``: PEP 658's ``<wheel url>.metadata`` where the index serves it,
    else read out of the remote wheel with HTTP range requests. A few KiB either way, never the wheel."""
    norm = re.sub(r"[-_.]+", "_", name).lower()
    wheels = [f for f in project_files(name)
              if f["filename"].lower().startswith(f"{norm}-{version}-") and f["filename"].endswith(".whl")]
    if not wheels:
        raise LookupError(f"{name}=={version}: no wheel on {INDEX}")
    # a wheel of the target where there is one: platform wheels may declare different requirements (torch's do)
    wheels.sort(key=lambda f: ("x86_64" not in f["filename"] and "-any.whl" not in f["filename"],
                               "cp312" not in f["filename"]))
    wheel = wheels[0]
    try:
        text = _get(wheel["url"] + ".metadata").decode()
    except urllib.error.HTTPError as e:
        if e.code != 404:
            raise
        remote = io.BufferedReader(_HttpRangeFile(wheel["url"], wheel["size"]), buffer_size=1 << 16)
        with zipfile.ZipFile(remote) as zf:
            member = next(n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
            text = zf.read(member).decode()
    return email.parser.Parser().parsestr(text)


def requires(meta: email.message.Message, extra: str = "") -> dict[str, Requirement]:
    """Requires-Dist of ``meta`` for the target: without ``extra`` the base requirements, with it only what that extra
    adds (markers evaluated for TARGET_ENV)."""
    out: dict[str, Requirement] = {}
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if (req.marker is not None and "extra" in str(req.marker)) != bool(extra):
            continue
        if req.marker is None or req.marker.evaluate({**TARGET_ENV, "extra": extra}):
            out[re.sub(r"[-_.]+", "-", req.name).lower()] = req
    return out


def te_torch_requires(version: str, cuda_major: int = CUDA_MAJOR) -> list[str]:
    """Requires-Dist of transformer-engine-torch==version when built against a CUDA-``cuda_major`` torch, from the
    PKG-INFO of its sdist (see the module docstring for why the core wheel's name is switched)."""
    sdists = [f for f in project_files(TE_TORCH)
              if f["filename"] == f"transformer_engine_torch-{version}.tar.gz"]
    if not sdists:
        raise LookupError(f"{TE_TORCH}=={version}: no sdist on {INDEX}")
    with tarfile.open(fileobj=io.BytesIO(_get(sdists[0]["url"])), mode="r:gz") as tar:
        member = next(m for m in tar.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO"))
        pkg_info = email.parser.Parser().parsestr(tar.extractfile(member).read().decode())
    out = []
    for line in pkg_info.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if re.fullmatch(r"transformer[-_]engine[-_]cu\d+", req.name):
            line = f"transformer-engine-cu{cuda_major}=={version}"
        out.append(str(line))
    return out


def te_torch_versions(requirements: list[str]) -> list[str]:
    """The transformer-engine-torch versions on PyPI that ``requirements``' transformer-engine specifier admits."""
    spec = next((Requirement(r).specifier for r in requirements if Requirement(r).name == "transformer-engine"), None)
    have = {f["filename"][len("transformer_engine_torch-"):-len(".tar.gz")]
            for f in project_files(TE_TORCH) if f["filename"].endswith(".tar.gz")}
    return sorted((v for v in have if spec is None or spec.contains(v, prereleases=True)), key=Version)


def uv_config(requirements: list[str]) -> str:
    """uv.toml text: static metadata for every transformer-engine-torch version the requirements admit."""
    versions = te_torch_versions(requirements)
    with ThreadPoolExecutor(8) as pool:
        reqs = list(pool.map(te_torch_requires, versions))
    return "".join(f'[[dependency-metadata]]\nname = "{TE_TORCH}"\nversion = "{v}"\n'
                   f"requires-dist = {json.dumps(r)}\n\n" for v, r in zip(versions, reqs))


def uv_bin() -> str:
    """The uv binary (setup.py's test extra installs the uv package into the venv)."""
    try:
        import uv  # noqa: PLC0415
        return uv.find_uv_bin()
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if not found:
            raise RuntimeError("uv not found: it is in setup.py's test extra (pip install uv)") from None
        return found


def resolve(requirements: list[str], constraints: Path | None = None,
            as_text: bool = False) -> tuple[dict[str, dict], str, float]:
    """Resolve ``requirements`` for the target with uv from PyPI's metadata. Returns ({name: pylock package entry},
    the requirements.txt text uv wrote (with ``as_text``, else ""), seconds). Raises IndexUnreachable when PyPI cannot
    be reached and RuntimeError (with uv's message) when the requirements cannot be resolved."""
    _get(f"{INDEX}/vllm/", accept="application/vnd.pypi.simple.v1+json")  # fail early and clearly when offline
    with tempfile.TemporaryDirectory(prefix="gpu-lock-") as tmp:
        t = Path(tmp)
        (t / "setup-py-requirements.in").write_text("\n".join(requirements) + "\n")  # named so in the lock's "via"
        (t / "uv.toml").write_text(uv_config(requirements))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "PIP_"))}
        env["UV_PYTHON_DOWNLOADS"] = "never"  # resolution only: no interpreter is needed or fetched
        base = [uv_bin(), "pip", "compile", "setup-py-requirements.in", "--config-file", "uv.toml",
                "--index-url", INDEX, "--python-version", PYTHON_VERSION, "--python-platform", PLATFORM,
                "--quiet", "--no-header"]
        if constraints is not None:
            base += ["--constraint", str(constraints)]
        start = time.monotonic()
        outs = {}
        formats = [("pylock.toml", "pylock.toml")] + ([("requirements.txt", "gpu.txt")] if as_text else [])
        for fmt, name in formats:
            r = subprocess.run([*base, "--format", fmt, "-o", name], cwd=t, env=env, capture_output=True, text=True,
                               timeout=600)
            if r.returncode != 0:
                msg = r.stderr.strip()
                if re.search(r"dns error|Connect|timed out|network", msg, re.I):
                    raise IndexUnreachable(f"uv could not reach {INDEX}:\n{msg}")
                raise RuntimeError(f"uv pip compile failed (exit {r.returncode}):\n{msg}")
            outs[name] = (t / name).read_text()
        seconds = time.monotonic() - start
    packages = {p["name"]: p for p in tomllib.loads(outs["pylock.toml"])["packages"]}
    return packages, outs.get("gpu.txt", ""), seconds


def lock_versions(text: str) -> dict[str, str]:
    """{name: version} of a requirements.txt-style lock (``name==version`` lines)."""
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[re.sub(r"[-_.]+", "-", name).lower()] = version
    return out


HEADER = """\
# The GPU install (docs/install.md): setup.py's COMMON + GPU + TEST lists resolved from PyPI for CPython 3.12 on
# x86_64 Linux with glibc >= 2.31 (uv --python-platform x86_64-manylinux_2_31), from metadata only.
# Generated by `python tools/dev/gpu_lock.py` (uv {uv}); tests/test_gpu_install.py checks that it is current.
# scripts/install.sh gpu installs exactly these versions with --no-deps; transformer-engine-torch is an sdist and is
# compiled there against the torch above (--no-build-isolation).
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 if the lock is not current")
    args = ap.parse_args(argv)
    reqs = setup_requirements()
    if args.check:
        packages, _, seconds = resolve(reqs, constraints=LOCK)
        got = {n: p["version"] for n, p in packages.items()}
        want = lock_versions(LOCK.read_text())
        if got != want:
            print(f"{LOCK} is not current: regenerate it with `python tools/dev/gpu_lock.py`\n"
                  f"  differs: {sorted(set(got.items()) ^ set(want.items()))}", file=sys.stderr)
            return 1
        print(f"{LOCK.relative_to(ROOT)} is current ({len(got)} packages, resolved in {seconds:.1f} s)")
        return 0
    packages, text, seconds = resolve(reqs, as_text=True)
    version = subprocess.run([uv_bin(), "--version"], capture_output=True, text=True).stdout.split()[1]
    LOCK.parent.mkdir(exist_ok=True)
    LOCK.write_text(HEADER.format(uv=version) + text)
    print(f"wrote {LOCK.relative_to(ROOT)}: {len(packages)} packages, resolved in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
