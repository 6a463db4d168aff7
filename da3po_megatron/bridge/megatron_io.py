"""Moving weights in and out of Megatron, through the mapping of :mod:`da3po_megatron.bridge.mapping`.

* :func:`load_hf_weights` fills *this rank's* ``GPTModel`` stage (its TP slice, its PP layers) straight from the HF
  safetensors files, reading only the slices it holds. Peak memory: the rank's own shard plus one tensor's slice.
* :func:`iter_model` is the collective generator of ``(global_megatron_name, full_tensor)`` for a live model:
  TP shards gathered on the first TP rank of each stage (``dist.gather``, so the full tensor exists on that rank only),
  split or replicated per the mapping table, ``linear_fc1`` re-interleaved to ``[gate; up]``, layer numbers global.
* :func:`iter_checkpoint` streams the full tensors of a Megatron ``dist_checkpointing`` (torch_dist) checkpoint saved at
  *any* TP x PP layout, one layer at a time, without building a model or a process group: it reads the checkpoint's
  PyTorch-DCP metadata and loads per-layer slices of the stacked ``decoder.layers.*`` tensors with a slice planner.
  Peak memory: one layer's tensors (plus the embedding). This is how the Megatron -> HF converter bounds memory.

Both generators feed the one HF export of :mod:`da3po_megatron.bridge.export`.

Megatron's dist checkpoint stores each per-layer parameter as one tensor with a leading layer axis (global layer
numbers), under the Transformer-Engine names for the pre-norms, and ``linear_fc1`` as ``[gate; up]`` -- the same full
layout the mapping uses, so no TP-dependent re-ordering is needed when reading it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from da3po_megatron.bridge import mapping
from da3po_megatron.bridge.hf_config import HFSpec, gpt_arch
from da3po_megatron.bridge.hf_io import SafetensorsReader


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare GPTModel under DDP / Float16Module wrappers."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def global_layer_fn(model: torch.nn.Module) -> Callable[[int], int]:
    """local layer index -> global (0-based) layer number, read from the built layers (``layer_number`` is 1-based)."""
    layers = unwrap(model).decoder.layers
    table = {i: int(layer.layer_number) - 1 for i, layer in enumerate(layers)}
    return table.__getitem__


def _tp() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def padded_vocab_of(model: torch.nn.Module) -> int:
    """The model's (padded) vocabulary size: ``GPTModel.vocab_size``."""
    return int(unwrap(model).vocab_size)


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, hf_dir: str | Path, arch: HFSpec | None = None) -> int:
    """Fill this rank's GPTModel shard from an HF checkpoint directory; returns the number of parameters set.

    ``arch``: the model's architecture (default: from ``hf_dir``'s config.json). Every parameter of the model must
    have a mapping (a clear error names the one that does not); shapes are checked against the architecture and
    against the Megatron parameter, naming the tensor on mismatch.
    """
    bare = unwrap(model)
    arch = gpt_arch(hf_dir if arch is None else arch)  # unsupported architecture -> ValueError before any reading
    reader = SafetensorsReader(hf_dir)
    tp_rank, tp_size = _tp()
    to_global = global_layer_fn(bare)
    padded = padded_vocab_of(bare)
    n = 0
    for local_name, param in bare.named_parameters():
        name = mapping.layer_name(local_name, to_global)
        shard = mapping.hf_to_megatron_shard(name, reader, arch, tp_rank, tp_size, padded)
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(f"Megatron parameter {name!r} (TP rank {tp_rank}/{tp_size}) has shape "
                             f"{tuple(param.shape)} but the HF tensors {mapping.hf_names_for(name, arch)} give "
                             f"{tuple(shard.shape)}")
        param.data.copy_(shard)
        n += 1
    return n


@torch.no_grad()
def iter_model(model: torch.nn.Module, arch: HFSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective generator of ``(global_megatron_name, full_tensor)`` for this rank's pipeline stage (``model``: the
    GPTModel stage, bare or DDP-wrapped), in ``named_parameters()`` order, one gathered tensor at a time.

    Every rank of the stage's TP group must iterate it to the end (the gathers are collective); items are yielded on
    TP rank 0 only (other ranks iterate without items). Tensors keep the parameters' dtype and device; replicated
    ones are views of the live weights. The last stage's copy of tied embeddings is skipped (it has no HF tensor).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    arch = gpt_arch(arch)
    bare = unwrap(model)
    to_global = global_layer_fn(bare)
    tp_rank, tp_size = _tp()
    group = ps.get_tensor_model_parallel_group() if tp_size > 1 else None
    dst = ps.get_tensor_model_parallel_src_rank() if tp_size > 1 else 0
    for local_name, param in bare.named_parameters():
        name = mapping.layer_name(local_name, to_global)
        if not mapping.hf_names_for(name, arch):  # tied output layer: no HF tensor, no gather
            continue
        # split or replicated per the mapping table, not per parameter attributes (TE's fused layers differ there)
        if tp_size == 1 or mapping.resolve(name, arch)[0].tp_dim is None:
            if tp_rank == 0:
                yield name, param.detach()
            continue
        shard = param.detach().contiguous()
        shards = [torch.empty_like(shard) for _ in range(tp_size)] if tp_rank == 0 else None
        dist.gather(shard, shards, dst=dst, group=group)
        if tp_rank == 0:
            full = mapping.full_from_tp_shards(name, shards, arch)
            del shards  # one full tensor alive while the consumer holds the item
            yield name, full


# ----------------------------------------------------------------------------------- reading a dist checkpoint


def _slice_planner(offsets: dict[str, tuple[int, ...]]):
    """A DCP load planner that fills plain tensors with a sub-block (at ``offsets``) of the saved global tensors."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class SlicePlanner(DefaultLoadPlanner):
        def create_local_plan(self):
            items = []
            for key, t in self.state_dict.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets[key]), sizes=t.size())
                items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
            return LoadPlan(items)

        def lookup_tensor(self, index):
            return self.state_dict[index.fqn]

    return SlicePlanner()


class CheckpointReader:
    """Full tensors (or per-layer slices) of a Megatron torch_dist checkpoint directory (``DIR/model``)."""

    def __init__(self, model_dir: str | Path):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.dir = Path(model_dir)
        if not (self.dir / ".metadata").exists():
            raise FileNotFoundError(f"no torch_dist Megatron checkpoint at {self.dir} (.metadata missing)")
        self._reader = dcp.FileSystemReader(str(self.dir))
        md = self._reader.read_metadata().state_dict_metadata
        self.tensors = {k: (tuple(v.size), v.properties.dtype) for k, v in md.items()
                        if isinstance(v, TensorStorageMetadata)}

    def load(self, wanted: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> dict[str, torch.Tensor]:
        """``{key: (offsets, sizes)}`` -> ``{key: tensor}`` in the saved dtype."""
        import torch.distributed.checkpoint as dcp

        out = {k: torch.empty(sizes, dtype=self.tensors[k][1]) for k, (_, sizes) in wanted.items()}
        with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": that is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(out, storage_reader=self._reader, planner=_slice_planner({k: o for k, (o, _) in wanted.items()}),
                     no_dist=True)
        return out

    def num_layers(self) -> int:
        stacked = [s[0] for k, (s, _) in self.tensors.items() if k.startswith("decoder.layers.")]
        return max(stacked) if stacked else 0


def iter_checkpoint(model_dir: str | Path, arch: HFSpec,
                    progress: Callable[[str], None] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(global_megatron_name, full_tensor)`` of every model tensor of a dist checkpoint, layer by layer."""
    arch = gpt_arch(arch)
    ck = CheckpointReader(model_dir)
    layers = arch.num_layers
    top = [k for k in ck.tensors if not k.startswith("decoder.layers.")]
    per_layer = [k for k in ck.tensors if k.startswith("decoder.layers.")]
    for key in per_layer:
        if ck.tensors[key][0][0] != layers:
            raise ValueError(f"checkpoint {model_dir}: {key} has {ck.tensors[key][0][0]} layers, the model "
                             f"{layers}")
    for key in top + per_layer:  # unknown tensors fail here, before any reading
        mapping.resolve(key.replace("decoder.layers.", "decoder.layers.0.", 1) if key in per_layer else key,
                        arch)
    for key in (k for k in top if k.startswith("embedding.")):
        yield key, ck.load({key: ((0,) * len(ck.tensors[key][0]), ck.tensors[key][0])})[key]
    for i in range(layers):
        wanted = {k: ((i,) + (0,) * (len(ck.tensors[k][0]) - 1), (1, *ck.tensors[k][0][1:])) for k in per_layer}
        got = ck.load(wanted)
        for key in per_layer:
            yield f"decoder.layers.{i}.{key[len('decoder.layers.'):]}", got[key][0]
        del got
        if progress:
            progress(f"  layer {i + 1}/{layers}")
    for key in (k for k in top if not k.startswith("embedding.")):
        yield key, ck.load({key: ((0,) * len(ck.tensors[key][0]), ck.tensors[key][0])})[key]
