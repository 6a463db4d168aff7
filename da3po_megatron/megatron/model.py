"""Build a megatron-core GPTModel from a Hugging Face ``config.json`` (Qwen3, Qwen2/Qwen2.5, Llama 3).

The architecture facts of each family are read from the HF config, never guessed:

==========  ===========  ============  ===========  ======================================
family      norm         QKV bias      QK-norm      notes
==========  ===========  ============  ===========  ======================================
qwen3       RMSNorm      no            yes          explicit ``head_dim``; tied or untied
qwen2       RMSNorm      yes           no           Qwen2 and Qwen2.5 share the layout
llama       RMSNorm      no            no           Llama 3 (optional ``llama3`` RoPE scaling)
==========  ===========  ============  ===========  ======================================

All use SwiGLU MLPs without biases, RoPE, and grouped-query attention. The layer spec is Transformer-Engine's when
CUDA and Transformer-Engine are present, Megatron's local spec otherwise (the bridge maps both). On GPU the model
runs in bf16 with fp32 master weights kept by Megatron's distributed optimizer; on CPU in float32.

Vocabulary: Megatron splits the output layer's vocabulary across TP ranks, so the vocabulary is padded up to a
multiple of ``tensor_model_parallel_size`` (and of ``make_vocab_size_divisible_by``, 1 by default so that the real
models' vocabularies -- all multiples of 128 -- stay unpadded and logits equal Hugging Face's). Padded rows are zero
and their logits must be ignored: :func:`vocab_sizes` returns both sizes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from da3po_megatron.config import ModelConfig
from da3po_megatron.megatron import cpu_compat

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}


# Dropout is off for RL: log-probs must be deterministic between the pi_old and the pi_theta pass.
ATTENTION_DROPOUT = 0.0
HIDDEN_DROPOUT = 0.0


def load_hf_config(path_or_dict: str | Path | dict[str, Any]) -> dict[str, Any]:
    """The HF config as a dict, from a checkpoint directory, a config.json path or a dict."""
    if isinstance(path_or_dict, dict):
        return dict(path_or_dict)
    p = Path(path_or_dict)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise FileNotFoundError(f"no Hugging Face config at {p}")
    return json.loads(p.read_text())


def model_family(hf: dict[str, Any]) -> str:
    """'qwen3' | 'qwen2' | 'llama' from the config's architectures; a clear error otherwise."""
    archs = hf.get("architectures") or []
    for a in archs:
        if a in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[a]
    raise ValueError(f"unsupported architecture {archs or hf.get('model_type')!r}; supported: "
                     f"{sorted(SUPPORTED_ARCHITECTURES)}")


def rope_theta(hf: dict[str, Any]) -> float:
    """RoPE base: ``rope_theta`` (transformers 4) or ``rope_parameters.rope_theta`` (transformers 5)."""
    params = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise ValueError("HF config has no rope_theta (neither top level nor in rope_parameters)")
    return float(theta)


def _rope_scaling(hf: dict[str, Any]) -> dict[str, Any] | None:
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"unsupported RoPE scaling {kind!r} (supported: none, llama3)")
    return scaling


def head_dim(hf: dict[str, Any]) -> int:
    return int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])


def vocab_sizes(hf: dict[str, Any], tp: int, divisible_by: int = 1) -> tuple[int, int]:
    """(unpadded, padded) vocabulary sizes: padded is a multiple of ``divisible_by * tp``."""
    v = int(hf["vocab_size"])
    m = max(1, divisible_by) * tp
    return v, ((v + m - 1) // m) * m


def use_te(options: ModelConfig) -> bool:
    """Whether to build with the Transformer-Engine layer spec."""
    if options.use_transformer_engine is False or not torch.cuda.is_available():
        if options.use_transformer_engine:
            raise RuntimeError("use_transformer_engine=True but CUDA is not available")
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception as e:  # ImportError, or OSError when libcuda is missing
        if options.use_transformer_engine:
            raise RuntimeError(f"use_transformer_engine=True but transformer_engine does not import: {e}") from e
        return False
    return True


def check_parallel_sizes(hf: dict[str, Any], tp: int, pp: int) -> None:
    """Raise ValueError unless the model splits at TP x PP: attention heads, KV heads (query groups) and the MLP's
    intermediate size divisible by ``tp``, layers divisible by ``pp``. The message names the field and the sizes that
    would work. Pure (no process group): ``da3po convert`` and ``da3po train`` call it
    before writing anything."""
    if tp < 1 or pp < 1:
        raise ValueError(f"tensor_model_parallel_size ({tp}) and pipeline_model_parallel_size ({pp}) must be >= 1")
    heads = int(hf["num_attention_heads"])
    checks = [("num_attention_heads", heads, tp, "tensor_model_parallel_size"),
              ("num_key_value_heads", int(hf.get("num_key_value_heads") or heads), tp, "tensor_model_parallel_size"),
              ("intermediate_size", int(hf.get("intermediate_size") or 0), tp, "tensor_model_parallel_size"),
              ("num_hidden_layers", int(hf["num_hidden_layers"]), pp, "pipeline_model_parallel_size")]
    for field_name, value, size, option in checks:
        if value and value % size:
            ok = [d for d in range(1, value + 1) if value % d == 0]
            if option.startswith("tensor"):  # TP must divide heads, KV heads and the MLP at once
                ok = [d for d in ok if all(v % d == 0 for f, v, _, o in checks if o == option and v)]
            raise ValueError(f"{field_name} ({value}) is not divisible by {option} ({size}); sizes that divide this "
                             f"model: {ok}")


def transformer_config(hf: dict[str, Any], options: ModelConfig, tp: int = 1, pp: int = 1, cp: int = 1):
    """A megatron ``TransformerConfig`` equivalent to the HF config, with parallel sizes and checks."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    family = model_family(hf)
    check_parallel_sizes(hf, tp, pp)
    heads, groups, layers = hf["num_attention_heads"], hf.get("num_key_value_heads", hf["num_attention_heads"]), \
        hf["num_hidden_layers"]
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf.get('hidden_act')!r} (SwiGLU models only)")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[options.params_dtype]
    kw: dict[str, Any] = dict(
        num_layers=layers,
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim(hf),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
        qk_layernorm=family == "qwen3",
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        attention_dropout=ATTENTION_DROPOUT,
        hidden_dropout=HIDDEN_DROPOUT,
        variable_seq_lengths=True,  # micro-batches differ in length (dynamic batching); PP exchanges shapes
        moe_token_dispatcher_type="alltoall",  # 0.16.1 rejects variable_seq_lengths with the default, even dense
        recompute_granularity=options.recompute_granularity,
        recompute_method=options.recompute_method,
        recompute_num_layers=options.recompute_num_layers,
        init_method_std=float(hf.get("initializer_range", 0.02)),
    )
    if cpu_compat.needed():
        kw.update(cpu_compat.cpu_safe_config_overrides())
    return TransformerConfig(**kw)


def layer_spec(config, te: bool):
    """Transformer-Engine spec (fused LayerNorm+Linear) or Megatron's local spec."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if te:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    return get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization=config.normalization)


def build_gpt_model(
    hf_config: str | Path | dict[str, Any],
    options: ModelConfig,
    pre_process: bool | None = None,
    post_process: bool | None = None,
):
    """The GPTModel stage of this rank (parallel state must be initialised: see ``runtime.init_parallel``), built as
    the run config's ``model`` section says (dtype, layer spec, recomputation, vocabulary padding)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    hf = load_hf_config(hf_config)
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    config = transformer_config(hf, options, tp, pp, cp)
    te = use_te(options)
    _, padded_vocab = vocab_sizes(hf, tp, options.make_vocab_size_divisible_by)
    scaling = _rope_scaling(hf)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, te),
        vocab_size=padded_vocab,
        max_sequence_length=int(hf.get("max_position_embeddings", 4096)),
        pre_process=ps.is_pipeline_first_stage() if pre_process is None else pre_process,
        post_process=ps.is_pipeline_last_stage() if post_process is None else post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=int(rope_theta(hf)),
        rope_scaling=scaling is not None,
        rope_scaling_factor=float(scaling["factor"]) if scaling else 8.0,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model
