"""Training curves from synthetic metrics.jsonl files: overlaid runs, missing keys, bad lines, the samples axis."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from da3po_megatron.eval.curves import discover_eval_keys, plot_runs, read_metrics

REPO = Path(__file__).resolve().parents[1]


def _run(tmp: Path, name: str, daa: bool, steps: int = 12) -> Path:
    d = tmp / name
    d.mkdir()
    lines = []
    for s in range(1, steps + 1):
        row = {"step": s, "reward/mean": -1 + s / steps, "acc/mean": s / (2 * steps), "filter/frac_filtered": 0.3,
               "gen/cumulative_samples": 512 * 16 * s * 1.3}
        if daa:
            row["daa/activation_frac"] = 0.1 + 0.01 * s
        if s % 4 == 0:
            row["eval/aime24/avg@k"] = 0.1 + 0.01 * s
            row["eval/math500/avg@8"] = 0.5
        lines.append(json.dumps(row))
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return d


def _is_png(p: Path) -> bool:
    return p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000


def test_plot_runs_overlays_runs_and_writes_one_png_per_quantity(tmp_path):
    runs = [_run(tmp_path, "dapo", daa=False), _run(tmp_path, "da3po", daa=True)]
    paths = plot_runs(runs, tmp_path / "out")
    names = [p.name for p in paths]
    assert names == ["reward.png", "accuracy.png", "eval_aime24.png", "eval_math500.png", "daa_activation.png",
                     "filtered.png", "overview.png"]
    assert all(_is_png(p) for p in paths)


def test_runs_without_a_key_are_skipped_and_absent_quantities_produce_no_file(tmp_path):
    d = tmp_path / "grpo"
    d.mkdir()
    (d / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.1}\n{"step": 2, "reward/mean": 0.2}\n')
    paths = plot_runs([d], tmp_path / "out")
    assert [p.name for p in paths] == ["reward.png", "overview.png"]


def test_bad_lines_are_skipped_with_a_warning_and_repeated_steps_keep_the_last_value(tmp_path):
    d = tmp_path / "r"
    d.mkdir()
    (d / "metrics.jsonl").write_text('{"step": 1, "acc/mean": 0.1}\n{"step": 2, "acc/mean": 0.2}\n'
                                     '{"step": 2, "acc/mean": 0.25}\n{"step": 3, "acc/me')
    with pytest.warns(UserWarning, match="skipped 1 line"):
        rows = read_metrics(d)
    assert [(r["step"], r["acc/mean"]) for r in rows] == [(1, 0.1), (2, 0.25)]


def test_eval_keys_with_literal_k_or_a_number_are_found_aime24_first(tmp_path):
    runs = [[{"step": 1, "eval/math500/avg@8": 0.5, "eval/aime24/avg@k": 0.1, "eval/aime24/pass@k": 0.3}]]
    assert discover_eval_keys(runs) == {"aime24": ["eval/aime24/avg@k"], "math500": ["eval/math500/avg@8"]}


def test_cli_with_samples_axis_and_labels(tmp_path):
    runs = [_run(tmp_path, "a", daa=True), _run(tmp_path, "b", daa=True)]
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "plot_curves.py"), *map(str, runs), "--out",
                           str(tmp_path / "o"), "--labels", "DAPO,DA3PO", "--x", "samples", "--smooth", "0.5"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "o" / "eval_aime24.png").is_file() and "overview.png" in proc.stdout


def test_missing_metrics_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_runs([tmp_path], tmp_path / "o")
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "plot_curves.py"), str(tmp_path / "nope"), "--out",
                           str(tmp_path / "o")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no metrics file" in proc.stderr
