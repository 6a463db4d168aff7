"""tools/diff_metrics.py: two runs' metrics compared exactly, wall-clock metrics left out, new metrics listed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("diff_metrics", ROOT / "tools/diff_metrics.py")
dm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dm)


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_equal_runs_pass_a_changed_value_fails_and_wall_clock_and_new_metrics_are_not_compared(tmp_path, capsys):
    base = [{"step": 1, "acc/mean": 0.25, "time/step": 1.0}, {"step": 2, "acc/mean": float("nan"), "time/step": 2.0}]
    a = _write(tmp_path / "a.jsonl", base)
    b = _write(tmp_path / "b.jsonl", [{**r, "time/step": 9.0, "rollout/staleness_max": 0.0} for r in base])
    assert dm.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "2 common steps, 2 values compared (wall-clock metrics left out): 0 differ" in out
    assert "metrics only in b (1): rollout/staleness_max" in out
    c = _write(tmp_path / "c.jsonl", [base[0], {**base[1], "acc/mean": 0.5}])
    assert dm.main([str(a), str(c)]) == 1
    assert "step 2 acc/mean: nan -> 0.5" in capsys.readouterr().out
    d = _write(tmp_path / "d.jsonl", base[:1])
    assert dm.main([str(a), str(d)]) == 1 and "steps only in a: [2]" in capsys.readouterr().out
