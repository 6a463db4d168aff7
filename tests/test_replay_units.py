"""Rollout dump and replay without Ray (issue 48; trainer/generation/replay.py): the manifest refuses a replay that does
not match its dump, naming each difference, before anything starts; ``rollout.dump_every`` / ``dump_keep`` bound the
disk; step files are written atomically; the compare metric. The end-to-end dump -> train_only / compare runs are in
tests/test_replay.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from da3po_megatron.algorithms import DynamicSamplingBuffer
from da3po_megatron.config import load_config
from da3po_megatron.data.datasets import Example
from da3po_megatron.rollout.types import Completion
from da3po_megatron.trainer import batch as B
from da3po_megatron.trainer.batch import StepRollout
from da3po_megatron.trainer.generation import replay as R
from da3po_megatron.trainer.generation.sampler import Sampler
from da3po_megatron.trainer.inputs import load_train_data

ROOT = Path(__file__).resolve().parents[1]


def fake_model(path: Path, vocab: str = "abc", hidden: int = 4) -> Path:
    """A model directory with what the identity reads: config.json, tokenizer files, a safetensors file."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": hidden}))
    (path / "tokenizer.json").write_text(json.dumps({"vocab": vocab}))
    save_file({"w": torch.zeros(hidden)}, str(path / "model.safetensors"))
    return path


def config(model: Path, tmp: Path, *overrides: str):
    return load_config(str(ROOT / "examples/tiny_cpu_da3po.yaml"),
                       [f"model.path={model}", f"trainer.run_dir={tmp / 'run'}", "data.synthetic.max_digits=3",
                        "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "rollout.n=4",
                        "rollout.max_response_length=8", "algorithm.overlong.buffer_length=2",
                        "trainer.total_steps=3", *overrides])


def state(cfg) -> dict:
    return load_train_data(cfg).iterator(seed=cfg.trainer.seed, shuffle=cfg.data.shuffle).state_dict()


def write_dump(cfg, root: Path, steps=(1, 2, 3)) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / R.MANIFEST).write_text(json.dumps(R.make_manifest(cfg, state(cfg))))
    for s in steps:
        R.step_file(root, s).write_bytes(b"")


def test_a_matching_dump_passes_and_layout_and_paths_may_differ(tmp_path):
    model = fake_model(tmp_path / "m")
    write_dump(config(model, tmp_path), tmp_path / "dump")
    moved = fake_model(tmp_path / "copy")  # the same model elsewhere (the cluster's path is not this machine's)
    cfg = config(moved, tmp_path, f"rollout.replay_dir={tmp_path / 'dump'}", "parallel.tensor_model_parallel_size=2",
                 "actor.packing=false", "actor.max_tokens_per_microbatch=1024")
    assert R.check_replay(cfg, state(cfg))["format"] == R.FORMAT


def test_a_dump_of_another_model_tokenizer_data_or_config_is_refused_naming_each_difference(tmp_path):
    write_dump(config(fake_model(tmp_path / "m"), tmp_path), tmp_path / "dump")
    other = fake_model(tmp_path / "other", vocab="abd", hidden=8)
    cfg = config(other, tmp_path, f"rollout.replay_dir={tmp_path / 'dump'}", "rollout.n=8", "daa.lambda_=2.5",
                 "data.synthetic.max_digits=4")
    with pytest.raises(R.ReplayManifestError) as e:
        R.check_replay(cfg, state(cfg))
    msg = str(e.value)
    for what in ("model config.json", "model model.safetensors", "tokenizer tokenizer.json", "data fingerprint",
                 "data num_examples", "config rollout.n: 4 in the dump, 8 here", "config daa.lambda_: 2.0 in the dump,"
                 " 2.5 here", "config data.synthetic.max_digits"):
        assert what in msg, what
    # --allow-config-change lets the config differ (a warning each), never the model, tokenizer or data
    with pytest.raises(R.ReplayManifestError) as e:
        R.check_replay(cfg, state(cfg), allow=True)
    assert "model config.json" in str(e.value) and "config rollout.n" not in str(e.value)
    same = config(fake_model(tmp_path / "m"), tmp_path, f"rollout.replay_dir={tmp_path / 'dump'}", "rollout.n=8")
    warnings: list[str] = []
    R.check_replay(same, state(same), allow=True, log=warnings.append)
    assert warnings == ["warning: replay: config rollout.n: 4 in the dump, 8 here: the replayed steps train "
                        "differently from the dumped ones"]


def test_missing_manifest_or_steps_are_refused(tmp_path):
    model = fake_model(tmp_path / "m")
    cfg = config(model, tmp_path, f"rollout.replay_dir={tmp_path / 'dump'}")
    with pytest.raises(R.ReplayManifestError, match="no manifest.json"):
        R.check_replay(cfg, state(cfg))
    write_dump(config(model, tmp_path), tmp_path / "dump", steps=(2, 3))
    with pytest.raises(R.ReplayManifestError, match=r"lacks steps 1 of the 1..3 .*it holds 2-3"):
        R.check_replay(cfg, state(cfg))
    R.check_replay(cfg, state(cfg), first_step=2)  # resuming from the checkpoint of step 1: enough


def test_the_refusal_comes_from_da3po_train_before_ray_starts(warm_model, tmp_path, capsys):
    """The CLI in this process: exit 2 naming the difference, and Ray never initialised here."""
    import ray

    from da3po_megatron.trainer.main import main

    write_dump(config(warm_model, tmp_path), tmp_path / "dump")
    overrides = ["model.path=" + str(warm_model), f"trainer.run_dir={tmp_path / 'run'}", "data.synthetic.max_digits=3",
                 "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "rollout.n=4",
                 "rollout.max_response_length=8", "algorithm.overlong.buffer_length=2", "trainer.total_steps=3",
                 f"rollout.replay_dir={tmp_path / 'dump'}", "daa.tau=0.25"]
    assert main(["--config", str(ROOT / "examples/tiny_cpu_da3po.yaml"), *overrides]) == 2
    err = capsys.readouterr().err
    assert "does not match this run" in err and "config daa.tau: 0.5 in the dump, 0.25 here" in err
    assert not ray.is_initialized()


# ------------------------------------------------------------------------------------------------ dump bound


def group(uid: str, seed: int, tokens: list[list[int]], acc: list[float]) -> B.Group:
    return B.Group(example=Example(uid=uid, prompt=[{"role": "user", "content": "p"}], answer="1", source="s"),
                   prompt_ids=[1, 2],
                   response_ids=tokens, texts=["x"] * len(tokens),
                   rollout_logprobs=[[-0.5] * len(t) for t in tokens], finish_reasons=["stop"] * len(tokens),
                   acc=acc, rewards=acc, advantages=[0.5, -0.5], seed=seed)


def StandInRun(cfg) -> Sampler:
    """The run's sampler with only the state a collection changes (data iterator, buffer, counters): its own
    ``state_dict`` is what the dump stores."""
    s = Sampler.__new__(Sampler)
    s.__dict__.update(cfg=cfg, prompts=load_train_data(cfg).iterator(seed=1),
                      buffer=DynamicSamplingBuffer(4, "carry", 2), totals={"samples": 0})
    return s


def test_dump_every_and_dump_keep_bound_the_disk_and_files_are_whole(tmp_path):
    cfg = config(fake_model(tmp_path / "m"), tmp_path, f"rollout.dump_dir={tmp_path / 'dump'}", "rollout.dump_every=2",
                 "rollout.dump_keep=2")
    run = StandInRun(cfg)
    rep = R.Replay(cfg)
    for step in range(1, 10):
        def live(step=step):
            run.prompts.take(2)
            run.totals["samples"] += 8
            g = group(f"u{step}", 7 * step, [[3, 4], [5]], [1.0, -1.0])
            return StepRollout([g], [g], {"dynamic_sampling/rounds": 1.0}, step - 1)

        rollout = rep.collect(run, step, live)
        rep.record(step, rollout, B.policy_batch(rollout.groups))
    assert sorted(p.name for p in (tmp_path / "dump").iterdir()) == ["step_000006.pt", "step_000008.pt"]
    rec = torch.load(R.step_file(tmp_path / "dump", 8), weights_only=True)
    assert rec["driver"]["totals"]["samples"] == 64 and rec["driver"]["prompts"]["consumed"] == 16
    assert rec["rollout"]["groups"][0]["seed"] == 56 and rec["batch"]["advantages"].tolist() == [0.5, -0.5]


def test_a_failed_write_leaves_neither_a_file_nor_a_temporary(tmp_path):
    def boom(f):
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        R._atomic(tmp_path / "step_000001.pt", boom)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------ compare


def test_token_match_ratio_counts_agreeing_prefixes_and_seed_runs_rebuild_the_rounds():
    rec = [group("a", 100, [[1, 2, 3], [4, 5]], [1.0, -1.0]), group("b", 108, [[6, 7], [8]], [1.0, -1.0])]

    def comp(tokens, lp=-0.5):
        return Completion(prompt_index=0, sample_index=0, prompt_token_ids=[1], token_ids=tokens, text="",
                          logprobs=[lp] * len(tokens), finish_reason="stop", num_tokens=len(tokens))

    same = [[comp([1, 2, 3]), comp([4, 5])], [comp([6, 7]), comp([8])]]
    assert R.compare_completions(rec, same)["replay/token_match_ratio"] == 1.0
    other = [[comp([1, 9, 3]), comp([4, 5, 6])], [comp([6, 7], -0.25), comp([2])]]
    m = R.compare_completions(rec, other)
    assert m["replay/token_match_ratio"] == pytest.approx((1 + 2 + 2 + 0) / (3 + 3 + 2 + 1))
    assert m["replay/logprob_diff_max"] == pytest.approx(0.25)
    # one round of n=4: prompt i seeded 100 + 4 i; a second call starts a new run
    groups = [group(u, s, [[1], [2]], [1.0, -1.0]) for u, s in (("a", 100), ("b", 104), ("c", 108), ("d", 300))]
    assert [(s, [g.example.uid for g in gs]) for s, gs in R.seed_runs(groups, 4)] == [
        (100, ["a", "b", "c"]), (300, ["d"])]
    assert np.isfinite(m["replay/logprob_diff_mean"])


# ----------------------------------------------------------------------------------- the producer (issue 58)


def producer_loop(cfg, task, monkeypatch):
    """The real loop (``trainer/loop.run_steps``), ``RunState``, ``Replay``, ``Sampler`` and (unless replaying)
    ``AsyncRollout`` over the scripted engine mock of test_async_rollout.py, with stand-ins for what needs a model:
    the prompt rendering and the reward (test_async_rollout's scripted task), pi_old (the rollout log-probs: the
    policy's forward is tests/test_replay.py's) and the update, which records a digest of every array it was given
    (``trained``) -- so two runs that train the same batches log the same metrics and digests."""
    import hashlib
    from contextlib import nullcontext
    from types import SimpleNamespace

    from test_async_rollout import G, ScriptedPartialEngineClientMock

    from da3po_megatron.data.datasets import PromptDataset
    from da3po_megatron.trainer import loop
    from da3po_megatron.trainer.resume.run_state import RunState

    data = PromptDataset([Example(f"u{i:03d}", [{"role": "user", "content": f"L{n}:{kind}"}], kind, "s",
                                  {"bucket": n}) for i, (n, kind) in enumerate(task)])
    rewards = SimpleNamespace(score_batch=lambda texts, answers, kind: SimpleNamespace(
        rewards=[1.0 if a == "all" or i % G == 0 else -1.0 for i, a in enumerate(answers)], timeouts=0, errors=0))
    sampler = Sampler(cfg, None, data, rewards)
    sampler.render_prompts = lambda exs: [ex.problem_text for ex in exs]
    sampler.rollout = None if cfg.rollout.replay_dir else ScriptedPartialEngineClientMock(2)
    state = RunState(cfg, None, None, sampler, SimpleNamespace(baseline=None))
    state.should_checkpoint = lambda step: False
    replay = sampler.replay = R.Replay(cfg).start(sampler, None, False)
    rows, trained = [], []

    def train_step(batch):
        d = R.batch_to_dict(batch)
        arrays = [x for name in sorted(d) for x in (
            (d[name]["values"], d[name]["offsets"]) if isinstance(d[name], dict) else (d[name],))]
        trained.append(hashlib.sha256(b"".join(a.numpy().tobytes() for a in arrays)).hexdigest())
        return {"loss": float(np.sum(batch.advantages))}

    def pi_old(run, batch, versions=None, routes=None):
        trained.append(versions.values.tolist() if versions is not None else None)  # per-token versions trained
        return batch, {}

    monkeypatch.setattr(loop, "old_logprobs", pi_old)
    run = SimpleNamespace(cfg=cfg, sampler=sampler, state=state, replay=replay, should_evaluate=lambda s: False,
                          logger=SimpleNamespace(log=lambda step, m: rows.append(m)),
                          profiler=SimpleNamespace(start=lambda s: None, stop=lambda: None),
                          stop=SimpleNamespace(abandonable=nullcontext), policy=SimpleNamespace(train_step=train_step),
                          check_update=lambda s, m: None, sync_weights=lambda: {}, preempted=lambda: False,
                          engines_idle=lambda: None)
    try:
        loop.run_steps(run)
    finally:
        if state.producer is not None:
            state.producer.close()
    return rows, trained


def test_the_producers_batches_are_dumped_and_replay_without_a_producer_to_the_same_updates_mock(tmp_path,
                                                                                                  monkeypatch):
    """rollout.dump_dir under the asynchronous producer (staleness 2, partial rollouts): every step file holds the
    batch the producer gave -- long groups stitched over two versions, per token -- and the driver state its metrics
    read; rollout.replay_dir (train_only) replays it without a producer or engines: the same batches, per-token
    versions and behaviour log-probs reach pi_old and the update, and every metric but the wall-clock ones is equal.
    At b6cc7ac the config refused rollout.dump_dir with the producer."""
    from test_async_rollout import LONG, G

    from da3po_megatron.trainer.observability.metrics import is_wall_clock

    model = fake_model(tmp_path / "m")
    task = ([(2, "mix")] * 2 + [(LONG, "mix")] * 2 + [(3, "all" if i % 5 == 4 else "mix") for i in range(80)])
    base = [f"model.path={model}", "data.format=synthetic", "data.train_batch_size=2", f"rollout.n={G}",
            "actor.ppo_mini_batch_size=1", "rollout.mode=streaming", "rollout.staleness=2",
            "rollout.partial_rollouts=true", "rollout.max_versions_per_response=8", "rollout.max_inflight_prompts=4",
            "algorithm.name=dapo", "algorithm.rollout_correction=tis", "rollout.stream_steps_per_call=1",
            "data.shuffle=false", "trainer.total_steps=5", f"trainer.run_dir={tmp_path / 'run'}"]
    dump = tmp_path / "dump"
    rows, trained = producer_loop(load_config(None, base + [f"rollout.dump_dir={dump}"]), task, monkeypatch)
    assert R.dumped_steps(dump) == [1, 2, 3, 4, 5]
    long = [g for s in range(1, 6) for g in torch.load(R.step_file(dump, s), weights_only=True)["rollout"]["groups"]
            if g["example"]["meta"]["bucket"] == LONG]
    assert len(long) == 2 and all(v.tolist()[0] == 0 and v.tolist()[-1] >= 1 for g in long
                                  for v in g["token_versions"])  # interrupted at the first sync, continued (under
    # the default rollout.release_order=oldest_decided the short groups behind them may train first: later versions)
    for s, row in enumerate(rows, 1):  # the driver state is the one the step's metrics read
        driver = torch.load(R.step_file(dump, s), weights_only=True)["driver"]
        assert driver["totals"]["groups"] == row["gen/cumulative_groups"]
    replayed, again = producer_loop(load_config(None, base + [f"rollout.replay_dir={dump}"]), task, monkeypatch)
    assert again == trained and any(v is not None and len(set(v)) > 1 for v in trained[::2])
    assert [{k: v for k, v in r.items() if not is_wall_clock(k)} for r in replayed] == [
        {k: v for k, v in r.items() if not is_wall_clock(k)} for r in rows]


def test_a_launch_removes_the_dump_steps_after_the_step_it_starts_from(tmp_path, capsys):
    """A SIGKILLed asynchronous launch left steps 3-4 (after its last checkpoint, step 2) and a half-written
    temporary; the resumed launch trains other batches from step 3 on, so they go, named, before it writes."""
    cfg = config(fake_model(tmp_path / "m"), tmp_path, f"rollout.dump_dir={tmp_path / 'dump'}")
    write_dump(cfg, tmp_path / "dump", steps=(1, 2, 3, 4))
    (tmp_path / "dump/.step_000005.pt.123.tmp").write_bytes(b"half")
    run = StandInRun(cfg)
    R.Replay(cfg).start(run, tmp_path / "run/checkpoints/step_000002", False)
    assert sorted(p.name for p in (tmp_path / "dump").iterdir()) == ["manifest.json", "step_000001.pt",
                                                                     "step_000002.pt"]
    assert "dump: removed steps 3-4" in capsys.readouterr().out
