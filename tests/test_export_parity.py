"""One HF export: the weight sync's stream of a live policy and ``da3po convert megatron-to-hf`` of the checkpoint it
saves are bit-identical, for Qwen3 (tied and untied), Qwen2 and Llama at TP=2 x PP=2.

Real parts: one torchrun world of 4 gloo ranks (megatron-core on CPU) runs the PolicyWorker on each tiny model (4
layers, so PP stage 1 renumbers its local layers 0-1 to 2-3; vocabulary padded 128 -> 192 over TP), loads the HF
weights through the bridge, takes one train step, iterates the stream ``push_policy_weights`` sends to vLLM and saves a
training checkpoint; the converter's command line then writes the HF directory from that checkpoint in one process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

MODELS = [("qwen3", True), ("qwen3", False), ("qwen2", False), ("llama", False)]


@pytest.fixture(scope="module")
def parity(tmp_path_factory) -> dict:
    from da3po_megatron import tiny

    d = tmp_path_factory.mktemp("parity")
    hfs = [tiny.build_model(d / f"{f}{'_tied' if t else ''}", f, seed=5, num_layers=4, tie_word_embeddings=t)
           for f, t in MODELS]
    out = d / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone",
           str(Path(__file__).with_name("_export_parity.py")), "--tp", "2",
           "--pp", "2", "--out", str(out)] + [a for h in hfs for a in ("--hf", str(h))]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return {"dir": out, "hfs": hfs, "result": json.loads((out / "result.json").read_text())}


def _load_dir(d: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


@pytest.mark.parametrize("index,family,tied", [(i, f, t) for i, (f, t) in enumerate(MODELS)])
def test_weight_sync_stream_and_megatron_to_hf_are_bit_identical(parity, tmp_path, index, family, tied):
    from da3po_megatron.bridge.convert import main as convert

    out, hf = parity["dir"], parity["hfs"][index]
    info = parity["result"][str(hf)]["info"]
    assert (info["tp"], info["pp"], info["padded_vocab_size"]) == (2, 2, 192)
    synced: dict[str, torch.Tensor] = {}
    for stage in (0, 1):  # each stage's sending rank streams its own layers, with global layer numbers
        part = torch.load(out / f"{index}_sync_pp{stage}.pt")
        assert part and not synced.keys() & part.keys()
        synced.update(part)
    assert convert(["megatron-to-hf", "--ckpt", str(out / f"{index}_ckpt"), "--out", str(tmp_path / "hf")]) == 0
    converted = _load_dir(tmp_path / "hf")
    source = _load_dir(hf)
    assert sorted(synced) == sorted(converted) == sorted(source)
    assert ("lm_head.weight" in synced) == (not tied)
    assert "model.layers.3.mlp.down_proj.weight" in synced  # stage 1's local layer 1
    for name in source:
        assert synced[name].dtype == converted[name].dtype == torch.float32, name
        assert torch.equal(synced[name], converted[name]), name
    moved = [n for n in source if not torch.equal(synced[n], source[n])]
    assert len(moved) > len(source) // 2  # the train step changed the weights: the parity is not the HF files'
