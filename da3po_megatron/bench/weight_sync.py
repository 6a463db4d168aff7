#!/usr/bin/env python
"""Benchmark the trainer -> vLLM weight sync: disk, bytes and collective transports side by side in one run.

For each model (``--models``) and engine count (``--engines``) the same Ray engine actors receive the same weights
through every transport (``--paths``), ``--repeats`` times each (weights perturbed before every repeat, so each sync
is a real change); every sync ends with the engines serving the new weights (session closed, prefix cache reset).

- ``disk``: the tensors -> ``model.safetensors`` -> every engine reloads the directory (page cache: a shared file
  system is slower);
- ``bytes``: buckets of ``--bucket-mb`` packed into flat buffers, ``ray.put`` once, pulled by every engine
  (:meth:`RolloutClient.update_weights`);
- ``collective``: a private gloo (CPU) / NCCL (CUDA) group from the sender to every engine worker, flat buckets
  broadcast (:class:`~da3po_megatron.rollout.collective_transport.CollectiveTransport`).

Physical references measured in the same run: ``link`` = one broadcast of a single buffer over the collective group
(what the group's link moves at best; the model's size, at most ``--link-probe-mb``: every receiver allocates it,
and a 2.4 GB probe to two engines next to their models and the sender's exhausted 24 GiB), ``memcpy`` = one
``copy_`` of a buffer of the model's size in this process.
Each row: median seconds, GB/s per engine (model bytes / seconds), that rate as a fraction of link and memcpy, and
the split export+mapping / packing / transfer / engine load (bytes: transfer and load are one engine call; disk: save
/ reload). The sender is a transformers model in the driver (``--source hf``: no Megatron mapping, so export is
~0) or a Megatron policy group (``--source megatron``: export = TP gathers + bridge mapping, on the policy ranks).

Models: ``tiny`` (Qwen3, hidden 512, 8 layers, fp32) and ``qwen3-0.6b`` (random weights with Qwen3-0.6B's shape:
hidden 1024, FFN 3072, 16/8 heads of 128, vocab 151,936, tied; ``--qwen-layers`` of its 28 layers, ``--dtype``).

    da3po bench weight-sync --models tiny qwen3-0.6b --engines 1 2 --dtype bfloat16 --qwen-layers 28
    da3po bench weight-sync --source megatron --policy-tp 2 --models tiny --engines 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, vocab_size=151936, tie_word_embeddings=True, rope_theta=1_000_000.0,
                 rms_norm_eps=1e-6, max_position_embeddings=4096)


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny"], help="tiny, qwen3-0.6b, or HF checkpoint dirs")
    ap.add_argument("--qwen-layers", type=int, default=28, help="qwen3-0.6b: decoder layers (28 = the real depth)")
    ap.add_argument("--engines", type=int, nargs="+", default=[1])
    ap.add_argument("--paths", nargs="+", default=["disk", "bytes", "collective"],
                    choices=("disk", "bytes", "collective"))
    ap.add_argument("--source", choices=("hf", "megatron"), default="hf")
    ap.add_argument("--policy-tp", type=int, default=1, help="--source megatron: tensor_model_parallel_size")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-cache-mb", type=int, default=32)
    ap.add_argument("--link-probe-mb", type=float, default=512, help="size cap of the link-reference broadcast")
    ap.add_argument("--engine-node", choices=("any", "other"), default="any",
                    help="other: the engines on a Ray node other than the driver's (the sender with --source hf), "
                         "e.g. under slurm/train.sbatch with DA3PO_DRIVER; the model directory must be on a shared "
                         "file system (--work-dir)")
    ap.add_argument("--work-dir", default=None, help="where the models are built (default: a temporary directory)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    return ap.parse_args(argv)


def build(name: str, work: str, dtype: str, qwen_layers: int) -> str:
    import torch

    if os.path.isdir(name):
        return name
    from da3po_megatron.tiny import build_model, build_tokenizer

    out = f"{work}/{name}"
    if name == "tiny":
        return str(build_model(out, seed=0, hidden_size=512, num_layers=8, num_heads=16, num_kv_heads=4))
    if name != "qwen3-0.6b":
        raise SystemExit(f"--models: unknown model {name!r} (tiny, qwen3-0.6b or a checkpoint directory)")
    from transformers import AutoModelForCausalLM, Qwen3Config

    tok = build_tokenizer(out)
    cfg = Qwen3Config(num_hidden_layers=qwen_layers, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, dtype=dtype, **QWEN3_06B)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    del model
    return out


def memcpy_seconds(nbytes: int, repeats: int = 3) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


MAX_MODEL_LEN = 256  # the bench generates a few short probes: a small KV cache leaves the memory to the weights


def kv_cache_bytes(model: str, args) -> int:
    """``--kv-cache-mb``, raised to what one MAX_MODEL_LEN sequence of ``model`` needs (x2 for vLLM's rounding):
    a 28-layer Qwen3-0.6B shape needs ~59 MB in float32, more than the tiny model's 32 MiB default."""
    from da3po_megatron.bridge.hf_config import gpt_arch

    arch = gpt_arch(model)  # the bridge reads the HF config (head_dim, KV heads)
    per_token = 2 * arch.num_layers * arch.num_query_groups * arch.kv_channels  # K and V
    need = 2 * per_token * MAX_MODEL_LEN * (2 if args.dtype in ("bfloat16", "float16") else 4)
    return max(args.kv_cache_mb * 2**20, need)


def engine_placement(where: str, n_engines: int) -> tuple[object | None, str]:
    """``--engine-node other``: a placement group pinning every engine to one Ray node that is not the driver's
    (through Ray's per-node ``node:<ip>`` resource); returns it and the placement's name for the rows."""
    if where == "any":
        return None, "same node" if len(_alive_nodes()) == 1 else "any node"
    import ray
    from ray.util.placement_group import placement_group

    here = ray.util.get_node_ip_address()
    others = sorted(ip for ip in _alive_nodes() if ip != here)
    if not others:
        raise SystemExit(f"--engine-node other: the Ray cluster has no node besides the driver's ({here}); run under "
                         "slurm/train.sbatch with DA3PO_DRIVER on 2+ nodes (docs/rollout.md)")
    pg = placement_group([{"CPU": 1, f"node:{others[0]}": 0.001}] * n_engines, strategy="PACK")
    ray.get(pg.ready(), timeout=300)
    return pg, f"{here} -> {others[0]}"


def _alive_nodes() -> list[str]:
    import ray

    return [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]


def bench_one(args, model: str, label: str, n_engines: int, work: str) -> list[dict]:
    import torch

    from da3po_megatron.rollout import EngineConfig, RolloutClient
    from da3po_megatron.rollout.client import iter_buckets, pack_bucket
    from da3po_megatron.rollout.collective_transport import CollectiveTransport, StreamSender
    from da3po_megatron.rollout.weight_sync import hf_state_tensors, save_and_reload, sync_policy_group_to_engines

    pg, placement = engine_placement(args.engine_node, n_engines)
    client = RolloutClient.ray(EngineConfig(model, dtype=args.dtype, kv_cache_memory_bytes=kv_cache_bytes(model, args),
                                            enable_prefix_caching=False, max_model_len=MAX_MODEL_LEN), n_engines,
                               placement_group=pg)
    group = hf = None
    rows: list[dict] = []
    try:
        if args.source == "hf":
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, args.dtype)).eval()
            sender = StreamSender(lambda: hf_state_tensors(hf))
            transport = CollectiveTransport(sender.run, num_stages=1)
            n_bytes = sum(t.numel() * t.element_size() for _, t in hf_state_tensors(hf))

            def perturb(r: int) -> None:
                with torch.no_grad():
                    for p in hf.parameters():
                        p.add_(1e-3 * (r + 1))
        else:
            from da3po_megatron.bridge.export import load_policy_hf
            from da3po_megatron.bridge.hf_config import gpt_arch
            from da3po_megatron.config import standalone_policy_config
            from da3po_megatron.megatron.actor_group import PolicyGroup

            pcfg = standalone_policy_config(model, ["model.params_dtype=float32",
                                                    f"parallel.tensor_model_parallel_size={args.policy_tp}"])
            group = PolicyGroup(pcfg, gpt_arch(model), world_size=args.policy_tp, num_cpus_per_rank=1)
            group.run_on_all(load_policy_hf, model)
            transport = CollectiveTransport(group.run_on_all, num_stages=1)
            n_bytes = 0

            def perturb(r: int) -> None:  # noqa: ARG001 - the policy's weights stay; every sync still moves them all
                pass

        times: dict[str, list[dict]] = {p: [] for p in args.paths}
        t0 = time.perf_counter()
        transport.ensure_group(client)
        setup_s = time.perf_counter() - t0
        for r in range(args.repeats):
            if "collective" in args.paths:
                perturb(r)
                s = transport.sync(client, bucket_mb=args.bucket_mb)
                n_bytes = int(s["bytes"])
                times["collective"].append({"seconds": s["seconds"], "export": s["export_s"], "pack": s["pack_s"],
                                            "transfer": s["engine_recv_s"], "load": s["engine_load_s"]})
            if "bytes" in args.paths:
                perturb(r)
                if args.source == "hf":
                    tp = time.perf_counter()  # packing + ray.put alone, on the same stream (refs dropped)
                    for bucket in iter_buckets(hf_state_tensors(hf), int(args.bucket_mb * 2**20)):
                        import ray

                        ray.put(pack_bucket(bucket))
                    pack_s = time.perf_counter() - tp
                    t = time.perf_counter()
                    client.update_weights(hf_state_tensors(hf), bucket_mb=args.bucket_mb)
                    sec = time.perf_counter() - t
                else:
                    pack_s = float("nan")
                    sec = sync_policy_group_to_engines(group, client, bucket_mb=args.bucket_mb)["seconds"]
                times["bytes"].append({"seconds": sec, "export": 0.0 if args.source == "hf" else float("nan"),
                                       "pack": pack_s, "transfer": float("nan"), "load": sec - pack_s})
            if "disk" in args.paths:
                perturb(r)
                shutil.rmtree(f"{work}/ckpt", ignore_errors=True)
                if args.source == "hf":
                    d = save_and_reload(hf_state_tensors(hf), f"{work}/ckpt", client, model)
                else:
                    from da3po_megatron.bridge.export import export_policy_state

                    t = time.perf_counter()  # gathered on the policy ranks, sent to the driver
                    exported = {k: v for part in group.run_on_all(export_policy_state) for k, v in part.items()}
                    d = save_and_reload(exported.items(), f"{work}/ckpt", client, model)
                    d["seconds"] = time.perf_counter() - t
                    del exported
                times["disk"].append({"seconds": d["seconds"], "export": float("nan"), "pack": d.get("save_seconds"),
                                      "transfer": float("nan"), "load": d["reload_seconds"]})
        probe = min(n_bytes, int(args.link_probe_mb * 2**20))
        link = statistics.median(transport.link_bandwidth(client, probe) for _ in range(max(2, args.repeats)))
        link *= n_bytes / probe  # seconds the link needs for the model's bytes at the probe's rate
        mem = memcpy_seconds(n_bytes)
        transport.teardown(client)
        for path, reps in times.items():
            med = {k: statistics.median(x[k] for x in reps) for k in reps[0]}
            gbps = n_bytes / med["seconds"] / 1e9
            rows.append({"model": label, "engines": n_engines, "placement": placement, "path": path,
                         "mb": round(n_bytes / 1e6, 1),
                         "seconds": round(med["seconds"], 4), "gbps_per_engine": round(gbps, 3),
                         "of_link": round(gbps / (n_bytes / link / 1e9), 3),
                         "of_memcpy": round(gbps / (n_bytes / mem / 1e9), 4),
                         "link_gbps": round(n_bytes / link / 1e9, 3), "memcpy_gbps": round(n_bytes / mem / 1e9, 2),
                         "export_s": round(med["export"], 4), "pack_s": round(med["pack"], 4),
                         "transfer_s": round(med["transfer"], 4), "load_s": round(med["load"], 4),
                         "group_setup_s": round(setup_s, 3)})
    finally:
        if group is not None:
            group.shutdown()
        client.shutdown()
        if pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(pg)
        hf = None  # noqa: F841 - free the model before the next configuration
    return rows


def main(argv=None) -> list[dict]:
    args = parse(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import ray

    from da3po_megatron.trainer.cluster.bringup import start_local_ray

    if not ray.is_initialized():
        if "RAY_ADDRESS" in os.environ:
            ray.init(address=os.environ["RAY_ADDRESS"], include_dashboard=False, log_to_driver=False)
        else:
            start_local_ray(None, max(4, max(args.engines) + args.policy_tp), log_to_driver=False)
    if args.work_dir:
        os.makedirs(args.work_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench_sync_", dir=args.work_dir)
    rows: list[dict] = []
    try:
        for name in args.models:
            model = build(name, work, args.dtype, args.qwen_layers)
            label = name if name != "qwen3-0.6b" else f"qwen3-0.6b-shape L{args.qwen_layers}"
            for n in args.engines:
                rows += bench_one(args, model, f"{label} {args.dtype}", n, work)
                print(json.dumps(rows[-len(args.paths):]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nsource={args.source}, bucket {args.bucket_mb} MiB, median of {args.repeats}; link = one broadcast of a "
          f"single buffer (model-sized, at most {args.link_probe_mb:g} MiB) over the same group, memcpy = one "
          "copy_ of a model-sized buffer")
    print("| model | engines | placement | path | MB | seconds | GB/s per engine | of link | of memcpy | export+map s "
          "| pack s | transfer s | engine load s |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        def f(v):
            return "-" if v != v else f"{v:g}"  # NaN: not separable on this path

        print(f"| {r['model']} | {r['engines']} | {r['placement']} | {r['path']} | {r['mb']} | {r['seconds']:.3f} | "
              f"{r['gbps_per_engine']:.3f} | {r['of_link']:.0%} | {r['of_memcpy']:.1%} | {f(r['export_s'])} | "
              f"{f(r['pack_s'])} | {f(r['transfer_s'])} | {f(r['load_s'])} |")
    for r in rows:
        if r["path"] == "collective":
            print(f"{r['model']}, {r['engines']} engine(s): link {r['link_gbps']} GB/s, memcpy {r['memcpy_gbps']} "
                  f"GB/s, group set-up {r['group_setup_s']} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
