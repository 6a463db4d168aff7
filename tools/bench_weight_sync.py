#!/usr/bin/env python
"""Benchmark the trainer -> vLLM weight sync: in-memory bucketed sync vs saving an HF checkpoint + engine reload.

Both paths start from the same weights in the trainer's memory and end with every engine serving them (prefix cache
reset included); they run side by side in one process on the same engines, ``--repeats`` times each (the weights are
perturbed before every repeat so each sync is a real change), and the table shows median seconds, GB/s (model bytes
per engine / seconds) and the ratio disk / memory.

- ``memory``: HF-named tensors -> safetensors buckets of ``--bucket-mb`` -> every engine (``RolloutClient``);
- ``disk``: the same tensors -> ``model.safetensors`` in ``--disk-dir`` -> every engine reloads the directory
  (vLLM ``reload_weights(weights_path=...)``). The file is read back from the page cache right after it was written,
  so on a shared cluster file system the disk path is slower than measured here.

Sources: ``--source hf`` (a transformers model in this process; default) or ``--source megatron`` (a Megatron
``PolicyGroup`` of ``--policy-tp`` Ray actors: memory = :func:`sync_policy_group_to_engines`, the policy ranks push
buckets straight to the engine actors; disk = export to the driver, HF mapping, save, reload).

    python tools/bench_weight_sync.py                                  # tiny Qwen3, hidden 512, 8 layers (~100 MB)
    python tools/bench_weight_sync.py --source megatron --policy-tp 2 --ray
    python tools/bench_weight_sync.py --model /ckpt/Qwen3-4B-Base --dtype bfloat16 --ray --engines 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: build a tiny random Qwen3)")
    ap.add_argument("--hidden-size", type=int, default=512, help="tiny model only")
    ap.add_argument("--num-layers", type=int, default=8, help="tiny model only")
    ap.add_argument("--source", choices=("hf", "megatron"), default="hf")
    ap.add_argument("--policy-tp", type=int, default=1, help="--source megatron: tensor_model_parallel_size")
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--ray", action="store_true", help="engines as Ray actors (required for --source megatron)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--disk-dir", default=None, help="where the disk path writes its checkpoint (default: a tmp dir)")
    ap.add_argument("--kv-cache-mb", type=int, default=64)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from da3po_megatron.rollout import EngineConfig, RolloutClient
    from da3po_megatron.rollout.weight_sync import (
        hf_state_tensors,
        save_and_reload,
        sync_policy_group_to_engines,
    )

    if args.source == "megatron" and not args.ray:
        raise SystemExit("--source megatron needs --ray (the policy ranks are Ray actors)")
    work = tempfile.mkdtemp(prefix="bench_sync_")
    model = args.model
    if model is None:
        from da3po_megatron.tiny import build_model

        model = str(build_model(f"{work}/qwen3", seed=0, hidden_size=args.hidden_size, num_layers=args.num_layers,
                                num_heads=args.hidden_size // 32, num_kv_heads=max(1, args.hidden_size // 128)))
    disk_dir = args.disk_dir or f"{work}/ckpt"
    if args.ray or args.source == "megatron":
        import ray

        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS", "local"), include_dashboard=False, log_to_driver=False,
                     **({"num_cpus": max(4, args.engines + args.policy_tp)} if "RAY_ADDRESS" not in os.environ
                        else {}))
    cfg = EngineConfig(model, dtype=args.dtype, kv_cache_memory_bytes=args.kv_cache_mb * 2**20)
    client = RolloutClient.ray(cfg, args.engines) if args.ray else RolloutClient.local(cfg, args.engines)
    group = None
    rows: dict[str, list[float]] = {"memory": [], "disk": []}
    n_bytes = 0
    try:
        if args.source == "hf":
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, args.dtype)).eval()
            n_bytes = sum(t.numel() * t.element_size() for _, t in hf_state_tensors(hf))
            for r in range(args.repeats):
                with torch.no_grad():
                    for p in hf.parameters():
                        p.add_(1e-3 * (r + 1))
                t = time.perf_counter()
                client.update_weights(hf_state_tensors(hf), bucket_mb=args.bucket_mb)
                rows["memory"].append(time.perf_counter() - t)
                with torch.no_grad():
                    for p in hf.parameters():
                        p.add_(1e-3)
                shutil.rmtree(disk_dir, ignore_errors=True)
                rows["disk"].append(save_and_reload(hf_state_tensors(hf), disk_dir, client, model)["seconds"])
        else:
            from da3po_megatron.bridge.export import export_policy_state, load_policy_hf
            from da3po_megatron.config import standalone_policy_config
            from da3po_megatron.megatron.actor_group import PolicyGroup

            pcfg = standalone_policy_config(model, ["model.params_dtype=float32",
                                                    f"parallel.tensor_model_parallel_size={args.policy_tp}"])
            group = PolicyGroup(pcfg, world_size=args.policy_tp, num_cpus_per_rank=1)
            group.run_on_all(load_policy_hf, model)
            for _ in range(args.repeats):
                stats = sync_policy_group_to_engines(group, client, bucket_mb=args.bucket_mb)
                rows["memory"].append(stats["seconds"])
                n_bytes = stats["bytes"]
                shutil.rmtree(disk_dir, ignore_errors=True)
                t = time.perf_counter()
                exported = {k: v for part in group.run_on_all(export_policy_state) for k, v in part.items()}
                save_and_reload(exported.items(), disk_dir, client, model)  # gathered on the ranks, sent to the driver
                rows["disk"].append(time.perf_counter() - t)
                del exported
    finally:
        if group is not None:
            group.shutdown()
        client.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {"bench": "weight_sync", "model": model if args.model else f"tiny qwen3 h{args.hidden_size} "
              f"L{args.num_layers}", "source": args.source, "policy_tp": args.policy_tp, "engines": args.engines,
              "ray": args.ray, "dtype": args.dtype, "bucket_mb": args.bucket_mb, "model_bytes": n_bytes,
              "memory_s": round(med["memory"], 4), "disk_s": round(med["disk"], 4),
              "memory_gbps": round(n_bytes / med["memory"] / 1e9, 3),
              "disk_gbps": round(n_bytes / med["disk"] / 1e9, 3),
              "disk_over_memory": round(med["disk"] / med["memory"], 2), "repeats": args.repeats}
    print(f"{result['model']}: {n_bytes / 1e6:.1f} MB per engine, {args.engines} engine(s) "
          f"({'Ray' if args.ray else 'in-process'}), source={args.source}, bucket {args.bucket_mb} MiB")
    print(f"  {'path':<8} {'seconds':>9} {'GB/s':>8}")
    for k in ("memory", "disk"):
        print(f"  {k:<8} {med[k]:>9.3f} {n_bytes / med[k] / 1e9:>8.3f}")
    print(f"  disk / memory = {result['disk_over_memory']:.2f}x")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
