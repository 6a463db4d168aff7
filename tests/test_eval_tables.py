"""Paper-style Markdown tables (Tables 1-2) from `da3po eval` result JSONs, and the runner's result helpers."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from da3po_megatron.eval.metrics import average_scores, score_benchmark
from da3po_megatron.eval.runner import flat_metrics, parse_k, write_results
from da3po_megatron.eval.tables import load_result, render_table


def _result(name: str, mats: dict[str, np.ndarray]) -> dict:
    scores = {b: score_benchmark(b, m) for b, m in mats.items()}
    return {"name": name, "benchmarks": {b: s.to_dict() for b, s in scores.items()}, "average": average_scores(scores)}


@pytest.fixture()
def two_runs():
    dapo = _result("DAPO", {"math500": np.array([[1, 0], [0, 0]]), "aime24": np.array([[1, 1, 0, 0]])})
    da3po = _result("DA3PO", {"math500": np.array([[1, 1], [0, 1]]), "aime24": np.array([[0, 0, 0, 0]])})
    return dapo, da3po


def test_table_has_one_row_per_run_paper_column_order_and_average(two_runs):
    table = render_table(two_runs, bold_best=False)
    lines = table.strip().splitlines()
    assert lines[0] == "| Method | AIME24 avg/pass@4 | MATH-500 avg/pass@2 | Average avg/pass@k |"
    assert lines[1] == "|---|---|---|---|"
    # DAPO: AIME24 avg 50, pass 100; MATH-500 avg 25, pass@2 50; average (50+25)/2, (100+50)/2
    assert lines[2] == "| DAPO | 50.0 / 100.0 | 25.0 / 50.0 | 37.5 / 75.0 |"
    assert lines[3] == "| DA3PO | 0.0 / 0.0 | 75.0 / 100.0 | 37.5 / 50.0 |"


def test_best_value_per_column_is_bold_and_ties_are_all_bold(two_runs):
    table = render_table(two_runs, style="split")
    header, _, dapo, da3po = table.strip().splitlines()
    assert header.split(" | ")[1:3] == ["AIME24 avg@4", "AIME24 pass@4"]
    assert "**50.0**" in dapo and "**75.0**" in da3po
    assert dapo.count("**37.5**") == 1 and da3po.count("**37.5**") == 1  # tied average avg@k


def test_missing_benchmark_shows_a_dash_and_a_note(two_runs):
    dapo, _ = two_runs
    only_math = _result("GRPO", {"math500": np.array([[1, 1], [1, 1]])})
    table = render_table([dapo, only_math], bold_best=False)
    assert "| GRPO | – | 100.0 / 100.0 |" in table
    assert "different benchmark sets" in table


def test_ci_appends_196_standard_errors():
    r = _result("x", {"math500": np.array([[1, 0], [0, 0], [1, 1]])})
    se = r["benchmarks"]["math500"]["avg_at_k_se"]
    assert f"± {100 * 1.96 * se:.1f}" in render_table([r], ci=True)


def test_write_results_then_render_from_files_and_cli(tmp_path, two_runs):
    for r in two_runs:
        rows = [{"id": str(i), "answer": "1", "correct": [1]} for i in range(2)]
        write_results({**r, "samples": {"math500": rows}}, tmp_path / r["name"])
    data = json.loads((tmp_path / "DAPO" / "results.json").read_text())
    assert data["benchmarks"]["math500"]["correct"] == [[1], [1]] and "samples" not in data
    assert (tmp_path / "DAPO" / "samples" / "math500.jsonl").read_text().count("\n") == 2
    assert "| DAPO |" in (tmp_path / "DAPO" / "results.md").read_text()
    assert load_result(tmp_path / "DA3PO")["name"] == "DA3PO"
    proc = subprocess.run([sys.executable, "-m", "da3po_megatron.eval.tables", str(tmp_path / "DAPO"),
                           str(tmp_path / "DA3PO" / "results.json"), "--names", "a,b", "--out", str(tmp_path / "t.md")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "| a |" in proc.stdout and "| b |" in proc.stdout and (tmp_path / "t.md").read_text() == proc.stdout


def test_load_result_rejects_files_that_are_not_eval_results(tmp_path):
    (tmp_path / "m.json").write_text('{"step": 1}')
    with pytest.raises(ValueError, match="no 'benchmarks'"):
        load_result(tmp_path / "m.json")
    with pytest.raises(FileNotFoundError, match="da3po eval"):
        load_result(tmp_path / "none.json")


def test_flat_metrics_keys_for_the_trainer(two_runs):
    m = flat_metrics(two_runs[0])
    assert m["eval/aime24/avg@k"] == pytest.approx(0.5) and m["eval/aime24/k"] == 4
    assert m["eval/avg/pass@k"] == pytest.approx(0.75)


def test_parse_k_defaults_to_the_paper_protocol_and_accepts_overrides():
    assert parse_k(None, ["aime24", "math500"]) == {"aime24": 32, "math500": 8}
    assert parse_k("2", ["aime24", "math500"]) == {"aime24": 2, "math500": 2}
    assert parse_k("AIME2024=4", ["aime24", "math500"]) == {"aime24": 4, "math500": 8}
    with pytest.raises(ValueError, match="not among"):
        parse_k("amc=4", ["aime24"])
    with pytest.raises(ValueError, match=">= 1"):
        parse_k("aime24=0", ["aime24"])
