"""The control plane at full size: one RL step of the real driver code, with stand-in engines and policy ranks.

``da3po bench control-plane --size paper|4x|16x [--scale F]`` (or ``python -m da3po_megatron.bench.control_plane``) runs
the driver's own code of one step of Algorithm 1 -- :meth:`RolloutClient.generate` with its ``assemble``, the reward
pool (:class:`RewardPool`, real worker processes, the ``coin`` reward of ``da3po_megatron/bench/rl_step.py``),
``Sampler.score`` / ``make_groups`` with overlong shaping, the dynamic-sampling buffer over generation rounds
(over-sampled as ``Sampler.prompts_for_round`` does), ``compute_advantages`` with DAA, ``policy_batch``,
``old_logprobs`` (the policy's ``compute_logprobs``, the mismatch metrics), ``PolicyGroup.train_step``,
``step_metrics`` and ``RunState.trainer_state`` written with ``torch.save`` -- against stand-ins that do no model
compute:

- engines (:class:`StandInEngine`): real Ray actors that return :class:`Completion` objects of the recorded shape:
  response lengths gamma-distributed (shape 2) and capped at the size's L_max (``finish_reason="length"`` there),
  random token ids in a 151,643-token vocabulary (Qwen's), random log-probs, ~4 characters of text per token ending
  in a verdict the ``coin`` reward reads; each prompt's success probability from a Beta(0.4, 0.6) prior, so dynamic
  sampling keeps ~70 % of groups at G = 16;
- policy ranks (:class:`StandInRank`): real Ray actors that receive what :class:`PolicyGroup` sends them (real Ray
  serialization), take their data-parallel share as the real :class:`PolicyWorker` does (``ForwardSchedule.dp_shard``
  for ``compute_logprobs``, per mini-batch for ``train_step``), touch every token of it, and acknowledge with what they
  received. ``compute_logprobs`` answers with the shape the real worker returns.

Sizes (``--size``): ``paper`` = the DA3PO paper's step (512 prompts x G = 16 kept, responses up to 4K tokens,
mean 2,283 tokens -- the 18.7 M-token batch of issue 36 --, 16 policy ranks on 2 x 8 GPUs); ``4x`` = 2,048 prompts,
32 ranks; ``16x`` = 8,192 prompts, responses up to 8K (mean 4,566), 64 ranks. ``--scale F`` simulates the fraction F
of the prompts (and so of the tokens) and extrapolates per-token work linearly (x 1/F); ``--ranks-actual R`` runs R
stand-in rank actors in place of the size's ranks (2 shared cores cannot hold 64 Python processes); per-rank work is
then extrapolated x ranks / R for what is sent to every rank (the "before" data path serialized the batch once per
rank) -- the table says which factor each column used.

MoE (``--moe qwen3-30b-a3b``, issue 46 M3): the stand-in engines also return Qwen3-30B-A3B's routes (48 MoE layers x
top-8, uint8: 384 B per position, prompt included) and routing replay R3 is on, so every route travels: engine ->
driver (``generate``), into the groups and the batch, to the ranks' shares (``old_logprobs``, ``train``) and into
the driver's checkpoint state; compare with the dense run of the same size. The stand-ins are in
``da3po_megatron/testing/control_plane_standins.py``.

The modeled GPU step time (the denominator of the overhead ratio): verl's DAPO recipe on Qwen2.5-32B reports, for the
paper-size batch on 16 GPUs, step times of 566-699 s (issue 36; verl ``recipe/dapo`` README, the DAPO step timings);
we use their middle, 630 s, and scale it with response tokens per GPU (decode and training are linear in tokens at
fixed length; attention's quadratic part is left out, which makes the modeled time -- and so the ratio's denominator
-- smaller, i.e. the ratio pessimistic).

Per phase it prints driver wall seconds, driver CPU seconds, bytes moved through Ray (Ray's own serializer sizes
each payload: completions returned by the engines, what the ranks were sent and what they returned), the driver's
peak RSS (``ru_maxrss``) and the object store's peak (polled from the raylet every 0.2 s).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from da3po_megatron.bench.driver_probe import DriverIntake, Phases, StorePoll, ray_bytes, rss_mb
from da3po_megatron.testing import control_plane_standins
from da3po_megatron.testing.control_plane_standins import StandInEngine, StandInRank, _warm_rank, standin_logprobs

MODEL_STEP_S_PAPER = 630.0  # middle of verl's 566-699 s DAPO step on 16 GPUs at the paper's batch (see docstring)
PAPER_TOKENS = 18.7e6  # response tokens of the paper-size batch (issue 36)


@dataclass(frozen=True)
class Size:
    name: str
    prompts: int  # kept groups per step (data.train_batch_size)
    group: int  # G
    max_response: int  # L_max
    mean_response: float  # mean response length before the cap
    prompt_len: int
    ranks: int  # policy ranks (one per GPU, DP = ranks)
    engines: int  # rollout engines (one per GPU pair)
    mini_batch: int  # actor.ppo_mini_batch_size (prompts per optimizer step)

    def model_step_s(self, response_tokens: float) -> float:
        """Modeled GPU seconds of the step: the paper's step scaled by response tokens per GPU."""
        return MODEL_STEP_S_PAPER * (response_tokens / PAPER_TOKENS) * (16 / self.ranks)


SIZES = {
    "tiny": Size("tiny", 8, 4, 64, 24.0, 16, 4, 2, 2),
    "paper": Size("paper", 512, 16, 4096, 2700.0, 256, 16, 8, 32),
    "4x": Size("4x", 2048, 16, 4096, 2700.0, 256, 32, 16, 128),
    "16x": Size("16x", 8192, 16, 8192, 5400.0, 256, 64, 32, 512),
}


# ------------------------------------------------------------------------------------------------ the step
# examples/tiny_cpu_da3po.yaml's settings (the CPU demo's recipe) that the step below does not set itself, written
# out so that the bench runs from an installed package without the examples/ folder
RECIPE = ["model.path=outputs/demo/warmup", "model.params_dtype=float32", "parallel.pipeline_model_parallel_size=1",
          "optim.lr=1.0e-4", "optim.weight_decay=0.0", "optim.clip_grad=1.0", "rollout.num_engines=1",
          "rollout.dtype=float32", "rollout.kv_cache_memory_bytes=67108864", "rollout.weight_sync_bucket_mb=16",
          "rollout.logprob_check_fraction=1.0", "algorithm.name=da3po", "algorithm.overlong.buffer_length=4",
          "daa.lambda_=2.0", "daa.tau=0.5", "data.format=synthetic", "data.synthetic.min_digits=1",
          "data.synthetic.max_digits=8", "data.synthetic.train_per_bucket=256", "data.synthetic.eval_per_bucket=16",
          "reward.num_workers=1", "reward.timeout_s=5", "eval.every=10", "eval.benchmarks=[synthetic]", "eval.k=4",
          "ray.address=local", "trainer.total_steps=30", "trainer.seed=1", "trainer.save_every=10",
          "trainer.keep_last=2", "trainer.run_dir=runs/tiny_cpu_da3po"]


def bench_config(size: Size, prompts: int, ranks: int, dp: int, moe: Any = None):
    """The run config of the step (``moe``: a named MoE's routes, with routing replay R3 on: every route travels)."""
    from da3po_megatron.config import load_config

    mini = max(1, min(size.mini_batch, prompts))
    return load_config(None, [*RECIPE,
        f"rollout.n={size.group}", f"rollout.max_response_length={size.max_response}",
        "rollout.max_prompt_length=2048", f"data.train_batch_size={prompts}",
        f"actor.max_tokens_per_microbatch={2048 + size.max_response}",
        f"actor.ppo_mini_batch_size={mini}", f"parallel.data_parallel_size={dp}",
        f"parallel.tensor_model_parallel_size={ranks // dp}",
        "reward.kind=coin", "algorithm.max_generation_rounds=8", "trainer.tensorboard=false",
        *(["moe.routing_replay=rollout"] if moe is not None else [])])


def make_policy_group(cfg, actors, infos):
    """The real :class:`PolicyGroup` dispatch around stand-in actors (no megatron-core behind them)."""
    from da3po_megatron.megatron.actor_group import PolicyGroup

    if hasattr(PolicyGroup, "attach"):
        return PolicyGroup.attach(cfg, actors, infos)
    g = object.__new__(PolicyGroup)
    g.cfg, g.actors, g.world_size, g.infos = cfg, actors, len(actors), infos
    g._pg, g._own_pg, g.start_timeout_s, g.rank_hosts = None, False, 600.0, None
    return g


def run_step(size: Size, scale: float, ranks_actual: int, engines_actual: int, reward_workers: int,
             tmp: Path, dp: int | None = None, keep_rows: bool = False, moe: Any = None) -> dict[str, Any]:
    """One step at ``size`` x ``scale`` (see the module docstring); ``dp``: data-parallel ranks among the
    ``ranks_actual`` (default all: TP = 1); ``keep_rows``: the ranks report which rows they held and worked on;
    ``moe``: a ``control_plane_standins.RouteShape`` -- the engines return its routes and R3 replays them."""
    import ray
    import torch

    from da3po_megatron.algorithms import DynamicSamplingBuffer
    from da3po_megatron.data.datasets import Example
    from da3po_megatron.rewards.pool import RewardPool
    from da3po_megatron.rollout.client import RolloutClient
    from da3po_megatron.rollout.consistency import DriftMonitor
    from da3po_megatron.rollout.route_refs import ROUTES_FILE, write_routes
    from da3po_megatron.rollout.types import EngineConfig
    from da3po_megatron.trainer import batch as B
    from da3po_megatron.trainer.batch import StepRollout
    from da3po_megatron.trainer.generation.collect import token_stats
    from da3po_megatron.trainer.generation.sampler import GENERATION_TOTALS, Sampler
    from da3po_megatron.trainer.observability.step_metrics import step_metrics
    from da3po_megatron.trainer.old_logprobs import old_logprobs
    from da3po_megatron.trainer.resume.run_state import RunState

    prompts = max(1, round(size.prompts * scale))
    dp = dp or ranks_actual
    cfg = bench_config(size, prompts, ranks_actual, dp, moe)
    phases = Phases()
    engine_cls = ray.remote(num_cpus=0)(StandInEngine)
    engines = [engine_cls.remote(e, size.max_response, size.mean_response, moe) for e in range(engines_actual)]
    rank_cls = ray.remote(num_cpus=0)(type("StandInRankTP", (StandInRank,), {"tp": ranks_actual // dp}))
    ranks = [rank_cls.remote(r, dp, cfg.ppo_mini_batch_responses, keep_rows) for r in range(ranks_actual)]
    ray.get([e.ready.remote() for e in engines])
    infos = ray.get([r.info.remote() for r in ranks])
    ray.get([r.execute.remote(_warm_rank) for r in ranks])  # imports (torch) outside the timed phases
    if moe is not None:  # the checkpoint's route writer starts once per run, not per step (route_refs.RouteFiles)
        from da3po_megatron.rollout.route_refs import route_files

        ray.get(route_files().__ray_ready__.remote())
    rollout = RolloutClient(EngineConfig(model_path="stand-in"), engines, mode="ray")
    policy = make_policy_group(cfg, ranks, infos)
    rewards = RewardPool(num_workers=reward_workers, timeout_s=10.0)
    sampler = Sampler.__new__(Sampler)  # the trainer's sampler over stand-in parts (no dataset, no tokenizer)
    sampler.__dict__.update(cfg=cfg, rewards=rewards, rollout=rollout, data_skipped_rows=0, engine_weight_step=0,
                            buffer=DynamicSamplingBuffer(prompts, surplus="carry", group_size=size.group),
                            prompts=SimpleNamespace(state_dict=lambda: {"position": 0}), selection_metrics={},
                            totals=dict.fromkeys(GENERATION_TOTALS, 0))
    sampler.totals.update(groups=10 * prompts, kept_groups=7 * prompts)  # steady state: earlier steps' keep rate
    drift = DriftMonitor(0.0)
    state = RunState(cfg, None, None, sampler, drift)  # type: ignore[arg-type] - no checkpoint manager needed
    run = SimpleNamespace(cfg=cfg, policy=policy, drift=drift, state=state, buffer=sampler.buffer)
    sampling_seed = 1
    from da3po_megatron.rollout.types import SamplingConfig

    rollout.generate([[0, 7]] * len(engines), SamplingConfig(n=1, max_tokens=2, seed=0))  # engines' first call
    rss_base = rss_mb()
    poll = StorePoll()
    poll.start()
    phases.poll = poll
    uid = 0
    intake, route_to_driver = DriverIntake(), 0.0  # bytes the driver deserialised; the routes' part of them
    generated: list = []
    t_step = time.perf_counter()
    for round_ in range(cfg.algorithm.max_generation_rounds):
        if run.buffer.is_full:
            break
        k = sampler.prompts_for_round(prompts - len(run.buffer))
        examples = [Example(uid=f"p{uid + i}", prompt="", source="bench",  # coin reward: correct w.p. p
                            answer=f"coin:{np.random.default_rng(uid + i).beta(0.4, 0.6):.6f}") for i in range(k)]
        token_prompts = [[uid + i] + [7] * (size.prompt_len - 1) for i in range(k)]
        uid += k
        with phases("generate"), intake:
            comps = rollout.generate(token_prompts, sampler.sampling_config(sampling_seed + round_))
        sample = [c for cs in comps[:8] for c in cs]
        scale_up = len(comps) * size.group / len(sample)
        phases.add_bytes("generate", sum(ray_bytes(c) for c in sample) * scale_up)
        route_to_driver += sum(ray_bytes(c) - ray_bytes(replace(c, routed_experts=None)) for c in sample
                               if c.routed_experts is not None) * scale_up  # the routes' part of the answer
        with phases("reward"):
            groups = sampler.score(examples, comps)
        with phases("dynamic_sampling"):
            generated += groups
            sampler.totals["groups"] += len(groups)
            sampler.totals["kept_groups"] += run.buffer.add(groups, [g.p_hat for g in groups])
        del comps
    with phases("dynamic_sampling"):
        batch_groups = run.buffer.take()
        stats = {**run.buffer.stats(), **token_stats(batch_groups, generated)}
    with phases("advantages"):
        daa = B.compute_advantages(batch_groups, cfg.algorithm.advantage_eps, cfg.daa.enable, cfg.daa.lambda_,
                                   cfg.daa.tau, cfg.daa.mode, cfg.daa.lambda_min, cfg.daa.lambda_max)
    with phases("policy_batch"):
        batch = B.policy_batch(batch_groups)
    batch_bytes = ray_bytes(batch)
    route_bytes = 0 if batch.routed_experts is None else \
        int(batch.routed_experts.lengths().sum()) * moe.layers * moe.top_k  # uint8: one byte per expert id
    with phases("old_logprobs"), intake:
        batch, mismatch = old_logprobs(run, batch, fresh=True)
    with phases("train"), intake:
        train_metrics = policy.train_step(batch)
    reports = ray.get([r.report.remote() for r in ranks])
    with phases("metrics"):
        ro = StepRollout(batch_groups, generated, stats, 0, {})
        metrics = step_metrics(cfg, 0, ro, daa, mismatch, train_metrics, {}, {}, time.perf_counter() - t_step,
                               {**sampler.totals, **state.update_totals})
    with phases("checkpoint"):
        # the leftover (carried) groups are the driver state that grows with the batch
        # (as CheckpointManager.start: routes by reference are written to routes.npz by a Ray actor)
        path = tmp / "trainer_state.pt"
        with intake:
            torch.save(write_routes(state.trainer_state(), tmp), path)
    phases.add_bytes("checkpoint", path.stat().st_size)
    route_file = tmp / ROUTES_FILE
    route_file_bytes = route_file.stat().st_size if route_file.exists() else 0
    store_peak = poll.stop()
    rewards.close()
    response_tokens = float(sum(len(r) for g in batch_groups for r in g.response_ids))
    # bytes each rank was sent: what the dispatch serialized, per call
    per_rank = [{m: sum(x["held_rows"] for x in rep if x["method"] == m) for m in ("compute_logprobs", "train_step")}
                for rep in reports]
    sent = getattr(policy, "sent_bytes", None)
    if sent:  # the sharded path counts what it put; only rank 0 answers with the log-probs
        phases.add_bytes("old_logprobs", sent.get("compute_logprobs", 0) + ray_bytes(standin_logprobs(batch, True)))
        phases.add_bytes("train", sent.get("train_step", 0))
    else:  # every rank received the whole batch, and answered with all log-probs: once per rank and call
        lp_bytes = ray_bytes(standin_logprobs(batch))
        phases.add_bytes("old_logprobs", (batch_bytes + lp_bytes) * ranks_actual)
        phases.add_bytes("train", batch_bytes * ranks_actual)
    for a in engines + ranks:
        ray.kill(a)
    return {"size": size.name, "scale": scale, "prompts": prompts, "responses": len(batch),
            "response_tokens": response_tokens, "generated_groups": len(generated),
            "kept_frac": metrics.get("dynamic_sampling/kept_frac"), "ranks_actual": ranks_actual,
            "engines_actual": engines_actual, "phases": phases.rows, "batch_bytes": batch_bytes,
            "route_bytes": route_bytes, "moe": None if moe is None else moe.name,
            "driver_deserialised_bytes": intake.bytes, "route_bytes_to_driver": route_to_driver,
            "route_bytes_to_ranks": sum(x.get("route_bytes", 0) for rep in reports for x in rep),
            "checkpoint_route_file_bytes": route_file_bytes,
            "driver_peak_rss_mb": rss_mb(), "driver_base_rss_mb": rss_base, "object_store_peak_bytes": store_peak,
            "per_rank_rows": per_rank, "reports": reports if keep_rows else None,
            "policy_batch_rows": len(batch), "step_wall_s": time.perf_counter() - t_step,
            "dispatch_puts": getattr(policy, "put_counts", None)}


def extrapolate(res: dict[str, Any], size: Size) -> dict[str, Any]:
    """Full-size figures: per-token work x 1/scale; what every rank was sent x ranks / ranks_actual when the
    batch went to every rank whole (the "before" data path), x 1 when each rank got only its share."""
    f_tok = 1.0 / res["scale"]
    whole = res.get("dispatch_puts") is None
    f_rank = size.ranks / res["ranks_actual"] if whole else 1.0
    out = {}
    for name, r in res["phases"].items():
        f = f_tok * (f_rank if name in ("old_logprobs", "train") else 1.0)
        out[name] = {k: (v * f if k in ("wall_s", "cpu_s", "bytes") else v) for k, v in r.items()}
    tokens = res["response_tokens"] * f_tok
    total = sum(r["cpu_s"] for r in out.values())  # the driver's own work (stand-ins' compute is not the driver's)
    model = size.model_step_s(tokens)
    return {"phases": out, "response_tokens": tokens, "driver_s": total,
            "driver_wall_s": sum(r["wall_s"] for r in out.values()), "model_step_s": model,
            "overhead": total / model,
            "rss_mb": res["driver_base_rss_mb"] + (res["driver_peak_rss_mb"] - res["driver_base_rss_mb"]) * f_tok,
            "store_peak_bytes": res["object_store_peak_bytes"] * f_tok * f_rank,
            "route_bytes": res.get("route_bytes", 0) * f_tok,
            **{k: res.get(k, 0) * f_tok for k in ("driver_deserialised_bytes", "route_bytes_to_driver",
                                                   "route_bytes_to_ranks", "checkpoint_route_file_bytes")}}


def table(res: dict[str, Any], full: dict[str, Any], size: Size) -> str:
    moe = f"; {res['moe']} routes with R3 (batch routes {res['route_bytes'] / 2**20:.0f} MB, full size " \
        f"{full['route_bytes'] / 2**30:.1f} GB)" if res.get("moe") else "; dense"
    lines = [f"size {size.name}{moe}: {res['prompts']} prompts x G={size.group} simulated (scale {res['scale']:g}), "
             f"{res['responses']} responses, {res['response_tokens'] / 1e6:.2f} M response tokens, "
             f"{res['generated_groups']} groups generated (kept {res['kept_frac']:.2f}); "
             f"{res['ranks_actual']} rank actors for {size.ranks}, {res['engines_actual']} engines",
             f"{'phase':<17}{'wall s':>9}{'cpu s':>9}{'MB moved':>11}{'RSS MB':>9} | full size: "
             f"{'cpu s':>9}{'wall s':>9}{'GB moved':>10}"]
    for name, r in res["phases"].items():
        fr = full["phases"][name]
        lines.append(f"{name:<17}{r['wall_s']:>9.2f}{r['cpu_s']:>9.2f}{r['bytes'] / 2**20:>11.1f}"
                     f"{r['rss_mb']:>9.0f} | {'':>10}{fr['cpu_s']:>9.1f}{fr['wall_s']:>9.1f}"
                     f"{fr['bytes'] / 2**30:>10.2f}")
    lines.append(f"driver total {sum(r['cpu_s'] for r in res['phases'].values()):.2f} s CPU, "
                 f"{sum(r['wall_s'] for r in res['phases'].values()):.2f} s wall measured; "
                 f"peak RSS {res['driver_peak_rss_mb']:.0f} MB, object store peak "
                 f"{res['object_store_peak_bytes'] / 2**20:.0f} MB")
    lines.append(f"full size: {full['response_tokens'] / 1e6:.1f} M tokens, driver {full['driver_s']:.1f} s CPU "
                 f"({full['driver_wall_s']:.1f} s wall on 2 shared cores) vs "
                 f"modeled GPU step {full['model_step_s']:.0f} s -> overhead {100 * full['overhead']:.2f} %; "
                 f"RSS ~{full['rss_mb'] / 1024:.1f} GB, object store peak ~{full['store_peak_bytes'] / 2**30:.1f} GB")
    lines.append(f"driver deserialised {res['driver_deserialised_bytes'] / 2**20:.1f} MB (full size "
                 f"{full['driver_deserialised_bytes'] / 2**30:.2f} GB); routes engines -> driver "
                 f"{res['route_bytes_to_driver'] / 2**20:.2f} MB ({full['route_bytes_to_driver'] / 2**30:.3f} GB), "
                 f"fetched by the ranks {res['route_bytes_to_ranks'] / 2**20:.1f} MB "
                 f"({full['route_bytes_to_ranks'] / 2**30:.1f} GB), checkpoint route file "
                 f"{res['checkpoint_route_file_bytes'] / 2**20:.1f} MB (written by a Ray actor)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="da3po bench control-plane")
    ap.add_argument("--size", choices=sorted(SIZES), default="paper")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the size's prompts to simulate")
    ap.add_argument("--ranks-actual", type=int, default=None, help="stand-in rank actors (default min(ranks, 16))")
    ap.add_argument("--engines-actual", type=int, default=None, help="stand-in engines (default min(engines, 4))")
    ap.add_argument("--reward-workers", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--moe", choices=sorted(control_plane_standins.MOE_MODELS), default=None,
                    help="the engines return this MoE's routes (uint8 [positions, layers, top_k]) and routing "
                         "replay R3 is on: every route travels engine -> driver -> ranks")
    args = ap.parse_args(argv)
    size = SIZES[args.size]
    import ray

    from da3po_megatron.trainer.cluster.bringup import start_local_ray

    tmp = Path(tempfile.mkdtemp(prefix="da3po-cp-", dir="/tmp"))
    start_local_ray(str(tmp / "ray"), num_cpus=2, log_to_driver=False)
    try:
        res = run_step(size, args.scale, args.ranks_actual or min(size.ranks, 16),
                       args.engines_actual or min(size.engines, 4), args.reward_workers, tmp,
                       moe=control_plane_standins.MOE_MODELS.get(args.moe))
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    full = extrapolate(res, size)
    print(table(res, full, size), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"measured": res, "full_size": full}, indent=1, default=float))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
