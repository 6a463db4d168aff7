"""HF <-> Megatron bridge: one parameter mapping (:mod:`.mapping`) used by the checkpoint converters (:mod:`.convert`)
and by the in-memory weight sync to vLLM. See ``docs/conversion.md``."""

from da3po_megatron.bridge.mapping import (
    full_from_tp_shards,
    hf_names_for,
    hf_to_megatron,
    hf_to_megatron_shard,
    megatron_to_hf,
    rules,
    tp_shard_of_full,
)

__all__ = [
    "export_state_dict",
    "full_from_tp_shards",
    "hf_names_for",
    "hf_to_megatron",
    "hf_to_megatron_shard",
    "iter_checkpoint",
    "load_hf_weights",
    "megatron_to_hf",
    "rules",
    "tp_shard_of_full",
]


def __getattr__(name: str):  # the Megatron-side helpers import megatron-core lazily
    if name in ("export_state_dict", "iter_checkpoint", "load_hf_weights"):
        from da3po_megatron.bridge import megatron_io

        return getattr(megatron_io, name)
    raise AttributeError(name)
