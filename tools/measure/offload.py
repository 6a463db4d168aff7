"""Seconds and GB/s of each ``actor.offload`` tier (megatron/offload.py) on this machine, beside a plain copy of the
same bytes.

One process (gloo, world 1) builds the real policy (megatron-core DDP + distributed optimizer + Adam, fp32 on CPU,
bf16 on CUDA) on a tiny Qwen3 widened by ``--hidden`` / ``--layers``, takes one training step (so Adam's state
exists), then per tier times ``--cycles`` offload + reload cycles through ``PolicyWorker.offload_state`` /
``reload_offloaded``, and a plain ``copy_`` of the same number of bytes (device -> persistent host buffer and
back; pinned on CUDA) as the reference. The first cycle allocates the host buffers and is reported apart.

    python -m torch.distributed.run --nproc-per-node 1 tools/measure/offload.py [--hidden 512 --layers 4 --cycles 5
        --out table.md]

On CPU the "device" is host memory: the figures measure the cycle's own cost (copies, storage resize), not a
PCIe transfer; on a GPU they are the D2H / H2D rates the offload reaches.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def _model(out: Path, hidden: int, layers: int) -> Path:
    from da3po_megatron.tiny import build_model

    return build_model(out, family="qwen3", seed=0, hidden_size=hidden, num_layers=layers, ffn_hidden_size=3 * hidden,
                       num_heads=hidden // 32, num_kv_heads=max(1, hidden // 128))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from da3po_megatron.megatron.batching import PolicyBatch
    from da3po_megatron.testing.policy_job import ADVANTAGES, small_policy
    from da3po_megatron.testing.policy_selfcheck import fixed_batch
    with tempfile.TemporaryDirectory() as d:
        hf = _model(Path(d) / "hf", args.hidden, args.layers)
        w = small_policy(str(hf), overrides=("actor.offload=all",))
        prompts, responses = fixed_batch()
        lp = w.compute_logprobs(PolicyBatch(prompts, responses))
        w.train_step(PolicyBatch(prompts, responses, lp, ADVANTAGES))
        cuda = w.device.type == "cuda"

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize()

        rows = []
        for tier, parts in (("grads", ("grads",)), ("grads+optimizer", ("grads", "optimizer")),
                            ("all", ("grads", "optimizer", "params"))):
            times = []
            freed: dict[str, int] = {}
            for _ in range(args.cycles + 1):
                sync()
                t0 = time.perf_counter()
                freed = w.offload_state(parts)
                sync()
                t1 = time.perf_counter()
                w.reload_offloaded()
                sync()
                times.append((t1 - t0, time.perf_counter() - t1))
            copied = sum(v for k, v in freed.items() if k != "grads")  # gradients are freed, not copied
            off = min(t[0] for t in times[1:])
            on = min(t[1] for t in times[1:])
            if copied:
                src = torch.empty(copied, dtype=torch.uint8, device=w.device)
                host = torch.empty(copied, dtype=torch.uint8, pin_memory=cuda)
                memcpy = []
                for _ in range(args.cycles):
                    sync()
                    t0 = time.perf_counter()
                    host.copy_(src, non_blocking=cuda)
                    sync()
                    t1 = time.perf_counter()
                    src.copy_(host, non_blocking=cuda)
                    sync()
                    memcpy.append((t1 - t0, time.perf_counter() - t1))
                mo, mi = min(m[0] for m in memcpy), min(m[1] for m in memcpy)
                del src, host
            else:
                mo = mi = float("nan")
            rows.append({"tier": tier, "freed_bytes": sum(freed.values()), "copied_bytes": copied,
                         "first_offload_s": times[0][0], "offload_s": off, "reload_s": on,
                         "offload_gbps": copied / off / 1e9 if copied else float("nan"),
                         "reload_gbps": copied / on / 1e9 if copied else float("nan"),
                         "memcpy_out_gbps": copied / mo / 1e9 if copied else float("nan"),
                         "memcpy_in_gbps": copied / mi / 1e9 if copied else float("nan")})
        w.shutdown()
    head = (f"device {'cuda' if cuda else 'cpu'}, hidden {args.hidden}, layers {args.layers}, best of "
            f"{args.cycles} cycles (the first, which allocates the host buffers, apart)")
    lines = [head, "", "| tier | freed MB | copied MB | first offload s | offload s | reload s | offload GB/s | "
             "reload GB/s | memcpy out GB/s | memcpy in GB/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tier']} | {r['freed_bytes'] / 1e6:.1f} | {r['copied_bytes'] / 1e6:.1f} | "
                     f"{r['first_offload_s']:.4f} | {r['offload_s']:.4f} | {r['reload_s']:.4f} | "
                     f"{r['offload_gbps']:.2f} | {r['reload_gbps']:.2f} | {r['memcpy_out_gbps']:.2f} | "
                     f"{r['memcpy_in_gbps']:.2f} |")
    text = "\n".join(lines)
    print(text)
    print(json.dumps(rows))
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
