"""`da3po convert` end to end on a tiny random HF model: real megatron-core in 4 spawned gloo processes (TP=2, PP=2),
real dist_checkpointing, real transformers for the logits comparison. One multi-process launch per direction checks
several things (see the test body); the CLI's error paths run without spawning anything.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from da3po_megatron import tiny
from da3po_megatron.bridge import convert


@pytest.fixture(scope="module")
def tied_qwen3(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hf_qwen3_tied")
    tiny.build_model(d, "qwen3", seed=7, tie_word_embeddings=True, num_layers=4)
    return d


def _hf_tensors(d: Path) -> dict[str, torch.Tensor]:
    index = d / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    out = {}
    for f in files:
        out.update(load_file(str(d / f)))
    return out


def test_hf_to_megatron_tp2_pp2_and_back_is_bit_exact_and_loads_at_tp1_with_equal_logits(tied_qwen3, tmp_path,
                                                                                         monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # laid out as a training run's checkpoint, to convert back through its `latest` pointer
    ckpt, back = tmp_path / "run" / "checkpoints" / "step_000000" / "policy", tmp_path / "back"
    # 4 processes: shard-aware load, save, re-read from disk; logits vs transformers across TP2 x PP2 with tied
    # embeddings (the last stage's output-layer copy); the export gather reproduces every HF tensor.
    assert convert.main(["hf-to-megatron", "--hf", str(tied_qwen3), "--out", str(ckpt), "--tp", "2", "--pp", "2",
                         "--verify"]) == 0
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["layout"]["tensor_model_parallel_size"] == 2 and meta["layout"]["pipeline_model_parallel_size"] == 2
    assert meta["verify"]["max_abs_diff"] < 1e-4
    source = _hf_tensors(tied_qwen3)
    assert meta["verify"]["export_checked"] == len(source)
    assert {p.name for p in (ckpt / "hf").iterdir()} >= {"config.json", "tokenizer.json", "generation_config.json"}
    # Megatron -> HF in this process (no model, no process group), in several shards; then --verify loads the
    # TP2 x PP2 checkpoint into a TP=1 model (1 process) and compares its logits with transformers on the output.
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_000000\n")
    assert convert.main(["megatron-to-hf", "--ckpt", str(tmp_path / "run" / "checkpoints" / "latest"), "--out",
                         str(back), "--max-shard-size", "150KB",
                         "--verify", "--verify-tp", "1"]) == 0
    out = capsys.readouterr().out
    print(out)
    roundtrip = _hf_tensors(back)
    assert sorted(roundtrip) == sorted(source) and "lm_head.weight" not in roundtrip
    assert all(torch.equal(roundtrip[k], source[k]) for k in source)
    assert len(list(back.glob("model-*-of-*.safetensors"))) > 1
    assert (back / "tokenizer.json").read_bytes() == (tied_qwen3 / "tokenizer.json").read_bytes()
    assert json.loads((back / "config.json").read_text()) == json.loads((tied_qwen3 / "config.json").read_text())
    diffs = [float(line.split("= ")[1].split()[0]) for line in out.splitlines() if "max |logits_megatron" in line]
    assert len(diffs) == 2 and max(diffs) < 1e-4


def test_existing_output_is_refused_without_force(tied_qwen3, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert convert.main(["hf-to-megatron", "--hf", str(tied_qwen3), "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err and (out / "keep.txt").exists()
    assert convert.main(["megatron-to-hf", "--ckpt", str(tmp_path), "--out", str(out)]) == 2
    assert "not a da3po-megatron checkpoint" in capsys.readouterr().err


def test_output_inside_the_input_is_refused_even_with_force(tied_qwen3, capsys):
    assert convert.main(["hf-to-megatron", "--hf", str(tied_qwen3), "--out", str(tied_qwen3), "--force"]) == 2
    assert "would overwrite the input" in capsys.readouterr().err
    assert (tied_qwen3 / "model.safetensors").exists()


def test_unsupported_architecture_fails_before_spawning_with_its_name(tied_qwen3, tmp_path, capsys):
    src = tmp_path / "mixtral"
    src.mkdir()
    for f in tied_qwen3.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["MixtralForCausalLM"]
    (src / "config.json").write_text(json.dumps(cfg))
    assert convert.main(["hf-to-megatron", "--hf", str(src), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "MixtralForCausalLM" in err and "Qwen3ForCausalLM" in err


def test_parallel_sizes_that_do_not_divide_the_model_fail_before_anything_is_written(tied_qwen3, tmp_path, capsys):
    # tied_qwen3: 4 heads, 2 KV heads, 4 layers -> TP=3 and PP=3 cannot work; nothing may be spawned or written
    for flags, field in ((["--tp", "3"], "num_attention_heads (4)"), (["--pp", "3"], "num_layers (4)")):
        out = tmp_path / f"o{flags[1]}{flags[0]}"
        assert convert.main(["hf-to-megatron", "--hf", str(tied_qwen3), "--out", str(out), *flags]) == 2
        err = capsys.readouterr().err
        assert field in err and "sizes that divide this model" in err and not out.exists()


def test_check_parallel_sizes_names_the_field_and_the_sizes_that_work():
    from da3po_megatron.megatron.arch import GPTArch

    smollm2 = GPTArch(num_layers=30, hidden_size=576, ffn_hidden_size=1536, num_attention_heads=9,
                      num_query_groups=3, kv_channels=64, vocab_size=49152)
    smollm2.check_parallel_sizes(3, 2)
    with pytest.raises(ValueError, match=r"num_attention_heads \(9\) is not divisible by tensor_model_parallel_size "
                                         r"\(2\); sizes that divide this model: \[1, 3\]"):
        smollm2.check_parallel_sizes(2, 1)
    with pytest.raises(ValueError, match=r"num_query_groups \(3\).*\(9\)"):
        smollm2.check_parallel_sizes(9, 1)
    with pytest.raises(ValueError, match=r"num_layers \(30\) is not divisible by pipeline_model_parallel_size"):
        smollm2.check_parallel_sizes(1, 4)


def test_verify_tolerance_scales_with_the_logits_depth_and_dtype():
    t = convert.verify_tolerance(33.5, 30)  # SmolLM2-135M: measured difference 8.0e-5 must pass with margin
    assert 5e-4 < t < 1e-3
    assert convert.verify_tolerance(0.3, 2) == convert.verify_tolerance(1.0, 2)  # floor at |logit| 1
    assert convert.verify_tolerance(20, 4) == pytest.approx(2 * convert.verify_tolerance(10, 4))
    assert convert.verify_tolerance(10, 36) == pytest.approx(3 * convert.verify_tolerance(10, 4))
    assert convert.verify_tolerance(10, 4, torch.bfloat16) / convert.verify_tolerance(10, 4) == pytest.approx(2.0**16)


def test_help_documents_both_directions(capsys):
    with pytest.raises(SystemExit) as e:
        convert.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "hf-to-megatron" in text and "megatron-to-hf" in text
    for direction, flags in (("hf-to-megatron", ("--tp", "--pp", "--force", "--verify")),
                             ("megatron-to-hf", ("--ckpt", "--max-shard-size", "--force", "--verify"))):
        with pytest.raises(SystemExit):
            convert.main([direction, "--help"])
        sub = capsys.readouterr().out
        assert all(f in sub for f in flags)


def test_tools_wrappers_call_the_converter(tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    for tool, direction in (("convert_hf_to_megatron.py", "hf-to-megatron"),
                            ("convert_megatron_to_hf.py", "megatron-to-hf")):
        r = subprocess.run([sys.executable, str(root / "tools" / tool), "--help"], capture_output=True, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
        assert r.returncode == 0 and f"convert {direction}" in r.stdout
