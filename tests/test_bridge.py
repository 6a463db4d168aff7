"""The HF <-> Megatron mapping (da3po_megatron.bridge) on tiny random HF models of each family, real megatron-core
(CPU, gloo, one process) and real transformers: layouts, TP shards, vocabulary padding, logits equality, clear errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from da3po_megatron import tiny
from da3po_megatron.bridge import mapping
from da3po_megatron.bridge.hf_config import gpt_arch, load_hf_config, rope_theta
from da3po_megatron.bridge.hf_io import SafetensorsReader, ShardedSafetensorsWriter

FAMILIES = [("qwen3", False), ("qwen3", True), ("qwen2", False), ("llama", False)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[tuple[str, bool], Path]:
    out = {}
    for family, tied in FAMILIES:
        d = tmp_path_factory.mktemp(f"{family}{'_tied' if tied else ''}")
        tiny.build_model(d, family, seed=3, tie_word_embeddings=tied)
        out[(family, tied)] = d
    return out


def _megatron_names(hf: dict) -> list[str]:
    names = []
    for r in mapping.rules(hf):
        if r.megatron == "output_layer.weight" and hf.get("tie_word_embeddings"):
            continue
        names += [f"decoder.layers.{i}.{r.megatron}" for i in range(hf["num_hidden_layers"])] if r.per_layer \
            else [r.megatron]
    return names


# ----------------------------------------------------------------------------------------- HF config -> GPTArch


@pytest.mark.parametrize("family,tied", FAMILIES)
def test_gpt_arch_reads_each_family_from_its_hf_config_and_survives_json(models, family, tied):
    from da3po_megatron.megatron.arch import GPTArch

    hf = load_hf_config(models[(family, tied)])
    a = gpt_arch(models[(family, tied)])
    assert a == gpt_arch(hf) == gpt_arch(a)
    assert (a.add_qkv_bias, a.qk_layernorm, a.share_embeddings_and_output_weights) == \
        (family == "qwen2", family == "qwen3", tied)
    assert (a.num_layers, a.hidden_size, a.ffn_hidden_size, a.vocab_size, a.kv_channels) == \
        (hf["num_hidden_layers"], hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"], 32)
    assert a.num_query_groups == hf["num_key_value_heads"] and a.rotary_base == int(rope_theta(hf))
    assert GPTArch.from_dict(json.loads(json.dumps(a.to_dict()))) == a  # what travels into checkpoint metadata
    with pytest.raises(ValueError, match="unknown GPTArch fields"):
        GPTArch.from_dict({**a.to_dict(), "num_hidden_layers": 2})


def test_the_hf_config_reader_names_the_file_and_the_unsupported_feature(models, tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=rf"{tmp_path}/config.json: not valid JSON"):
        gpt_arch(tmp_path)
    hf = load_hf_config(models[("llama", False)])
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        gpt_arch({**hf, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="RoPE scaling 'yarn'"):
        gpt_arch({**hf, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert gpt_arch({**hf, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}).rope_scaling_factor == 8.0


def test_the_megatron_package_never_imports_the_bridge_nor_reads_hf_config_keys():
    """The dependency runs one way (bridge -> megatron): the policy knows a GPTArch, never an HF config."""
    import ast

    root = Path(__file__).resolve().parents[1] / "da3po_megatron" / "megatron"
    hf_keys = {"num_hidden_layers", "num_key_value_heads", "intermediate_size", "rms_norm_eps", "tie_word_embeddings",
               "rope_theta", "rope_scaling", "architectures", "attention_bias", "initializer_range", "head_dim",
               "max_position_embeddings", "hidden_act", "pad_token_id"}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                assert not any(n.startswith("da3po_megatron.bridge") for n in names), f"{path.name} imports {names}"
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert node.value not in hf_keys, f"{path.name} reads the HF config key {node.value!r}"


# ----------------------------------------------------------------------------------------- pure mapping


def _qkv_hf(heads=8, groups=2, hd=4, hidden=3):
    q = torch.arange(heads * hd * hidden, dtype=torch.float32).reshape(heads * hd, hidden)
    k = 1000 + torch.arange(groups * hd * hidden, dtype=torch.float32).reshape(groups * hd, hidden)
    v = 2000 + torch.arange(groups * hd * hidden, dtype=torch.float32).reshape(groups * hd, hidden)
    cfg = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": hidden, "intermediate_size": 6,
           "num_attention_heads": heads, "num_key_value_heads": groups, "head_dim": hd, "vocab_size": 10,
           "num_hidden_layers": 1, "rope_theta": 1e6}
    a = "model.layers.0.self_attn."
    return cfg, {a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v}


def test_qkv_rows_are_interleaved_per_query_group_and_tp_shards_hold_whole_groups():
    cfg, state = _qkv_hf()
    q, k, v = state.values()
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    full = mapping.hf_to_megatron(name, state, cfg)
    # group g: 4 query heads of head_dim 4 (16 rows), then k_g (4 rows), then v_g (4 rows)
    expected = torch.cat([q[:16], k[:4], v[:4], q[16:], k[4:], v[4:]])
    assert torch.equal(full, expected)
    shards = [mapping.hf_to_megatron_shard(name, mapping.DictReader(state), cfg, r, 2) for r in range(2)]
    assert torch.equal(shards[0], expected[:24]) and torch.equal(torch.cat(shards), full)
    assert torch.equal(mapping.full_from_tp_shards(name, shards, cfg), full)
    back = dict(mapping.megatron_to_hf(name, full, cfg))
    assert all(torch.equal(back[n], state[n]) for n in state)


def test_gate_up_fused_with_each_tp_rank_holding_its_gate_and_up_slices():
    cfg, _ = _qkv_hf()
    gate = torch.arange(18, dtype=torch.float32).reshape(6, 3)
    up = 100 + gate
    state = {"model.layers.0.mlp.gate_proj.weight": gate, "model.layers.0.mlp.up_proj.weight": up}
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    full = mapping.hf_to_megatron(name, state, cfg)
    assert torch.equal(full, torch.cat([gate, up]))
    for tp in (2, 3):
        shards = [mapping.hf_to_megatron_shard(name, mapping.DictReader(state), cfg, r, tp) for r in range(tp)]
        rows = 6 // tp
        assert torch.equal(shards[1], torch.cat([gate[rows:2 * rows], up[rows:2 * rows]]))
        assert all(torch.equal(s, mapping.tp_shard_of_full(name, full, cfg, r, tp)) for r, s in enumerate(shards))
        assert torch.equal(mapping.full_from_tp_shards(name, shards, cfg), full)
    assert [n for n, _ in mapping.megatron_to_hf(name, full, cfg)] == list(state)


def test_vocab_padding_adds_zero_rows_on_import_and_is_stripped_on_export():
    cfg, _ = _qkv_hf()
    emb = torch.randn(10, 3)
    state = {"model.embed_tokens.weight": emb}
    shards = [mapping.hf_to_megatron_shard("embedding.word_embeddings.weight", mapping.DictReader(state), cfg, r, 4,
                                           padded_vocab=12) for r in range(4)]
    full = torch.cat(shards)
    assert full.shape == (12, 3) and torch.equal(full[:10], emb) and not full[10:].any()
    assert shards[3].shape == (3, 3)
    (hf_name, back), = mapping.megatron_to_hf("embedding.word_embeddings.weight", full, cfg)
    assert hf_name == "model.embed_tokens.weight" and torch.equal(back, emb)


def test_transformer_engine_and_local_spec_norm_names_map_to_the_same_hf_tensors():
    cfg, _ = _qkv_hf()
    assert mapping.hf_names_for("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", cfg) == \
        mapping.hf_names_for("decoder.layers.0.input_layernorm.weight", cfg) == \
        ["model.layers.0.input_layernorm.weight"]
    assert mapping.hf_names_for("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", cfg) == \
        mapping.hf_names_for("decoder.layers.0.pre_mlp_layernorm.weight", cfg) == \
        ["model.layers.0.post_attention_layernorm.weight"]


@pytest.mark.parametrize("family,tied", FAMILIES)
def test_every_hf_tensor_round_trips_bit_exactly_through_full_megatron_tensors(models, family, tied):
    d = models[(family, tied)]
    hf = load_hf_config(d)
    state = load_file(str(d / "model.safetensors"))
    back = {}
    for name in _megatron_names(hf):
        back.update(mapping.megatron_to_hf(name, mapping.hf_to_megatron(name, state, hf, padded_vocab=130), hf))
    assert sorted(back) == sorted(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert ("lm_head.weight" in state) == (not tied)


@pytest.mark.parametrize("family,tied", FAMILIES)
def test_the_export_stream_of_full_megatron_tensors_is_the_hf_state(models, family, tied):
    from da3po_megatron.bridge.export import to_hf

    d = models[(family, tied)]
    hf = load_hf_config(d)
    state = load_file(str(d / "model.safetensors"))
    megatron = ((n, mapping.hf_to_megatron(n, state, hf, padded_vocab=130)) for n in _megatron_names(hf))
    streamed = list(to_hf(megatron, d))  # the stage every export (sync, convert, --verify) goes through
    assert len(streamed) == len(state) and all(torch.equal(t, state[k]) for k, t in streamed)
    with pytest.raises(ValueError, match=r"'decoder\.layers\.0\.mlp\.router\.weight' \(1,\) to HF"):
        list(to_hf([("decoder.layers.0.mlp.router.weight", torch.zeros(1))], hf))


def test_unsupported_architecture_is_named_in_the_error():
    cfg, state = _qkv_hf()
    cfg["architectures"] = ["MixtralForCausalLM"]
    with pytest.raises(ValueError, match="MixtralForCausalLM"):
        mapping.hf_to_megatron("decoder.layers.0.self_attention.linear_qkv.weight", state, cfg)


def test_unknown_megatron_tensor_and_wrong_full_shape_are_named_in_the_error():
    cfg, state = _qkv_hf()
    with pytest.raises(ValueError, match="decoder.layers.0.mlp.router.weight"):
        mapping.megatron_to_hf("decoder.layers.0.mlp.router.weight", torch.zeros(1), cfg)
    with pytest.raises(ValueError, match=r"linear_qkv\.weight.*\(24, 3\)"):  # a TP shard passed as the full tensor
        mapping.megatron_to_hf("decoder.layers.0.self_attention.linear_qkv.weight", torch.zeros(24, 3), cfg)


def test_mismatched_hf_shape_is_named_in_the_error(models, tmp_path):
    from da3po_megatron.bridge.convert import check_hf_checkpoint

    src = models[("qwen2", False)]
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    state = load_file(str(src / "model.safetensors"))
    state["model.layers.1.self_attn.k_proj.bias"] = torch.zeros(7)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias.*\(7,\).*\(64,\)"):
        check_hf_checkpoint(tmp_path)
    cfg = load_hf_config(tmp_path)
    with pytest.raises(ValueError, match="k_proj.bias"):
        mapping.hf_to_megatron_shard("decoder.layers.1.self_attention.linear_qkv.bias", SafetensorsReader(tmp_path),
                                     cfg)


def test_sharded_writer_splits_files_writes_an_index_and_transformers_loads_it(models, tmp_path):
    from transformers import AutoModelForCausalLM

    src = models[("llama", False)]
    state = load_file(str(src / "model.safetensors"))
    writer = ShardedSafetensorsWriter(tmp_path, "100KB", progress=lambda _: None)
    for k, v in state.items():
        writer.add(k, v)
    files = writer.close()
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state) and set(index["weight_map"].values()) == set(files)
    for f in ("config.json",):
        (tmp_path / f).write_bytes((src / f).read_bytes())
    a = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    b = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    tokens = torch.randint(0, 100, (1, 9))
    with torch.no_grad():
        assert torch.equal(a(tokens).logits, b(tokens).logits)


# ----------------------------------------------------------------------------------------- real megatron-core


@pytest.fixture(scope="module")
def megatron_world():
    """A one-process gloo world with TP = PP = 1 (real megatron-core parallel state)."""
    from megatron.core import parallel_state as ps

    from da3po_megatron.megatron.runtime import ParallelLayout, destroy_parallel, init_parallel

    fresh = not ps.model_parallel_is_initialized()
    init_parallel(ParallelLayout(1, 1), rank=0, world_size=1)
    yield
    if fresh:
        destroy_parallel()


@pytest.mark.parametrize("family,tied", FAMILIES)
def test_megatron_logits_equal_transformers_logits_and_export_reproduces_hf(models, megatron_world, family, tied):
    from transformers import AutoModelForCausalLM

    from da3po_megatron.bridge.export import export_model
    from da3po_megatron.bridge.megatron_io import load_hf_weights
    from da3po_megatron.config import ModelConfig
    from da3po_megatron.megatron.model import build_gpt_model

    d = models[(family, tied)]
    hf = load_hf_config(d)
    # make_vocab_size_divisible_by=3 pads 128 -> 129 rows: padding must not change the real logits
    model = build_gpt_model(gpt_arch(d), ModelConfig(params_dtype="float32", make_vocab_size_divisible_by=3)).eval()
    assert load_hf_weights(model, d) == sum(1 for _ in model.parameters())
    assert model.vocab_size == 129 and not model.embedding.word_embeddings.weight[128:].any()
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tokens = torch.randint(0, hf["vocab_size"], (3, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens, torch.arange(21).expand(3, -1), None)[..., : hf["vocab_size"]]
        theirs = ref(tokens).logits
    diff = (ours - theirs).abs().max().item()
    print(f"{family} tied={tied}: max |megatron - transformers| logits = {diff:.2e} (max |logit| "
          f"{theirs.abs().max().item():.2f})")
    assert diff < 1e-4
    exported = dict(export_model(model, hf))
    state = load_file(str(d / "model.safetensors"))
    assert sorted(exported) == sorted(state) and all(torch.equal(exported[k], state[k]) for k in state)


def test_loading_into_a_model_of_another_config_names_the_tensor(models, megatron_world):
    from da3po_megatron.bridge.megatron_io import load_hf_weights
    from da3po_megatron.config import ModelConfig
    from da3po_megatron.megatron.model import build_gpt_model

    hf = load_hf_config(models[("qwen3", False)])
    # the HF files hold intermediate_size 128
    model = build_gpt_model(gpt_arch({**hf, "intermediate_size": 96}), ModelConfig(params_dtype="float32"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight.*\(128, 64\).*\(96, 64\)"):
        load_hf_weights(model, models[("qwen3", False)], {**hf, "intermediate_size": 96})
