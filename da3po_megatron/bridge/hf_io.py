"""Hugging Face checkpoint files: lazy safetensors reading, streamed sharded writing, side files (config, tokenizer).

Reading goes through ``safetensors.safe_open(...).get_slice``: a tensor-parallel rank reads only the rows / columns it
holds, and nothing is loaded until asked for. Writing accumulates tensors up to ``max_shard_size`` bytes, writes that
shard and forgets it, then writes ``model.safetensors.index.json`` (transformers' naming:
``model-0000K-of-0000N.safetensors``, or ``model.safetensors`` when one shard suffices).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from da3po_megatron.bridge.mapping import Reader

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def parse_size(text: str | int) -> int:
    """'5GB' / '500MB' / '10KiB' / 1234 -> bytes (decimal for KB/MB/GB, binary for KiB/MiB/GiB, as transformers)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot parse size {text!r} (examples: 5GB, 500MB, 2GiB)")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(m.group(1)) * scale)


class SafetensorsReader(Reader):
    """Lazy reader of an HF checkpoint directory (``model.safetensors`` or an index with shards)."""

    def __init__(self, hf_dir: str | Path):
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.dir / "model.safetensors").exists():
            weight_map = None
        else:
            raise FileNotFoundError(f"no safetensors weights in {self.dir} (model.safetensors or "
                                    f"model.safetensors.index.json); convert .bin checkpoints with transformers first")
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self._handles = {f: safe_open(str(self.dir / f), framework="pt") for f in files}
        if weight_map is None:
            weight_map = {k: "model.safetensors" for k in self._handles["model.safetensors"].keys()}
        self.weight_map: dict[str, str] = weight_map

    def names(self) -> list[str]:
        return list(self.weight_map)

    def where(self, name: str) -> str:
        return str(self.dir / self.weight_map.get(name, "?"))

    def _slice(self, name: str):
        if name not in self.weight_map:
            raise KeyError(f"HF tensor {name!r} not found in {self.dir} (files: {sorted(self._handles)})")
        return self._handles[self.weight_map[name]].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        sl = self._slice(name)
        if dim is None:
            return sl[:]
        index = [slice(None)] * len(sl.get_shape())
        index[dim] = slice(start, stop)
        return sl[tuple(index)]


class ShardedSafetensorsWriter:
    """Streamed writer: :meth:`add` tensors (flushed at ``max_shard_size``); :meth:`close` writes the index."""

    def __init__(self, out_dir: str | Path, max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None,
                 progress=print):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = parse_size(max_shard_size)
        self.dtype = dtype
        self.progress = progress
        self._buffer: dict[str, torch.Tensor] = {}
        self._bytes = 0
        self._files: list[tuple[str, list[str]]] = []  # temporary file name, tensor names
        self.total_bytes = 0
        self.seen: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.seen:
            raise ValueError(f"HF tensor {name!r} written twice")
        self.seen.add(name)
        t = tensor.detach().to("cpu")
        if self.dtype is not None and t.is_floating_point():
            t = t.to(self.dtype)
        t = t.contiguous().clone()  # own storage: safetensors refuses shared / non-contiguous tensors
        size = t.numel() * t.element_size()
        if self._buffer and self._bytes + size > self.max_bytes:
            self._flush()
        self._buffer[name] = t
        self._bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self._buffer:
            return
        tmp = f"tmp-{len(self._files) + 1:05d}.safetensors"
        save_file(self._buffer, str(self.dir / tmp), metadata={"format": "pt"})
        self.progress(f"  wrote shard {len(self._files) + 1} ({len(self._buffer)} tensors, {self._bytes / 2**20:.1f} "
                      f"MiB)")
        self._files.append((tmp, list(self._buffer)))
        self._buffer, self._bytes = {}, 0

    def close(self) -> list[str]:
        """Flush, give the shards their final names, write the index; returns the file names."""
        self._flush()
        n = len(self._files)
        weight_map, names = {}, []
        for k, (tmp, tensors) in enumerate(self._files, 1):
            final = "model.safetensors" if n == 1 else f"model-{k:05d}-of-{n:05d}.safetensors"
            os.replace(self.dir / tmp, self.dir / final)
            names.append(final)
            weight_map.update({t: final for t in tensors})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return names


def copy_side_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy config, generation config, tokenizer and other small top-level files (no weights, no index)."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for p in sorted(src.iterdir()):
        if not p.is_file() or p.name.endswith(WEIGHT_SUFFIXES) or p.name in INDEX_NAMES or p.name.startswith("."):
            continue
        shutil.copy2(p, dst / p.name)
        copied.append(p.name)
    if "config.json" not in copied:
        raise FileNotFoundError(f"{src} has no config.json")
    return copied
