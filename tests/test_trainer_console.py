"""The quiet console (trainer/observability/console.py): worker output goes to run_dir/logs at file-descriptor level
(child processes included), the driver's third-party logs go to driver.log, our lines stay on the console, --verbose
shows everything. Each case runs in a fresh Python process so that pytest's own streams are untouched; the Ray side is
covered by the end-to-end trainer tests (tests/test_trainer_e2e.py: worker-*.log files, no vLLM chatter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from da3po_megatron.trainer.observability.console import HOOK, LOG_DIR_ENV, ray_init_kwargs

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=60)


def test_worker_hook_sends_python_c_level_and_child_output_to_the_log_dir(tmp_path):
    code = ("import os, subprocess, sys\n"
            "from da3po_megatron.trainer.observability.console import redirect_worker_output\n"
            "redirect_worker_output()\n"
            "print('python line'); sys.stderr.write('stderr line\\n'); os.write(1, b'fd line\\n')\n"
            "subprocess.run(['echo', 'child line'])\n"
            "print(os.getpid())\n")
    p = _python(code, {LOG_DIR_ENV: str(tmp_path)})
    assert p.returncode == 0 and p.stdout == "" and p.stderr == ""
    (log,) = tmp_path.glob("worker-*.log")
    text = log.read_text()
    for line in ("python line", "stderr line", "fd line", "child line"):
        assert line in text
    assert log.name == f"worker-{text.split()[-1]}.log"


def test_worker_hook_is_a_no_op_without_a_log_dir(tmp_path):
    p = _python("from da3po_megatron.trainer.observability.console import redirect_worker_output\n"
                "redirect_worker_output(); print('still here')", {LOG_DIR_ENV: ""})
    assert p.stdout == "still here\n"


def test_ray_init_kwargs_quiet_uses_the_hook_verbose_forwards_worker_output(tmp_path, monkeypatch):
    monkeypatch.setenv(LOG_DIR_ENV, str(tmp_path))
    monkeypatch.delenv("DA3PO_RAY_LOG_TO_DRIVER", raising=False)
    quiet = ray_init_kwargs(verbose=False)
    assert quiet == {"log_to_driver": False,
                     "runtime_env": {"worker_process_setup_hook": HOOK, "env_vars": {LOG_DIR_ENV: str(tmp_path)}}}
    assert ray_init_kwargs(verbose=True) == {"log_to_driver": True}
    monkeypatch.setenv("DA3PO_RAY_LOG_TO_DRIVER", "0")
    assert ray_init_kwargs(verbose=True) == {"log_to_driver": False}


def test_driver_console_keeps_our_lines_and_files_third_party_logs_and_warnings(tmp_path):
    code = ("import logging, sys, warnings\n"
            "lib = logging.getLogger('somelib'); lib.addHandler(logging.StreamHandler(sys.stderr))\n"
            "from da3po_megatron.trainer.observability.console import configure\n"
            f"configure({str(tmp_path)!r}, verbose={{verbose}})\n"
            "print('step 1/2 | acc 0.5')\n"
            "lib.warning('Apex is not installed. Falling back to Torch Norm')\n"
            "logging.getLogger('vllm.engine').info('Initializing a V1 LLM engine')\n"
            "warnings.warn('TransformerEngine is not available')\n"
            "late = logging.getLogger('ray')  # a library imported after configure, with its own handler\n"
            "late.addHandler(logging.StreamHandler(sys.stderr)); late.propagate = False\n"
            "from da3po_megatron.trainer.observability.console import ray_init_kwargs\n"
            "ray_init_kwargs()\n"
            "late.info('Started a local Ray instance.')\n")
    quiet = _python(code.replace("{verbose}", "False"), {})
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout == "step 1/2 | acc 0.5\n" and quiet.stderr == ""
    log = (tmp_path / "logs/driver.log").read_text()
    for line in ("step 1/2 | acc 0.5", "somelib: Apex is not installed", "vllm.engine: Initializing a V1 LLM engine",
                 "TransformerEngine is not available", "ray: Started a local Ray instance."):
        assert line in log
    verbose = _python(code.replace("{verbose}", "True"), {})
    assert "Apex is not installed" in verbose.stderr and "TransformerEngine is not available" in verbose.stderr
