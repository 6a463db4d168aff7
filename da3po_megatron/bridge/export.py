"""The one Megatron -> Hugging Face export: a stream of ``(hf_name, tensor)``, one gathered tensor at a time.

Every consumer of HF-named weights takes this stream: ``da3po convert megatron-to-hf`` (:func:`export_checkpoint`),
``convert --verify`` and the in-memory weight sync to vLLM (:func:`export_model` / :func:`export_policy`, consumed by
:mod:`da3po_megatron.rollout.weight_sync`). The stream has two possible *sources* of ``(global Megatron name, full
tensor)`` -- a live, TP x PP-sharded model (:func:`da3po_megatron.bridge.megatron_io.iter_model`: TP shards gathered
on the stage's first TP rank, ``linear_fc1`` re-interleaved to ``[gate; up]``, layer numbers made global) or a
``dist_checkpointing`` directory saved at any layout (:func:`~da3po_megatron.bridge.megatron_io.iter_checkpoint`) --
and one mapping stage, :func:`to_hf` (the table of :mod:`da3po_megatron.bridge.mapping`: QKV split per query group,
gate / up split, vocabulary padding stripped, the tied output layer left out). Since both sources hold the same full
Megatron layout and go through the same mapping, a live model and the checkpoint it saves export bit-identical HF
tensors (tests/test_export_parity.py checks it for Qwen3 tied and untied, Qwen2 and Llama at TP=2 x PP=2).

Memory bound: one full Megatron tensor (plus the HF views of it) at a time on the sending rank; consumers that keep
tensors past the next item must copy them (the live source hands out views of the weights).

Policy-side adapters (a :class:`~da3po_megatron.megatron.policy.PolicyWorker` knows no HF names, so HF weights go in
and out of it here, run on every rank through ``PolicyWorker.execute`` / ``PolicyGroup.run_on_all``):
:func:`load_policy_hf` fills a worker from an HF directory, :func:`export_policy` is its HF stream and
:func:`export_policy_state` the same as a CPU dict (small models and tests).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from da3po_megatron.bridge import mapping
from da3po_megatron.bridge.hf_config import HFSpec, gpt_arch
from da3po_megatron.bridge.megatron_io import iter_checkpoint, iter_model, load_hf_weights, unwrap

log = logging.getLogger(__name__)

HFStream = Iterator[tuple[str, torch.Tensor]]


def to_hf(megatron_stream: Iterable[tuple[str, torch.Tensor]], arch: HFSpec) -> HFStream:
    """Map ``(global Megatron name, full tensor)`` items to ``(hf_name, tensor)`` with the mapping table.

    ``arch``: the model's :class:`~da3po_megatron.megatron.arch.GPTArch`, or its HF config (a dict or the directory
    holding its config.json). A tensor the table does not know, or of the wrong shape, raises ValueError naming it."""
    arch = gpt_arch(arch)
    for name, tensor in megatron_stream:
        try:
            pairs = mapping.megatron_to_hf(name, tensor, arch)
        except (KeyError, ValueError) as e:
            raise ValueError(f"cannot map Megatron tensor {name!r} {tuple(tensor.shape)} to HF: {e}") from e
        yield from pairs
        del pairs, tensor  # not held while the next tensor is gathered (issue 49: one full tensor at a time)


def export_model(model: torch.nn.Module, arch: HFSpec, owner_only: bool = False,
                 experts_last: bool = False, everywhere: bool = False) -> HFStream:
    """The HF stream of a live GPTModel stage (bare or DDP-wrapped). Collective over the stage's TP group: every rank
    iterates it to the end; items come out on TP rank 0 only (of every PP stage and DP replica). MoE experts come
    out on the ranks that own them; ``owner_only``: every tensor once in the world; ``experts_last``: the experts
    after every other tensor; ``everywhere``: TP shards all-gathered, items on every TP rank (the colocated IPC
    transport; see :func:`~da3po_megatron.bridge.megatron_io.iter_model`)."""
    arch = gpt_arch(arch)
    return to_hf(iter_model(model, arch, owner_only=owner_only, experts_last=experts_last, everywhere=everywhere),
                 arch)


def export_checkpoint(model_dir: str | Path, arch: HFSpec, progress: Callable[[str], None] | None = None) -> HFStream:
    """The HF stream of a Megatron dist checkpoint (``CKPT/model``) saved at any TP x PP; one process, no model."""
    arch = gpt_arch(arch)
    return to_hf(iter_checkpoint(model_dir, arch, progress=progress), arch)


# --------------------------------------------------------------------------------------------- policy workers


def load_policy_hf(worker: Any, hf_dir: str | Path) -> bool:
    """Fill this policy rank's model stage from an HF checkpoint directory (reads only its own slices) and refresh the
    optimizer's master weights. Not collective. Returns False, keeping the current weights with a warning, when the
    directory holds no ``*.safetensors`` (a config-only model directory)."""
    if not any(Path(hf_dir).glob("*.safetensors")):
        log.warning("no *.safetensors in %s: keeping the current (random) initialisation", hf_dir)
        return False
    load_hf_weights(unwrap(worker.model), hf_dir)
    optimizer = getattr(worker, "optimizer", None)
    if optimizer is not None:
        optimizer.reload_model_params()
    return True


def export_policy(worker: Any) -> HFStream:
    """The HF stream of a policy rank (collective like :func:`export_model`; items on TP rank 0 of every stage and
    DP replica -- replicas yield identical tensors, use DP rank 0's). An MoE policy's stream is ``owner_only``: each
    tensor on exactly one rank -- the non-expert ones on DP replica 0, each expert on the rank that owns it (so every
    EP rank sends its own experts and no rank gathers all of them), with the experts last (what lets the collective
    transport give each EP rank a broadcast group of its own: :mod:`~da3po_megatron.rollout.collective`)."""
    arch = worker.arch  # the GPTArch the worker was built from
    return export_model(worker.model, arch, owner_only=arch.is_moe, experts_last=arch.is_moe)


def export_policy_state(worker: Any) -> dict[str, torch.Tensor]:
    """:func:`export_policy` as CPU copies on the TP-rank-0 ranks of DP replica 0 ({} elsewhere; merge the stages'
    dicts). Holds the whole stage: small models and tests only."""
    keep = getattr(worker, "dp_rank", 0) == 0 or worker.arch.is_moe  # MoE: owner_only, every item once already
    return {k: v.detach().cpu().clone() for k, v in export_policy(worker) if keep}
