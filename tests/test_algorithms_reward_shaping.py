"""DAPO's soft overlong punishment (paper Eq. 8) at every boundary, for numbers and tensors."""

import pytest
import torch

from da3po_megatron.algorithms import accuracy_reward, overlong_penalty, shaped_reward

L_MAX, L_CACHE = 4096, 1024  # the paper's L_max; L_cache = 25 % of it is our choice: punishment starts after 3072


@pytest.mark.parametrize(
    "length,want",
    [
        (0, 0.0),
        (3071, 0.0),
        (3072, 0.0),  # |o| = L_max - L_cache: still free
        (3073, -1 / 1024),  # first punished token
        (3584, -0.5),  # halfway through the cache
        (4095, -1023 / 1024),
        (4096, -1.0),  # |o| = L_max: exactly -1
        (4097, -1.0),  # beyond L_max
        (10_000, -1.0),
    ],
)
def test_overlong_penalty_boundaries(length, want):
    assert overlong_penalty(length, L_MAX, L_CACHE) == want
    t = overlong_penalty(torch.tensor([length]), L_MAX, L_CACHE)
    assert t.dtype == torch.float32 and t.item() == pytest.approx(want, abs=1e-7)


def test_overlong_penalty_tensor_matches_scalar_everywhere():
    lengths = torch.arange(0, 40)
    got = overlong_penalty(lengths, 32, 8)
    want = [overlong_penalty(int(n), 32, 8) for n in lengths]
    assert got.tolist() == pytest.approx(want, abs=1e-7)
    assert got[24].item() == 0.0 and got[32].item() == -1.0


def test_zero_cache_is_a_hard_cut_and_penalty_factor_scales():
    assert overlong_penalty(32, 32, 0) == 0.0 and overlong_penalty(33, 32, 0) == -1.0
    assert overlong_penalty(torch.tensor([32, 33]), 32, 0).tolist() == [0.0, -1.0]
    assert overlong_penalty(28, 32, 8, penalty_factor=0.5) == -0.25


def test_overlong_penalty_rejects_bad_lengths():
    with pytest.raises(ValueError, match="L_cache"):
        overlong_penalty(3, 10, 11)
    with pytest.raises(ValueError, match="max_length"):
        overlong_penalty(3, 0, 0)


def test_shaped_reward_adds_accuracy_and_length_terms():
    acc = accuracy_reward(torch.tensor([True, False, True]))
    assert acc.tolist() == [1.0, -1.0, 1.0]
    r = shaped_reward(acc, torch.tensor([10, 30, 40]), max_length=32, cache_length=8)
    assert r.tolist() == pytest.approx([1.0, -1.75, 0.0])
    assert shaped_reward(1.0, 28, max_length=32, cache_length=8) == 0.5
    off = shaped_reward(acc, torch.tensor([10, 30, 40]), max_length=32, cache_length=8, overlong_shaping=False)
    assert off.tolist() == [1.0, -1.0, 1.0]
