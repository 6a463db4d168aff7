"""MoE routes by reference (``rollout/route_refs.py``, issue 60): an engine in a Ray actor puts each group's routes
into the object store once (the prompt's rows once when the samples share them), the driver's groups, batch and
checkpoint state hold refs, each policy rank fetches its share, and a checkpoint writes them from a Ray actor and reads
them back as refs with the same bytes (resumes exact). Real Ray actors stand in for the engine (no vLLM here: the
packing and the object path are what is tested; ``tests/test_moe_replay.py`` runs the real engines)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from da3po_megatron.megatron.batching import PolicyBatch, Ragged
from da3po_megatron.rollout.route_refs import GroupRoutes, RouteRef, RouteRefs, read_routes, write_routes


def _group(prompt_len: int = 5, lengths=(3, 1, 4), seed: int = 0, share: bool = True) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    head = rng.integers(0, 128, (prompt_len, 4, 2), dtype=np.uint8)
    rows = []
    for r in lengths:
        own = rng.integers(0, 128, (prompt_len + r - 1, 4, 2), dtype=np.uint8)
        if share:
            own[:prompt_len] = head
        rows.append(own)
    return rows


def test_a_group_stores_the_prompt_rows_once_when_its_samples_share_them():
    rows = _group()
    g = GroupRoutes.pack(rows, 5)
    assert g.values.dtype == np.uint8 and g.prompt == 5 and g.shared.all()
    assert len(g.values) == 5 + sum(len(r) - 5 for r in rows)  # prompt once, then each sample's own rows
    assert all(np.array_equal(g.sample(i), r) for i, r in enumerate(rows))
    other = _group(share=False)  # each sample computed its prompt (no prefix cache): each keeps its own rows
    g2 = GroupRoutes.pack([*other[:2], None], 5)
    assert not g2.shared[1] and np.array_equal(g2.sample(1), other[1]) and len(g2.sample(2)) == 0


def test_route_refs_share_like_the_batch_and_fetch_without_ray_when_inline():
    rows = _group()
    prompts = [[1] * 5] * 3
    responses = [[2] * 3, [3], [4] * 4]
    refs = RouteRefs.from_rows(rows)  # arrays of in-process engines, wrapped
    batch = PolicyBatch(prompts, responses, routed_experts=refs)
    share = batch.share([2, 0])
    assert isinstance(share.routed_experts, RouteRefs) and len(share.routed_experts) == 3
    got = share.routed_experts.fetch()
    assert isinstance(got, Ragged) and np.array_equal(got[2], rows[2]) and np.array_equal(got[0], rows[0])
    with pytest.raises(KeyError, match="not in this share"):
        got[1]
    with pytest.raises(ValueError, match=r"routed_experts\[1\] has 8 positions for 5"):
        PolicyBatch(prompts, responses, routed_experts=RouteRefs.from_rows([rows[0], rows[2], rows[2]]))


def test_a_checkpoint_without_ray_writes_and_reads_the_routes_file_in_process(tmp_path):
    rows = _group(seed=3)
    g = GroupRoutes.pack(rows, 5)
    state = {"groups": [{"routed_experts": [RouteRef(g, i, len(r)) for i, r in enumerate(rows)]}]}
    plain = write_routes(state, tmp_path)
    assert plain["groups"][0]["routed_experts"][2]["group"] == "g0" and (tmp_path / "routes.npz").exists()
    back = read_routes(plain, tmp_path)  # Ray not initialised here: the arrays themselves
    assert all(np.array_equal(a, r) for a, r in zip(back["groups"][0]["routed_experts"], rows))


def test_routes_put_by_an_engine_actor_reach_a_share_and_survive_a_checkpoint_as_refs(ray_session, tmp_path):
    import ray

    class Engine:  # defined here: Ray's workers cannot import this test module, the class travels by value
        """A Ray actor that puts routes as ``VLLMEngine.generate`` does (``route_refs.by_reference``)."""

        def put(self, groups, prompt_lens):
            from da3po_megatron.rollout.route_refs import by_reference

            return by_reference(groups, prompt_lens)

        def put_big(self, rows):
            from da3po_megatron.rollout.route_refs import by_reference

            return by_reference([[np.zeros((rows, 48, 8), np.uint8)]], [1])

    engine = ray.remote(num_cpus=0)(Engine).remote()
    groups = [_group(seed=1), _group(seed=2, share=False)]
    got = ray.get(engine.put.remote(groups, [5, 5]))
    flat = [r for g in got for r in g]
    assert all(isinstance(r, RouteRef) and not isinstance(r.ref, np.ndarray | GroupRoutes) for r in flat)
    assert got[0][0].ref == got[0][2].ref != got[1][0].ref  # one object per group
    want = [r for g in groups for r in g]
    fetched = RouteRefs(flat).fetch()
    assert all(np.array_equal(fetched[i], w) for i, w in enumerate(want))
    # the checkpoint: refs -> placeholders + routes.npz written by a Ray actor -> refs with the same bytes
    state = {"buffer": {"groups": [{"routed_experts": flat[:3]}, {"routed_experts": flat[3:]}]}, "step": 4}
    plain = write_routes(state, tmp_path)
    torch.save(plain, tmp_path / "trainer_state.pt")
    assert (tmp_path / "routes.npz").exists()
    assert plain["buffer"]["groups"][0]["routed_experts"][1] == {"routes_file": "routes.npz", "group": "g0",
                                                                 "sample": 1, "rows": len(want[1])}
    back = read_routes(torch.load(tmp_path / "trainer_state.pt", weights_only=True), tmp_path)
    refs = [r for g in back["buffer"]["groups"] for r in g["routed_experts"]]
    assert all(isinstance(r, RouteRef) for r in refs) and back["step"] == 4
    again = RouteRefs(refs).fetch()
    assert all(np.array_equal(again[i], w) for i, w in enumerate(want))
    # a group dropped (dynamic sampling) takes its refs with it: Ray frees the engine's object
    from da3po_megatron.bench.driver_probe import StorePoll

    dropped = ray.get(engine.put_big.remote(40_000))[0]  # 15 MB of routes, one completion, put by the engine
    held = StorePoll().sample()
    assert held >= 15_000_000
    del dropped
    deadline = time.monotonic() + 30
    while StorePoll().sample() > held - 10_000_000 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert StorePoll().sample() <= held - 10_000_000, (held, StorePoll().sample())
    ray.kill(engine)
