"""One set of checkpoint keys for MoE layers on both layer specs, and the load that accepts either (issue 46 M2).

megatron-core 0.16.1 ``models/gpt/gpt_layer_specs.py``:

- Transformer-Engine spec (``get_gpt_layer_with_transformer_engine_spec``, 271-303): ``input_layernorm`` is fused
  into ``linear_qkv`` (``TELayerNormColumnParallelLinear``: key ``self_attention.linear_qkv.layer_norm_weight``) in
  every layer; ``pre_mlp_layernorm`` is ``IdentityOp`` in a dense layer, whose ``linear_fc1`` fuses it (key
  ``mlp.linear_fc1.layer_norm_weight``), but in a MoE layer it is a ``TENorm`` of its own (265, 291: key
  ``pre_mlp_layernorm.weight``); its ``sharded_state_dict_keys_map`` names only the op-fuser modules (294-301).
- Megatron's local spec (``get_gpt_layer_local_spec``, 393-421): both norms are modules of their own in every layer
  and its ``sharded_state_dict_keys_map`` (417-420) renames them to TE's fused names -- ``input_layernorm.`` ->
  ``self_attention.linear_qkv.layer_norm_`` (right in every layer) and ``pre_mlp_layernorm.`` ->
  ``mlp.linear_fc1.layer_norm_``, right for a dense layer but not for a MoE layer (TE keeps ``pre_mlp_layernorm``
  there; a MoE layer's ``mlp`` has no ``linear_fc1`` on either spec).

So a MoE checkpoint saved with one spec did not load with the other (``load_model``: "lacks model tensors").
:func:`unify_moe_norm_keys` drops that one entry from the local spec's MoE layers (``model.layer_spec`` applies it),
so both specs now save ``pre_mlp_layernorm.weight`` for MoE layers; the experts already agree
(``TEGroupedMLP.sharded_state_dict`` is "interchangeable with SequentialMLP's", ``transformer/moe/experts.py``
768-805). :func:`accept_norm_aliases` is the load side: a checkpoint written before the change (local spec, MoE
norm under ``mlp.linear_fc1.layer_norm_weight``) still loads, the model's key renamed to the checkpoint's where only
the alias is there. Both are pure functions of specs / key sets (tests/test_moe_checkpoint.py).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

log = logging.getLogger(__name__)

PRE_MLP = "pre_mlp_layernorm."
FUSED_FC1 = "mlp.linear_fc1.layer_norm_"
# a MoE layer's pre-MLP norm: TE's (and now both specs') key suffix and the local spec's former one
NORM_ALIASES = (("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
                ("pre_mlp_layernorm.bias", "mlp.linear_fc1.layer_norm_bias"))


def is_moe_layer_spec(spec: Any) -> bool:
    """Whether a ``TransformerLayer`` ModuleSpec's MLP is megatron-core's ``MoELayer``."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    mlp = getattr(getattr(spec, "submodules", None), "mlp", None)
    return getattr(mlp, "module", None) is MoELayer


def unify_moe_norm_keys(block_spec: Any) -> Any:
    """``block_spec`` (a ``TransformerBlockSubmodules``) with the local spec's ``pre_mlp_layernorm.`` ->
    ``mlp.linear_fc1.layer_norm_`` key mapping removed from its MoE layers (new ModuleSpecs; dense layers and
    Transformer-Engine's specs, which have no such entry, are unchanged)."""
    layers = []
    for spec in block_spec.layer_specs:
        sub = spec.submodules
        keys = dict(getattr(sub, "sharded_state_dict_keys_map", None) or {})
        if is_moe_layer_spec(spec) and keys.get(PRE_MLP) == FUSED_FC1:
            del keys[PRE_MLP]
            spec = replace(spec, submodules=replace(sub, sharded_state_dict_keys_map=keys))
        layers.append(spec)
    return replace(block_spec, layer_specs=layers)


def _sharded_items(state: Any):
    """Every ShardedTensor / ShardedObject / factory in a (nested) sharded state dict."""
    if isinstance(state, dict):
        for v in state.values():
            yield from _sharded_items(v)
    elif isinstance(state, list | tuple):
        for v in state:
            yield from _sharded_items(v)
    elif hasattr(state, "key") and hasattr(state, "replica_id"):
        yield state


def accept_norm_aliases(sharded_state: Any, saved_keys: set[str]) -> list[tuple[str, str]]:
    """Rename (in place) each model key of ``sharded_state`` that the checkpoint (``saved_keys``, its ShardedTensor
    keys) lacks to its pre-MLP-norm alias when the checkpoint has that (module doc); returns (model key, checkpoint
    key) of each rename."""
    renamed = []
    for item in _sharded_items(sharded_state):
        if item.key in saved_keys:
            continue
        for a, b in NORM_ALIASES:
            for mine, theirs in ((a, b), (b, a)):
                if item.key.endswith("." + mine):
                    alias = item.key[: -len(mine)] + theirs
                    if alias in saved_keys:
                        renamed.append((item.key, alias))
                        item.key = alias
                        break
            else:
                continue
            break
    return renamed


def saved_tensor_keys(directory: str) -> set[str]:
    """The ShardedTensor keys of a ``dist_checkpointing`` checkpoint (its metadata only: no tensor is read)."""
    from megatron.core.dist_checkpointing.serialization import load_tensors_metadata

    return set(load_tensors_metadata(directory).keys())


def layer_spec_name(model: Any) -> str:
    """"transformer_engine" when any module of ``model`` comes from megatron-core's TE extension, else "local"."""
    for m in model.modules():
        if type(m).__module__.startswith("megatron.core.extensions.transformer_engine"):
            return "transformer_engine"
    return "local"
