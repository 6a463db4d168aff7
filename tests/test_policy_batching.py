"""Dynamic micro-batching and sequence packing of the policy (pure torch, no Megatron)."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest
import torch

from da3po_megatron.megatron.batching import PolicyBatch, balance_across_dp
from da3po_megatron.megatron.packing import build_microbatch, microbatches, plan_microbatches


def _batch() -> PolicyBatch:
    return PolicyBatch(
        prompt_ids=[[10, 11, 12], [20, 21], [30], [40, 41, 42, 43]],
        response_ids=[[13, 14], [22, 23, 24], [], [44]],
        old_logprobs=[[-1.0, -2.0], [-0.5, -0.6, -0.7], [], [-3.0]],
        advantages=[1.0, -1.0, 0.5, 2.0],
    )


def test_plan_respects_the_token_budget_and_covers_every_sequence_once():
    lengths = [7, 3, 9, 1, 4, 4, 8, 2]
    for budget in (9, 10, 16, 100):
        plan = plan_microbatches(lengths, budget)
        assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in mb) <= budget for mb in plan)
        padded = plan_microbatches(lengths, budget, packing=False)
        assert all(len(mb) * max(lengths[i] for i in mb) <= budget for mb in padded)
    assert len(plan_microbatches(lengths, 100)) == 1


def test_sequence_longer_than_the_budget_is_an_error_naming_it():
    with pytest.raises(ValueError, match="sequence 1 has 12 tokens .* max_tokens_per_microbatch = 10"):
        plan_microbatches([3, 12], 10)


def test_dp_balance_splits_tokens_evenly_and_deterministically():
    lengths = [10, 9, 8, 7, 3, 2, 2, 1]
    shards = balance_across_dp(lengths, 2)
    assert sorted(i for s in shards for i in s) == list(range(8))
    loads = [sum(lengths[i] for i in s) for s in shards]
    assert abs(loads[0] - loads[1]) <= 2
    assert shards == balance_across_dp(lengths, 2)
    assert all(s == sorted(s) for s in shards)


def test_packed_row_has_restarting_positions_block_diagonal_causal_mask_and_response_targets():
    b = _batch()
    mb = build_microbatch(b, [0, 1, 2], packing=True)
    assert mb.tokens.tolist() == [[10, 11, 12, 13, 14, 20, 21, 22, 23, 24, 30]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0]]
    mask = mb.attention_mask[0, 0]  # True = masked
    assert mask.shape == (11, 11)
    allowed = ~mask
    assert allowed[4, 0] and allowed[4, 4] and not allowed[4, 5]  # causal within sequence 0
    assert not allowed[5, 4] and allowed[9, 5] and not allowed[5, 9]  # sequence 1 never sees sequence 0
    assert allowed[10, 10] and allowed[10].sum() == 1
    # response token j is scored at position start + P - 1 + j, its target is the token itself
    assert mb.token_index.tolist() == [2, 3, 6, 7, 8]
    assert mb.token_targets.tolist() == [13, 14, 22, 23, 24]
    assert mb.tokens.view(-1)[mb.token_index + 1].tolist() == mb.token_targets.tolist()
    assert mb.token_seq.tolist() == [0, 0, 1, 1, 1] and mb.token_pos.tolist() == [0, 1, 0, 1, 2]
    assert mb.response_mask.tolist() == [[1, 1, 0], [1, 1, 1], [0, 0, 0]]
    assert mb.old_logprobs[1].tolist() == pytest.approx([-0.5, -0.6, -0.7])
    assert mb.advantages.tolist() == [1.0, -1.0, 0.5]
    assert mb.unflatten(torch.arange(5.0)).tolist() == [[0, 1, 0], [2, 3, 4], [0, 0, 0]]


def test_dense_packing_fills_rows_as_long_as_the_longest_sequence():
    b = PolicyBatch(prompt_ids=[[1, 2, 3, 4], [5], [6, 7], [8]], response_ids=[[9, 10], [11], [12], [13, 14]])
    mb = build_microbatch(b, [0, 1, 2, 3], packing=True, row_capacity=0)  # lengths 6, 2, 3, 3 -> rows of 6
    assert mb.tokens.tolist() == [[1, 2, 3, 4, 9, 10], [6, 7, 12, 8, 13, 14], [5, 11, 0, 0, 0, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2], [0, 1, 0, 0, 0, 0]]
    flat = mb.tokens.view(-1)
    assert flat[mb.token_index + 1].tolist() == mb.token_targets.tolist() == [9, 10, 11, 12, 13, 14]
    for r in range(3):  # block-diagonal causal per row; padding sees only itself
        for i in range(6):
            seen = (~mb.attention_mask[r, 0, i]).nonzero().view(-1).tolist()
            assert seen == list(range(i - int(mb.position_ids[r, i]), i + 1)), (r, i, seen)
    assert mb.num_response_tokens == 6


def test_padded_rows_hold_one_sequence_each_with_causal_mask():
    mb = build_microbatch(_batch(), [1, 3], packing=False, pad_id=0)
    assert mb.tokens.tolist() == [[20, 21, 22, 23, 24], [40, 41, 42, 43, 44]]
    assert mb.token_index.tolist() == [1, 2, 3, 5 + 3]
    assert mb.attention_mask.shape == (2, 1, 5, 5)


def test_thd_packing_describes_sequences_by_cu_seqlens_without_dense_mask():
    mb = build_microbatch(_batch(), [0, 1, 3], packing=True, thd=True)
    assert mb.attention_mask is None
    assert mb.cu_seqlens.tolist() == [0, 5, 10, 15] and mb.max_seqlen == 5


def test_microbatches_keep_batch_row_indices():
    b = _batch()
    mbs = microbatches(b, [1, 2, 3], max_tokens=6)
    assert sorted(r for mb in mbs for r in mb.rows) == [1, 2, 3]
    assert all(mb.num_tokens <= 6 for mb in mbs)


def test_policy_batch_validates_shapes_and_pickles():
    with pytest.raises(ValueError, match="old_logprobs\\[1\\] has 1 values for 3 response tokens"):
        PolicyBatch([[1], [2]], [[3], [4, 5, 6]], old_logprobs=[[0.0], [0.0]])
    with pytest.raises(ValueError, match="prompt_ids\\[0\\] is empty"):
        PolicyBatch([[]], [[1]])
    with pytest.raises(ValueError, match="2 responses but 1 advantages"):
        PolicyBatch([[1], [2]], [[3], [4]], advantages=[1.0])
    b = _batch()
    c = pickle.loads(pickle.dumps(b))
    assert c == b and c.select([3, 0]).response_ids == [[44], [13, 14]]


def test_token_weights_travel_with_their_tokens_through_selection_and_micro_batches():
    b = replace(_batch(), token_weights=[[0.5, 2.0], [1.0, 1.5, 0.25], [], [0.75]])
    assert b.select([3, 0]).token_weights == [[0.75], [0.5, 2.0]]
    mbs = microbatches(b, [0, 1, 2, 3], max_tokens=6)
    assert len(mbs) > 1
    for mb in mbs:  # every token's weight sits where its old log-prob sits
        for seq, pos in zip(mb.token_seq.tolist(), mb.token_pos.tolist()):
            row = mb.rows[seq]
            assert mb.token_weights[seq, pos].item() == b.token_weights[row][pos]
            assert mb.old_logprobs[seq, pos].item() == pytest.approx(b.old_logprobs[row][pos])
    assert build_microbatch(_batch(), [0, 1]).token_weights is None  # the default: no weights, no tensor
    with pytest.raises(ValueError, match="token_weights\\[1\\] has 2 values for 3 response tokens"):
        PolicyBatch([[1], [2]], [[3], [4, 5, 6]], token_weights=[[1.0], [1.0, 1.0]])
    with pytest.raises(ValueError, match="2 responses but 1 token_weights rows"):
        PolicyBatch([[1], [2]], [[3], [4]], token_weights=[[1.0]])
