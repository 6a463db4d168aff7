"""One process of a conversion's world (spawned by :func:`convert._spawn`, PP x lcm(TP, EP x ETP) of them).

Each rank joins the parent's rendezvous store, builds its GPTModel stage and, by the task's ``mode``:

- ``hf-to-megatron``: reads only its slices of the HF safetensors (:func:`megatron_io.load_hf_weights`) and saves
  its shard with ``dist_checkpointing`` (:func:`da3po_megatron.megatron.checkpoint.save_model`);
- ``--verify`` (both directions): re-reads the saved model into a float32 stage, compares the full-vocabulary logits
  of the last stage with transformers' on random tokens (:func:`verify_rank`) and, after hf-to-megatron, checks that
  the weight sync's export stream gives back the source HF tensors (:func:`verify_export`). Results are written as
  JSON next to ``task["result"]``; the parent judges them (:func:`convert._check_verify`).

The task is a plain dict (picklable for ``spawn``): ``mode``, ``tp``, ``pp``, ``ep``, ``etp``, ``hf_dir``,
``config_dir``, ``model_dir``, ``params_dtype`` (a key of :data:`DTYPES`), ``make_vocab_size_divisible_by``,
``verify``, ``result`` (+ optional ``seed``, ``batch``, ``seq_len``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from da3po_megatron.bridge.hf_config import gpt_arch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def say(msg: str) -> None:
    """The converter's progress line (the parent and rank 0 of its world)."""
    print(f"[convert] {msg}", flush=True)


def forward_logits(model, tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits [b, s, V_padded] of a (TP x PP) GPTModel on every rank of the last stage, else None."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    b, s = tokens.shape
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    pos = torch.arange(s, device=device).unsqueeze(0).expand(b, -1)

    def step(_data, m):
        return m(tokens, pos, None), (lambda out, non_loss_data=False: out)

    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter([None]), model=[model], num_microbatches=1, seq_length=s,
            micro_batch_size=b, forward_only=True, collect_non_loss_data=True)
    if not ps.is_pipeline_last_stage():
        return None
    return gather_from_tensor_model_parallel_region(out[0]).float().cpu()


def verify_rank(model, task: dict[str, Any]) -> None:
    """On the last stage: compare Megatron logits with transformers' on ``task['hf_dir']``; TP rank 0 writes JSON."""
    from megatron.core import parallel_state as ps

    vocab = gpt_arch(task["hf_dir"]).vocab_size
    gen = torch.Generator().manual_seed(task.get("seed", 0))
    tokens = torch.randint(0, vocab, (task.get("batch", 3), task.get("seq_len", 24)), generator=gen)
    logits = forward_logits(model, tokens)
    if logits is None or ps.get_tensor_model_parallel_rank() != 0 or ps.get_data_parallel_rank() != 0:
        return
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(task["hf_dir"], dtype=torch.float32)
    with torch.no_grad():  # the weights as the checkpoint holds them (no-op for float32 or bf16 sources)
        for p in ref_model.parameters():
            p.copy_(p.to(DTYPES[task["params_dtype"]]).float())
        ref = ref_model(tokens).logits.float()
    del ref_model
    mine = logits[..., : ref.shape[-1]]
    result = {"max_abs_diff": float((mine - ref).abs().max()), "max_abs_logit": float(ref.abs().max()),
              "tokens": list(tokens.shape), "padded_vocab": int(logits.shape[-1])}
    Path(task["result"]).write_text(json.dumps(result))


def verify_export(model, task: dict[str, Any], rank: int) -> None:
    """The weight sync's stream (:func:`~da3po_megatron.bridge.export.export_model`: TP gather + mapping) must give
    back the source HF tensors."""
    from da3po_megatron.bridge.export import export_model
    from da3po_megatron.bridge.hf_io import SafetensorsReader

    reader = SafetensorsReader(task["hf_dir"])
    checked, bad = 0, []
    for hf_name, t in export_model(model, task["hf_dir"], owner_only=True):
        src = reader.read(hf_name).to(DTYPES[task["params_dtype"]]).to(t.dtype)
        checked += 1
        if not torch.equal(t.cpu(), src):
            bad.append(hf_name)
    if checked:
        Path(task["result"]).with_name(f"export_{rank}.json").write_text(json.dumps({"checked": checked,
                                                                                       "mismatched": bad}))


def worker(rank: int, world: int, port: int, task: dict[str, Any]) -> None:
    from da3po_megatron.bridge.megatron_io import load_hf_weights
    from da3po_megatron.config import ModelConfig
    from da3po_megatron.megatron.checkpoint import load_model, save_model
    from da3po_megatron.megatron.model import build_gpt_model, import_megatron_core

    import_megatron_core()  # before megatron-core is first imported here: a broken Transformer-Engine is hidden
    from da3po_megatron.megatron.runtime import ParallelLayout, destroy_parallel, init_parallel, join_rendezvous

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    tp, pp = task["tp"], task["pp"]
    init_parallel(ParallelLayout(tp, pp, 1, task.get("ep", 1), task.get("etp")), rank=rank, world_size=world,
                  store=join_rendezvous("127.0.0.1", port))  # the parent serves the store (_spawn)
    try:
        # Verification always computes in float32 (see below); only the conversion builds in the saved dtype.
        options = ModelConfig(params_dtype=task["params_dtype"] if task["mode"] == "hf-to-megatron" else "float32",
                              make_vocab_size_divisible_by=task["make_vocab_size_divisible_by"])
        arch = gpt_arch(task["config_dir"])
        model = build_gpt_model(arch, options)
        model.eval()
        t0 = time.perf_counter()
        if task["mode"] == "hf-to-megatron":
            n = load_hf_weights(model, task["hf_dir"])
            if rank == 0:
                say(f"rank 0: loaded {n} parameters from {task['hf_dir']} in {time.perf_counter() - t0:.2f}s")
            save_model(model, task["model_dir"])
            if rank == 0:
                say(f"saved {task['model_dir']} (TP={tp} PP={pp}) in {time.perf_counter() - t0:.2f}s")
        if task.get("verify"):
            # Re-read what was written (verification checks the files, not memory), into a float32 model: a bf16
            # checkpoint is compared with transformers on the same bf16-rounded weights, both computing in float32.
            if options.params_dtype != "float32":
                del model
                model = build_gpt_model(arch, replace(options, params_dtype="float32")).eval()
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            load_model(model, task["model_dir"])
            verify_rank(model, task)
            if task["mode"] == "hf-to-megatron":
                verify_export(model, task, rank)
    finally:
        destroy_parallel()
