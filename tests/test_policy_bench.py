"""da3po_megatron/bench/train_step.py: the FLOPs estimate and a real one-rank run on a tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from da3po_megatron.bench import train_step as bench_train_step


def test_model_flops_is_6NT_plus_causal_attention():
    from da3po_megatron.megatron.arch import GPTArch

    arch = GPTArch(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                   kv_channels=32, vocab_size=128)
    attn = 64 * 32 * (4 + 4) + 4 * 32 * 64
    n = 2 * (attn + 3 * 64 * 128) + 128 * 64
    assert bench_train_step.model_flops(arch, [10, 20]) == 6 * n * 30 + 6 * 2 * 4 * 32 * (100 + 400)


def test_bench_runs_one_train_step_on_a_tiny_model(tmp_path):
    out = tmp_path / "bench.json"
    # without the MASTER_* / RANK variables that in-process torch.distributed tests leave in this process's
    # environment (the bench would try to bind the port that process still holds)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "da3po_megatron.bench.train_step", "--tiny", "--batch", "4",
                           "--prompt-len", "8", "--response-len", "16", "--max-tokens", "48", "--warmup", "0",
                           "--steps", "1", "--json", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["tokens_per_step"] == 4 * 24 and r["num_microbatches"] == 2
    assert r["train_tokens_per_s"] > 0 and r["peak_memory_gib"] > 0 and r["params"] == 115136
    assert "mfu" not in r  # CPU: no MFU
