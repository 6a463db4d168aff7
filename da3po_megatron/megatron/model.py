"""Build a megatron-core GPTModel from a :class:`~da3po_megatron.megatron.arch.GPTArch` (the architecture in
Megatron's terms; the bridge derives it from a Hugging Face config: :func:`da3po_megatron.bridge.hf_config.gpt_arch`).

Every model is a dense GQA transformer with SwiGLU MLPs without biases, RMSNorm and RoPE; the arch says what differs
between families (QKV bias for Qwen2, QK-norm for Qwen3, tied embeddings, RoPE base and Llama-3 scaling,
``kv_channels``).
The layer spec is Transformer-Engine's when CUDA and Transformer-Engine are present, Megatron's local spec otherwise
(the bridge maps both). On GPU the model runs in bf16 with fp32 master weights kept by Megatron's distributed
optimizer; on CPU in float32.

Vocabulary: Megatron splits the output layer's vocabulary across TP ranks, so the vocabulary is padded up to a
multiple of ``tensor_model_parallel_size`` (and of ``make_vocab_size_divisible_by``, 1 by default so that the real
models' vocabularies -- all multiples of 128 -- stay unpadded and logits equal Hugging Face's). Padded rows are zero
and their logits must be ignored: :meth:`GPTArch.vocab_sizes` returns both sizes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from da3po_megatron.config import ModelConfig
from da3po_megatron.megatron import cpu_compat
from da3po_megatron.megatron.arch import GPTArch

# Dropout is off for RL: log-probs must be deterministic between the pi_old and the pi_theta pass.
ATTENTION_DROPOUT = 0.0
HIDDEN_DROPOUT = 0.0


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


def transformer_config(arch: GPTArch, options: ModelConfig, tp: int = 1, pp: int = 1, cp: int = 1):
    """A megatron ``TransformerConfig`` for ``arch``, with parallel sizes (checked:
    :meth:`GPTArch.check_parallel_sizes`) and the run config's ``model`` options (dtype, recomputation)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    arch.check_parallel_sizes(tp, pp)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[options.params_dtype]
    kw: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=arch.layernorm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.add_qkv_bias,
        qk_layernorm=arch.qk_layernorm,
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
        init_method_std=arch.init_method_std,
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
    arch: GPTArch,
    options: ModelConfig,
    pre_process: bool | None = None,
    post_process: bool | None = None,
):
    """The GPTModel stage of this rank (parallel state must be initialised: see ``runtime.init_parallel``), built as
    the run config's ``model`` section says (dtype, layer spec, recomputation, vocabulary padding)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    config = transformer_config(arch, options, tp, pp, cp)
    te = use_te(options)
    _, padded_vocab = arch.vocab_sizes(tp, options.make_vocab_size_divisible_by)
    scaling = arch.rope_scaling_factor
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, te),
        vocab_size=padded_vocab,
        max_sequence_length=arch.max_sequence_length,
        pre_process=ps.is_pipeline_first_stage() if pre_process is None else pre_process,
        post_process=ps.is_pipeline_last_stage() if post_process is None else post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.share_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_base=arch.rotary_base,
        rope_scaling=scaling is not None,
        rope_scaling_factor=float(scaling) if scaling is not None else 8.0,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model
