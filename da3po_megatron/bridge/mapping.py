"""The HF <-> Megatron parameter mapping, written once: names, QKV / gate-up layouts, TP shards, vocabulary padding.

One declarative table (:func:`rules`) lists, for a model of a supported family (Qwen3, Qwen3-MoE, Qwen2/2.5, Llama 3;
given as its :class:`~da3po_megatron.megatron.arch.GPTArch` or its Hugging Face config), every Megatron ``GPTModel``
parameter with the HF tensors it is made of, how they are combined (``kind``) and how the result is split across
tensor-parallel ranks (``tp_dim``). Every use goes through it:

* import, shard-aware (:func:`hf_to_megatron_shard`): the TP slice of one Megatron parameter built from *slices* of HF
  tensors read lazily (``safe_open(...).get_slice``), so a rank reads only what it holds;
* export, streaming (:func:`megatron_to_hf`): one full (TP-gathered) Megatron tensor -> its HF tensors, used by the
  offline converter and by the in-memory weight sync to vLLM, tensor by tensor;
* TP gather/split of a live parameter (:func:`full_from_tp_shards`, :func:`tp_shard_of_full`).

Layouts (Megatron's, megatron-core 0.16.1):

* ``linear_qkv`` rows are interleaved per query group g = 0..G-1: ``[q_g (H/G x head_dim rows), k_g (head_dim),
  v_g (head_dim)]``; a TP rank holds G/TP whole groups, so the full tensor is the plain concatenation of the TP shards.
  Biases (Qwen2) follow the same rows.
* ``linear_fc1`` fuses SwiGLU's gate and up projections. Each TP rank holds ``[gate_shard; up_shard]``; the *full*
  tensor used here (and in Megatron's dist checkpoints) is ``[gate; up]``, which is not the concatenation of the TP
  shards: :func:`full_from_tp_shards` / :func:`tp_shard_of_full` do the re-ordering.
* ``linear_proj`` / ``linear_fc2`` are row-parallel (split along the input dim 1); everything column-parallel along 0.
* The vocabulary (``embedding.word_embeddings`` / ``output_layer``) is split along rows and padded to
  ``padded_vocab_size`` (a multiple of TP): zero rows on import, stripped on export.
* Norms: the local layer spec has ``input_layernorm`` / ``pre_mlp_layernorm``; Transformer-Engine's spec fuses them
  into ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight`` (Megatron's dist checkpoint always uses the
  TE names). Both names map to the same HF tensors. QK-norm (Qwen3): ``q_layernorm`` / ``k_layernorm``.
* Tied embeddings: HF has no ``lm_head.weight``; a Megatron last pipeline stage without the embedding still owns an
  ``output_layer.weight`` copy, imported from ``model.embed_tokens.weight`` and skipped on export.

* Mixture-of-Experts (Qwen3-MoE; :func:`rules` marks each per-layer rule for dense layers, MoE layers or both):
  the router ``mlp.router.weight`` [E, h] is HF's ``mlp.gate.weight`` (replicated); expert ``e``'s
  ``mlp.experts.local_experts.{e}.linear_fc1`` / ``linear_fc2`` (``SequentialMLP``, the local spec; the TE spec's
  ``TEGroupedMLP`` names them ``mlp.experts.linear_fc1.weight{e}``, an alias) are HF's per-expert
  ``mlp.experts.{e}.{gate,up,down}_proj.weight`` -- the layout of the Hub checkpoints and of transformers 5's
  ``save_pretrained`` (it fuses them only in memory). Expert rules are split over the *expert* tensor-parallel
  ranks (ETP) and carry the global expert number: a live model names its local experts 0..E/EP-1, which
  :func:`expert_name` makes global (``ep_rank * E / EP + local``). An expert is a tensor of its own in every use:
  no [E x ...] tensor of a layer is ever built.

Why an own table and not mbridge: mbridge 0.15.1 is not a dependency of this project, and on CPU it needs five
workarounds (TE forced off, local-spec norm names added by hand, ``rope_theta`` for transformers 5, config overrides,
a ``.cuda()`` remap) -- more code than this table, which has three families of the same dense GQA+SwiGLU shape.
The names and layouts follow Megatron-LM's ``tools/checkpoint`` loaders and verl / slime / mbridge's Qwen bridges.

Deliberately left out: shared experts, expert biases, MLA, multi-token prediction, bias-ful MLPs, non-SwiGLU
activations (the model builder rejects them), virtual pipeline stages (layer numbers are read from the built model,
so they would work, untested).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from da3po_megatron.bridge.hf_config import HFSpec, gpt_arch

# Both layer-spec spellings of the two pre-norms, normalised to the local-spec name used in the table.
_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# An expert's parameter: SequentialMLP (local spec) or TEGroupedMLP (TE spec; ``linear_fc1.weight{e}``)
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
_GROUPED_RE = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


@dataclass(frozen=True)
class Rule:
    """One Megatron parameter and the HF tensors it is made of.

    Attributes:
        megatron: the Megatron name; per-layer rules hold the suffix after ``decoder.layers.{i}.``.
        hf: HF names (``{i}`` = global layer number) in the order ``kind`` combines them.
        kind: ``copy`` (one tensor), ``qkv`` (q, k, v interleaved per query group), ``gate_up`` ([gate; up]),
            ``vocab`` (one tensor, rows padded to the padded vocabulary).
        tp_dim: dimension split across TP ranks (None = replicated on every TP rank).
        per_layer: whether ``megatron`` / ``hf`` are per-layer templates.
        layers: which layers have it: None = every layer, "dense" = dense-MLP layers, "moe" = MoE layers.
        expert: an expert's parameter: ``megatron`` / ``hf`` hold ``{e}`` (the global expert number), split over the
            expert tensor-parallel ranks; :func:`resolve` returns it with ``{e}`` filled in.
    """

    megatron: str
    hf: tuple[str, ...]
    kind: str
    tp_dim: int | None
    per_layer: bool = True
    layers: str | None = None
    expert: bool = False


def rules(arch: HFSpec) -> list[Rule]:
    """The mapping table for this model (which rules exist depends on QKV bias, QK-norm, tying). ``arch``: a
    :class:`GPTArch` or an HF config (dict / directory), as everywhere in this module."""
    d = gpt_arch(arch)
    a, m = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    dense = "dense" if d.is_moe else None
    table = [
        Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", 0, per_layer=False),
        Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", None, per_layer=False),
        # Tied: the last stage's copy of the embedding (exists only when PP > 1); never exported.
        Rule("output_layer.weight", ("model.embed_tokens.weight",) if d.share_embeddings_and_output_weights
             else ("lm_head.weight",), "vocab", 0, per_layer=False),
        Rule("input_layernorm.weight", ("model.layers.{i}.input_layernorm.weight",), "copy", None),
        Rule("self_attention.linear_qkv.weight", (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
             "qkv", 0),
        Rule("self_attention.linear_proj.weight", (a + "o_proj.weight",), "copy", 1),
        Rule("pre_mlp_layernorm.weight", ("model.layers.{i}.post_attention_layernorm.weight",), "copy", None),
        Rule("mlp.linear_fc1.weight", (m + "gate_proj.weight", m + "up_proj.weight"), "gate_up", 0, layers=dense),
        Rule("mlp.linear_fc2.weight", (m + "down_proj.weight",), "copy", 1, layers=dense),
    ]
    if d.is_moe:
        x, e = "mlp.experts.local_experts.{e}.", m + "experts.{e}."
        table += [Rule("mlp.router.weight", (m + "gate.weight",), "copy", None, layers="moe"),
                  Rule(x + "linear_fc1.weight", (e + "gate_proj.weight", e + "up_proj.weight"), "gate_up", 0,
                       layers="moe", expert=True),
                  Rule(x + "linear_fc2.weight", (e + "down_proj.weight",), "copy", 1, layers="moe", expert=True)]
    if d.add_qkv_bias:
        table.append(Rule("self_attention.linear_qkv.bias", (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"),
                          "qkv", 0))
    if d.qk_layernorm:
        table += [Rule("self_attention.q_layernorm.weight", (a + "q_norm.weight",), "copy", None),
                  Rule("self_attention.k_layernorm.weight", (a + "k_norm.weight",), "copy", None)]
    return table


def _rule_index(arch: HFSpec) -> dict[str, Rule]:
    return {r.megatron: r for r in rules(arch)}


def _split_expert(key: str) -> tuple[str, int | None]:
    """A per-layer key -> (its rule key with ``{e}``, the expert number) for expert parameters, else (key, None)."""
    mt = _EXPERT_RE.match(key) or _GROUPED_RE.match(key)
    if mt is None:
        return key, None
    if mt.re is _EXPERT_RE:
        return f"mlp.experts.local_experts.{{e}}.{mt.group(2)}", int(mt.group(1))
    return f"mlp.experts.local_experts.{{e}}.{mt.group(1)}.weight", int(mt.group(2))


def layer_has(rule: Rule, layer: int | None, arch: HFSpec) -> bool:
    """Whether ``rule`` exists at global ``layer`` (dense-MLP rules only in dense layers, MoE rules in MoE layers)."""
    if rule.layers is None or layer is None:
        return True
    return gpt_arch(arch).is_moe_layer(layer) == (rule.layers == "moe")


def experts_of(rule: Rule, arch: HFSpec) -> list[int | None]:
    """The global expert numbers a rule is instantiated for ([None] for a non-expert rule)."""
    return list(range(gpt_arch(arch).num_moe_experts or 0)) if rule.expert else [None]


def with_expert(rule: Rule, expert: int | None) -> Rule:
    """``rule`` with ``{e}`` filled in (the rule itself for a non-expert rule)."""
    if expert is None or not rule.expert:
        return rule
    e = str(expert)
    return Rule(rule.megatron.replace("{e}", e), tuple(h.replace("{e}", e) for h in rule.hf), rule.kind, rule.tp_dim,
                rule.per_layer, rule.layers, rule.expert)


def resolve(name: str, arch: HFSpec) -> tuple[Rule, int | None]:
    """(rule, global layer number or None) for a global Megatron parameter name of either layer spec; an expert's
    rule comes with its (global) expert number filled in (:func:`with_expert`)."""
    d = gpt_arch(arch)
    index = _rule_index(d)
    layer = None
    key, expert = name, None
    mt = _LAYER_RE.match(name)
    if mt:
        layer, key = int(mt.group(1)), _TE_ALIASES.get(mt.group(2), mt.group(2))
        key, expert = _split_expert(key)
        if layer >= d.num_layers:
            raise ValueError(f"Megatron tensor {name!r}: layer {layer} out of range (the model has {d.num_layers} "
                             "layers)")
    rule = index.get(key)
    if rule is None or rule.per_layer != (layer is not None) or not layer_has(rule, layer, d):
        raise ValueError(f"no HF mapping for Megatron tensor {name!r}; known: {sorted(index)}")
    if expert is not None and expert >= (d.num_moe_experts or 0):
        raise ValueError(f"Megatron tensor {name!r}: expert {expert} out of range (the model has "
                         f"{d.num_moe_experts} experts)")
    return with_expert(rule, expert), layer


def hf_names(rule: Rule, layer: int | None) -> list[str]:
    return [h.format(i=layer) for h in rule.hf]


def _ffn(rule: Rule, d) -> int:
    """The SwiGLU width of a gate/up rule: an expert's or the dense MLP's."""
    return d.moe_ffn_hidden_size if rule.expert else d.ffn_hidden_size


def expected_hf_shapes(rule: Rule, arch: HFSpec) -> list[tuple[int, ...]]:
    """The shapes the HF tensors of ``rule`` must have, from the architecture (for clear shape errors)."""
    d = gpt_arch(arch)
    q, kv = d.num_attention_heads * d.kv_channels, d.num_query_groups * d.kv_channels
    weight = rule.megatron.endswith("weight")
    if rule.kind == "vocab":
        return [(d.vocab_size, d.hidden_size)]
    if rule.kind == "qkv":
        return [(q, d.hidden_size), (kv, d.hidden_size), (kv, d.hidden_size)] if weight else [(q,), (kv,), (kv,)]
    if rule.kind == "gate_up":
        return [(_ffn(rule, d), d.hidden_size)] * 2
    if rule.expert:  # linear_fc2 of an expert
        return [(d.hidden_size, d.moe_ffn_hidden_size)]
    if rule.megatron == "mlp.router.weight":
        return [(d.num_moe_experts, d.hidden_size)]
    return [{
        "decoder.final_layernorm.weight": (d.hidden_size,),
        "input_layernorm.weight": (d.hidden_size,),
        "pre_mlp_layernorm.weight": (d.hidden_size,),
        "self_attention.linear_proj.weight": (d.hidden_size, q),
        "mlp.linear_fc2.weight": (d.hidden_size, d.ffn_hidden_size),
        "self_attention.q_layernorm.weight": (d.kv_channels,),
        "self_attention.k_layernorm.weight": (d.kv_channels,),
    }[rule.megatron]]


def full_megatron_shape(rule: Rule, arch: HFSpec, padded_vocab: int | None = None) -> tuple[int, ...]:
    """Shape of the full (TP-gathered) Megatron tensor of ``rule``."""
    d = gpt_arch(arch)
    shapes = expected_hf_shapes(rule, d)
    if rule.kind == "vocab":
        return (padded_vocab or d.vocab_size, d.hidden_size)
    if rule.kind in ("qkv", "gate_up"):
        return (sum(s[0] for s in shapes), *shapes[0][1:])
    return shapes[0]


# --------------------------------------------------------------------------------------------------- import


class Reader:
    """Where HF tensors come from: ``shape(name)`` and ``read(name, dim, start, stop)`` (a slice along ``dim``;
    ``dim=None`` = the whole tensor). :class:`da3po_megatron.bridge.hf_io.SafetensorsReader` reads lazily from files;
    :class:`DictReader` serves an in-memory state dict."""

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        raise NotImplementedError

    def where(self, name: str) -> str:
        return "the HF state dict"


class DictReader(Reader):
    """A :class:`Reader` over an in-memory ``{hf_name: tensor}``."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def _get(self, name: str) -> torch.Tensor:
        if name not in self.state:
            raise KeyError(f"HF tensor {name!r} not found in {self.where(name)}")
        return self.state[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._get(name).shape)

    def read(self, name, dim=None, start=0, stop=None):
        t = self._get(name)
        return t if dim is None else t.narrow(dim, start, (t.shape[dim] if stop is None else stop) - start)


def _check_hf_shapes(rule: Rule, names: list[str], reader: Reader, arch: HFSpec) -> None:
    for name, want in zip(names, expected_hf_shapes(rule, arch)):
        got = reader.shape(name)
        if tuple(got) != tuple(want):
            raise ValueError(f"HF tensor {name!r} in {reader.where(name)} has shape {tuple(got)}, expected "
                             f"{tuple(want)} from the config (hidden_size / heads / head_dim / vocab_size)")


def hf_to_megatron_shard(name: str, reader: Reader, arch: HFSpec, tp_rank: int = 0, tp_size: int = 1,
                         padded_vocab: int | None = None) -> torch.Tensor:
    """The TP-rank-``tp_rank`` shard of Megatron parameter ``name`` (global layer number), reading only the HF rows /
    columns that shard needs. ``padded_vocab`` defaults to the unpadded vocabulary."""
    d = gpt_arch(arch)
    rule, layer = resolve(name, d)
    names = hf_names(rule, layer)
    _check_hf_shapes(rule, names, reader, d)
    hd = d.kv_channels
    if rule.kind == "vocab":
        padded = padded_vocab or d.vocab_size
        if padded < d.vocab_size or padded % tp_size:
            raise ValueError(f"{name}: padded vocabulary {padded} must be >= vocab_size {d.vocab_size} and a "
                             f"multiple of TP={tp_size}")
        rows = padded // tp_size
        lo, hi = tp_rank * rows, (tp_rank + 1) * rows
        real = reader.read(names[0], 0, min(lo, d.vocab_size), min(hi, d.vocab_size))
        if real.shape[0] == rows:
            return real
        pad = torch.zeros(rows - real.shape[0], d.hidden_size, dtype=real.dtype)
        return torch.cat([real, pad], 0)
    if rule.kind == "qkv":
        if d.num_query_groups % tp_size or d.num_attention_heads % d.num_query_groups:
            raise ValueError(f"{name}: {d.num_query_groups} query groups / {d.num_attention_heads} heads cannot be "
                             f"split over TP={tp_size}")
        g = d.num_query_groups // tp_size
        nq = d.num_attention_heads // d.num_query_groups * hd
        q = reader.read(names[0], 0, tp_rank * g * nq, (tp_rank + 1) * g * nq)
        k = reader.read(names[1], 0, tp_rank * g * hd, (tp_rank + 1) * g * hd)
        v = reader.read(names[2], 0, tp_rank * g * hd, (tp_rank + 1) * g * hd)
        rest = tuple(q.shape[1:])
        out = torch.cat([q.reshape(g, nq, *rest), k.reshape(g, hd, *rest), v.reshape(g, hd, *rest)], 1)
        return out.reshape(g * (nq + 2 * hd), *rest)
    if rule.kind == "gate_up":
        width = _ffn(rule, d)
        if width % tp_size:
            raise ValueError(f"{name}: {'moe_' if rule.expert else ''}ffn_hidden_size {width} is not divisible by "
                             f"{'expert ' if rule.expert else ''}TP={tp_size}")
        f = width // tp_size
        return torch.cat([reader.read(n, 0, tp_rank * f, (tp_rank + 1) * f) for n in names], 0)
    if rule.tp_dim is None:
        return reader.read(names[0])
    size = reader.shape(names[0])[rule.tp_dim]
    if size % tp_size:
        raise ValueError(f"{name}: dim {rule.tp_dim} of {names[0]} ({size}) is not divisible by TP={tp_size}")
    part = size // tp_size
    return reader.read(names[0], rule.tp_dim, tp_rank * part, (tp_rank + 1) * part)


def hf_to_megatron(name: str, hf_state: dict[str, torch.Tensor] | Reader, arch: HFSpec,
                   padded_vocab: int | None = None) -> torch.Tensor:
    """The full (unsharded) Megatron tensor ``name`` from HF tensors."""
    reader = hf_state if isinstance(hf_state, Reader) else DictReader(hf_state)
    return hf_to_megatron_shard(name, reader, arch, 0, 1, padded_vocab)


# --------------------------------------------------------------------------------------------------- export


def megatron_to_hf(name: str, tensor: torch.Tensor, arch: HFSpec) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of one full (TP-gathered, global layer number) Megatron tensor; ``[]`` for the last stage's
    copy of tied embeddings. Vocabulary padding is stripped. Returned tensors are views of ``tensor`` where possible
    (callers that keep them beyond ``tensor``'s lifetime should ``clone()``)."""
    d = gpt_arch(arch)
    rule, layer = resolve(name, d)
    names = hf_names(rule, layer)
    want = full_megatron_shape(rule, d, tensor.shape[0] if rule.kind == "vocab" else None)
    if tuple(tensor.shape) != tuple(want):
        raise ValueError(f"Megatron tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(want)} for "
                         f"the model (a TP shard instead of the full tensor?)")
    if rule.kind == "vocab":
        if name == "output_layer.weight" and d.share_embeddings_and_output_weights:
            return []
        if tensor.shape[0] < d.vocab_size:
            raise ValueError(f"Megatron tensor {name!r} has {tensor.shape[0]} rows < vocab_size {d.vocab_size}")
        return [(names[0], tensor[: d.vocab_size])]
    if rule.kind == "qkv":
        hd, groups = d.kv_channels, d.num_query_groups
        nq = d.num_attention_heads // groups * hd
        rest = tuple(tensor.shape[1:])
        q, k, v = tensor.reshape(groups, nq + 2 * hd, *rest).split([nq, hd, hd], 1)
        return [(names[0], q.reshape(d.num_attention_heads * hd, *rest)),
                (names[1], k.reshape(groups * hd, *rest)),
                (names[2], v.reshape(groups * hd, *rest))]
    if rule.kind == "gate_up":
        gate, up = tensor.chunk(2, 0)
        return [(names[0], gate), (names[1], up)]
    return [(names[0], tensor)]


def hf_names_for(name: str, arch: HFSpec) -> list[str]:
    """The HF names Megatron tensor ``name`` maps to (no tensor needed)."""
    d = gpt_arch(arch)
    rule, layer = resolve(name, d)
    if rule.megatron == "output_layer.weight" and d.share_embeddings_and_output_weights:
        return []
    return hf_names(rule, layer)


# --------------------------------------------------------------------------------------------------- TP layout


def full_from_tp_shards(name: str, shards: list[torch.Tensor], arch: HFSpec) -> torch.Tensor:
    """Join the TP shards (rank order) of Megatron parameter ``name`` into the full tensor of this module's layout."""
    rule, _ = resolve(name, arch)
    if rule.tp_dim is None or len(shards) == 1:
        return shards[0]
    if rule.kind == "gate_up":
        halves = [s.chunk(2, 0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    return torch.cat(shards, rule.tp_dim)


def tp_shard_of_full(name: str, full: torch.Tensor, arch: HFSpec, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The inverse of :func:`full_from_tp_shards` for one rank."""
    rule, _ = resolve(name, arch)
    if rule.tp_dim is None:
        return full
    if rule.kind == "gate_up":
        gate, up = full.chunk(2, 0)
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], 0)
    return full.chunk(tp_size, rule.tp_dim)[tp_rank]


def layer_name(name: str, global_layer: Callable[[int], int], expert_offset: int = 0) -> str:
    """Rename ``decoder.layers.{local}.x`` to its global layer number (``global_layer(local)``) and a local
    expert's number to its global one (``expert_offset + local``: ``ep_rank * num_local_experts``)."""
    mt = _LAYER_RE.match(name)
    if not mt:
        return name
    rest = mt.group(2)
    if expert_offset:
        ex = _EXPERT_RE.match(rest)
        gx = _GROUPED_RE.match(rest) if ex is None else None
        if ex is not None:
            rest = f"mlp.experts.local_experts.{expert_offset + int(ex.group(1))}.{ex.group(2)}"
        elif gx is not None:
            rest = f"mlp.experts.{gx.group(1)}.weight{expert_offset + int(gx.group(2))}"
    return f"decoder.layers.{global_layer(int(mt.group(1)))}.{rest}"


def is_expert(name: str) -> bool:
    """Whether a (local or global) Megatron parameter name is an expert's (split over EP x ETP, not TP)."""
    mt = _LAYER_RE.match(name)
    return bool(mt and (_EXPERT_RE.match(mt.group(2)) or _GROUPED_RE.match(mt.group(2))))


def hf_state_names(arch: HFSpec) -> list[str]:
    """Every HF tensor name the model's checkpoint holds under the mapping (the tied ``lm_head`` left out)."""
    d = gpt_arch(arch)
    out: list[str] = []
    for rule in rules(d):
        if rule.megatron == "output_layer.weight" and d.share_embeddings_and_output_weights:
            continue
        for layer in range(d.num_layers) if rule.per_layer else [None]:
            if layer_has(rule, layer, d):
                for e in experts_of(rule, d):
                    out += hf_names(with_expert(rule, e), layer)
    return out
