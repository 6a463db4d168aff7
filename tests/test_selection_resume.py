"""Selective rollout (``data.selection=skip_zero_variance``, issue 50) survives a SIGKILL: the per-prompt history, the
exploration rates and the memoised skip decisions are in the checkpoint, so a run killed during a step and resumed
logs the same per-step metrics as an uninterrupted one (the fault suite's pattern and helpers,
tests/test_reliability_faults.py / trainer/faults.py). 6 training prompts (2 per bucket) and a batch of 4: prompts
come back from step 2 on, so the history decides skips before the kill."""

from __future__ import annotations

import pytest
from test_reliability_faults import launch, metrics, model, stable, tail  # noqa: F401 - model: the fixture

SELECT = ("data.selection=skip_zero_variance", "data.synthetic.train_per_bucket=2", "trainer.total_steps=5")

pytestmark = pytest.mark.slow


@pytest.mark.timeout(1200)
def test_selection_killed_mid_step_resumes_to_identical_metrics(model, tmp_path):  # noqa: F811 - the fixture
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    p, ref_s = launch(model, ref_dir, "", *SELECT)
    assert p.returncode == 0, tail(p)
    ref = metrics(ref_dir)
    assert [r["step"] for r in ref] == [1, 2, 3, 4, 5]
    assert sum(r["selection/skipped"] for r in ref[:3]) > 0, [r["selection/skipped"] for r in ref]  # skips decided
    p, kill_s = launch(model, run_dir, "kill@generate@4", *SELECT)  # SIGKILL while step 4 generates
    assert p.returncode == -9, tail(p)
    p, resume_s = launch(model, run_dir, "", *SELECT)
    assert p.returncode == 0, tail(p)
    assert "resumed from" in p.stdout and "selection: resumed the history of" in p.stdout, tail(p)
    got = metrics(run_dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    for a, b in zip(got, ref, strict=True):
        assert stable(a) == stable(b), {k: (stable(a).get(k), v) for k, v in stable(b).items() if
                                        stable(a).get(k) != v}
    print(f"selection kill/resume: reference {ref_s:.0f} s, killed launch {kill_s:.0f} s, resume {resume_s:.0f} s")
