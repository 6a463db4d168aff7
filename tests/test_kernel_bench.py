"""da3po_megatron/bench/loss.py runs end to end on tiny CPU sizes and prints one table with every requested path."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_loss_prints_a_row_per_path_with_memory_and_time(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, "-m", "da3po_megatron.bench.loss", "--cpu", "--tokens", "32", "--vocab", "1000",
         "--hidden", "16", "--repeats", "1", "--paths", "reference,chunked_inplace,triton,fused_linear",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},  # this checkout's package
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["path"]: row for row in json.loads(out.read_text())["rows"]}
    for path in ("reference", "chunked_inplace", "fused_linear"):
        assert rows[path]["time_s"] > 0 and rows[path]["input_bytes"] > 0, rows[path]
        assert f"| {path}" in r.stdout
    assert "skipped" in rows["triton"]  # no CUDA here and TRITON_INTERPRET is not set for the benchmark
