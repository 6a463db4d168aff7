"""The rollout/policy drift alert (rollout/consistency.py DriftMonitor): quiet at the fresh-sync level, loud when the
mismatch grows the way the tied-head sync bug made it grow (SmolLM2-135M, 3 RL steps: 1e-5 -> 1.5e-4 -> 2.4e-4)."""

from __future__ import annotations

import math

import pytest

from da3po_megatron.rollout.consistency import DriftMonitor


def m(mean: float) -> dict[str, float]:
    return {"rollout/logprob_diff_mean": mean, "rollout/logprob_diff_max": 10 * mean}


def test_fresh_sync_level_every_step_raises_no_alert():
    mon = DriftMonitor(factor=10, floor=1e-5)
    for step, mean in enumerate([1.1e-5, 0.9e-5, 1.3e-5, 2.0e-6], start=1):
        out = mon.update(step, m(mean))
        assert out["rollout/logprob_drift_alert"] == 0.0 and out["rollout/logprob_drift_ratio"] < 2


def test_the_tied_head_drift_is_flagged_with_a_warning_and_a_metric():
    mon = DriftMonitor(factor=10, floor=1e-5)
    assert mon.update(1, m(1e-5))["rollout/logprob_drift_alert"] == 0.0
    with pytest.warns(RuntimeWarning, match=r"step 2: .*mismatch 0\.00015.*15\.0x the fresh-sync level"):
        out = mon.update(2, m(1.5e-4))
    assert out == {"rollout/logprob_drift_ratio": pytest.approx(15.0), "rollout/logprob_drift_alert": 1.0}


def test_the_floor_keeps_numerical_noise_below_it_from_alerting():
    mon = DriftMonitor(factor=10, floor=1e-5)
    mon.update(1, m(1e-8))  # an unusually exact first step
    assert mon.update(2, m(5e-6))["rollout/logprob_drift_alert"] == 0.0  # 500x the baseline, but under the floor


def test_factor_zero_only_logs_and_nan_is_ignored():
    mon = DriftMonitor(factor=0, floor=1e-5)
    assert mon.update(1, m(math.nan)) == {}
    mon.update(2, m(1e-5))
    out = mon.update(3, m(1.0))
    assert out == {"rollout/logprob_drift_ratio": pytest.approx(1e5), "rollout/logprob_drift_alert": 0.0}
