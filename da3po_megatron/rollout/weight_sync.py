"""Megatron policy -> vLLM engines weight sync, in memory, in bounded buckets (the "one mapping, two uses" of DESIGN).

The HF-named tensors come from the bridge's one export stream (:mod:`da3po_megatron.bridge.export`, the same one
``da3po convert megatron-to-hf`` and ``--verify`` consume): :func:`~da3po_megatron.bridge.export.export_policy`
yields ``(hf_name, tensor)`` one gathered tensor at a time on the first TP rank of each PP stage (QKV and gate/up
split, vocabulary padding removed, the tied output layer left out); :meth:`RolloutClient.push_weights` packs those
into safetensors buckets of at most ``bucket_mb`` MiB and loads them into every engine inside one layerwise-reload
session; the prefix cache is reset at the end. Memory bound on the sending side: one gathered Megatron tensor plus at
most two buckets.

Entry points:

- :func:`sync_policy_to_engines` -- one process holds the whole HF stream (a TP=1/PP=1 model, a checkpoint, tests);
- :func:`sync_policy_group_to_engines` -- the Ray policy (``PolicyGroup``): :func:`push_policy_weights` runs inside
  every policy rank (``run_on_all``); every rank iterates the collective export, the TP-rank-0 ranks of DP replica 0
  (one per PP stage) push their buckets straight to the engine actors. With one PP stage its sender opens the
  engines' session with its first bucket and closes it with its last (a one-bucket model: one call per engine);
  with several stages, which push concurrently (an engine loads buckets in any order within one session), the
  driver brackets them with ``client.begin_weight_update()`` / ``client.finish_weight_update()``.
- :func:`hf_state_tensors` -- a Hugging Face model's ``state_dict`` as the stream (tests, HF-side tools).
- :func:`save_and_reload` -- the slow baseline the benchmark compares against: write an HF checkpoint to disk and have
  every engine reload it.

The same stream (:func:`policy_hf_stream`, from the senders :func:`sender_stage` names) feeds the other transports:
"collective" (:mod:`~da3po_megatron.rollout.collective_transport`: a gloo / NCCL broadcast group per PP stage) and
"ipc" (:mod:`~da3po_megatron.rollout.ipc`: CUDA-IPC handles, colocated); :func:`choose_transport` picks one per
placement (``rollout.weight_transfer``). Left out: LoRA-only sync, quantised (fp8) weight sync.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from da3po_megatron.bridge.export import export_policy
from da3po_megatron.ranges import ranged
from da3po_megatron.rollout.client import RolloutClient


def sync_policy_to_engines(hf_stream: Iterable[tuple[str, torch.Tensor]], client: RolloutClient,
                           bucket_mb: float = 256, dtype: torch.dtype | None = None) -> dict:
    """Stream a whole HF export held by one process (the bridge's :func:`~da3po_megatron.bridge.export.export_model`
    of a TP=1/PP=1 model, :func:`~da3po_megatron.bridge.export.export_checkpoint`, the merged
    :func:`~da3po_megatron.bridge.export.export_policy_state` of small test models) into every engine: buckets, load,
    prefix-cache reset.

    Returns ``{"seconds", "bytes", "buckets", "tensors", "max_bucket_bytes", "gbps"}`` (bytes per engine).
    """
    t0 = time.perf_counter()
    stats = client.update_weights(hf_stream, bucket_mb=bucket_mb, dtype=dtype)
    stats["seconds"] = time.perf_counter() - t0
    stats["gbps"] = stats["bytes"] / max(stats["seconds"], 1e-9) / 1e9
    return stats


def sender_stage(worker: Any) -> int | None:
    """The PP stage this policy rank sends for, or None: the TP-rank-0 rank of DP replica 0 and CP rank 0 of each
    stage sends (its export holds that stage's gathered tensors); every other rank only takes part in the export's
    collectives. Context-parallel ranks hold the same weights (CP splits the sequence, not the parameters), so
    without the CP condition each CP rank of a stage would push the stage again (``parallel.context_parallel_size``
    > 1 is refused by the config checks today; this keeps the sender rule right when it is allowed)."""
    if any(getattr(worker, k, 0) != 0 for k in ("dp_rank", "tp_rank", "cp_rank")):
        return None
    return int(getattr(worker, "pp_rank", 0))


def sends_experts(worker: Any) -> bool:
    """Whether this policy rank pushes MoE experts it owns although it is no :func:`sender_stage` rank: with
    expert parallelism each EP rank (its expert-TP rank 0 in expert-data-parallel replica 0) sends its own experts,
    in buckets, one expert tensor at a time -- no rank gathers the experts of a layer (the export is ``owner_only``:
    :func:`~da3po_megatron.bridge.export.export_policy`). The bytes transport pushes its buckets to the engines; the
    collective transport gives each such rank a broadcast group of its own
    (:func:`~da3po_megatron.rollout.collective_transport.sender_slot`); IPC passes each EP rank's expert buckets
    round the EP group so that every GPU exports them (:func:`~da3po_megatron.rollout.ipc.ep_shared_buckets`;
    docs/moe.md)."""
    arch = getattr(worker, "arch", None)
    if arch is None or not getattr(arch, "is_moe", False) or sender_stage(worker) is not None:
        return False
    from da3po_megatron.bridge.megatron_io import expert_sender

    return expert_sender(arch)


def policy_hf_stream(worker: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy rank's HF-named export stream (collective: every rank iterates it to the end). The one place the
    transports take the policy's weights from. A non-policy sender (tools, tests: see
    :class:`~da3po_megatron.rollout.collective.StreamSender`) supplies ``hf_stream()`` instead."""
    if hasattr(worker, "hf_stream"):
        return worker.hf_stream()
    return export_policy(worker)


@ranged("weight_sync")  # a named range in a profiled step's rank trace (trainer/observability/profiling.py); else no-op
def push_policy_weights(worker: Any, client: RolloutClient, bucket_mb: float = 256,
                        dtype: torch.dtype | None = None, session: bool = False, strict: bool = True) -> dict:
    """Collective on every policy rank: inside a ``client.begin/finish_weight_update`` bracket on the driver, or
    with ``session`` (one PP stage: its sender is the only one) opening and closing the engines' session itself.

    ``worker`` is a :class:`~da3po_megatron.megatron.policy.PolicyWorker`. Every rank iterates the bridge's export
    (:func:`~da3po_megatron.bridge.export.export_policy`; its TP gathers are collective); ranks with TP rank 0 in DP
    replica 0 push their stage's tensors. Returns this rank's push stats (zeros where it pushed nothing).
    """
    t0 = time.perf_counter()
    stream = policy_hf_stream(worker)
    if sender_stage(worker) is None and not sends_experts(worker):
        for _ in stream:  # take part in the collectives, push nothing
            pass
        return {"seconds": 0.0, "bytes": 0, "buckets": 0, "tensors": 0, "max_bucket_bytes": 0,
                "rank_s": time.perf_counter() - t0}
    stats = client.push_weights(stream, bucket_mb=bucket_mb, dtype=dtype, session=session, strict=strict)
    stats["rank_s"] = time.perf_counter() - t0  # inside this rank's actor call: the driver's wait minus this = its call
    return stats


def sync_policy_group_to_engines(policy_group: Any, client: RolloutClient, bucket_mb: float = 256,
                                 dtype: torch.dtype | None = None, strict: bool = True) -> dict:
    """The Ray-side sync: :func:`push_policy_weights` on every policy rank (through ``PolicyGroup.run_on_all``;
    each pushing rank sends its buckets straight to the engine actors, nothing passes through the driver). One PP
    stage: its sender opens and closes the engines' session with its first and last bucket (prefix caches reset);
    several: the driver opens it before (``client.begin_weight_update()``) and closes it after
    (``client.finish_weight_update()``). On failure the engines' sessions are aborted (they refuse to generate
    until the next complete sync).

    Returns the summed push stats with the wall time of the whole sync (``seconds``) and ``gbps`` (bytes per engine
    / seconds).
    """
    t0 = time.perf_counter()
    p = policy_group.cfg.parallel  # one sender: one stage and no expert ranks of their own (EP > 1 sends per EP rank)
    one_sender = int(p.pipeline_model_parallel_size) == 1 and int(getattr(p, "expert_model_parallel_size", 1)) == 1
    try:
        if one_sender:
            parts = policy_group.run_on_all(push_policy_weights, client, bucket_mb, dtype, True, strict)
            client.note_weight_update()
        else:
            client.begin_weight_update()
            parts = policy_group.run_on_all(push_policy_weights, client, bucket_mb, dtype)
            client.finish_weight_update(strict=strict)
    except BaseException:
        client.abort_weight_update()
        raise
    stats = {k: sum(p[k] for p in parts) for k in ("bytes", "buckets", "tensors")}
    stats["max_bucket_bytes"] = max(p["max_bucket_bytes"] for p in parts)
    for k in ("export_s", "pack_s", "engine_s", "engine_call_s", "rank_s"):  # the slowest rank's split
        stats[k] = max(p.get(k, 0.0) for p in parts)
    stats["pushing_ranks"] = sum(1 for p in parts if p["buckets"])
    stats["seconds"] = time.perf_counter() - t0
    stats["gbps"] = stats["bytes"] / max(stats["seconds"], 1e-9) / 1e9
    return stats


TRANSPORTS = ("auto", "bytes", "collective", "ipc")


def choose_transport(setting: str, *, has_cuda: bool, colocate: bool, policy_hosts: Iterable[str],
                     engine_hosts: Iterable[str]) -> str:
    """The weight transport a run uses (``rollout.weight_transfer``), from the placement.

    "auto": "collective" when an engine runs on a node that holds no policy rank, or on CUDA when engines have GPUs
    of their own (not colocated); "ipc" colocated on CUDA; "bytes" otherwise, i.e. policy and engines on one CPU
    node, where Ray's object store is shared memory and measured as fast as a gloo loopback broadcast (see
    docs/rollout.md "Benchmarks"). An explicit choice is checked against what the placement allows.

    An MoE policy with expert parallelism (EP > 1) changes nothing here: every transport carries every EP rank's
    experts, each sent by the rank that owns it -- "bytes" (:func:`sends_experts`), "collective" (one broadcast group
    per EP rank) and "ipc" (each EP rank's expert buckets passed round the EP group, then exported on every GPU:
    :func:`~da3po_megatron.rollout.ipc.ep_shared_buckets`); docs/moe.md.
    """
    if setting not in TRANSPORTS:
        raise ValueError(f"rollout.weight_transfer must be one of {TRANSPORTS}, got {setting!r}")
    if setting == "ipc" and not (has_cuda and colocate):
        raise ValueError("rollout.weight_transfer='ipc' needs CUDA and rollout.colocate=true (IPC handles share one "
                         "GPU's memory between the policy and the engine)")
    if setting == "collective" and has_cuda and colocate:
        raise ValueError("rollout.weight_transfer='collective' with rollout.colocate=true on CUDA: NCCL refuses two "
                         "ranks on one GPU; use 'ipc' or 'bytes'")
    if setting != "auto":
        return setting
    if has_cuda:
        return "ipc" if colocate else "collective"
    other_node = set(engine_hosts) - set(policy_hosts)
    return "collective" if other_node else "bytes"


def hf_state_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A ``transformers`` model's weights as the HF-named stream (tied ``lm_head.weight`` left out)."""
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        yield name, tensor


def save_and_reload(named_tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path, client: RolloutClient,
                    model_path: str | Path | None = None) -> dict:
    """The disk path: write the tensors as an HF safetensors checkpoint (config/tokenizer files copied from
    ``model_path``), then every engine reloads it from disk. Returns seconds for save, reload and total."""
    import shutil

    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if model_path is not None:
        for f in Path(model_path).iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and not f.name.endswith(".index.json"):
                shutil.copy2(f, out / f.name)
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in named_tensors}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    n_bytes = sum(t.numel() * t.element_size() for t in state.values())
    del state
    t_save = time.perf_counter() - t0
    t_reload = client.reload_from_path(str(out))
    return {"save_seconds": t_save, "reload_seconds": t_reload, "seconds": time.perf_counter() - t0,
            "bytes": n_bytes}
