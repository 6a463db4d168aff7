"""HF <-> Megatron bridge: everything that knows Hugging Face names, layouts and config keys lives here.

The HF config is read in one place (:mod:`.hf_config`: ``load_hf_config``, the supported families, ``gpt_arch``: the
config as a :class:`da3po_megatron.megatron.arch.GPTArch`, the only description of a model the Megatron side takes).
One parameter mapping (:mod:`.mapping`), one way in (:func:`.megatron_io.load_hf_weights`,
:func:`.export.load_policy_hf`: a rank reads only its TP / PP slices of the HF files) and one way out (:mod:`.export`:
a stream of ``(hf_name, tensor)``, one gathered tensor at a time), used alike by the checkpoint converter
(:mod:`.convert`, ``--verify`` included) and by the in-memory weight sync to vLLM
(:mod:`da3po_megatron.rollout.weight_sync`). See ``docs/conversion.md``.

Dependency direction: bridge -> megatron, one way: the bridge imports :mod:`da3po_megatron.megatron`, never the
reverse. The policy knows a ``GPTArch``, never an HF config or HF names: it holds a Megatron ``GPTModel`` stage, and
whoever needs HF weights in or out of it (the trainer, the converter, the weight sync, tests) calls the bridge on each
policy rank (``PolicyWorker.execute`` / ``PolicyGroup.run_on_all``).

This face names the pure mapping only; the Megatron-side helpers (:mod:`.export`, :mod:`.megatron_io`) import
megatron-core, so their importers name those modules.
"""

from da3po_megatron.bridge.hf_config import gpt_arch, load_hf_config
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
    "full_from_tp_shards",
    "gpt_arch",
    "hf_names_for",
    "hf_to_megatron",
    "hf_to_megatron_shard",
    "load_hf_config",
    "megatron_to_hf",
    "rules",
    "tp_shard_of_full",
]

