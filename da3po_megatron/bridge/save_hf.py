"""Hugging Face weights written at checkpoint time (``trainer.save_hf_every``), from the weight sync's export stream.

The policy ranks run :func:`write_policy_hf` together (``PolicyGroup.run_on_all``): every rank iterates the bridge's
export (:func:`~da3po_megatron.bridge.export.export_policy` -- the same stream the weight sync to vLLM and
``da3po convert megatron-to-hf`` consume: TP shards gathered, QKV / gate-up split, vocabulary padding stripped, the
tied output layer left out), and the rank that sends each PP stage's tensors in a weight sync (TP rank 0 of DP
replica 0) writes them, streamed, into safetensors shards of its own (``ShardedSafetensorsWriter``: at most
``max_shard_size`` in memory). The driver then :func:`assemble_hf_dir`: the stages' shards get their global names
(``model.safetensors``, or ``model-0000K-of-0000N.safetensors`` + ``model.safetensors.index.json``), the model
directory's config, generation config and tokenizer files are copied beside them, and every tensor the mapping
expects is checked to be there. The directory is written inside the checkpoint's temporary directory
(``.tmp-step_N/hf/``), so the checkpoint's manifest covers it and the same atomic rename publishes it with the
Megatron checkpoint (``trainer/resume/checkpoint.py``); ``latest`` never names a step whose HF weights are half written.

dtype: as ``da3po convert megatron-to-hf`` with ``--dtype auto``: the dtype the HF config declares (``dtype`` /
``torch_dtype``), else the policy's. The result loads with ``transformers.AutoModelForCausalLM.from_pretrained`` and
``vllm.LLM`` as is (tests/test_operations.py compares both with the policy's logits).

MoE with expert parallelism: the export is ``owner_only`` (every tensor on exactly one rank: the non-expert ones on
the stage's sender, each expert on the rank that owns it), so every rank that receives items writes its own shards
(``.stage<pp>.rank<r>/``) -- each EP rank writes the experts it owns, no rank gathers another's -- and the driver
assembles all of them into the one directory.

Left out: writing in a background thread (the write costs about one weight sync plus the disk write, paid inside the
save, docs/operations.md).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from da3po_megatron.bridge import mapping
from da3po_megatron.bridge.export import export_policy
from da3po_megatron.bridge.hf_config import gpt_arch
from da3po_megatron.bridge.hf_io import ShardedSafetensorsWriter, copy_side_files

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STAGE_DIR = ".stage{}.rank{}"


def hf_dtype(model_dir: str | Path) -> torch.dtype | None:
    """The dtype the HF config in ``model_dir`` declares (None: not declared, keep the policy's)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "").replace("torch.", "")
    return DTYPES.get(name)


def write_policy_hf(worker: Any, out_dir: str, dtype: torch.dtype | None = None,
                    max_shard_size: str | int = "5GB") -> dict[str, Any]:
    """Collective on every policy rank: the HF export of this rank's stage into ``out_dir/.stage<pp>.rank<r>/`` on
    the ranks that write: a dense model's stage sender (TP rank 0 of DP replica 0; the DP replicas' identical copies
    are not written), an MoE's every rank its ``owner_only`` export gives items (the stage's sender and the EP ranks'
    expert owners). The others only take part in the export's gathers. Returns, on a writer,
    ``{"stage", "rank", "dir", "weight_map", "bytes"}``; ``{}`` elsewhere."""
    import torch.distributed as dist

    moe = bool(getattr(getattr(worker, "arch", None), "is_moe", False))
    sender = moe or (getattr(worker, "dp_rank", 0) == 0 and getattr(worker, "tp_rank", 0) == 0)
    stage = int(getattr(worker, "pp_rank", 0))
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    writer = None
    for name, tensor in export_policy(worker):
        if not sender:
            continue
        if writer is None:  # the first item this rank writes (an MoE rank that owns nothing writes nothing)
            d = Path(out_dir) / STAGE_DIR.format(stage, rank)
            shutil.rmtree(d, ignore_errors=True)
            writer = ShardedSafetensorsWriter(d, max_shard_size, dtype, progress=lambda *_: None)
        writer.add(name, tensor)
    if writer is None:
        return {}
    writer.close()
    index = json.loads((writer.dir / "model.safetensors.index.json").read_text())
    return {"stage": stage, "rank": rank, "dir": str(writer.dir), "weight_map": index["weight_map"],
            "bytes": writer.total_bytes}


def expected_hf_names(arch: Any) -> set[str]:
    """Every HF tensor the model's checkpoint holds under the mapping (the tied ``lm_head`` left out)."""
    d = gpt_arch(arch)
    if hasattr(mapping, "hf_state_names"):
        return set(mapping.hf_state_names(d))
    names = {n for r in mapping.rules(d) for n in (mapping.hf_names(r, None) if not r.per_layer else
             [h for i in range(d.num_layers) for h in mapping.hf_names(r, i)])}
    if d.share_embeddings_and_output_weights:
        names.discard("lm_head.weight")
    return names


def assemble_hf_dir(out_dir: str | Path, parts: list[dict[str, Any]], model_dir: str | Path) -> dict[str, Any]:
    """Driver side: turn the stages' shards (``parts``: :func:`write_policy_hf`'s results of all ranks) into one HF
    directory at ``out_dir`` with the config / tokenizer files of ``model_dir``. Raises ValueError naming missing
    tensors. Returns ``{"files", "tensors", "bytes"}``."""
    out = Path(out_dir)
    parts = sorted((p for p in parts if p), key=lambda p: (p["stage"], p["rank"]))
    seen: dict[str, str] = {}
    for p in parts:  # every tensor from exactly one writer
        for t in p["weight_map"]:
            if t in seen:
                raise ValueError(f"HF weights written at save time into {out}: {t!r} written twice ({seen[t]} and "
                                 f"{p['dir']})")
            seen[t] = p["dir"]
    shards = [(p, f) for p in parts for f in sorted(set(p["weight_map"].values()))]
    n = len(shards)
    weight_map: dict[str, str] = {}
    files = []
    for k, (part, f) in enumerate(shards, 1):
        final = "model.safetensors" if n == 1 else f"model-{k:05d}-of-{n:05d}.safetensors"
        os.replace(Path(part["dir"]) / f, out / final)
        weight_map.update({t: final for t, file in part["weight_map"].items() if file == f})
        files.append(final)
    for part in parts:
        shutil.rmtree(part["dir"], ignore_errors=True)
    total = sum(p["bytes"] for p in parts)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    copy_side_files(model_dir, out)
    missing = sorted(expected_hf_names(model_dir) - set(weight_map))
    if missing:
        raise ValueError(f"HF weights written at save time into {out} lack {len(missing)} tensors the mapping "
                         f"expects, e.g. {missing[:6]}")
    return {"files": files, "tensors": len(weight_map), "bytes": total}


def save_policy_hf(policy: Any, out_dir: str | Path, model_dir: str | Path, max_shard_size: str | int = "5GB"
                   ) -> dict[str, Any]:
    """The whole save-time HF write for a ``PolicyGroup`` (driver): every rank exports, the senders write, the
    driver assembles ``out_dir``. dtype as ``da3po convert --dtype auto``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = hf_dtype(model_dir)
    parts = policy.run_on_all(write_policy_hf, str(out), dtype, max_shard_size)
    return assemble_hf_dir(out, [p for p in parts if p], model_dir)  # dense: one writer per stage; MoE: + EP ranks
