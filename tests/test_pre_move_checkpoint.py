"""Checkpoints written before trainer/ was cut by concern (issue 56, point 7) still resume after it: the driver's
trainer state that the flat layout of f5d1453 wrote (``RunCheckpoints.trainer_state`` + ``plain_state``; and the
per-step driver state of ``rollout.dump_dir``, ``replay.driver_state``) loads into today's owners -- the
:class:`~da3po_megatron.trainer.generation.sampler.Sampler` (prompt position, data.selection's history, the carried
buffer group, counters, RNG) and :class:`~da3po_megatron.trainer.resume.run_state.RunState` (step, update counters,
drift baseline, the staleness-1 prefetched batch, the producer's snapshot) -- and what it restores equals what was
saved. How the files were made: ``tests/data/pre_move_checkpoint/make_fixture.py``."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from da3po_megatron.config import load_config
from da3po_megatron.trainer.generation.sampler import Sampler
from da3po_megatron.trainer.inputs import load_train_data
from da3po_megatron.trainer.resume.run_state import RunState

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests/data/pre_move_checkpoint"


class StandInPool:
    def close(self) -> None:
        return None


@pytest.fixture()
def expected() -> dict:
    return json.loads((DATA / "expected.json").read_text())


def parts(expected: dict) -> tuple[Sampler, RunState]:
    cfg = load_config(ROOT / "examples/tiny_cpu_da3po.yaml", expected["overrides"])
    sampler = Sampler(cfg, None, load_train_data(cfg), rewards=StandInPool())
    return sampler, RunState(cfg, None, None, sampler, SimpleNamespace(baseline=None))  # type: ignore[arg-type]


def test_a_trainer_state_written_by_the_flat_layout_resumes_into_the_sampler_and_run_state(expected):
    saved = torch.load(DATA / "trainer_state.pt", weights_only=True)
    random.seed(99)  # the restore must bring the saved RNG back, whatever ran before
    sampler, state = parts(expected)
    state.load(saved)
    assert state.step == expected["step"] and sampler.engine_weight_step == 0  # set by restore() after the sync
    assert {**sampler.totals, **state.update_totals} == expected["totals"]
    assert state.update_totals == {"skipped_updates": 1, "consecutive_skipped_updates": 0}
    assert state.drift.baseline == expected["drift_baseline"]
    assert len(sampler.buffer) == expected["buffer_groups"]
    assert [g.example.uid for g in state.pending[0].groups] == expected["pending_groups"]
    assert state.producer_state["next_j"] == expected["async_next_j"]
    assert [p["example"]["uid"] for p in state.producer_state["partials"]] == expected["async_partial_uids"]
    # the generation side's state equals what was saved: taken again, it is the file's (selection history included)
    again = sampler.state_dict()
    for key in ("prompts", "selection", "totals"):  # (fields added since, e.g. selection's posterior, aside)
        assert {k: again[key][k] for k in saved[key] if k in again[key]} == {
            k: v for k, v in saved[key].items() if key != "totals" or k in sampler.totals}, key
    assert again["buffer"]["groups"][0]["example"] == saved["buffer"]["groups"][0]["example"]
    assert again["rng"]["python"] == saved["rng"]["python"]
    assert np.array_equal(again["rng"]["numpy"]["state"], saved["rng"]["numpy"]["state"]) if isinstance(
        again["rng"]["numpy"], dict) else True
    assert torch.equal(again["rng"]["torch"], saved["rng"]["torch"])
    # and the stream goes on where the saved run's did
    assert [ex.uid for ex in sampler.next_prompts(4)] == expected["next_uids"]
    # a checkpoint written now has the same keys (and format) as the old one
    assert set(state.trainer_state()) == set(saved)


def test_a_dump_driver_state_written_by_the_flat_layout_replays_into_the_sampler(expected):
    saved = torch.load(DATA / "driver_state.pt", weights_only=True)
    sampler, _ = parts(expected)
    sampler.load_state_dict(saved)  # what Replay.collect does with rec["driver"]
    assert len(sampler.buffer) == expected["buffer_groups"]
    assert sampler.totals == {k: v for k, v in expected["totals"].items() if k in sampler.totals}
    assert {k: sampler.state_dict()["selection"][k] for k in saved["selection"]} == saved["selection"]
    assert [ex.uid for ex in sampler.next_prompts(4)] == expected["next_uids"]
