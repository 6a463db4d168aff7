"""Selective rollout (``data.selection=skip_zero_variance``, issue 50) survives a SIGKILL: the per-prompt history, the
exploration rates and the memoised skip decisions are in the checkpoint, so a run killed during a step and resumed
logs the same per-step metrics as an uninterrupted one (the fault suite's pattern and helpers,
tests/test_reliability_faults.py / trainer/faults.py).

The smallest run that proves it, in two launches: 6 training prompts (2 per bucket of the 3-digit tiny task) and a
batch of 4, so step 1 already goes round the prompt set and step 2 draws prompts with a history -- the selection skips
some of them (asserted). The first launch is SIGKILLed in the middle of step 2's checkpoint save, after step 2's
metrics were logged: its steps 1-2 are an uninterrupted run's, so they are the reference (no third launch). The
second launch resumes from step 1's checkpoint (history, rates and memoised decisions restored), runs step 2 again
and must log exactly what the uninterrupted step 2 logged, skips included. Both rules: the streak rule
(``skip_zero_variance``) and the pass-rate posterior (``posterior``, issue 59: its Beta evidence, bucket means and
learnt G travel in the same ``selection`` entry)."""

from __future__ import annotations

import pytest
from test_reliability_faults import launch, metrics, model, stable, tail  # noqa: F401 - model: the fixture

SELECT = ("data.synthetic.train_per_bucket=2", "trainer.total_steps=2", "trainer.save_every=1")

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
@pytest.mark.parametrize("rule", ["skip_zero_variance", "posterior"])
def test_selection_killed_mid_step_resumes_to_identical_metrics(model, tmp_path, rule):  # noqa: F811 - the fixture
    run_dir = tmp_path / "run"
    select = (f"data.selection={rule}", *SELECT)
    p, kill_s = launch(model, run_dir, "kill@checkpoint@2", *select)  # SIGKILL inside step 2's checkpoint save
    assert p.returncode == -9, tail(p)
    ref = metrics(run_dir)  # logged before the kill, by a run that was never interrupted
    assert [r["step"] for r in ref] == [1, 2]
    assert ref[1]["selection/skipped"] > 0, [r["selection/skipped"] for r in ref]  # the history decides skips
    p, resume_s = launch(model, run_dir, "", *select)
    assert p.returncode == 0, tail(p)
    assert "at step 1 (" in p.stdout and "selection: resumed the history of" in p.stdout, tail(p)
    got = metrics(run_dir)
    assert [r["step"] for r in got] == [1, 2]
    for a, b in zip(got, ref, strict=True):
        assert stable(a) == stable(b), {k: (stable(a).get(k), v) for k, v in stable(b).items() if
                                        stable(a).get(k) != v}
    print(f"selection ({rule}) kill/resume: killed launch {kill_s:.0f} s, resume {resume_s:.0f} s")
