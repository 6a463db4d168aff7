"""Dynamic sampling: group filter (0 < p_hat < 1) and the cross-round buffer (drop vs carry, counters, resume)."""

import pickle

import pytest
import torch

from da3po_megatron.algorithms import ALL_CORRECT, ALL_WRONG, KEEP, DynamicSamplingBuffer, filter_groups


def test_filter_groups_keeps_only_mixed_groups_with_reasons():
    correct = torch.tensor([1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0], dtype=torch.bool)
    keep, p_hat, reason = filter_groups(correct, 3)
    assert keep.tolist() == [True, False, False, True]
    assert p_hat.tolist() == pytest.approx([2 / 3, 0.0, 1.0, 1 / 3])
    assert reason.tolist() == [KEEP, ALL_WRONG, ALL_CORRECT, KEEP]


def _round(tag: str, p_hats: list[float]) -> tuple[list[dict], list[float]]:
    return [{"id": f"{tag}{i}", "p": p} for i, p in enumerate(p_hats)], p_hats


def test_buffer_fills_across_rounds_and_drops_surplus():
    buf = DynamicSamplingBuffer(target_groups=4, surplus="drop", group_size=8)
    buf.reset_stats()
    assert buf.add(*_round("a", [0.0, 0.5, 1.0, 0.25])) == 2
    assert not buf.is_full
    assert buf.add(*_round("b", [0.125, 1.0, 0.0, 0.875, 0.5])) == 3
    assert buf.is_full
    batch = buf.take()
    assert [g["id"] for g in batch] == ["a1", "a3", "b0", "b3"]
    s = buf.stats()
    assert s["dynamic_sampling/generated_groups"] == 9
    assert s["dynamic_sampling/kept_groups"] == 5
    assert s["dynamic_sampling/discarded_all_correct_groups"] == 2
    assert s["dynamic_sampling/discarded_all_wrong_groups"] == 2
    assert s["dynamic_sampling/discarded_surplus_groups"] == 1
    assert s["dynamic_sampling/discarded_surplus_samples"] == 8
    assert s["dynamic_sampling/generated_samples"] == 72
    assert s["dynamic_sampling/rounds"] == 2
    assert s["dynamic_sampling/carried_groups"] == 0
    assert len(buf) == 0


def test_buffer_carries_surplus_to_next_step_first_in_line():
    buf = DynamicSamplingBuffer(target_groups=2, surplus="carry")
    buf.add(*_round("a", [0.5, 0.5, 0.5]))
    assert [g["id"] for g in buf.take()] == ["a0", "a1"]
    assert buf.stats()["dynamic_sampling/discarded_surplus_groups"] == 0
    assert buf.stats()["dynamic_sampling/carried_groups"] == 1
    buf.reset_stats()
    assert buf.stats()["dynamic_sampling/carried_in_groups"] == 1
    assert not buf.is_full
    buf.add(*_round("b", [0.3, 1.0]))
    assert [g["id"] for g in buf.take()] == ["a2", "b0"]
    assert buf.stats()["dynamic_sampling/generated_groups"] == 2


def test_take_before_full_raises_with_counts():
    buf = DynamicSamplingBuffer(target_groups=3)
    buf.add(*_round("a", [0.5, 0.0]))
    with pytest.raises(RuntimeError, match="only 1 of 3 groups kept after 1 round"):
        buf.take()


def test_state_dict_round_trip_resumes_carried_surplus_exactly():
    buf = DynamicSamplingBuffer(target_groups=2, surplus="carry", group_size=4)
    buf.add(*_round("a", [0.5, 0.25, 0.75, 1.0]))
    buf.take()
    state = pickle.loads(pickle.dumps(buf.state_dict()))  # what a checkpoint does
    fresh = DynamicSamplingBuffer(target_groups=2, surplus="carry", group_size=4)
    fresh.load_state_dict(state)
    assert fresh.stats() == buf.stats()
    for b in (buf, fresh):
        b.reset_stats()
        b.add(*_round("b", [0.5]))
    assert buf.take() == fresh.take() == [{"id": "a2", "p": 0.75}, {"id": "b0", "p": 0.5}]
    with pytest.raises(ValueError, match="surplus"):
        DynamicSamplingBuffer(target_groups=2, surplus="drop").load_state_dict(state)


def test_state_dict_does_not_alias_buffered_groups():
    buf = DynamicSamplingBuffer(target_groups=5)
    groups, p = _round("a", [0.5])
    buf.add(groups, torch.tensor(p))
    state = buf.state_dict()
    groups[0]["id"] = "mutated"
    assert state["groups"][0]["id"] == "a0"


def test_buffer_rejects_bad_arguments():
    with pytest.raises(ValueError, match="surplus"):
        DynamicSamplingBuffer(2, surplus="keep")
    with pytest.raises(ValueError, match="target_groups"):
        DynamicSamplingBuffer(0)
    with pytest.raises(ValueError, match="2 groups but 1 p_hat"):
        DynamicSamplingBuffer(2).add(["x", "y"], [0.5])
