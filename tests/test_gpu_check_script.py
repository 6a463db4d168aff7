"""tools/gpu_check.sh -- the one prepared run for a session lent a GPU machine -- works end to end, here at tiny sizes.

A device session has minutes, not hours: a typo found there costs the whole budget. This runs the script on CPU with
`GPU_CHECK_SMALL=1` (same steps, tiny shapes; the kernel-test step is skipped here because the suite runs those tests
anyway) and checks the summary, the exit status and the files it leaves for the device tool to bring back (at most 8).
"""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    e = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable, GPU_CHECK_SMALL="1")
    e.update(env)
    e.pop("MASTER_PORT", None)
    e.pop("MASTER_ADDR", None)
    return subprocess.run(["bash", "tools/gpu_check.sh", "run"], cwd=REPO, env=e, capture_output=True, text=True,
                          timeout=900)


def _summary(tmp_path: Path) -> dict[str, str]:
    lines = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    return {ln.split()[0]: ln.split()[1] for ln in lines}


def test_gpu_check_runs_every_step_at_tiny_sizes_and_leaves_at_most_8_files(tmp_path):
    # skipped here to save process starts in CI: bench_loss_16k is bench_loss_8k's command at another size, and
    # convert_verify is `da3po convert hf-to-megatron --verify`, which tests/test_convert.py runs
    r = _run(tmp_path, GPU_CHECK_SKIP="kernel_tests,bench_loss_16k,convert_verify")
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-3000:]
    assert _summary(tmp_path) == {"kernel_tests": "SKIP", "bench_loss_8k": "PASS", "bench_loss_16k": "SKIP",
                                  "train_step": "PASS", "resume": "PASS", "te_spec": "SKIP", "convert_verify": "SKIP",
                                  "ipc_sync": "PASS", "collective_cuda": "PASS"}
    assert "te_spec                SKIP no CUDA" in (tmp_path / "out" / "summary.txt").read_text()
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert len(files) <= 8, files
    assert {"env.txt", "summary.txt", "bench_loss_8k.json", "bench_loss_8k.txt", "train_step.txt"} <= set(files)
    assert "torch" in (tmp_path / "out" / "env.txt").read_text()
    assert "| reference" in (tmp_path / "out" / "bench_loss_8k.txt").read_text()
    train = (tmp_path / "out" / "train_step.txt").read_text()
    assert '"loss_backend": "kernel"' in train and '"loss_backend": "fused_linear"' in train
    assert '"loss_backend_ran": "kernel:chunked"' in train  # what the step reports it ran (--expect-loss-backend)
    assert '"check": "resume", "ok": true' in train and '"optimizer": "torch.optim.adamw.AdamW"' in train
    assert "| ipc_sync |" in train and "| pack |" in train  # the weight-sync IPC leg, appended to the same file
    assert '"check": "collective_cuda"' in train and "wrong tensors: 0" in train  # the collective receive step


def test_a_failing_step_is_recorded_and_the_script_exits_non_zero(tmp_path):
    # a Python that does not exist: every step that runs fails, and says so in the summary
    r = _run(tmp_path, GPU_CHECK_SKIP="kernel_tests,bench_loss_16k", PYTHON="/nonexistent/python")
    assert r.returncode != 0
    s = _summary(tmp_path)
    assert s["bench_loss_8k"] == "FAIL" and s["bench_loss_16k"] == "SKIP"
