"""Benchmark asynchronous RL (issue 37): staleness k, with and without partial rollouts, on long-tailed lengths.

Each setting is a real ``da3po train`` run (megatron-core policy, vLLM engine, Ray, reward pool) of a random-weight
model of the given shape on the synthetic task's eight difficulty buckets with the benchmark options of
``data/synthetic.py``: every prompt's responses are exactly as long as a length drawn once per prompt from a
log-normal whose median grows geometrically with the bucket (``data.synthetic.response_tokens=[easy, hard]``,
``rollout.ignore_eos=true``: hard prompts are long, with a long tail, as in math RL), and a response is correct with a
per-bucket probability falling with the bucket (``data.synthetic.coin_p``, ``reward.kind=coin``), so dynamic sampling
keeps and filters groups as it would on a policy that solves easy prompts and rarely hard ones. All settings see the
same prompts and seeds; ``--warmup`` steps, then ``--steps`` measured.

Settings (``--settings``, comma-separated): ``K`` = ``rollout.staleness=K``; a suffix ``p`` adds
``rollout.partial_rollouts=true``, ``d`` the comparison's discard policy (``rollout.late_policy=discard``: groups
released as they complete, late kept groups thrown away, counted per bucket). ``0`` is the paper's synchronous loop,
the reference.

Printed per setting (means over the measured steps): step time, generate / train / wait / pause phases (wait: the
policy waiting for its batch; pause: draining or interrupting the producer's requests before the weight sync),
trained tokens per step and per second (and the speed-up over the reference), the share of *hard* groups (buckets
whose coin p < tau, the p_hat < tau regime where DAA acts) in the trained batches with its binomial standard error,
and in everything generated, the hard share's change against the reference (issue 37: it must not fall), the
histogram of staleness (versions behind, over the trained groups) and, with partial rollouts, of versions spanned
per response, and with ``d`` the groups discarded for being late per bucket (summed over the measured steps).

    da3po bench async                                  # the issue-37 table (docs/throughput.md)
    da3po bench async --settings 0,1,2p --steps 2     # a quick look
    da3po bench async --small                          # CI-sized
    da3po bench async --standin 1,4                    # the producer's pause / engine idle at 1 vs 4 engines,
                                                       # fifo vs oldest_decided release (issue 58)
    da3po bench async --engines 1,2                    # the same with real vLLM engines (`da3po train`)

``--standin E1,E2,...`` (issue 47) runs the real producer (``trainer/generation/async_rollout.py``) against stand-in
engines (``da3po_megatron/testing/standin_engines.py``, NOT vLLM: one worker thread per engine, ``--standin-step-ms``
per engine step, every running sample decodes one token per step, long-tailed lengths) and a stand-in trainer
(``--standin-train-ms`` per step, ``--standin-sync-ms`` per weight sync), at staleness 2 with and without partial
rollouts, with ``--standin-groups`` groups in flight per engine and a batch of as many: the pause seconds per sync
(drain or interrupt) beside the drain's floor (the longest running group's remaining engine steps when the pause is
asked for), and the engines' idle fraction outside the pause and the sync with the part of it in which the staleness
bound held admission, beside 1 engine, in one run.

``--engines E1,E2,...`` (issue 58 point 3) runs the real trainer instead: one ``da3po train`` per release order and
engine count with ``rollout.num_engines=E``, ``rollout.staleness=2``, ``rollout.partial_rollouts=true`` and, as the
stand-in bench, weak scaling (``data.train_batch_size`` = ``--prompts`` x E, groups in flight ``--inflight`` x E);
printed from the trainer's metrics (means over the measured steps): engine idle outside the pause
(``rollout/async/engine_idle_frac``, driver side) and the bound's part of it (``engine_idle_bound_frac``), the pause
(``time/rollout_pause``), trained tokens/s, each beside the same order's run at the first engine count.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

COIN_P = (0.9, 0.8, 0.65, 0.5, 0.4, 0.3, 0.2, 0.12)  # buckets 1..8: hard (p < tau = 0.5) are 5..8
HIST = re.compile(r"^rollout/(staleness|versions_spanned)_hist/(\d+)$")
DISCARD = re.compile(r"^rollout/async/discarded_late/bucket_(\w+)$")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="0,1,1p,2,2p,4,4p")
    ap.add_argument("--mode", default="streaming", choices=["rounds", "streaming"], help="rollout.mode of every run")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4, help="attention heads (head_dim 32 on CPU)")
    ap.add_argument("--prompts", type=int, default=16, help="data.train_batch_size (kept groups per step)")
    ap.add_argument("--n", type=int, default=8, help="responses per prompt (G)")
    ap.add_argument("--response-tokens", default="6,96", help="median response length of the easiest,hardest bucket")
    ap.add_argument("--max-response-len", type=int, default=256, help="rollout.max_response_length (the tail's cap)")
    ap.add_argument("--tau", type=float, default=0.5, help="hard buckets: coin p < tau")
    ap.add_argument("--inflight", type=int, default=0, help="rollout.max_inflight_prompts (0 = prompts / 2)")
    ap.add_argument("--engine-cpus", default="0", help="ray.engine_cpus ('' = no pinning)")
    ap.add_argument("--policy-cpus", default="1", help="ray.policy_cpus ('' = no pinning)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="", help="working directory (default: a temporary one)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--run-timeout", type=float, default=900, help="seconds per setting before it is stopped")
    ap.add_argument("--small", action="store_true", help="CI-sized: 4 prompts x 4 responses, short lengths")
    ap.add_argument("--standin", default="", help="engine counts for the stand-in producer bench, e.g. 1,4")
    ap.add_argument("--standin-step-ms", type=float, default=10.0, help="stand-in engine step (one token per sample)")
    ap.add_argument("--standin-train-ms", type=float, default=200.0, help="stand-in train step")
    ap.add_argument("--standin-sync-ms", type=float, default=50.0, help="stand-in weight sync")
    ap.add_argument("--standin-groups", type=int, default=4, help="groups in flight per engine (= batch / engines)")
    ap.add_argument("--standin-steps-per-call", type=int, default=8, help="rollout.stream_steps_per_call")
    ap.add_argument("--release-orders", "--standin-order", dest="orders", default="fifo,oldest_decided",
                    help="rollout.release_order(s) of --standin and --engines, side by side (issue 58)")
    ap.add_argument("--engines", default="", help="engine counts for real `da3po train` runs under the producer "
                    "(staleness 2 + partial rollouts, batch and groups in flight x engines), e.g. 1,2")
    ap.add_argument("extra", nargs="*", help="section.key=value overrides for every run")
    args = ap.parse_args(argv)
    if args.small:
        args.prompts, args.n, args.response_tokens, args.max_response_len = 4, 4, "2,12", 24
        args.warmup, args.steps = 1, 2
    return args


def setting_overrides(spec: str) -> tuple[int, list[str]]:
    """``2p`` -> (2, [rollout.staleness=2, rollout.partial_rollouts=true]); ``2d`` / ``2pd``: the discard policy."""
    m = re.fullmatch(r"(\d+)(p?)(d?)", spec.strip())
    if not m:
        raise SystemExit(f"setting {spec!r}: expected K, Kp (partial rollouts), Kd or Kpd (discard), e.g. 2p")
    k = int(m.group(1))
    return k, ([f"rollout.staleness={k}"] + (["rollout.partial_rollouts=true"] if m.group(2) else [])
               + (["rollout.late_policy=discard"] if m.group(3) else []))


def overrides(args: argparse.Namespace, model: Path, run_dir: Path) -> list[str]:
    easy, hard = (int(x) for x in args.response_tokens.split(","))
    return [f"model.path={model}", "model.params_dtype=float32", "data.format=synthetic",
            "data.apply_chat_template=false", "data.synthetic.min_digits=1", "data.synthetic.max_digits=8",
            "data.synthetic.train_per_bucket=256", f"data.synthetic.response_tokens=[{easy},{hard}]",
            f"data.synthetic.coin_p=[{','.join(f'{p:g}' for p in COIN_P)}]", "reward.kind=coin",
            "reward.num_workers=1", f"data.train_batch_size={args.prompts}", f"rollout.n={args.n}",
            f"actor.ppo_mini_batch_size={args.prompts}", f"rollout.max_response_length={args.max_response_len}",
            "rollout.max_prompt_length=32", "rollout.ignore_eos=true", "rollout.dtype=float32",
            "rollout.num_engines=1", f"rollout.mode={args.mode}",
            f"rollout.max_inflight_prompts={args.inflight or max(1, args.prompts // 2)}",
            "rollout.logprob_check_fraction=1.0", "algorithm.name=da3po", "algorithm.rollout_correction=tis",
            "algorithm.overlong.enable=false", "algorithm.overlong.buffer_length=0",
            "algorithm.max_generation_rounds=16",
            f"actor.max_tokens_per_microbatch={max(4096, 32 + args.max_response_len)}",
            f"ray.engine_cpus='{args.engine_cpus}'", f"ray.policy_cpus='{args.policy_cpus}'",
            f"trainer.total_steps={args.warmup + args.steps}", "trainer.save_every=0", "eval.every=0",
            "trainer.tensorboard=false", f"trainer.seed={args.seed}", f"trainer.run_dir={run_dir}",
            "trainer.resume=false"]


def summarise(rows: list[dict], hard: set[int]) -> dict:
    """Means over the measured steps; histograms summed over them (counts) or averaged (fractions)."""
    def mean(key: str) -> float:
        vals = [float(r.get(key, 0.0) or 0.0) for r in rows]
        return sum(vals) / len(vals) if vals else 0.0

    out: dict = {k: mean(f"time/{k}") for k in ("step", "generate", "old_logprobs", "train", "weight_sync",
                                                 "wait_rollout", "rollout_pause")}
    out["kept_tokens"], out["decoded_tokens"] = mean("rollout/kept_tokens"), mean("rollout/decoded_tokens")
    total_s = sum(float(r.get("time/step", 0.0)) for r in rows)
    out["trained_tokens_per_s"] = sum(float(r.get("rollout/kept_tokens", 0.0)) for r in rows) / max(total_s, 1e-9)
    for where in ("batch", "gen"):
        out[f"{where}_hard_share"] = mean_share(rows, where, hard)
    out["groups"] = sum(float(r.get("dynamic_sampling/kept_groups", 0.0)) for r in rows)
    s = out["batch_hard_share"]
    out["batch_hard_share_se"] = (s * (1 - s) / max(out["groups"], 1.0)) ** 0.5
    hists: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    discarded: dict[str, float] = defaultdict(float)
    for r in rows:
        for key, v in r.items():
            if (m := HIST.match(key)) and isinstance(v, int | float):
                hists[m.group(1)][int(m.group(2))] += float(v) / len(rows)
            elif (m := DISCARD.match(key)) and isinstance(v, int | float):
                discarded[m.group(1)] += float(v)
    out["discarded_late"] = dict(sorted(discarded.items()))
    if not hists["staleness"]:  # a trainer without the histogram: the per-step maximum (rollout/staleness)
        for r in rows:
            hists["staleness"][int(r.get("rollout/staleness", 0))] += 1.0 / len(rows)
    out["hist"] = {name: dict(sorted(h.items())) for name, h in hists.items() if h}
    return out


def mean_share(rows: list[dict], where: str, hard: set[int]) -> float:
    """Mean over steps of the share of ``where``'s groups (batch = trained, gen = generated) from the hard buckets."""
    shares = [sum(float(v) for k, v in r.items() if k.startswith(f"{where}/group_frac_bucket/")
                  and k.rsplit("/", 1)[1].isdigit() and int(k.rsplit("/", 1)[1]) in hard) for r in rows]
    return sum(shares) / len(shares) if shares else 0.0


def fmt_hist(h: dict[int, float]) -> str:
    return " ".join(f"{k}:{v:.2f}" for k, v in h.items()) or "-"


def standin_table(args: argparse.Namespace) -> int:
    """``--standin``: the producer at several engine counts against stand-in engines (see the module docstring)."""
    from da3po_megatron.testing.standin_engines import bench_standin

    rows = []
    orders = [x.strip() for x in args.orders.split(",") if x.strip()]
    for order in orders:
        for partial in (True, False):
            for n in [int(x) for x in args.standin.split(",") if x.strip()]:
                rows.append({"order": order, **bench_standin(
                    n, partial, groups_per_engine=args.standin_groups, step_s=args.standin_step_ms / 1e3,
                    train_s=args.standin_train_ms / 1e3, sync_s=args.standin_sync_ms / 1e3, steps=args.steps,
                    warmup=args.warmup, steps_per_call=args.standin_steps_per_call, seed=args.seed,
                    release_order=order)})
                print(f"{order}, {n} engines, partial {partial}: {rows[-1]['step_s']:.2f} s/step", flush=True)
    print(f"\nasync producer with stand-in engines (NOT vLLM): staleness 2, {args.standin_groups} groups x 8 responses "
          f"in flight per engine (batch = that x engines), engine step {args.standin_step_ms:g} ms, train "
          f"{args.standin_train_ms:g} ms, sync {args.standin_sync_ms:g} ms, stream_steps_per_call "
          f"{args.standin_steps_per_call}, release order {' vs '.join(orders)}, {args.steps} "
          f"steps after {args.warmup} warm-up (means per step)\n")
    print("| release order | engines | pause | pause s / sync (mean, max) | vs 1 engine | drain floor s (vs 1 engine) "
          "| engine idle (outside pause) | driver-side idle | of it: the bound held admission | trained tok/s | vs 1 "
          "engine | step s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        one = next(x for x in rows if x["partial"] == r["partial"] and x["order"] == r["order"]
                   and x["engines"] == rows[0]["engines"])
        print(f"| {r['order']} | {r['engines']} | {'interrupt (partial)' if r['partial'] else 'drain'} | "
              f"{r['pause_s']:.3f}, {r['pause_s_max']:.3f} | {r['pause_s'] / max(one['pause_s'], 1e-9):.2f}x | "
              f"{r['pause_floor_s']:.3f} ({r['pause_floor_s'] / max(one['pause_floor_s'], 1e-9):.2f}x) | "
              f"{r['idle_frac']:.1%} | {r['driver_idle_frac']:.1%} | {r['bound_idle_frac']:.1%} | "
              f"{r['trained_tok_s']:,.0f} | {r['trained_tok_s'] / max(one['trained_tok_s'], 1e-9):.2f}x | "
              f"{r['step_s']:.2f} |")
    print("\ndrain floor: the engine steps the longest group on the engines still needed when the pause was asked "
          "for, x the engine steps' mean wall time (a drain cannot be shorter; an interrupt does not wait for it); "
          "idle: the share of "
          "engine time outside the pause and the sync without a call running (engine side: measured inside the "
          "stand-ins; driver side: no call in flight, rollout/async/engine_idle_frac), and of it the time the "
          "staleness bound held admission (rollout/async/engine_idle_bound_frac: nothing the engine may run)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "standin": rows}, indent=1))
    return 0


def train_run(args: argparse.Namespace, model: Path, run_dir: Path, extra: list[str], env: dict, name: str
              ) -> list[dict] | None:
    """One ``da3po train`` of the bench's task with ``extra`` overrides: its metrics rows after the warm-up, or None
    (the error printed) when it failed or ran past ``--run-timeout``."""
    cmd = [sys.executable, "-m", "da3po_megatron.cli", "train", *overrides(args, model, run_dir), *extra, *args.extra]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        print(f"error: setting {name} did not finish in {args.run_timeout:.0f} s (--run-timeout); logs in "
              f"{run_dir / 'logs'}; command: {' '.join(cmd)}", file=sys.stderr)
        return None
    if p.returncode != 0:
        print(p.stdout[-3000:], p.stderr[-5000:], file=sys.stderr)
        print(f"error: setting {name} failed (exit {p.returncode}); command: {' '.join(cmd)}", file=sys.stderr)
        return None
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if r["step"] > args.warmup]


def engines_table(args: argparse.Namespace, work: Path, model: Path, hard: set[int], env: dict) -> int:
    """``--engines``: the producer with real vLLM engines at several counts, per release order (module docstring)."""
    rows = []
    counts = [int(x) for x in args.engines.split(",") if x.strip()]
    for order in [x.strip() for x in args.orders.split(",") if x.strip()]:
        for n in counts:
            t0 = time.perf_counter()
            extra = [f"rollout.num_engines={n}", "rollout.staleness=2", "rollout.partial_rollouts=true",
                     f"rollout.release_order={order}", f"data.train_batch_size={args.prompts * n}",
                     f"actor.ppo_mini_batch_size={args.prompts * n}",
                     f"rollout.max_inflight_prompts={(args.inflight or max(1, args.prompts // 2)) * n}"]
            measured = train_run(args, model, work / f"e{n}_{order}", extra, env, f"{order} x {n}")
            if measured is None:
                return 1
            r = {"order": order, "engines": n, "wall_s": time.perf_counter() - t0, **summarise(measured, hard),
                 **{k: sum(float(x.get(f"rollout/async/{k}", 0.0)) for x in measured) / len(measured)
                    for k in ("engine_idle_frac", "engine_idle_bound_frac", "deadline_waits", "out_of_order_groups")}}
            rows.append(r)
            print(f"{order}, {n} engines: {r['step']:.2f} s/step ({r['wall_s']:.0f} s)", flush=True)
    easy, hard_len = args.response_tokens.split(",")
    print(f"\nasync producer with real vLLM engines (`da3po train`): qwen3 hidden {args.hidden} x {args.layers} layers "
          f"(random weights), staleness 2 + partial rollouts, {args.prompts} prompts x engines per batch x "
          f"{args.n} responses, long-tailed lengths (median {easy} -> {hard_len} tokens, cap {args.max_response_len}), "
          f"engine cpus '{args.engine_cpus}', policy cpus '{args.policy_cpus}', {args.steps} steps after "
          f"{args.warmup} warm-up (means per step)\n")
    print("| release order | engines | engine idle (outside pause) | of it: the bound held admission | pause s | vs 1 "
          "engine | trained tok/s | vs 1 engine | step s | takes waiting for a deadline | out-of-order groups |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        one = next(x for x in rows if x["order"] == r["order"] and x["engines"] == counts[0])
        print(f"| {r['order']} | {r['engines']} | {r['engine_idle_frac']:.1%} | {r['engine_idle_bound_frac']:.1%} | "
              f"{r['rollout_pause']:.2f} | {r['rollout_pause'] / max(one['rollout_pause'], 1e-9):.2f}x | "
              f"{r['trained_tokens_per_s']:,.0f} | "
              f"{r['trained_tokens_per_s'] / max(one['trained_tokens_per_s'], 1e-9):.2f}x | {r['step']:.2f} | "
              f"{r['deadline_waits']:.2f} | {r['out_of_order_groups']:.2f} |")
    print(f"\nvs 1 engine: against the same order's run with {counts[0]} engine(s); takes waiting / out-of-order "
          "groups: per step (rollout/async/deadline_waits, out_of_order_groups)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "engines": rows}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.standin:
        return standin_table(args)
    work = Path(args.out or tempfile.mkdtemp(prefix="bench_async_"))
    work.mkdir(parents=True, exist_ok=True)
    from da3po_megatron.tiny import build_model

    model = build_model(work / "model", "qwen3", seed=args.seed, hidden_size=args.hidden, num_layers=args.layers,
                        num_heads=args.heads, num_kv_heads=max(1, args.heads // 2),
                        max_position_embeddings=max(512, 64 + args.max_response_len))
    hard = {b + 1 for b, p in enumerate(COIN_P) if p < args.tau}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "DA3PO_RAY_LOG_TO_DRIVER": "0"}
    if args.engines:
        return engines_table(args, work, model, hard, env)
    results = []
    for spec in [s.strip() for s in args.settings.split(",") if s.strip()]:
        k, extra = setting_overrides(spec)
        t0 = time.perf_counter()
        measured = train_run(args, model, work / f"s{spec}", extra, env, spec)
        if measured is None:
            return 1
        label = f"staleness {k}" + (" + partial" if "p" in spec else "") + (" + discard" if "d" in spec else "")
        results.append({"setting": spec, "label": label, "wall_s": time.perf_counter() - t0,
                        **summarise(measured, hard)})
        print(f"{label}: {results[-1]['step']:.2f} s/step ({results[-1]['wall_s']:.0f} s)", flush=True)
    easy, hard_len = args.response_tokens.split(",")
    print(f"\nasync RL step: qwen3 hidden {args.hidden} x {args.layers} layers (random weights), rollout.mode "
          f"{args.mode}, {args.prompts} prompts x {args.n} responses, synthetic buckets 1-8 with coin p "
          f"{'/'.join(f'{p:g}' for p in COIN_P)} and long-tailed lengths (median {easy} -> {hard_len} tokens, cap "
          f"{args.max_response_len}), hard = buckets {sorted(hard)} (p < {args.tau:g}), engine cpus "
          f"'{args.engine_cpus}', policy cpus '{args.policy_cpus}', {args.steps} steps after {args.warmup} warm-up "
          "(means per step)\n")
    ref = results[0]
    print("| setting | step s | generate s | train s | wait s | pause s | trained tok/step | trained tok/s | "
          "speed-up | hard share (trained) | vs ref | hard share (generated) | staleness hist | versions spanned | "
          "discarded late |")
    print("|---|" + "---|" * 14)
    for r in results:
        print(f"| {r['label']} | {r['step']:.2f} | {r['generate']:.2f} | {r['train']:.2f} | {r['wait_rollout']:.2f} "
              f"| {r['rollout_pause']:.2f} | {r['kept_tokens']:,.0f} | {r['trained_tokens_per_s']:,.0f} | "
              f"{r['trained_tokens_per_s'] / max(ref['trained_tokens_per_s'], 1e-9):.2f}x | "
              f"{r['batch_hard_share']:.3f} +- {r['batch_hard_share_se']:.3f} | "
              f"{r['batch_hard_share'] - ref['batch_hard_share']:+.3f} | {r['gen_hard_share']:.3f} | "
              f"{fmt_hist(r['hist'].get('staleness', {}))} | {fmt_hist(r['hist'].get('versions_spanned', {}))} | "
              f"{' '.join(f'{b}:{v:g}' for b, v in r['discarded_late'].items() if v) or '-'} |")
    print(f"\nreference: {ref['label']}; staleness hist = mean fraction of trained groups per versions-behind value "
          "(or, where the trainer logs no histogram, the fraction of steps per step maximum)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "hard_buckets": sorted(hard),
                                               "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
