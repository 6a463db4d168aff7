"""The control plane at a tiny size: ``da3po_megatron/bench/control_plane.py``'s step of the real driver code (client,
reward pool, groups, dynamic sampling, advantages with DAA, the policy batch, ``PolicyGroup`` dispatch, metrics, the
driver's checkpoint state) against stand-in engines and ranks (real Ray actors that do no model compute -- hence
"stand_in" in the test's name). What it protects (issue 36): each data-parallel rank receives only its share of the
batch, every row is serialized exactly once per call (one ``ray.put`` per DP share, not one copy per rank), the ranks
of one DP rank share one object, and only rank 0 answers with the log-probs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from da3po_megatron.megatron.batching import PolicyBatch, Ragged, balance_across_dp, dp_shares

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    from da3po_megatron.bench import control_plane

    return control_plane


def test_a_share_holds_only_its_rows_and_is_indexed_by_batch_row():
    b = PolicyBatch([[1, 2], [3], [4, 5, 6], [7]], [[8], [9, 10], [], [11, 12, 13]],
                    old_logprobs=[[-1.0], [-2.0, -3.0], [], [-4.0, -5.0, -6.0]], advantages=[1.0, -1.0, 0.5, 2.0])
    s = b.share([3, 1])
    assert len(s) == 4 and s.lengths() == b.lengths() and s.held_rows.tolist() == [1, 3]
    assert s.response_ids[3].tolist() == [11, 12, 13] and s.old_logprobs[1].tolist() == [-2.0, -3.0]
    assert s.response_ids.values.tolist() == [9, 10, 11, 12, 13]  # only the held rows' tokens travel
    assert s.response_ids.values.dtype == np.int32 and s.old_logprobs.values.dtype == np.float32
    with pytest.raises(KeyError, match="row 0 is not in this share"):
        s.prompt_ids[0]


def test_balance_across_dp_heap_gives_the_greedy_split_of_27dab78():
    def greedy(lengths, dp):  # the O(n * dp) loop it replaced
        loads, shards = [0] * dp, [[] for _ in range(dp)]
        for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
            r = min(range(dp), key=lambda k: (loads[k], len(shards[k]), k))
            shards[r].append(i)
            loads[r] += lengths[i]
        return [sorted(s) for s in shards]

    rng = np.random.default_rng(0)
    for dp in (1, 2, 3, 8):
        lengths = rng.integers(1, 50, 97).tolist() + [5] * 20  # ties included
        assert balance_across_dp(lengths, dp) == greedy(lengths, dp)
    shares = dp_shares(list(range(1, 33)), 4, mini_batch=8)
    assert sorted(i for s in shares for i in s) == list(range(32))


def test_ragged_take_gathers_rows_in_order():
    r = Ragged.from_rows([[1, 2], [], [3, 4, 5]], np.int32)
    assert r.take([2, 0, 1]).tolist() == [[3, 4, 5], [1, 2], []] and r == [[1, 2], [], [3, 4, 5]]


def test_stand_in_control_plane_sends_each_dp_rank_its_share_once_per_call(ray_session, tmp_path):
    bench = _bench()
    res = bench.run_step(bench.SIZES["tiny"], 1.0, ranks_actual=4, engines_actual=1, reward_workers=0,
                         tmp=tmp_path, dp=2, keep_rows=True)  # 4 ranks = DP 2 x TP 2
    n = res["policy_batch_rows"]
    print({k: res[k] for k in ("responses", "response_tokens", "dispatch_puts", "batch_bytes")})
    assert res["dispatch_puts"] == {"compute_logprobs": 2, "train_step": 2}  # one put per DP share and call
    for method in ("compute_logprobs", "train_step"):
        seen = [next(x for x in rep if x["method"] == method) for rep in res["reports"]]
        for rank, x in enumerate(seen):
            assert x["batch_rows"] == n
            assert x["held"] == x["worked"], (method, rank)  # it received exactly the rows it works on
        assert seen[0]["held"] == seen[1]["held"] and seen[2]["held"] == seen[3]["held"]  # TP ranks: one share
        a, b = set(seen[0]["held"]), set(seen[2]["held"])
        assert not a & b and a | b == set(range(n))  # every row serialized once: in exactly one share
        assert 0 < len(a) < n
    assert res["phases"]["train"]["bytes"] < 1.5 * res["batch_bytes"]  # ~ the payload once, not once per rank
    assert res["kept_frac"] is not None and res["phases"]["checkpoint"]["bytes"] > 0


def test_stand_in_control_plane_with_r3_routes_keeps_every_route_array_out_of_the_driver(ray_session, tmp_path):
    """Issue 60: with Qwen3-30B-A3B's routes and R3 on, the same tiny step as a dense one -- the same seeds, so the
    same lengths and groups -- must not bring the routes into the driver process: the engines' answers, what the
    driver deserialises over the whole step (every ``ray.get``: engines, ranks, the checkpoint's route writer) and
    the driver's checkpoint state grow by the refs only, while the ranks fetch every route of their shares. Before
    (b6cc7ac) every route travelled engine -> driver -> DP shares and into the checkpoint state."""
    from da3po_megatron.testing.control_plane_standins import MOE_MODELS

    bench = _bench()
    size = bench.SIZES["tiny"]
    kw = dict(ranks_actual=2, engines_actual=1, reward_workers=0, dp=2)
    (tmp_path / "dense").mkdir()
    (tmp_path / "moe").mkdir()
    dense = bench.run_step(size, 1.0, tmp=tmp_path / "dense", **kw)
    moe = bench.run_step(size, 1.0, tmp=tmp_path / "moe", moe=MOE_MODELS["qwen3-30b-a3b"], **kw)
    assert moe["response_tokens"] == dense["response_tokens"] and moe["responses"] == dense["responses"]
    routes = moe["route_bytes"]  # the kept batch's routes (uint8, 384 B per position)
    print({k: (dense.get(k), moe.get(k)) for k in ("route_bytes", "driver_deserialised_bytes",
                                                    "route_bytes_to_driver", "route_bytes_to_ranks")},
          {p: (dense["phases"][p]["bytes"], moe["phases"][p]["bytes"]) for p in ("generate", "checkpoint")})
    assert routes > 20 * dense["batch_bytes"] > 0
    refs = 300 * moe["generated_groups"] * size.group  # ~ a ref (or its checkpoint placeholder) per completion
    assert moe["phases"]["generate"]["bytes"] < dense["phases"]["generate"]["bytes"] + refs
    assert moe["phases"]["checkpoint"]["bytes"] < dense["phases"]["checkpoint"]["bytes"] + refs
    assert moe["driver_deserialised_bytes"] < dense["driver_deserialised_bytes"] + 0.05 * routes
    assert moe["route_bytes_to_driver"] < min(refs, 0.1 * routes)  # a ref per completion, not its routes
    assert moe["route_bytes_to_ranks"] >= 2 * routes  # old log-probs and train: each rank fetched its share


def test_driver_state_groups_round_trip_as_tensors_and_old_list_states_still_load(tmp_path):
    import torch

    from da3po_megatron.data.datasets import Example
    from da3po_megatron.trainer import batch as B

    ex = Example(uid="u0", prompt="q", answer="1", source="s")
    old = {"example": {"uid": "u0", "prompt": "q", "answer": "1", "source": "s", "meta": {}}, "prompt_ids": [7, 8],
           "response_ids": [[1, 2, 3], [4]], "texts": ["a", "b"], "rollout_logprobs": [[-0.5, -0.25, -1.0], [-2.0]],
           "finish_reasons": ["stop", "stop"], "acc": [1.0, -1.0], "rewards": [1.0, -1.0], "advantages": [],
           "weight_step": 3}  # a checkpoint's group as 27dab78 wrote it (lists of numbers)
    g = B.group_from_dict(old)
    assert g.response_ids[0].dtype == np.int32 and g.rollout_logprobs[1].tolist() == [-2.0]
    torch.save({"groups": [B.group_to_dict(g)]}, tmp_path / "s.pt")
    back = B.group_from_dict(torch.load(tmp_path / "s.pt", weights_only=True)["groups"][0])
    assert [r.tolist() for r in back.response_ids] == old["response_ids"] and back.weight_step == 3
    assert back.example == ex and back.prompt_ids.tolist() == [7, 8]
    pb = B.policy_batch([back])
    assert pb.response_ids == [[1, 2, 3], [4]] and pb.old_logprobs[0].tolist() == [-0.5, -0.25, -1.0]
