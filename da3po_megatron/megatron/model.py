"""Build a megatron-core GPTModel from a :class:`~da3po_megatron.megatron.arch.GPTArch` (the architecture in
Megatron's terms; the bridge derives it from a Hugging Face config: :func:`da3po_megatron.bridge.hf_config.gpt_arch`).

Every model is a dense GQA transformer with SwiGLU MLPs without biases, RMSNorm and RoPE; the arch says what differs
between families (QKV bias for Qwen2, QK-norm for Qwen3, tied embeddings, RoPE base and Llama-3 scaling,
``kv_channels``).
The layer spec is Transformer-Engine's when CUDA and Transformer-Engine are present, Megatron's local spec otherwise
(the bridge maps both). On GPU the model runs in bf16 with fp32 master weights kept by Megatron's distributed
optimizer; on CPU in float32.

Mixture-of-Experts (Qwen3-MoE, ``arch.is_moe``): megatron-core's ``MoELayer`` in the layers the arch marks
(``moe_layer_freq`` as a list; the others keep the dense MLP), built by ``get_gpt_decoder_block_spec``
(megatron-core 0.16.1 ``models/gpt/gpt_layer_specs.py`` 517-650). Router: softmax in fp32 (``moe_router_dtype``)
over ``moe_router_topk`` experts; HF's ``norm_topk_prob=True`` (softmax over all, top-k, renormalise) equals
Megatron's top-k-then-softmax (``moe_router_pre_softmax=False``, ``moe_utils.py`` 709-715), ``False`` is
``pre_softmax=True``. Dropless (no capacity factor), no load-balancing loss unless ``model.moe_aux_loss_coeff`` > 0
(RL keeps the router as it is: docs/moe.md). Experts: ``SequentialMLP`` (one MLP per local expert) on the local spec,
``TEGroupedMLP`` (grouped GEMM) on the Transformer-Engine spec. Token dispatcher: ``alltoall`` on every backend --
it runs on gloo (``all_to_all_single`` with uneven splits) as on NCCL. ``expert_model_parallel_size`` (EP) splits the
experts over ranks carved out of the data-parallel ranks; ``expert_tensor_parallel_size`` (ETP, default TP) splits
each expert's MLP. Routing replay (``moe_enable_routing_replay``): one ``RouterReplay`` per MoE layer
(``transformer/moe/router_replay.py``), driven by :mod:`da3po_megatron.megatron.moe`.

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


# Why Transformer-Engine was hidden from megatron-core in this process (:func:`import_megatron_core`), or None.
_TE_HIDDEN: str | None = None


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def te_import_error() -> str | None:
    """None when Transformer-Engine is usable by megatron-core's TE layer spec, else which import failed and why.

    The same imports megatron-core 0.16.1 makes before it sets ``HAVE_TE`` (``models/gpt/gpt_layer_specs.py``
    42-50: ``transformer_engine``, ``extensions.transformer_engine``'s ``TEFusedMLP`` / ``TENorm``, and
    ``extensions.transformer_engine_spec_provider.TESpecProvider``; ``extensions/transformer_engine.py`` 61-77 itself
    needs ``transformer_engine.pytorch.fp8``), then megatron's own verdicts. ``import transformer_engine`` alone
    proves nothing: TE's top-level ``__init__`` swallows an ImportError of its ``pytorch`` submodule (TransformerEngine
    v2.11 ``transformer_engine/__init__.py`` 13-16), e.g. an extension built for another torch.
    """
    if _TE_HIDDEN is not None:
        return _TE_HIDDEN
    import importlib
    import warnings

    steps = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.fp8",
             "megatron.core.extensions.transformer_engine", "megatron.core.extensions.transformer_engine_spec_provider",
             "megatron.core.models.gpt.gpt_layer_specs")
    for name in steps:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception as e:  # ImportError, OSError (libcuda missing), RuntimeError from a broken extension
            return f"`import {name}` failed: {_first_line(e)}"
        if name.startswith("megatron.") and getattr(module, "HAVE_TE", True) is False:
            return f"megatron-core's {name}.HAVE_TE is False (one of its Transformer-Engine imports failed)"
    return None


def import_megatron_core(require_te: bool = False) -> None:
    """``import megatron.core`` -- without Transformer-Engine when TE is installed but its PyTorch part cannot load.

    megatron-core 0.16.1 decides "TE or not" by ``import transformer_engine`` in many places, and some then import
    ``transformer_engine.pytorch...`` unguarded (``fp8_utils.py`` 24-48) or guarded by ``except ModuleNotFoundError``
    only (``tensor_parallel/random.py`` 25-32). TE's top-level import succeeds even when its PyTorch part fails
    (``transformer_engine/__init__.py`` 13-16), so a broken TE -- an extension built for another torch (``undefined
    symbol``), a missing ``transformer_engine_torch`` -- makes ``import megatron.core`` itself fail deep inside TE.
    Here the PyTorch part is imported first; when it fails, TE is hidden from this process (``sys.modules`` entry
    None: every ``import transformer_engine`` then raises ModuleNotFoundError, which all of megatron's guards catch)
    and one line says which import failed and why: megatron-core then runs exactly as without TE (Megatron's local
    layer spec, torch's Adam). ``require_te`` (``model.use_transformer_engine=True``) raises instead. Call it before
    anything imports megatron-core in the process (the policy ranks do, first thing).
    """
    global _TE_HIDDEN
    import importlib.util
    import logging
    import sys

    if "megatron.core" not in sys.modules and sys.modules.get("transformer_engine", False) is not None:
        try:
            installed = importlib.util.find_spec("transformer_engine") is not None
        except (ImportError, ValueError):
            installed = False
        if installed:
            try:
                import warnings

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    import transformer_engine.pytorch  # noqa: F401
            except Exception as e:  # ImportError, OSError (no libcuda), FileNotFoundError (no extension library)
                reason = f"`import transformer_engine.pytorch` failed: {_first_line(e)}"
                if require_te:
                    raise RuntimeError(f"model.use_transformer_engine=True but Transformer-Engine is not usable: "
                                       f"{reason}") from e
                for name in [m for m in sys.modules if m == "transformer_engine" or
                             m.startswith("transformer_engine.")]:
                    del sys.modules[name]
                sys.modules["transformer_engine"] = None  # type: ignore[assignment]
                _TE_HIDDEN = reason
                logging.getLogger(__name__).warning(
                    "Transformer-Engine not usable (%s): megatron-core runs without it -- Megatron's local layer spec, "
                    "torch's Adam (reinstall TE for torch %s: scripts/install.sh gpu)", reason, torch.__version__)
    import megatron.core  # noqa: F401


def use_te(options: ModelConfig) -> bool:
    """Whether to build with the Transformer-Engine layer spec: CUDA present and TE usable (:func:`te_import_error`).

    ``model.use_transformer_engine``: None (default) = when usable, else Megatron's local spec with one log line
    naming the failed import; True = required (error otherwise); False = never.
    """
    if options.use_transformer_engine is False or not torch.cuda.is_available():
        if options.use_transformer_engine:
            raise RuntimeError("model.use_transformer_engine=True but CUDA is not available")
        return False
    err = te_import_error()
    if err is None:
        return True
    if options.use_transformer_engine:
        raise RuntimeError(f"model.use_transformer_engine=True but Transformer-Engine is not usable: {err}")
    if err != _TE_HIDDEN:  # (when hidden, import_megatron_core has said so)
        import logging

        logging.getLogger(__name__).warning("Transformer-Engine not usable (%s): building with Megatron's local spec",
                                            err)
    return False


def routes_wanted(moe: Any) -> bool:
    """Whether an MoE policy handles routes (replays them, or records its own for the agreement metric): the run
    config's ``moe.routing_replay != none`` or ``moe.router_agreement`` (None, e.g. conversion: no)."""
    return moe is not None and (getattr(moe, "routing_replay", "none") != "none"
                                or bool(getattr(moe, "router_agreement", False)))


def moe_config_kwargs(arch: GPTArch, moe: Any = None, ep: int = 1, etp: int | None = None,
                      te: bool = False) -> dict[str, Any]:
    """The ``TransformerConfig`` MoE fields of ``arch`` ({} for a dense model; see the module doc). ``moe``: the run
    config's ``moe`` section (``routing_replay``, ``aux_loss_coeff``; None = defaults: no replay, no aux loss)."""
    if not arch.is_moe:
        return {}
    aux = float(getattr(moe, "aux_loss_coeff", 0.0) or 0.0)
    return dict(
        num_moe_experts=arch.num_moe_experts,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_router_topk=arch.moe_router_topk,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not arch.moe_norm_topk_prob,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if aux > 0 else "none",
        moe_aux_loss_coeff=aux,
        moe_layer_freq=arch.moe_pattern(),
        moe_grouped_gemm=te,
        moe_token_dispatcher_type="alltoall",
        moe_permute_fusion=False,
        moe_router_fusion=False,
        moe_enable_routing_replay=routes_wanted(moe),
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )


def transformer_config(arch: GPTArch, options: ModelConfig, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                       etp: int | None = None, te: bool = False, moe: Any = None, sequence_parallel: bool = False):
    """A megatron ``TransformerConfig`` for ``arch``, with parallel sizes (checked:
    :meth:`GPTArch.check_parallel_sizes`) and the run config's ``model`` options (dtype, recomputation); MoE fields
    from :func:`moe_config_kwargs` (``te``: grouped GEMM experts). ``sequence_parallel``: the run config's resolved
    ``parallel.sequence_parallel`` (megatron-core's ``ModelParallelConfig.sequence_parallel``; only with TP > 1)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    arch.check_parallel_sizes(tp, pp, ep, etp)
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
        sequence_parallel=bool(sequence_parallel) and tp > 1,
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
    kw.update(moe_config_kwargs(arch, moe, ep, etp if etp is not None else tp, te))
    if cpu_compat.needed():
        kw.update(cpu_compat.cpu_safe_config_overrides())
    return TransformerConfig(**kw)


def layer_spec(config, te: bool):
    """Transformer-Engine spec (fused LayerNorm+Linear) or Megatron's local spec; for MoE the whole decoder block's
    spec (MoE and dense layers per ``config.moe_layer_freq``, this rank's pipeline stage)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if config.num_moe_experts:  # MoE layers save the same norm keys on both specs (checkpoint_keys.py)
        from da3po_megatron.megatron.checkpoint_keys import unify_moe_norm_keys

        return unify_moe_norm_keys(get_gpt_decoder_block_spec(config, use_transformer_engine=te,
                                                              normalization=config.normalization))
    if te:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    return get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization=config.normalization)


def build_gpt_model(
    arch: GPTArch,
    options: ModelConfig,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    moe: Any = None,
    sequence_parallel: bool = False,
):
    """The GPTModel stage of this rank (parallel state must be initialised: see ``runtime.init_parallel``), built as
    the run config's ``model`` section says (dtype, layer spec, recomputation, vocabulary padding), with sequence
    parallelism when ``sequence_parallel`` (``parallel.sequence_parallel``) and TP > 1: on the local spec its torch
    norm goes through :func:`cpu_compat.allow_sequence_parallel_torch_norm`."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    etp = ps.get_expert_tensor_parallel_world_size()
    te = use_te(options)
    config = transformer_config(arch, options, tp, pp, cp, ep, etp, te, moe, sequence_parallel)
    if config.sequence_parallel and not te:
        cpu_compat.allow_sequence_parallel_torch_norm()
    if arch.is_moe:
        from da3po_megatron.megatron.moe import patch_megatron_moe

        patch_megatron_moe()
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
