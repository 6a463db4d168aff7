"""``GPTArch``: the architecture of a dense GPT model in Megatron's own terms -- all the policy knows about a model.

The field names are megatron-core's (``TransformerConfig``: ``num_layers``, ``hidden_size``, ``ffn_hidden_size``,
``num_attention_heads``, ``num_query_groups``, ``kv_channels``, ``layernorm_epsilon``, ``add_qkv_bias``,
``qk_layernorm``, ``init_method_std``; ``GPTModel``: ``vocab_size``, ``max_sequence_length``,
``share_embeddings_and_output_weights``, ``rotary_base``, RoPE scaling), so :func:`.model.transformer_config` and
:func:`.model.build_gpt_model` read it field by field. Every model is SwiGLU, RMSNorm, RoPE, grouped-query attention,
no linear biases (besides the optional QKV bias).

Mixture-of-Experts (Qwen3-MoE): ``num_moe_experts`` experts of width ``moe_ffn_hidden_size`` replace the dense MLP
in the layers ``moe_layer_pattern`` marks 1 (Megatron's ``moe_layer_freq`` as a list: 1 = MoE, 0 = dense MLP of
``ffn_hidden_size``); a softmax router in fp32 picks ``moe_router_topk`` experts per token, their weights renormalised
over the top-k when ``moe_norm_topk_prob``. No shared experts (the Qwen3-MoE family has none).

Where it comes from: the bridge reads a Hugging Face ``config.json`` and returns one
(:func:`da3po_megatron.bridge.hf_config.gpt_arch`); this package never reads an HF config. It is a frozen, picklable
value, so it travels to the Ray policy actors as it is, and JSON-able (:meth:`GPTArch.to_dict` /
:meth:`GPTArch.from_dict`) for checkpoint metadata.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class GPTArch:
    """A dense GQA + SwiGLU GPT in Megatron terms (see the module doc)."""

    num_layers: int  # transformer layers
    hidden_size: int  # model width h
    ffn_hidden_size: int  # SwiGLU intermediate size (per gate / up projection)
    num_attention_heads: int  # query heads a
    num_query_groups: int  # KV heads g (grouped-query attention; g == a is plain multi-head attention)
    kv_channels: int  # per-head dimension d (may differ from h / a, e.g. Qwen3)
    vocab_size: int  # the tokenizer's vocabulary, unpadded (see :meth:`vocab_sizes`)
    layernorm_epsilon: float = 1e-6  # RMSNorm epsilon
    add_qkv_bias: bool = False  # bias on the fused QKV projection (Qwen2)
    qk_layernorm: bool = False  # RMSNorm on queries and keys per head (Qwen3)
    share_embeddings_and_output_weights: bool = False  # tied input embedding and output layer
    rotary_base: int = 10_000  # RoPE theta
    rope_scaling_factor: float | None = None  # Llama-3-style RoPE frequency scaling factor; None = no scaling
    max_sequence_length: int = 4096  # the position range the model was trained for
    init_method_std: float = 0.02  # std of the normal initialisation (the weights are then loaded over it)
    pad_token_id: int = 0  # the token that fills padded positions of a micro-batch (masked out of every result)
    num_moe_experts: int | None = None  # routed experts per MoE layer; None = a dense model
    moe_ffn_hidden_size: int | None = None  # each expert's SwiGLU intermediate size
    moe_router_topk: int = 1  # experts per token
    moe_norm_topk_prob: bool = True  # renormalise the top-k router probabilities (HF ``norm_topk_prob``)
    moe_layer_pattern: tuple[int, ...] | None = None  # per layer 1 = MoE, 0 = dense; None = every layer MoE

    def __post_init__(self) -> None:
        if self.moe_layer_pattern is not None and not isinstance(self.moe_layer_pattern, tuple):
            object.__setattr__(self, "moe_layer_pattern", tuple(int(x) for x in self.moe_layer_pattern))
        if self.num_moe_experts is not None:
            if self.num_moe_experts < 1 or not self.moe_ffn_hidden_size or self.moe_ffn_hidden_size < 1:
                raise ValueError(f"GPTArch: an MoE model needs num_moe_experts >= 1 and moe_ffn_hidden_size >= 1, got "
                                 f"{self.num_moe_experts}, {self.moe_ffn_hidden_size}")
            if not 1 <= self.moe_router_topk <= self.num_moe_experts:
                raise ValueError(f"GPTArch.moe_router_topk ({self.moe_router_topk}) must be in 1.."
                                 f"{self.num_moe_experts} (num_moe_experts)")
            if self.moe_layer_pattern is not None and (len(self.moe_layer_pattern) != self.num_layers or
                                                       set(self.moe_layer_pattern) - {0, 1}):
                raise ValueError(f"GPTArch.moe_layer_pattern must hold num_layers ({self.num_layers}) entries of 0/1, "
                                 f"got {self.moe_layer_pattern}")
        for f in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                  "kv_channels", "vocab_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"GPTArch.{f} must be a positive int, got {v!r}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"GPTArch.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_query_groups ({self.num_query_groups})")

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (checkpoint metadata); :meth:`from_dict` inverts it."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTArch:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown GPTArch fields {unknown}; known: {sorted(known)}")
        return cls(**d)

    # ------------------------------------------------------------------ facts that follow from the shapes
    @property
    def is_moe(self) -> bool:
        """Whether any layer is a Mixture-of-Experts layer."""
        return self.num_moe_experts is not None and any(self.moe_pattern())

    def moe_pattern(self) -> list[int]:
        """Per layer: 1 = MoE, 0 = dense MLP (all 0 for a dense model)."""
        if self.num_moe_experts is None:
            return [0] * self.num_layers
        return list(self.moe_layer_pattern) if self.moe_layer_pattern is not None else [1] * self.num_layers

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global (0-based) layer ``layer`` holds experts."""
        return bool(self.moe_pattern()[layer])

    def vocab_sizes(self, tp: int, divisible_by: int = 1) -> tuple[int, int]:
        """(unpadded, padded) vocabulary sizes: Megatron splits the output layer's rows over TP ranks, so the padded
        size is a multiple of ``divisible_by * tp`` (padded rows are zero; their logits must be ignored)."""
        m = max(1, divisible_by) * tp
        return self.vocab_size, ((self.vocab_size + m - 1) // m) * m

    def check_parallel_sizes(self, tp: int, pp: int, ep: int = 1, etp: int | None = None) -> None:
        """Raise ValueError unless the model splits at TP x PP (x EP x ETP): attention heads, query groups and the
        MLP's ``ffn_hidden_size`` divisible by ``tp``, layers divisible by ``pp``; for MoE ``num_moe_experts``
        divisible by ``ep`` and ``moe_ffn_hidden_size`` by ``etp`` (expert tensor parallelism, default ``tp``). The
        message names the field and the sizes that would work. Pure (no process group): ``da3po convert`` and
        ``da3po train`` call it before writing anything."""
        etp = tp if etp is None else etp
        if ep < 1 or etp < 1:
            raise ValueError(f"expert_model_parallel_size ({ep}) and expert_tensor_parallel_size ({etp}) must be >= 1")
        if (ep > 1 or etp != tp) and not self.is_moe:
            raise ValueError(f"expert_model_parallel_size={ep} / expert_tensor_parallel_size={etp} need an MoE model "
                             "(this one is dense)")
        if self.is_moe:
            for field_name, value, size, option in (("num_moe_experts", self.num_moe_experts, ep,
                                                     "expert_model_parallel_size"),
                                                    ("moe_ffn_hidden_size", self.moe_ffn_hidden_size, etp,
                                                     "expert_tensor_parallel_size")):
                if value % size:
                    ok = [d for d in range(1, value + 1) if value % d == 0]
                    raise ValueError(f"{field_name} ({value}) is not divisible by {option} ({size}); sizes that "
                                     f"divide this model: {ok}")
        if tp < 1 or pp < 1:
            raise ValueError(f"tensor_model_parallel_size ({tp}) and pipeline_model_parallel_size ({pp}) must be >= 1")
        checks = [("num_attention_heads", self.num_attention_heads, tp, "tensor_model_parallel_size"),
                  ("num_query_groups", self.num_query_groups, tp, "tensor_model_parallel_size"),
                  ("ffn_hidden_size", self.ffn_hidden_size, tp, "tensor_model_parallel_size"),
                  ("num_layers", self.num_layers, pp, "pipeline_model_parallel_size")]
        if all(self.moe_pattern()):  # no dense MLP is built: its width need not split
            checks.pop(2)
        for field_name, value, size, option in checks:
            if value % size:
                ok = [d for d in range(1, value + 1) if value % d == 0]
                if option.startswith("tensor"):  # TP must divide heads, query groups and the MLP at once
                    ok = [d for d in ok if all(v % d == 0 for f, v, _, o in checks if o == option)]
                raise ValueError(f"{field_name} ({value}) is not divisible by {option} ({size}); sizes that divide "
                                 f"this model: {ok}")
