"""The asynchronous producer's checkpoint snapshot with arrays as Ray hands them over (issue 47 follow-up; a run with
staleness 2, partial rollouts and TIS stopped at step 10's checkpoint: "Cannot save multiple tensors or storages that
view the same data as different types"), and ``rollout.dump_dir`` with the producer (issue 48 follow-up: refused;
issue 58: dumped when the step completes, replayed without the producer).

A completion that crossed Ray holds read-only views into its object's one buffer, packed back to back; an empty
array's view has the address of the next array, of another dtype. Measured with ray.put/ray.get of one segment
({"token_ids", "logprobs", "routes"} of 4 samples with 3, 0, 2, 0 tokens): token_ids[3] (int32, empty) at the
address of logprobs[0] (float32), logprobs[3] (empty) at routes[0] (uint8); torch.save of their ``from_numpy``
tensors raised exactly that error. :func:`ray_like_views_standin` packs arrays the same way without Ray."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from da3po_megatron.config import ConfigError, load_config
from da3po_megatron.data.datasets import Example
from da3po_megatron.trainer import batch as B
from da3po_megatron.trainer.batch import StepRollout, rollout_from_dict, rollout_to_dict
from da3po_megatron.trainer.generation.async_partial import Partial, ProducerSnapshot, plain_state


def ray_like_views_standin(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """Stand-in for Ray's deserialisation: the arrays packed back to back (8-byte aligned) into one buffer and handed
    back as read-only views of it, so an empty array's view starts where the next array starts."""
    offsets, end = [], 0
    for a in arrays:
        offsets.append(end)
        end += -(-a.nbytes // 8) * 8
    buf = np.zeros(max(end, 8), np.uint8)
    out = []
    for a, o in zip(arrays, offsets):
        buf[o:o + a.nbytes] = np.frombuffer(a.tobytes(), np.uint8)
        out.append(buf[o:o + a.nbytes].view(a.dtype).reshape(a.shape))
    buf.flags.writeable = False
    for v in out:
        v.flags.writeable = False
    return out


def _segment(lengths: list[int], finished: list[bool], seed: int) -> dict:
    """One interrupted segment of len(lengths) samples, its per-token arrays as views into one buffer."""
    rng = np.random.default_rng(seed)
    toks = [rng.integers(0, 1000, k).astype(np.int32) for k in lengths]
    lps = [-rng.random(k).astype(np.float32) for k in lengths]
    routes = [rng.integers(0, 8, (k + 3, 2, 2)).astype(np.uint8) for k in lengths]
    views = ray_like_views_standin(toks + lps + routes)
    n = len(lengths)
    return {"token_ids": views[:n], "logprobs": views[n:2 * n], "routed_experts": views[2 * n:],
            "finished": finished, "reasons": ["stop" if f else "" for f in finished],
            "texts": [f"t{i}" if f else "" for i, f in enumerate(finished)]}


def _group(uid: str, lengths: list[int], version: int, seed: int) -> B.Group:
    """A scored group whose per-token arrays (token ids, log-probs, versions, routes) are views into one buffer."""
    rng = np.random.default_rng(seed)
    ex = Example(uid, [{"role": "user", "content": "q"}], "1", "s", {"bucket": 3})
    arrs = ([np.array([1, 2, 3], np.int32)] + [rng.integers(0, 1000, k).astype(np.int32) for k in lengths]
            + [-rng.random(k).astype(np.float32) for k in lengths]
            + [np.full(k, version - (i % 2), np.int32) for i, k in enumerate(lengths)]
            + [rng.integers(0, 8, (k + 2, 2, 2)).astype(np.uint8) for k in lengths])
    v = ray_like_views_standin(arrs)
    n = len(lengths)
    return B.Group(ex, v[0], v[1:1 + n], ["x"] * n, v[1 + n:1 + 2 * n], ["stop"] * n, [1.0, -1.0] * (n // 2),
                   [1.0, -1.0] * (n // 2), [0.5, -0.5] * (n // 2), version, routed_experts=v[1 + 3 * n:],
                   token_versions=v[1 + 2 * n:1 + 3 * n], seed=7)


def _snapshot() -> ProducerSnapshot:
    ex = Example("p0", [{"role": "user", "content": "q"}], "1", "s")
    p = Partial(3, ex, start_version=1, n=4)
    p.add_segment(_segment([3, 0, 2, 0], [False, False, True, False], 0), 1)  # empty samples: shared addresses
    p.add_segment(_segment([0, 4, 0, 1], [False, True, False, False], 1), 2)
    q = Partial(4, ex, start_version=2, n=4)  # admitted, never interrupted
    return ProducerSnapshot(next_j=5, release_j=1, first_version=2, partials=[p, q],
                            decided=[(1, _group("d1", [2, 0, 3, 0], 2, 1)), (2, _group("d2", [0, 0, 1, 1], 1, 2))],
                            released=[_group("r0", [1, 0], 1, 3)], counters={"admitted": 5.0})


def _roundtrip(obj):
    f = io.BytesIO()
    torch.save(obj, f)
    f.seek(0)
    return torch.load(f, weights_only=True)


def _same_group(a: B.Group, b: B.Group) -> None:
    assert a.example == b.example and a.weight_step == b.weight_step and a.seed == b.seed
    assert (a.texts, a.finish_reasons, a.acc, a.rewards, a.advantages) == (
        b.texts, b.finish_reasons, b.acc, b.rewards, b.advantages)
    assert np.array_equal(a.prompt_ids, b.prompt_ids)
    for name in ("response_ids", "rollout_logprobs", "token_versions", "routed_experts"):
        for x, y in zip(getattr(a, name), getattr(b, name), strict=True):
            assert np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(x, y), name


def test_a_producer_snapshot_of_ray_views_round_trips_through_torch_save_exactly_standin():
    """Partials with prefixes, per-token versions and routes, decided and released groups, all holding Ray-like
    views (empty ones aliasing the next array of another dtype): torch.save / torch.load(weights_only=True) round-trip
    them exactly (HEAD: RuntimeError "... view the same data as different types"), every saved tensor its own
    storage, no larger than its data (nothing pins or stores the Ray buffer)."""
    snap = _snapshot()
    state = plain_state({"step": 10, "async_rollout": snap})["async_rollout"]
    tensors = [t for t in _leaves(state) if isinstance(t, torch.Tensor)]
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors)
    back = _roundtrip(state)
    assert (back["next_j"], back["release_j"], back["first_version"], back["counters"]) == (5, 1, 2, {"admitted": 5.0})
    for p, d in zip(snap.partials, back["partials"], strict=True):
        r = Partial.from_dict(d)
        assert (r.j, r.example, r.start_version, r.n, r.done, r.reasons, r.texts, r.segments, r.span) == (
            p.j, p.example, p.start_version, p.n, p.done, p.reasons, p.texts, p.segments, p.span)
        for name in ("tokens", "logprobs", "versions"):
            for xs, ys in zip(getattr(p, name), getattr(r, name), strict=True):
                assert [x.dtype for x in xs] == [y.dtype for y in ys] and all(map(np.array_equal, xs, ys)), name
        for x, y in zip(p.routes, r.routes, strict=True):
            assert (x is None and y is None) or (x.dtype == y.dtype and np.array_equal(x, y))
        cont, cont_back = p.continuation([11, 12, None, 14]), r.continuation([11, 12, None, 14])
        assert all(map(np.array_equal, cont["prefix"], cont_back["prefix"])) and cont["seeds"] == cont_back["seeds"]
    for (j, g), (jb, gd) in zip(snap.decided, back["decided"], strict=True):
        assert j == jb
        _same_group(g, B.group_from_dict(gd))
    for g, gd in zip(snap.released, back["released"], strict=True):
        _same_group(g, B.group_from_dict(gd))


def test_a_staleness_1_pending_batch_of_ray_views_round_trips_through_torch_save_standin():
    """The staleness-1 prefetched batch (``run.pending``, ``batch.rollout_to_dict``) holding Ray-like views."""
    r = StepRollout([_group("a", [2, 0], 3, 4)], [_group("a", [2, 0], 3, 4), _group("b", [0, 0], 3, 5)],
                    {"rollout/x": 1.0}, 3)
    back = rollout_from_dict(_roundtrip(rollout_to_dict(r)))
    assert back.weight_step == 3 and back.stats == {"rollout/x": 1.0}
    for a, b in zip(r.groups + r.generated, back.groups + back.generated, strict=True):
        _same_group(a, b)


def _leaves(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _leaves(v)
    elif isinstance(x, list | tuple):
        for v in x:
            yield from _leaves(v)
    else:
        yield x


BASE = ["model.path=x", "data.format=synthetic", "rollout.n=4", "actor.ppo_mini_batch_size=1",
        "data.train_batch_size=2", "rollout.mode=streaming", "algorithm.rollout_correction=tis"]


@pytest.mark.parametrize("over", [["rollout.staleness=2"], ["rollout.staleness=2", "rollout.partial_rollouts=true"],
                                  ["rollout.staleness=1", "rollout.partial_rollouts=true"]])
def test_a_rollout_dump_with_the_asynchronous_producer_loads_and_replays_train_only(tmp_path, over):
    """Issue 48 refused ``rollout.dump_dir`` with the producer (its ``take()`` left no driver state: the first due
    step died in ``Replay.record``); issue 58 dumps it (``Replay.completed``) and replays it without the producer,
    train_only -- compare regenerates rounds, which a streamed producer run has none of (refused naming
    rollout.mode)."""
    from da3po_megatron.trainer.generation.async_rollout import uses_producer

    cfg = load_config(None, BASE + over + [f"rollout.dump_dir={tmp_path / 'dump'}"])
    assert uses_producer(cfg)
    replay = load_config(None, BASE + over + [f"rollout.replay_dir={tmp_path / 'dump'}"])
    assert not uses_producer(replay)  # the recorded batches, no producer
    with pytest.raises(ConfigError, match=r"rollout\.mode .*replay_mode=compare"):
        load_config(None, BASE + over + [f"rollout.replay_dir={tmp_path / 'dump'}", "rollout.replay_mode=compare"])


def test_a_producer_step_is_held_by_record_and_written_with_the_driver_state_when_it_completes(tmp_path):
    """The loop with the producer calls ``Replay.record`` for a step whose ``Replay.collect`` never ran
    (trainer/loop.py: ``producer.take(step)``, then ``run.replay.record``): nothing is written then; the step file
    appears when the step completes (``RunState.step_completed`` -> ``Replay.completed``), with that moment's state."""
    from da3po_megatron.trainer.generation.replay import Replay, step_file

    cfg = load_config(None, BASE + ["rollout.staleness=2", f"rollout.dump_dir={tmp_path / 'dump'}"])
    replay = Replay(cfg)
    replay.record(1, StepRollout([], [], {"rollout/async/queued_groups": 3.0}, 0), None)
    assert not step_file(tmp_path / "dump", 1).exists()
    replay.completed(1, lambda: {"totals": {"groups": 7}})
    rec = torch.load(step_file(tmp_path / "dump", 1), weights_only=True)
    assert rec["driver"] == {"totals": {"groups": 7}}
    assert rec["rollout"]["stats"] == {"rollout/async/queued_groups": 3.0}
    replay.completed(2, lambda: {})  # a step that was not due (or not recorded): nothing
    assert not step_file(tmp_path / "dump", 2).exists()
