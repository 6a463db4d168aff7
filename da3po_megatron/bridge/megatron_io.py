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

Mixture-of-Experts: a rank holds ``E / EP`` experts (global numbers ``ep_rank * E / EP + local``, made global by
:func:`~da3po_megatron.bridge.mapping.layer_name`), each split over the expert tensor-parallel group (ETP). On import
a rank reads only its experts' ETP slices; the live export gathers an expert over its ETP group only and yields it on
the ETP-rank-0 rank of each EP rank that owns it (:func:`iter_model` ``owner_only``) -- one expert at a time, never
a layer's [E x ...] tensor, never all experts on one rank. The dist checkpoint stores experts as one tensor per
parameter with [layer, expert] leading axes (``SequentialMLP.sharded_state_dict``, megatron-core 0.16.1
``transformer/moe/experts.py`` 935-976); :func:`iter_checkpoint` reads them one (layer, expert) block at a time.

Both generators feed the one HF export of :mod:`da3po_megatron.bridge.export`.

Megatron's dist checkpoint stores each per-layer parameter as one tensor with a leading layer axis (global layer
numbers), under the Transformer-Engine names for the pre-norms, and ``linear_fc1`` as ``[gate; up]`` -- the same full
layout the mapping uses, so no TP-dependent re-ordering is needed when reading it.
"""

from __future__ import annotations

import re
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


def _experts(arch) -> tuple[int, int, int, int, int]:
    """(expert offset of this rank, ETP rank, ETP size, EP rank, expert-data-parallel rank) -- zeros/ones for a dense
    model or without parallel state."""
    from megatron.core import parallel_state as ps

    if not arch.is_moe or not ps.model_parallel_is_initialized():
        return 0, 0, 1, 0, 0
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    return (ep_rank * (arch.num_moe_experts // ep), ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_tensor_parallel_world_size(), ep_rank, ps.get_expert_data_parallel_rank())


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
    offset, etp_rank, etp_size, _, _ = _experts(arch)
    to_global = global_layer_fn(bare)
    padded = padded_vocab_of(bare)
    n = 0
    for local_name, param in bare.named_parameters():
        name = mapping.layer_name(local_name, to_global, offset)
        r, s = (etp_rank, etp_size) if mapping.is_expert(name) else (tp_rank, tp_size)
        shard = mapping.hf_to_megatron_shard(name, reader, arch, r, s, padded)
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(f"Megatron parameter {name!r} (TP rank {r}/{s}) has shape "
                             f"{tuple(param.shape)} but the HF tensors {mapping.hf_names_for(name, arch)} give "
                             f"{tuple(shard.shape)}")
        param.data.copy_(shard)
        n += 1
    return n


def expert_sender(arch: HFSpec) -> bool:
    """Whether this rank yields its experts in :func:`iter_model` (ETP rank 0 of expert-data-parallel replica 0: one
    rank per EP rank and stage); True for a dense model."""
    offset, etp_rank, _, _, edp_rank = _experts(gpt_arch(arch))
    return etp_rank == 0 and edp_rank == 0


@torch.no_grad()
def iter_model(model: torch.nn.Module, arch: HFSpec, owner_only: bool = False,
               experts_last: bool = False, everywhere: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective generator of ``(global_megatron_name, full_tensor)`` for this rank's pipeline stage (``model``: the
    GPTModel stage, bare or DDP-wrapped), in ``named_parameters()`` order, one gathered tensor at a time.

    Every rank of the stage's TP group must iterate it to the end (the gathers are collective); items are yielded on
    TP rank 0 only (other ranks iterate without items). Tensors keep the parameters' dtype and device; replicated
    ones are views of the live weights. The last stage's copy of tied embeddings is skipped (it has no HF tensor).

    MoE: an expert's tensors are gathered over its ETP group and yielded on that group's rank 0 in every
    expert-data-parallel replica (so each EP rank yields the experts it owns). ``owner_only``: every item exactly once
    per stage in the whole world -- non-expert tensors on TP rank 0 of DP replica 0 only, experts on ETP rank 0 of
    expert-data-parallel replica 0 of each EP rank (:func:`expert_sender`) -- for the senders of a weight sync, which
    then need not filter by DP rank.

    ``experts_last``: every non-expert tensor first, then the experts (each pass in ``named_parameters()`` order,
    the same on every rank, so the gathers still pair up). Then a rank's TP gathers (pass 1) all come before the
    experts it yields (pass 2), whose only collectives are ETP gathers with ranks that yield nothing: the collective
    weight transport relies on this to let each EP rank broadcast its own experts on a group of its own without a
    deadlock (:mod:`~da3po_megatron.rollout.collective`).

    ``everywhere`` (the colocated IPC transport, :func:`~da3po_megatron.rollout.ipc.ipc_buckets`): the shards are
    all-gathered (``dist.all_gather``) instead of gathered on rank 0, and every rank of the TP (ETP) group yields
    every item, so each GPU holds each full tensor of its stage in turn. Same collectives in the same order on every
    rank of the group; not with ``owner_only``.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if everywhere and owner_only:
        raise ValueError("iter_model: everywhere (every rank yields every item) contradicts owner_only")
    arch = gpt_arch(arch)
    bare = unwrap(model)
    to_global = global_layer_fn(bare)
    tp_rank, tp_size = _tp()
    offset, etp_rank, etp_size, _, edp_rank = _experts(arch)
    dense_ok = not owner_only or not ps.model_parallel_is_initialized() or ps.get_data_parallel_rank() == 0
    expert_ok = not owner_only or edp_rank == 0
    group = ps.get_tensor_model_parallel_group() if tp_size > 1 else None
    dst = ps.get_tensor_model_parallel_src_rank() if tp_size > 1 else 0
    named = [(mapping.layer_name(n, to_global, offset), p) for n, p in bare.named_parameters()]
    if experts_last:
        named = ([(n, p) for n, p in named if not mapping.is_expert(n)]
                 + [(n, p) for n, p in named if mapping.is_expert(n)])
    for name, param in named:
        if not mapping.hf_names_for(name, arch):  # tied output layer: no HF tensor, no gather
            continue
        if mapping.is_expert(name):
            if etp_size == 1 or mapping.resolve(name, arch)[0].tp_dim is None:
                if (etp_rank == 0 or everywhere) and expert_ok:
                    yield name, param.detach()
                continue
            egroup = ps.get_expert_tensor_parallel_group()
            shards = _collect(param, etp_size, etp_rank == 0, egroup, dist.get_global_rank(egroup, 0), everywhere)
            if (etp_rank == 0 or everywhere) and expert_ok:
                full = mapping.full_from_tp_shards(name, shards, arch)
                del shards
                yield name, full
                del full
            continue
        if not dense_ok:  # owner_only on a DP replica > 0: its whole TP group skips (no gather), yields nothing
            continue
        # split or replicated per the mapping table, not per parameter attributes (TE's fused layers differ there)
        if tp_size == 1 or mapping.resolve(name, arch)[0].tp_dim is None:
            if tp_rank == 0 or everywhere:
                yield name, param.detach()
            continue
        shards = _collect(param, tp_size, tp_rank == 0, group, dst, everywhere)
        if tp_rank == 0 or everywhere:
            full = mapping.full_from_tp_shards(name, shards, arch)
            del shards  # one full tensor alive while the consumer holds the item
            yield name, full
            del full  # not held while the next tensor is gathered (a generator keeps its locals between items)


def _collect(param: torch.Tensor, size: int, root: bool, group, dst: int, everywhere: bool) -> list | None:
    """The ``size`` TP (or ETP) shards of ``param`` in rank order: gathered on the group's rank 0 (``dst``, global;
    None elsewhere) or, ``everywhere``, all-gathered on every rank of the group."""
    import torch.distributed as dist

    shard = param.detach().contiguous()
    if everywhere:
        shards = [torch.empty_like(shard) for _ in range(size)]
        dist.all_gather(shards, shard, group=group)
        return shards
    shards = [torch.empty_like(shard) for _ in range(size)] if root else None
    dist.gather(shard, shards, dst=dst, group=group)
    return shards


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


_CKPT_EXPERT = re.compile(r"^mlp\.experts\.experts\.(linear_fc[12]\.weight)$")


def _ckpt_key(key: str) -> tuple[str, int | None, str]:
    """A checkpoint key -> (kind, layer, rest): ("top", None, key), ("stacked", None, rest) for a tensor with a leading
    layer axis (``decoder.layers.X``: homogeneous layers) or ("layer", i, rest) (``decoder.layers.i.X``: Megatron
    saves per-layer keys when the layers differ, e.g. MoE beside dense layers)."""
    if not key.startswith("decoder.layers."):
        return "top", None, key
    rest = key[len("decoder.layers."):]
    head, _, tail = rest.partition(".")
    if head.isdigit():
        return "layer", int(head), tail
    return "stacked", None, rest


def iter_checkpoint(model_dir: str | Path, arch: HFSpec,
                    progress: Callable[[str], None] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(global_megatron_name, full_tensor)`` of every model tensor of a dist checkpoint, layer by layer; an MoE
    layer's experts one expert at a time (``mlp.experts.experts.linear_fc1.weight`` holds [(layer,) expert, ...]:
    a slice read per expert, named ``mlp.experts.local_experts.{e}...`` with the global expert number)."""
    arch = gpt_arch(arch)
    ck = CheckpointReader(model_dir)
    layers = arch.num_layers
    kinds = {k: _ckpt_key(k) for k in ck.tensors}
    top = [k for k, (kind, _, _) in kinds.items() if kind == "top"]
    for key, (kind, layer, rest) in kinds.items():  # unknown tensors and wrong layer counts fail before any reading
        if kind == "stacked" and ck.tensors[key][0][0] != layers:
            raise ValueError(f"checkpoint {model_dir}: {key} has {ck.tensors[key][0][0]} layers, the model "
                             f"{layers}")
        ex = _CKPT_EXPERT.match(rest)
        probe = f"mlp.experts.local_experts.0.{ex.group(1)}" if ex else rest
        if kind == "top":
            mapping.resolve(key, arch)
        else:
            at = layer if kind == "layer" else next((i for i in range(layers) if _has_rule(probe, i, arch)), 0)
            mapping.resolve(f"decoder.layers.{at}.{probe}", arch)
            if ex and ck.tensors[key][0][0 if kind == "layer" else 1] != arch.num_moe_experts:
                raise ValueError(f"checkpoint {model_dir}: {key} holds {ck.tensors[key][0]} (experts axis), the model "
                                 f"has {arch.num_moe_experts} experts")

    def block(key: str, lead: tuple[int, ...]) -> torch.Tensor:
        size = ck.tensors[key][0]
        offsets = lead + (0,) * (len(size) - len(lead))
        return ck.load({key: (offsets, (1,) * len(lead) + tuple(size[len(lead):]))})[key].reshape(size[len(lead):])

    for key in (k for k in top if k.startswith("embedding.")):
        yield key, ck.load({key: ((0,) * len(ck.tensors[key][0]), ck.tensors[key][0])})[key]
    for i in range(layers):
        here = [(k, rest, (i,) if kind == "stacked" else ()) for k, (kind, layer, rest) in kinds.items()
                if (kind == "stacked" and _has_rule(_CKPT_EXPERT.sub(r"mlp.experts.local_experts.0.\1", rest), i, arch))
                or (kind == "layer" and layer == i)]
        plain = [(k, rest, lead) for k, rest, lead in here if not _CKPT_EXPERT.match(rest)]
        wanted = {k: (lead + (0,) * (len(ck.tensors[k][0]) - len(lead)),
                      (1,) * len(lead) + tuple(ck.tensors[k][0][len(lead):])) for k, _, lead in plain}
        got = ck.load(wanted) if wanted else {}
        for k, rest, lead in plain:
            yield f"decoder.layers.{i}.{rest}", got[k].reshape(ck.tensors[k][0][len(lead):])
        del got
        for k, rest, lead in here:
            ex = _CKPT_EXPERT.match(rest)
            if ex:
                for e in range(arch.num_moe_experts or 0):
                    yield f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{ex.group(1)}", block(k, lead + (e,))
        if progress:
            progress(f"  layer {i + 1}/{layers}")
    for key in (k for k in top if not k.startswith("embedding.")):
        yield key, ck.load({key: ((0,) * len(ck.tensors[key][0]), ck.tensors[key][0])})[key]


def _has_rule(rest: str, layer: int, arch) -> bool:
    """Whether the per-layer Megatron tensor ``rest`` exists at ``layer`` (dense vs MoE layers)."""
    try:
        mapping.resolve(f"decoder.layers.{layer}.{rest}", arch)
    except ValueError:
        return False
    return True
