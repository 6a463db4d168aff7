#!/usr/bin/env python
"""Hard prompts under staleness k, measured where it could fail (issue 47 point 8).

Three policies of the same DA3PO run (``examples/compare_cpu.yaml``: the tiny model warmed up on the synthetic
running-sums task, whose correctness depends on the policy; 8 difficulty buckets = 1..8 digits), with shared prompts
and seeds (``trainer.seed`` fixes the prompt stream, so seed s of every policy sees the same prompts in the same
order):

- ``sync``: the paper's synchronous loop (``rollout.staleness=0``);
- ``s2p_pace``: staleness 2 + partial rollouts, admission paced by the bound (the producer's default);
- ``s2p_oldest``: as ``s2p_pace`` with ``rollout.release_order=oldest_decided`` (decided groups leave oldest-admitted
  first, out of order, within each group's deadline; issue 58);
- ``s2p_discard_unpaced``: staleness 2 + partial rollouts with ``rollout.late_policy=discard_unpaced``: the engines
  generate ahead freely, groups are released in completion order and a kept group older than k when trained is
  thrown away.

Every run also sets ``eval.rescore_groups`` (``trainer/generation/rescore.py``): after each weight sync up to that many
kept and dropped groups of the step are generated again with the new weights, and the filter's (0 < p_hat < 1) and DAA's
(p_hat < tau) decisions made with the old p_hat are compared with the new ones. The synchronous run's rates are the
floor (p_hat from G samples is noisy, and the new weights are one update newer there too).

    python tools/studies/async_hard.py run --policy sync --seeds 0,1,2,3 --steps 30   # one grid per policy
    python tools/studies/async_hard.py report --out reports/async47                  # the tables (+ summary.json)

``run`` calls ``tools/compare_algorithms.py`` (method ``da3po:2``) with runs in ``runs/async47/<policy>`` and the
shared warm-up ``runs/async47/warmup``; re-running resumes. ``report`` reads their metrics.jsonl and writes, per
difficulty bucket: the trained share (and the groups discarded late), the decision-flip rates, and the held-out
avg@k at equal generated samples and at the last step -- each variant's difference from ``sync`` paired by seed
(mean of the per-seed differences +- its standard error, sd/sqrt(n)).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from da3po_megatron.eval.curves import read_metrics
from da3po_megatron.studies.compare.stats import curve_at, mean_std, paired, significant

ASYNC = ["rollout.mode=streaming", "rollout.staleness=2", "rollout.partial_rollouts=true",
         "algorithm.rollout_correction=tis"]
POLICIES = {"sync": [], "s2p_pace": [*ASYNC, "rollout.release_order=fifo"],
            "s2p_oldest": [*ASYNC, "rollout.release_order=oldest_decided"],
            "s2p_discard_unpaced": [*ASYNC, "rollout.late_policy=discard_unpaced"]}
ROOT = Path("runs/async47")
METHOD, SLUG = "da3po:2", "da3po_2"
SAMPLES = "gen/cumulative_samples"


def ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


def run_values(rows: list[dict], buckets: Sequence[int], budget: float, last: int, k: int) -> dict[str, float]:
    """One run's numbers: trained / discarded groups per bucket, decision-flip counts, held-out avg@k."""
    steps = [r for r in rows if r.get("step", 0) > 0 and "filter/kept_groups" in r]
    out: dict[str, float] = {"steps": float(len(steps))}
    trained = {r["step"]: r["filter/kept_groups"] - r.get("dynamic_sampling/discarded_surplus_groups", 0.0)
               for r in steps}  # the batch (kept groups beyond train_batch_size are dropped as surplus)
    total = sum(trained.values())
    out["trained_groups"] = total
    for b in buckets:
        out[f"trained/{b}"] = sum(r.get(f"batch/group_frac_bucket/{b}", 0.0) * trained[r["step"]] for r in steps)
        out[f"share/{b}"] = ratio(out[f"trained/{b}"], total)
        out[f"discarded/{b}"] = sum(r.get(f"rollout/async/discarded_late/bucket_{b}", 0.0) for r in steps)
    for what in ("groups", "kept", "kept_to_dropped", "dropped", "dropped_to_kept", "daa_flips", "age_sum",
                 "p_diff_sum"):
        for b in [None, *buckets]:
            key = f"rescore/{what}" if b is None else f"rescore/bucket{b}/{what}"
            out[key] = sum(r.get(key, 0.0) for r in steps)
    for b in [None, *buckets]:
        p = "rescore" if b is None else f"rescore/bucket{b}"
        out[f"{p}/keep_flip_rate"] = ratio(out[f"{p}/kept_to_dropped"] + out[f"{p}/dropped_to_kept"],
                                           out[f"{p}/groups"])
        out[f"{p}/daa_flip_rate"] = ratio(out[f"{p}/daa_flips"], out[f"{p}/kept"])
        out[f"{p}/age_mean"] = ratio(out[f"{p}/age_sum"], out[f"{p}/groups"])
        out[f"{p}/p_diff_mean"] = ratio(out[f"{p}/p_diff_sum"], out[f"{p}/kept"])
        for num, den in (("kept_to_dropped", "kept"), ("dropped_to_kept", "dropped"), ("daa_flips", "kept")):
            out[f"{p}/{num}_rate"] = ratio(out[f"{p}/{num}"], out[f"{p}/{den}"])
    out["samples"] = max((r.get(SAMPLES, 0.0) for r in rows), default=0.0)
    out["discarded_late_groups"] = sum(r.get("rollout/async/discarded_late_groups", 0.0) for r in steps)
    out["step_s"] = sum(r.get("time/step", 0.0) for r in steps) / max(len(steps), 1)
    for b in [None, *buckets]:
        key = f"eval/synthetic/avg@{k}" if b is None else f"eval/synthetic/bucket{b}/avg@{k}"
        name = "all" if b is None else str(b)
        out[f"avg_samples/{name}"] = _nan(curve_at(rows, key, budget, SAMPLES))
        out[f"avg_step/{name}"] = _nan(curve_at(rows, key, float(last), "step"))
        out[f"avg_start/{name}"] = _nan(curve_at(rows, key, 0.0, "step"))
    return out


def _nan(v: float | None) -> float:
    return math.nan if v is None else float(v)


def summary(vals, ref, others, budget, last, hard, tau, mean, pooled, diff) -> list[str]:  # noqa: ANN001
    """The one-table digest (docs/async.md quotes it): each row a quantity, sync's value and each policy's paired
    difference."""
    def n_of(den: str) -> str:
        return " / ".join(f"{sum(v[den] for v in vals[p].values()):.0f}" for p in [ref, *others])

    def row(name: str, base: str, key: str | None, scale: float = 100.0, fmt: str = "+.1f") -> str:
        cells = [diff(p, key, scale, fmt) if key else "" for p in others]
        return f"| {name} | {base} | " + " | ".join(cells) + " |"

    def flip(num: str, den: str) -> str:
        return f"{100 * pooled(ref, [f'rescore/{num}'], f'rescore/{den}'):.1f} %"

    disc = " | ".join(f"{sum(v['discarded_late_groups'] for v in vals[p].values()):.0f} "
                      f"({sum(v['discarded/hard'] for v in vals[p].values()):.0f})" for p in others)
    return ["\n**Summary**\n", f"| | {ref} | " + " | ".join(f"{p}: diff vs {ref}" for p in others) + " |",
            "|---|---:|" + "---|" * len(others),
            f"| responses generated in {last} steps (mean) | {mean(ref, 'samples'):,.0f} | "
            + " | ".join(f"{mean(p, 'samples'):,.0f}" for p in others) + " |",
            f"| groups discarded late (all seeds; of them hard) | 0 | {disc} |",
            row("trained share of the hard buckets", f"{100 * mean(ref, 'share/hard'):.1f} %", "share/hard"),
            row(f"trained share of bucket {max(hard)}", f"{100 * mean(ref, f'share/{max(hard)}'):.1f} %",
                f"share/{max(hard)}"),
            f"| age of the re-scored groups (versions, mean) | {pooled(ref, ['rescore/age_sum'], 'rescore/groups'):.2f}"
            " | " + " | ".join(f"{pooled(p, ['rescore/age_sum'], 'rescore/groups'):.2f}" for p in others) + " |",
            row("new p_hat - stale p_hat, re-scored kept groups",
                f"{pooled(ref, ['rescore/p_diff_sum'], 'rescore/kept'):+.3f}", "rescore/p_diff_mean", 1.0, "+.3f"),
            row(f"kept, the new p_hat would drop (n {n_of('rescore/kept')})", flip("kept_to_dropped", "kept"),
                "rescore/kept_to_dropped_rate"),
            row(f"dropped, the new p_hat would keep (n {n_of('rescore/dropped')})",
                flip("dropped_to_kept", "dropped"), "rescore/dropped_to_kept_rate"),
            row(f"kept, DAA decision p_hat < {tau:g} flips (n {n_of('rescore/kept')})", flip("daa_flips", "kept"),
                "rescore/daa_flips_rate"),
            row(f"held-out avg@k at equal samples ({budget:,.0f}), all buckets",
                f"{100 * mean(ref, 'avg_samples/all'):.1f}", "avg_samples/all"),
            row("the same, hard buckets", f"{100 * mean(ref, 'avg_samples/hard'):.1f}", "avg_samples/hard"),
            row(f"held-out avg@k at step {last}, all buckets", f"{100 * mean(ref, 'avg_step/all'):.1f}",
                "avg_step/all"),
            row("the same, hard buckets", f"{100 * mean(ref, 'avg_step/hard'):.1f}", "avg_step/hard")]


def report(root: Path, out: Path, k: int, tau: float) -> str:
    grids = {p: {int(d.name.removeprefix("seed")): read_metrics(d / "metrics.jsonl")
                 for d in sorted((root / p / SLUG).glob("seed*")) if (d / "metrics.jsonl").exists()}
             for p in POLICIES}
    grids = {p: g for p, g in grids.items() if g}
    if "sync" not in grids:
        raise SystemExit(f"no sync runs under {root}/sync/{SLUG}")
    # paired: only the seeds every policy finished (the last step of the longest run)
    done = max(r["step"] for g in grids.values() for rows in g.values() for r in rows)
    common = set.intersection(*[{s for s, rows in g.items() if max((r["step"] for r in rows), default=0) == done}
                                for g in grids.values()])
    grids = {p: {s: rows for s, rows in g.items() if s in common} for p, g in grids.items()}
    if not common:
        raise SystemExit(f"no seed finished step {done} under every policy")
    every = [r for g in grids.values() for rows in g.values() for r in rows]
    buckets = sorted({int(key.rsplit("/", 1)[1]) for r in every for key in r
                      if key.startswith("batch/group_frac_bucket/")})
    budget = min(max((r.get(SAMPLES, 0.0) for r in rows), default=0.0) for g in grids.values() for rows in g.values())
    last = min(max(r["step"] for r in rows if f"eval/synthetic/avg@{k}" in r) for g in grids.values()
               for rows in g.values())
    vals = {p: {s: run_values(rows, buckets, budget, last, k) for s, rows in g.items()} for p, g in grids.items()}
    start = next(r for r in every if r["step"] == 0 and f"eval/synthetic/avg@{k}" in r)
    hard = [b for b in buckets if start.get(f"eval/synthetic/bucket{b}/avg@{k}", 1.0) < tau]
    for p in vals:
        for v in vals[p].values():
            v["share/hard"] = sum(v[f"share/{b}"] for b in hard)
            v["discarded/hard"] = sum(v[f"discarded/{b}"] for b in hard)
            v["avg_samples/hard"] = sum(v[f"avg_samples/{b}"] for b in hard) / len(hard)
            v["avg_step/hard"] = sum(v[f"avg_step/{b}"] for b in hard) / len(hard)
            v["avg_start/hard"] = sum(v[f"avg_start/{b}"] for b in hard) / len(hard)
    ref, others = "sync", [p for p in vals if p != "sync"]
    lines: list[str] = []

    def mean(p: str, key: str) -> float:
        return mean_std([v[key] for v in vals[p].values()])[0]

    def pooled(p: str, num: Sequence[str], den: str) -> float:
        return ratio(sum(v[n] for v in vals[p].values() for n in num), sum(v[den] for v in vals[p].values()))

    def diff(p: str, key: str, scale: float = 100.0, fmt: str = "+.1f") -> str:
        m, se, n = paired({s: v[key] for s, v in vals[p].items()}, {s: v[key] for s, v in vals[ref].items()})
        flag = " *" if significant(m, se, n) else ""
        return f"{scale * m:{fmt}} (SE {scale * se:{fmt.lstrip('+')}}){flag}"

    seeds = {p: sorted(vals[p]) for p in vals}
    lines.append(f"Policies and seeds: {seeds}; {last} steps; equal-sample budget {budget:,.0f} generated responses "
                 f"(the smallest any run reached); hard buckets (starting held-out avg@{k} < {tau:g}): {hard}.")
    lines.append("Differences are vs sync, paired by seed (same prompts): mean of per-seed differences (SE = sd/sqrt(n)"
                 " over seeds); * marks |diff| > t * SE (Student's t, two-sided 95 %, seeds - 1 degrees of freedom: "
                 "12.7 for 2 seeds, 4.3 for 3).\n")
    lines.append("| policy | s/step | samples generated | discarded late (groups; hard) | mean age of re-scored groups "
                 "(versions) | mean p_hat now - stale, re-scored kept groups |")
    lines.append("|---|---:|---:|---|---:|---|")
    for p in vals:
        lines.append(f"| {p} | {mean(p, 'step_s'):.1f} | {mean(p, 'samples'):,.0f} | "
                     f"{sum(v['discarded_late_groups'] for v in vals[p].values()):.0f}; "
                     f"{sum(v['discarded/hard'] for v in vals[p].values()):.0f} | "
                     f"{pooled(p, ['rescore/age_sum'], 'rescore/groups'):.2f} | "
                     f"{pooled(p, ['rescore/p_diff_sum'], 'rescore/kept'):+.3f}"
                     + (f" (vs sync {diff(p, 'rescore/p_diff_mean', 1.0, '+.3f')})" if p != ref else "") + " |")
    lines += summary(vals, ref, others, budget, last, hard, tau, mean, pooled, diff)
    lines.append("\n**Trained share** of each bucket (kept groups trained, summed over steps; % of all trained groups; "
                 "mean over seeds) and the paired difference vs sync (points)\n")
    lines.append(f"| bucket | {ref} | " + " | ".join(f"{p} | diff" for p in others) + " | discarded late (" +
                 ", ".join(others) + ") |")
    lines.append("|---|---:|" + "---:|---|" * len(others) + "---|")
    for b in [*buckets, "hard"]:
        key = f"share/{b}"
        cells = [f"{100 * mean(p, key):.1f} | {diff(p, key)}" for p in others]
        disc = ", ".join(f"{sum(v[f'discarded/{b}'] for v in vals[p].values()):.0f}" for p in others)
        lines.append(f"| {b} | {100 * mean(ref, key):.1f} | " + " | ".join(cells) + f" | {disc} |")
    flips = (("kept_to_dropped", "kept", "the filter kept it (0 < p_hat < 1); the new p_hat would drop it"),
             ("dropped_to_kept", "dropped", "the filter dropped it; the new p_hat would keep it"),
             ("daa_flips", "kept", f"kept, and DAA's decision (p_hat < {tau:g}) differs under the new p_hat"))
    for num, den, what in flips:
        lines.append(f"\n**Decision flips, {num}** (%): re-scored groups where {what}; pooled over seeds "
                     f"(n = re-scored {den} groups), paired difference vs sync (points)\n")
        lines.append(f"| bucket | {ref} | " + " | ".join(f"{p} | diff" for p in others) + " |")
        lines.append("|---|---:|" + "---:|---|" * len(others))
        for b in [None, *buckets]:
            pre = "rescore" if b is None else f"rescore/bucket{b}"
            cells = []
            for p in [ref, *others]:
                n = sum(v[f"{pre}/{den}"] for v in vals[p].values())
                cells.append(f"{100 * pooled(p, [f'{pre}/{num}'], f'{pre}/{den}'):.1f} (n {n:.0f})")
                if p != ref:
                    cells.append(diff(p, f"{pre}/{num}_rate"))
            lines.append(f"| {'all' if b is None else b} | " + " | ".join(cells) + " |")
    for at, label in (("avg_samples", f"equal generated samples ({budget:,.0f})"), ("avg_step", f"step {last}")):
        lines.append(f"\n**Held-out avg@{k}** (%) at {label}: {ref} mean +- sd over seeds, paired difference vs sync\n")
        lines.append(f"| bucket | start | {ref} | " + " | ".join(others) + " |")
        lines.append("|---|---:|---:|" + "---|" * len(others))
        for b in ["all", *[str(x) for x in buckets], "hard"]:
            m, sd, _ = mean_std([v[f"{at}/{b}"] for v in vals[ref].values()])
            st = mean(ref, f"avg_start/{b}")
            lines.append(f"| {b} | {100 * st:.1f} | {100 * m:.1f} +- {100 * sd:.1f} | "
                         + " | ".join(diff(p, f"{at}/{b}") for p in others) + " |")
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text)
    (out / "summary.json").write_text(json.dumps({"budget": budget, "last_step": last, "hard": hard, "k": k,
                                                  "tau": tau, "runs": vals}, indent=1, allow_nan=True))
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train one policy's seeds (tools/compare_algorithms.py)")
    r.add_argument("--policy", choices=list(POLICIES), required=True)
    r.add_argument("--seeds", default="0,1,2")
    r.add_argument("--steps", type=int, default=30)
    r.add_argument("--rescore-groups", type=int, default=8, help="eval.rescore_groups (kept and dropped per step)")
    r.add_argument("--root", type=Path, default=ROOT)
    r.add_argument("overrides", nargs="*", help="extra section.key=value overrides for every run")
    q = sub.add_parser("report", help="the tables from the runs")
    q.add_argument("--root", type=Path, default=ROOT)
    q.add_argument("--out", type=Path, default=Path("reports/async47"))
    q.add_argument("--k", type=int, default=4, help="eval.k of the runs (avg@k)")
    q.add_argument("--tau", type=float, default=0.5, help="hard buckets: starting avg@k < tau; DAA's tau")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        cmd = [sys.executable, "tools/compare_algorithms.py", "--base", "examples/compare_cpu.yaml", "--methods",
               METHOD, "--seeds", a.seeds, "--steps", str(a.steps), "--out", str(a.root / "reports" / a.policy),
               "--runs-dir", str(a.root / a.policy), "--warmup-dir", str(a.root / "warmup"), "--no-figures",
               f"eval.rescore_groups={a.rescore_groups}", *POLICIES[a.policy], *a.overrides]
        print(" ".join(cmd), flush=True)
        return subprocess.call(cmd)
    print(report(a.root, a.out, a.k, a.tau), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
