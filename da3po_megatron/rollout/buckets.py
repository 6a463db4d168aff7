"""Weight-update buckets: HF-named tensors grouped into bounded buckets (:func:`iter_buckets`), and their two wire
forms -- safetensors bytes (:func:`serialize_bucket`) and numpy byte views for Ray's object store (:func:`pack_bucket`).
Used by :class:`~da3po_megatron.rollout.client.RolloutClient` (which re-exports them) and the weight-sync benchmarks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from da3po_megatron.rollout.types import checked_weights


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                 dtype: torch.dtype | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Group (name, tensor) pairs into dicts of at most ``bucket_bytes`` (a larger tensor forms its own bucket).

    Tensors are made contiguous CPU copies (cast to ``dtype`` when given); names must be unique.
    """
    for bucket, _ in iter_buckets_marked(named_tensors, bucket_bytes, dtype):
        yield bucket


def iter_buckets_marked(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                        dtype: torch.dtype | None = None) -> Iterator[tuple[dict[str, torch.Tensor], bool]]:
    """:func:`iter_buckets` with a flag on the last bucket (known without holding a bucket back: a bucket is only
    closed when the next tensor does not fit, or when the stream ends)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be > 0 bytes, got {bucket_bytes}")
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    storages: set[int] = set()
    for name, t in checked_weights(named_tensors, dtype):
        t = t.to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket, False
            bucket, size, storages = {}, 0, set()
        # safetensors refuses tensors that share memory: copy views into larger buffers (split QKV) and repeats (tied)
        ptr = t.untyped_storage().data_ptr()
        if t.untyped_storage().nbytes() != nbytes or ptr in storages:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        storages.add(ptr)
        bucket[name] = t
        size += nbytes
    if bucket:
        yield bucket, True


def serialize_bucket(bucket: dict[str, torch.Tensor]) -> bytes:
    """safetensors bytes of one bucket (one of the payloads the worker extension's ``da3po_load_bucket`` reads)."""
    from safetensors.torch import save

    return save(bucket)


def pack_bucket(bucket: dict[str, torch.Tensor]) -> tuple[list[Any], list[tuple[str, str, list[int]]]]:
    """One bucket for Ray: byte views of its tensors as numpy arrays + ``(name, dtype, shape)`` rows.

    Ray stores numpy arrays out of band: ``ray.put`` copies each tensor's bytes once into the object store and the
    engine reads them in place (zero-copy ``ray.get``), where safetensors bytes would be copied three more times.
    """
    arrays, meta = [], []
    for name, t in bucket.items():
        arrays.append(t.reshape(-1).view(torch.uint8).numpy())  # a view, no copy (any dtype, bf16 included)
        meta.append((name, str(t.dtype).removeprefix("torch."), list(t.shape)))
    return arrays, meta


__all__ = ["iter_buckets", "iter_buckets_marked", "pack_bucket", "serialize_bucket"]
