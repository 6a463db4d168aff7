"""``da3po convert``: checkpoint conversion between Hugging Face and Megatron (dist_checkpointing, torch_dist).

Directions::

    da3po convert hf-to-megatron --hf HF_DIR --out CKPT_DIR --tp N --pp N [--ep N --etp N] [--force] [--verify]
    da3po convert megatron-to-hf --ckpt CKPT_DIR --out HF_DIR [--max-shard-size 5GB] [--force] [--verify]

Megatron checkpoint layout (shared with the policy's checkpoints, :mod:`da3po_megatron.megatron.checkpoint`)::

    CKPT_DIR/model/      megatron.core.dist_checkpointing.save(model.sharded_state_dict(), ...)  (torch_dist)
    CKPT_DIR/hf/         HF config.json, generation_config.json, tokenizer files (copied back out by megatron-to-hf)
    CKPT_DIR/meta.json   format, layout, source, vocabulary sizes

Mixture-of-Experts (Qwen3-MoE): ``--ep`` / ``--etp`` (expert model / expert tensor parallel sizes) split the experts;
the world is then PP x lcm(TP, EP x ETP) processes (the expert ranks come out of the data-parallel ranks, as in
training). A checkpoint saved at any TP x PP x EP converts back to HF (and so to any other EP) bit-exactly: experts
are per-expert tensors in both formats (docs/moe.md).

hf-to-megatron spawns TP x PP processes (gloo on CPU, NCCL on GPU); each builds its GPTModel stage, reads only its
slices of the HF safetensors and saves its shard (what one rank does: :mod:`da3po_megatron.bridge.convert_worker`).
Peak memory per process: its shard + one tensor slice.
megatron-to-hf reads a checkpoint saved at *any* TP x PP in one process, without building a model: it streams
one layer at a time out of the checkpoint (PyTorch DCP slice reads) through the same HF export stream as the weight
sync (:mod:`da3po_megatron.bridge.export`) and writes safetensors shards of at most ``--max-shard-size``. Peak
memory: one layer + one output shard + the embedding.

``--verify`` runs both models on a few random token sequences and prints the max absolute logit difference between
Megatron and transformers; it exits with status 3 above the tolerance: ``--verify-tol`` if given, else relative to
the logits' magnitude, the compute dtype and the depth (:func:`verify_tolerance`). Parallel sizes (heads, KV heads,
MLP and layers divisible by TP / PP) are checked before anything is written.
Verification builds the full transformers model in one process (plus, for megatron-to-hf, a Megatron model at
``--verify-tp`` x ``--verify-pp``): it is the one step whose memory is not bounded by a layer.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from da3po_megatron.bridge import mapping
from da3po_megatron.bridge.convert_worker import DTYPES, say, worker
from da3po_megatron.bridge.hf_config import gpt_arch, load_hf_config, model_family
from da3po_megatron.bridge.hf_io import ShardedSafetensorsWriter, copy_side_files, parse_size

FORMAT = "da3po-megatron/1"  # same as da3po_megatron.megatron.checkpoint.FORMAT


class ConversionError(RuntimeError):
    """A user-facing conversion failure (bad input, existing output, failed verification)."""


def hf_dtype_name(hf: dict[str, Any]) -> str | None:
    """The checkpoint dtype the HF config declares (``dtype`` in transformers 5, ``torch_dtype`` before)."""
    name = hf.get("dtype") or hf.get("torch_dtype")
    return str(name).replace("torch.", "") if name else None


def resolve_hf_dir(spec: str | Path) -> Path:
    """A local HF directory, or a Hub id (``Qwen/Qwen3-4B-Base``) resolved through the local Hugging Face cache
    (``huggingface_hub.snapshot_download``; downloads only when the cache lacks it and the network is allowed)."""
    p = Path(spec)
    if p.is_dir():
        return p
    if re.fullmatch(r"[\w.-]+/[\w.-]+", str(spec)) and not p.exists():
        from huggingface_hub import snapshot_download

        say(f"{spec} is not a directory: resolving it as a Hugging Face Hub id")
        return Path(snapshot_download(str(spec), allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model",
                                                                 "*.jinja", "*.tiktoken"]))
    raise ConversionError(f"HF checkpoint {spec} is not a directory")


def resolve_ckpt_dir(spec: str | Path) -> Path:
    """The directory holding ``model/`` (+ ``hf/``): a converter output, a policy checkpoint, a run's step directory
    (``step_000200`` -> ``step_000200/policy``) or its ``latest`` pointer file."""
    p = Path(spec)
    if p.is_file():  # run_dir/checkpoints/latest holds the name of the newest step directory
        p = p.parent / p.read_text().strip()
    if not (p / "model").is_dir() and (p / "policy" / "model").is_dir():
        p = p / "policy"
    if not (p / "model").is_dir():
        raise ConversionError(f"{spec} is not a da3po-megatron checkpoint: no model/ directory (looked in {p})")
    return p


def _prepare_out(out: Path, force: bool, protect: list[Path]) -> None:
    out = out.resolve()
    for p in protect:
        p = p.resolve()
        if out == p or p.is_relative_to(out):
            raise ConversionError(f"output {out} would overwrite the input {p}")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise ConversionError(f"output {out} exists and is not empty; pass --force to overwrite it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def check_hf_checkpoint(hf_dir: str | Path, hf: dict[str, Any] | None = None) -> list[str]:
    """Check every HF tensor the mapping needs exists with the shape the config implies (headers only, no reads).

    Raises ValueError / KeyError naming the tensor; returns HF tensors the mapping does not use (e.g. a redundant
    ``lm_head.weight`` of a tied model), which are dropped by the conversion.
    """
    from da3po_megatron.bridge.hf_io import SafetensorsReader

    d = gpt_arch(hf or hf_dir)  # unsupported architecture -> ValueError
    reader = SafetensorsReader(hf_dir)
    used: set[str] = set()
    for rule in mapping.rules(d):
        if rule.megatron == "output_layer.weight" and d.share_embeddings_and_output_weights:
            continue
        for layer in range(d.num_layers) if rule.per_layer else [None]:
            if not mapping.layer_has(rule, layer, d):
                continue
            for e in mapping.experts_of(rule, d):
                names = mapping.hf_names(mapping.with_expert(rule, e), layer)
                mapping._check_hf_shapes(mapping.with_expert(rule, e), names, reader, d)
                used.update(names)
    return sorted(set(reader.names()) - used)


def conversion_world(tp: int, pp: int, ep: int = 1, etp: int | None = None) -> int:
    """Processes of a conversion: PP x lcm(TP, EP x ETP) (one DP replica unless the experts need more ranks)."""
    import math

    return pp * math.lcm(tp, ep * (tp if etp is None else etp))


def _spawn(task: dict[str, Any]) -> None:
    import torch.multiprocessing as mp

    from da3po_megatron.megatron.runtime import bind_rendezvous

    world = conversion_world(task["tp"], task["pp"], task.get("ep", 1), task.get("etp"))
    if torch.cuda.is_available() and world > torch.cuda.device_count():
        raise ConversionError(f"TP x PP (x EP) = {world} processes need {world} GPUs, {torch.cuda.device_count()} "
                              "visible")
    store = bind_rendezvous()  # bound before the workers are told its port: no probe-then-bind race
    try:
        mp.start_processes(worker, args=(world, store.port, task), nprocs=world, join=True, start_method="spawn")
    except mp.ProcessRaisedException as e:  # the worker's traceback is in the message; its last line is the error
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        raise ConversionError(f"a conversion process failed: {lines[-1] if lines else e}") from e
    except mp.ProcessExitedException as e:
        raise ConversionError(f"a conversion process died: {e}") from e


def verify_tolerance(max_abs_logit: float, num_layers: int, compute_dtype: torch.dtype = torch.float32) -> float:
    """The default ``--verify`` tolerance on max |logits_megatron - logits_transformers|, relative to the logits:

        tol = 32 * eps(compute_dtype) * sqrt(num_layers) * max(1, max |logit|)

    Both sides compute in ``compute_dtype`` (float32: eps 1.19e-7) on identical weights, so they differ only by the
    order of floating-point operations (fused QKV / gate-up GEMMs, TP partial sums): a rounding error of a few eps per
    operation, growing with the logits' magnitude and (as a random walk) with depth. Measured: SmolLM2-135M (30
    layers, max |logit| 33.5) differs by 8e-5 -> tol 7.0e-4; tiny 2-layer models by 5e-6..1.5e-5 at max |logit|
    6-10 -> tol 3.2e-5..5.4e-5. A wrong mapping (a swapped or mis-sliced tensor) gives differences of order 1.
    """
    return 32.0 * torch.finfo(compute_dtype).eps * max(1, num_layers) ** 0.5 * max(1.0, float(max_abs_logit))


def _check_verify(result_file: Path, tol: float | None, num_layers: int) -> dict[str, Any]:
    if not result_file.exists():
        raise ConversionError("verification produced no result (see worker output above)")
    r = json.loads(result_file.read_text())
    limit = verify_tolerance(r["max_abs_logit"], num_layers) if tol is None else tol
    say(f"verify: max |logits_megatron - logits_transformers| = {r['max_abs_diff']:.3g} "
         f"(max |logit| {r['max_abs_logit']:.3g}, tokens {r['tokens']}, tolerance {limit:.3g}"
         f"{' from --verify-tol' if tol is not None else ' relative: 32 eps_fp32 sqrt(layers) max|logit|'})")
    r["tolerance"] = limit
    if not r["max_abs_diff"] <= limit:
        raise ConversionError(f"verification failed: max abs logit difference {r['max_abs_diff']:.3g} > {limit:.3g}")
    return r


# ------------------------------------------------------------------------------------------- the two directions


def hf_to_megatron(hf_dir: str | Path, out: str | Path, tp: int = 1, pp: int = 1, *, force: bool = False,
                   verify: bool = False, params_dtype: str | None = None, make_vocab_size_divisible_by: int = 1,
                   verify_tol: float | None = None, ep: int = 1, etp: int | None = None) -> dict[str, Any]:
    """Convert an HF checkpoint directory into ``out/{model,hf,meta.json}`` at TP x PP (x EP x ETP for MoE);
    returns the meta dict."""
    t0 = time.perf_counter()
    hf_dir, out = resolve_hf_dir(hf_dir), Path(out)
    hf = load_hf_config(hf_dir)
    family, arch = model_family(hf), gpt_arch(hf)
    arch.check_parallel_sizes(tp, pp, ep, etp)  # before anything is written or spawned
    world = conversion_world(tp, pp, ep, etp)
    dropped = check_hf_checkpoint(hf_dir, hf)
    if dropped:
        say(f"note: {len(dropped)} HF tensors are not used by the mapping and are dropped: {dropped[:4]}")
    dtype = params_dtype or ("bfloat16" if hf_dtype_name(hf) == "bfloat16" else "float32")
    if dtype not in ("float32", "bfloat16"):
        raise ConversionError(f"--params-dtype must be float32 or bfloat16, got {dtype!r}")
    _prepare_out(out, force, [hf_dir])
    copied = copy_side_files(hf_dir, out / "hf")
    say(f"{hf.get('architectures', [family])[0]} ({family}): {arch.num_layers} layers, hidden "
         f"{arch.hidden_size} -> {out} at TP={tp} PP={pp}{f' EP={ep} ETP={etp or tp}' if arch.is_moe else ''}, "
         f"params {dtype}; copied {len(copied)} HF side files")
    with tempfile.TemporaryDirectory() as tmp:
        task = dict(mode="hf-to-megatron", tp=tp, pp=pp, ep=ep, etp=etp, hf_dir=str(hf_dir), config_dir=str(out / "hf"),
                    model_dir=str(out / "model"), params_dtype=dtype,
                    make_vocab_size_divisible_by=make_vocab_size_divisible_by, verify=verify,
                    result=str(Path(tmp) / "verify.json"))
        _spawn(task)
        vocab, padded = arch.vocab_sizes(tp, make_vocab_size_divisible_by)
        meta = {
            "format": FORMAT,
            "step": 0,
            "layout": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                       "context_parallel_size": 1, "data_parallel_size": world // (tp * pp), "world_size": world,
                       "expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp or tp},
            "converted_from": str(hf_dir.resolve()),
            "architecture": hf.get("architectures", [family])[0],
            "arch": arch.to_dict(),  # the model in Megatron terms (megatron.arch.GPTArch)
            "params_dtype": dtype,
            "vocab_size": vocab,
            "padded_vocab_size": padded,
            "make_vocab_size_divisible_by": make_vocab_size_divisible_by,
            "has_optimizer": False,
        }
        if verify:
            meta["verify"] = _check_verify(Path(task["result"]), verify_tol, arch.num_layers)
            exports = [json.loads(p.read_text()) for p in Path(tmp).glob("export_*.json")]
            checked, bad = sum(e["checked"] for e in exports), [b for e in exports for b in e["mismatched"]]
            say(f"verify: export stream (TP gather + mapping) reproduced {checked - len(bad)}/{checked} HF "
                 f"tensors exactly")
            meta["verify"]["export_checked"] = checked
            if bad or not checked:
                raise ConversionError(f"verification failed: exported tensors differ from the HF source: {bad[:6]}")
    (out / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    say(f"done in {time.perf_counter() - t0:.1f}s")
    return meta


def megatron_to_hf(ckpt: str | Path, out: str | Path, *, force: bool = False, verify: bool = False,
                   max_shard_size: str | int = "5GB", dtype: str = "auto", verify_tp: int = 1, verify_pp: int = 1,
                   verify_tol: float | None = None, hf_config: str | Path | None = None, verify_ep: int = 1,
                   verify_etp: int | None = None) -> dict[str, Any]:
    """Convert ``ckpt/{model,hf}`` (any TP x PP x EP) into an HF directory, streaming layer by layer.

    ``ckpt`` may also be a run's step directory or ``latest`` pointer (see :func:`resolve_ckpt_dir`); ``hf_config``
    replaces ``ckpt/hf`` as the source of config.json and tokenizer files."""
    from da3po_megatron.bridge.export import export_checkpoint
    from da3po_megatron.bridge.megatron_io import CheckpointReader

    t0 = time.perf_counter()
    ckpt, out = resolve_ckpt_dir(ckpt), Path(out)
    hf_side = Path(hf_config) if hf_config else ckpt / "hf"
    if not (hf_side / "config.json").exists():
        raise ConversionError(f"{hf_side / 'config.json'} missing: pass --hf-config with the HF config + tokenizer "
                              f"directory of the model")
    reader = CheckpointReader(ckpt / "model")
    hf = load_hf_config(hf_side)
    arch = gpt_arch(hf)  # unsupported architecture -> ValueError
    saved_dtype = reader.tensors["embedding.word_embeddings.weight"][1]
    want = hf_dtype_name(hf) if dtype == "auto" else dtype
    out_dtype = DTYPES.get(want or "", saved_dtype)
    padded = reader.tensors["embedding.word_embeddings.weight"][0][0]
    if verify:  # a layout --verify cannot build must fail before the output is written, not after
        arch.check_parallel_sizes(verify_tp, verify_pp, verify_ep, verify_etp)
        if padded % verify_tp:
            raise ConversionError(f"padded vocabulary {padded} is not divisible by --verify-tp {verify_tp}")
    _prepare_out(out, force, [ckpt])
    copy_side_files(hf_side, out)
    if dtype != "auto":
        cfg = json.loads((out / "config.json").read_text())
        cfg["dtype"] = dtype
        cfg.pop("torch_dtype", None)
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    say(f"{ckpt} -> {out}: {arch.num_layers} layers, saved {str(saved_dtype).replace('torch.', '')} -> "
         f"{str(out_dtype).replace('torch.', '')}, shards <= {max_shard_size}")
    writer = ShardedSafetensorsWriter(out, parse_size(max_shard_size), out_dtype, progress=say)
    n = 0
    for hf_name, t in export_checkpoint(ckpt / "model", arch, progress=say):  # the weight sync's stream, from disk
        writer.add(hf_name, t)
        n += 1
    files = writer.close()
    expected = set(mapping.hf_state_names(arch))
    missing = sorted(expected - writer.seen)
    if missing:
        raise ConversionError(f"checkpoint {ckpt / 'model'} lacks tensors for HF {missing[:6]}")
    say(f"wrote {n} tensors ({writer.total_bytes / 2**20:.1f} MiB) in {len(files)} file(s) in "
         f"{time.perf_counter() - t0:.1f}s")
    result: dict[str, Any] = {"tensors": n, "files": files, "bytes": writer.total_bytes}
    if verify:
        with tempfile.TemporaryDirectory() as tmp:
            task = dict(mode="verify", tp=verify_tp, pp=verify_pp, ep=verify_ep, etp=verify_etp, hf_dir=str(out),
                        config_dir=str(hf_side),
                        model_dir=str(ckpt / "model"), verify=True, result=str(Path(tmp) / "verify.json"),
                        params_dtype="bfloat16" if saved_dtype == torch.bfloat16 else "float32",  # verify in fp32
                        make_vocab_size_divisible_by=padded // verify_tp)
            say(f"verify: loading {ckpt / 'model'} at TP={verify_tp} PP={verify_pp}"
                 + (f" EP={verify_ep}" if arch.is_moe else ""))
            _spawn(task)
            result["verify"] = _check_verify(Path(task["result"]), verify_tol, arch.num_layers)
    return result


# ------------------------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="da3po convert", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  da3po convert hf-to-megatron --hf Qwen3-4B-Base --out ckpt/qwen3-4b-tp2 --tp 2 --verify\n"
               "  da3po convert megatron-to-hf --ckpt ckpt/qwen3-4b-tp2 --out Qwen3-4B-back --verify")
    sub = ap.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    a = sub.add_parser("hf-to-megatron", help="HF safetensors directory -> Megatron dist checkpoint (TP x PP)",
                       description="Spawn TP x PP processes; each loads its shard from the HF files and saves it "
                                   "with megatron.core.dist_checkpointing (torch_dist) to OUT/model.")
    a.add_argument("--hf", required=True, help="HF checkpoint directory (config.json, *.safetensors, tokenizer), or a "
                                               "Hub id found in the local Hugging Face cache")
    a.add_argument("--out", required=True, help="output checkpoint directory (OUT/model, OUT/hf, OUT/meta.json)")
    a.add_argument("--tp", type=int, default=1, help="tensor_model_parallel_size (default 1)")
    a.add_argument("--pp", type=int, default=1, help="pipeline_model_parallel_size (default 1)")
    a.add_argument("--ep", type=int, default=1, help="expert_model_parallel_size (MoE; default 1)")
    a.add_argument("--etp", type=int, default=None, help="expert_tensor_parallel_size (MoE; default: --tp)")
    a.add_argument("--params-dtype", choices=("float32", "bfloat16"), default=None,
                   help="dtype of the saved parameters (default: bfloat16 if the HF config says so, else float32)")
    a.add_argument("--make-vocab-size-divisible-by", type=int, default=1,
                   help="pad the vocabulary to a multiple of this x TP (default 1: only what TP needs)")
    b = sub.add_parser("megatron-to-hf", help="Megatron dist checkpoint (any TP x PP) -> HF safetensors directory",
                       description="Stream the checkpoint layer by layer into HF safetensors shards, copy config and "
                                   "tokenizer from CKPT/hf.")
    b.add_argument("--ckpt", required=True,
                   help="checkpoint directory with model/ and hf/: a converter output, a policy checkpoint, a run's "
                        "step directory or its checkpoints/latest pointer")
    b.add_argument("--out", required=True, help="output HF directory")
    b.add_argument("--hf-config", default=None,
                   help="directory with the HF config.json + tokenizer to use instead of CKPT/hf")
    b.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    b.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                   help="dtype of the written tensors (default auto: the HF config's dtype)")
    b.add_argument("--verify-tp", type=int, default=1, help="TP of the Megatron model built by --verify (default 1)")
    b.add_argument("--verify-pp", type=int, default=1, help="PP of the Megatron model built by --verify (default 1)")
    b.add_argument("--verify-ep", type=int, default=1, help="EP of the Megatron model built by --verify (MoE)")
    b.add_argument("--verify-etp", type=int, default=None, help="ETP of the Megatron model built by --verify (MoE)")
    for p in (a, b):
        p.add_argument("--force", action="store_true", help="overwrite a non-empty output directory")
        p.add_argument("--verify", action="store_true",
                       help="compare Megatron and transformers logits on random tokens, print the max abs diff")
        p.add_argument("--verify-tol", type=float, default=None,
                       help="max abs logit difference accepted by --verify (default: relative, 32 x eps(float32) x "
                            "sqrt(layers) x max|logit|; both sides compute in float32 on the checkpoint's weights)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.direction == "hf-to-megatron":
            hf_to_megatron(args.hf, args.out, args.tp, args.pp, force=args.force, verify=args.verify,
                           params_dtype=args.params_dtype,
                           make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                           verify_tol=args.verify_tol, ep=args.ep, etp=args.etp)
        else:
            megatron_to_hf(args.ckpt, args.out, force=args.force, verify=args.verify,
                           max_shard_size=args.max_shard_size, dtype=args.dtype, verify_tp=args.verify_tp,
                           verify_pp=args.verify_pp, verify_tol=args.verify_tol, hf_config=args.hf_config,
                           verify_ep=args.verify_ep, verify_etp=args.verify_etp)
    except (ConversionError, ValueError, KeyError, FileNotFoundError) as e:
        print(f"da3po convert: error: {e}", file=sys.stderr)
        return 3 if isinstance(e, ConversionError) and str(e).startswith("verification failed") else 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
