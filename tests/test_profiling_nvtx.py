"""``trainer.profile.nvtx``: NVTX ranges on the driver and on EVERY policy rank for the whole run, and a profiled step
returns the ranks to that state, not to off (issue 48, point 4). The policy ranks here are stand-ins (plain objects
called in turn, as ``PolicyGroup.run_on_all`` calls the real actors), and ``set_active`` is replaced by a recorder:
the test records which rank turned its ranges on or off, and how, without a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from da3po_megatron.config import ProfileConfig
from da3po_megatron.trainer.observability import profiling


class StandInPolicyGroup:
    """Stand-in for ``PolicyGroup``: ``run_on_all(fn, *args)`` calls ``fn(worker, *args)`` for each stand-in rank,
    with the rank's global rank answering that rank (the real actors are one process each)."""

    def __init__(self, world: int, monkeypatch: pytest.MonkeyPatch, current: list[int]) -> None:
        self.workers = [SimpleNamespace() for _ in range(world)]
        self.current = current
        monkeypatch.setattr(profiling, "_global_rank", lambda: self.current[0])

    def run_on_all(self, fn, *args):
        out = []
        for rank, worker in enumerate(self.workers):
            self.current[0] = rank
            out.append(fn(worker, *args))
        self.current[0] = -1  # the driver
        return out


class StandInEngines:
    def call_all(self, method, *args):
        return []


@pytest.mark.parametrize("nvtx", [True, False])
def test_nvtx_on_every_rank_for_the_whole_run_and_back_after_a_profiled_step(tmp_path, monkeypatch, nvtx):
    current = [-1]
    calls: list[tuple[int, bool, bool | None]] = []  # (rank or -1 = driver, active, nvtx)
    monkeypatch.setattr(profiling, "set_active", lambda active, nvtx=None: calls.append((current[0], active, nvtx)))
    monkeypatch.setattr(profiling, "nvtx_available", lambda: True)  # as on a GPU node
    group = StandInPolicyGroup(4, monkeypatch, current)
    prof = profiling.StepProfiler(ProfileConfig(steps=[2], ranks=[1], driver=False, nvtx=nvtx), tmp_path, group,
                                  StandInEngines())
    start_up = list(calls)
    if nvtx:  # the driver, then every rank: on, with NVTX
        assert start_up == [(-1, True, True)] + [(r, True, True) for r in range(4)]
    else:
        assert start_up == []
    calls.clear()
    prof.start(2)
    assert (1, True, None) in calls  # the profiled rank's ranges (record_function; NVTX where CUDA is)
    assert not [c for c in calls if c[0] in (0, 2, 3)]  # the others are left as they are
    calls.clear()
    prof.stop()
    # after the step: the driver back to the run's state, every rank back to its own base state -- NVTX on when
    # trainer.profile.nvtx is set (before issue 48: set_active(False) on every rank, i.e. NVTX off for the rest)
    last = {rank: (active, flag) for rank, active, flag in calls}
    base = (True, True) if nvtx else (False, None)
    assert last[-1] == (nvtx, True)
    assert [last[r] for r in range(4)] == [base] * 4
    assert (tmp_path / "profile" / "step_2" / "rank_1.json").is_file()
