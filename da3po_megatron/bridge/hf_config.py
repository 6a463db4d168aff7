"""The Hugging Face ``config.json`` -> :class:`~da3po_megatron.megatron.arch.GPTArch`: the one place that reads HF
config keys (Qwen3, Qwen3-MoE, Qwen2/Qwen2.5, Llama 3).

The architecture facts of each family are read from the HF config, never guessed:

==========  ===========  ============  ===========  ======================================
family      norm         QKV bias      QK-norm      notes
==========  ===========  ============  ===========  ======================================
qwen3       RMSNorm      no            yes          explicit ``head_dim``; tied or untied
qwen3_moe   RMSNorm      no            yes          Qwen3 attention + routed experts (no shared expert)
qwen2       RMSNorm      yes           no           Qwen2 and Qwen2.5 share the layout
llama       RMSNorm      no            no           Llama 3 (optional ``llama3`` RoPE scaling)
==========  ===========  ============  ===========  ======================================

All use SwiGLU MLPs without biases, RoPE, and grouped-query attention; :func:`gpt_arch` refuses anything else it can
see (another architecture, another activation, another RoPE scaling). The policy (:mod:`da3po_megatron.megatron`) is
built from the :class:`GPTArch` this returns and never reads an HF config itself.

Qwen3-MoE (``Qwen3MoeForCausalLM``, transformers 5 ``models/qwen3_moe``): ``num_experts`` routed experts of width
``moe_intermediate_size``, ``num_experts_per_tok`` per token, ``norm_topk_prob``; layer i is sparse when
``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0`` (``Qwen3MoeDecoderLayer.__init__``), else a dense
MLP of ``intermediate_size``. ``router_aux_loss_coef`` is the pre-training load-balancing loss; RL does not use it
(``docs/moe.md``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from da3po_megatron.megatron.arch import GPTArch

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}

HFSpec = GPTArch | dict[str, Any] | str | Path  # what the bridge's functions accept as "the model"


def load_hf_config(path_or_dict: str | Path | dict[str, Any]) -> dict[str, Any]:
    """The HF config as a dict, from a checkpoint directory, a config.json path or a dict.

    Raises FileNotFoundError (no config.json) or ValueError (not JSON, not an object), naming the file. The trainer
    checks the same file earlier with its own exit-2 message (``trainer.inputs.load_tokenizer``)."""
    if isinstance(path_or_dict, dict):
        return dict(path_or_dict)
    p = Path(path_or_dict)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise FileNotFoundError(f"no Hugging Face config at {p}")
    try:
        hf = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{p}: not valid JSON ({e}); the model directory is damaged") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{p}: not a Hugging Face model config (a JSON {type(hf).__name__}, not an object)")
    return hf


def model_family(hf: dict[str, Any]) -> str:
    """'qwen3' | 'qwen3_moe' | 'qwen2' | 'llama' from the config's architectures; a clear error otherwise."""
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


def rope_scaling_factor(hf: dict[str, Any]) -> float | None:
    """The ``llama3`` RoPE scaling factor (``rope_scaling`` or transformers 5's ``rope_parameters``), None without
    scaling; other scaling types are refused."""
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"unsupported RoPE scaling {kind!r} (supported: none, llama3)")
    return float(scaling["factor"])


def head_dim(hf: dict[str, Any]) -> int:
    """Per-head dimension: ``head_dim`` when given (Qwen3), else ``hidden_size / num_attention_heads``."""
    return int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])


def gpt_arch(spec: HFSpec) -> GPTArch:
    """The :class:`GPTArch` of an HF config (a dict, a checkpoint directory or a config.json path); a ``GPTArch`` is
    returned as it is. Raises ValueError for an unsupported architecture, activation or RoPE scaling, naming it."""
    if isinstance(spec, GPTArch):
        return spec
    hf = load_hf_config(spec)
    family = model_family(hf)
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf.get('hidden_act')!r} (SwiGLU models only)")
    heads = int(hf["num_attention_heads"])
    pad = hf.get("pad_token_id")
    moe: dict[str, Any] = {}
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)  # the Hub's key / transformers 5's
    if family == "qwen3_moe" and experts > 0:
        layers, step = int(hf["num_hidden_layers"]), int(hf.get("decoder_sparse_step") or 1)
        dense = {int(i) for i in hf.get("mlp_only_layers") or []}
        moe = dict(num_moe_experts=experts, moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
                   moe_router_topk=int(hf["num_experts_per_tok"]), moe_norm_topk_prob=bool(hf.get("norm_topk_prob")),
                   moe_layer_pattern=tuple(int(i not in dense and (i + 1) % step == 0) for i in range(layers)))
    return GPTArch(
        num_layers=int(hf["num_hidden_layers"]),
        hidden_size=int(hf["hidden_size"]),
        ffn_hidden_size=int(hf["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        kv_channels=head_dim(hf),
        vocab_size=int(hf["vocab_size"]),
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        add_qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
        qk_layernorm=family in ("qwen3", "qwen3_moe"),
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        rotary_base=int(rope_theta(hf)),
        rope_scaling_factor=rope_scaling_factor(hf),
        max_sequence_length=int(hf.get("max_position_embeddings", 4096)),
        init_method_std=float(hf.get("initializer_range", 0.02)),
        pad_token_id=int(pad) if isinstance(pad, int) else 0,
        **moe,
    )
