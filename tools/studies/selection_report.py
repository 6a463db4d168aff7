"""What pre-rollout selection (``data.selection``, issue 50) saved, what it trained on, and what it cost in held-out
accuracy, variant by variant, each paired by seed with the reference.

Each variant is ``NAME=DIR`` as for ``tools/compare_variants.py`` (``DIR/seed<k>/metrics.jsonl`` or a report's
``DIR/seed<k>.jsonl``), or ``NAME=DIR1,DIR2,...`` with one directory per starting policy (warm-up): a run is then
paired by (directory's position, seed), so independent warm-ups count as independent pairs (issue 59). The first
variant is the reference. Per run, over all its steps and over its second half (``late``):
generated (decoded) tokens per trained token = sum rollout/decoded_tokens / sum rollout/kept_tokens; the fraction of
generated groups that were zero-variance (all-correct / all-wrong); the trained share of the two hardest buckets
(mean over steps of batch/group_frac_bucket of the two largest buckets) and of every bucket; generation rounds and
surplus groups per step; prompts skipped per step by tail; the final exploration rates. Held-out avg@k (all buckets,
and the two hardest) at the last step every run reached and at the largest generated-token budget every run
reached. Each variant's difference from the reference is paired by seed (``tools/studies/async_hard.py``'s
``paired``: the mean of the per-seed differences +- its standard error sd/sqrt(n)), screened with Student's t
(two-sided 95 %, n - 1 degrees of freedom; ``*`` marks a significant difference). The saving is also given per seed
as the ratio reference / variant of tokens per trained token.

The ceiling (issue 59): no rule that decides before generation can save more than 1 / (1 - w), w the share of the
reference's decoded tokens that were not trained (``rollout/wasted_tokens / rollout/decoded_tokens``). The report
prints w and the ceiling per window of steps for the reference, and for each variant the share of the ceiling
reached, ``(1 - 1/saving) / w``: the fraction of the reference's wasted tokens (per trained token) the rule avoided.

    python tools/studies/selection_report.py dapo=runs/compare/sel50_off/dapo \\
        dapo+sel=runs/compare/sel50_on/dapo --out F.md
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from da3po_megatron.studies.compare.grid import load_variant as load
from da3po_megatron.studies.compare.stats import curve_at, mean_std, paired, significant

SHARE = "batch/group_frac_bucket/"
GEN_ACC = "gen/acc_bucket/"
GEN_SHARE = "gen/group_frac_bucket/"
TOKENS = "gen/cumulative_tokens"
EVAL = "eval/synthetic/"


def load_runs(spec: str) -> tuple[str, dict[int, list[dict]]]:
    """``NAME=DIR[,DIR...]`` -> (NAME, {key: rows}); with several directories the key is 1000 x position + seed."""
    name, _, paths = spec.partition("=")
    dirs = paths.split(",")
    if len(dirs) == 1:
        return load(spec)
    runs: dict[int, list[dict]] = {}
    for i, d in enumerate(dirs):
        runs.update({1000 * i + s: rows for s, rows in load(f"{name}={d}")[1].items()})
    return name, runs


def ceiling_rows(runs: dict[int, list[dict]], window: int) -> list[tuple[str, float, float]]:
    """(steps, w, 1 / (1 - w)) per window of ``window`` steps and over the run, w pooled over the runs' tokens."""
    def w_of(rows: list[dict]) -> float:
        dec = _sum(rows, "rollout/decoded_tokens")
        return _sum(rows, "rollout/wasted_tokens") / dec if dec else math.nan
    steps = [r for rows in runs.values() for r in rows]
    last = max((r["step"] for r in steps), default=0)
    out = []
    for lo in range(0, last, window):
        rows = [r for r in steps if lo < r["step"] <= lo + window]
        w = w_of(rows)
        out.append((f"{lo + 1}-{min(lo + window, last)}", w, 1 / (1 - w) if w < 1 else math.inf))
    w = w_of(steps)
    out.append(("all", w, 1 / (1 - w) if w < 1 else math.inf))
    return out


def _buckets(rows: list[dict]) -> list[str]:
    """Every bucket generated (``gen/acc_bucket/<b>``) or trained: one never trained (no mixed group) counts too."""
    return sorted({k.split("/")[-1] for r in rows for k in r if k.startswith((SHARE, GEN_ACC))}, key=float)


def _sum(steps: list[dict], key: str) -> float:
    return sum(r.get(key, 0.0) for r in steps)


def cost(steps: list[dict], hardest: list[str], buckets: list[str]) -> dict[str, float]:
    """Cost and trained-share figures of a run's ``steps`` (rows with a rollout)."""
    n = max(len(steps), 1)
    gen = max(_sum(steps, "dynamic_sampling/generated_groups"), 1.0)
    out = {"tokens/trained token": _sum(steps, "rollout/decoded_tokens") / max(_sum(steps, "rollout/kept_tokens"), 1),
           "zero-var %": 100 * (_sum(steps, "dynamic_sampling/discarded_all_correct_groups")
                                + _sum(steps, "dynamic_sampling/discarded_all_wrong_groups")) / gen,
           "all-wrong %": 100 * _sum(steps, "dynamic_sampling/discarded_all_wrong_groups") / gen,
           "hardest-2 share %": 100 * sum(sum(r.get(SHARE + b, 0.0) for b in hardest) for r in steps) / n,
           "rounds/step": _sum(steps, "dynamic_sampling/rounds") / n,
           "surplus/step": _sum(steps, "dynamic_sampling/discarded_surplus_groups") / n,
           "skipped c/step": _sum(steps, "selection/skipped_all_correct") / n,
           "skipped w/step": _sum(steps, "selection/skipped_all_wrong") / n,
           "p_c final": steps[-1].get("selection/explore_all_correct", math.nan) if steps else math.nan,
           "p_w final": steps[-1].get("selection/explore_all_wrong", math.nan) if steps else math.nan}
    for b in buckets:
        out[f"b{b}"] = 100 * sum(r.get(SHARE + b, 0.0) for r in steps) / n
        out[f"g{b}"] = 100 * sum(r.get(GEN_SHARE + b, 0.0) * r.get("dynamic_sampling/generated_groups", 0.0)
                                 for r in steps) / gen
    return out


def held_out(rows: list[dict], hardest: list[str], x_key: str, x: float) -> dict[str, float]:
    """Held-out avg@k (all buckets; the mean of the two hardest), interpolated at ``x`` of ``x_key`` (nan if not
    reached)."""
    metric = next((k.removeprefix(EVAL) for r in rows for k in r if k.startswith(EVAL + "avg@")), "avg@4")
    a = curve_at(rows, EVAL + metric, x, x_key)
    h = [curve_at(rows, f"{EVAL}bucket{b}/{metric}", x, x_key) for b in hardest]
    return {"all": math.nan if a is None else 100 * a,
            "hardest-2": math.nan if None in h else 100 * sum(h) / len(h)}  # type: ignore[arg-type]


def _diff(var: dict[int, float], ref: dict[int, float], fmt: str = "+.2f") -> str:
    m, se, n = paired(var, ref)
    return f"{m:{fmt}} (SE {se:.2f}){'*' if significant(m, se, n) else ''}"


def _cell(per_seed: dict[int, float], fmt: str = ".2f") -> str:
    m, sd, _ = mean_std([v for v in per_seed.values() if math.isfinite(v)])
    return f"{m:{fmt}} +- {sd:{fmt}}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help="NAME=DIR (the first is the reference)")
    ap.add_argument("--out", type=Path, default=None, help="also write the tables to this Markdown file")
    ap.add_argument("--window", type=int, default=10, help="steps per window of the ceiling table (default 10)")
    args = ap.parse_args(argv)
    variants = dict(load_runs(s) for s in args.variants)
    every = [r for runs in variants.values() for rows in runs.values() for r in rows]
    buckets = _buckets(every)
    hardest = buckets[-2:]
    ref = next(iter(variants))
    steps = {name: {s: [r for r in rows if "rollout/decoded_tokens" in r] for s, rows in runs.items()}
             for name, runs in variants.items()}
    last = min(rows[-1]["step"] for runs in steps.values() for rows in runs.values())
    phases = {"all steps": lambda rows: rows, f"late (steps > {last // 2})": lambda rows: [
        r for r in rows if last // 2 < r["step"] <= last]}
    lines = [f"Paired by seed with {ref}: diff = mean of per-seed (variant - {ref}) (SE = sd/sqrt(n)), * = beyond "
             f"Student's t (95 %, n-1 dof). Hardest buckets: {', '.join(hardest)}.\n"]
    cols = ["tokens/trained token", "zero-var %", "all-wrong %", "hardest-2 share %", "rounds/step", "surplus/step",
            "skipped c/step", "skipped w/step", "p_c final", "p_w final"]
    paired_cols = ("tokens/trained token", "zero-var %", "hardest-2 share %")
    lines += [f"\n**The ceiling** from {ref}: w = wasted / decoded tokens, pooled over its runs\n",
              "| steps | w | ceiling 1/(1-w) |", "|---|---:|---:|"]
    lines += [f"| {s} | {w:.3f} | {c:.2f}x |" for s, w, c in ceiling_rows(steps[ref], args.window)]
    for phase, pick in phases.items():
        figs = {name: {s: cost(pick(rows), hardest, buckets) for s, rows in runs.items()} for name, runs in
                steps.items()}
        lines += [f"\n**Cost, {phase}** (mean +- sd over seeds; paired diff vs {ref})\n",
                  "| variant | runs | saving vs " + ref + " (per run ratio) | % of the ceiling reached | "
                  + " | ".join(cols) + " |", "|---|---:|---:|---:|" + "---:|" * len(cols)]
        for name, per_seed in figs.items():
            col = {c: {s: f[c] for s, f in per_seed.items()} for c in cols}
            ratio = {s: figs[ref][s]["tokens/trained token"] / f["tokens/trained token"] for s, f in per_seed.items()
                     if s in figs[ref]}
            reach = {s: (1 - 1 / r) / (1 - figs[ref][s]["tokens/trained token"] ** -1) for s, r in ratio.items()}
            cells = [_cell(ratio) + "x", "-" if name == ref else _cell({s: 100 * v for s, v in reach.items()}, ".0f")]
            for c in cols:
                cell = _cell(col[c])
                if name != ref and c in paired_cols:
                    cell += " (" + _diff(col[c], {s: f[c] for s, f in figs[ref].items()}) + ")"
                cells.append(cell)
            lines.append(f"| {name} | {len(per_seed)} | " + " | ".join(cells) + " |")
        lines += [f"\ntrained share per difficulty bucket (% of the batch's groups, mean over steps and runs) and "
                  f"generated share (% of the generated groups), {phase}\n",
                  "| variant | " + " | ".join(f"b{b}" for b in buckets) + " |",
                  "|---|" + "---:|" * len(buckets)]
        for kind, title in (("b", "trained"), ("g", "generated")):
            lines += [f"| {name} ({title}) | " + " | ".join(_cell({s: f[f'{kind}{b}'] for s, f in per_seed.items()},
                                                                    ".1f").split(" +-")[0] for b in buckets) + " |"
                      for name, per_seed in figs.items()]
    budget = min(max((r.get(TOKENS, 0.0) for r in rows), default=0.0) for runs in variants.values()
                 for rows in runs.values())
    lines += [f"\n**Held-out avg@k** (temperature 1; all buckets and the two hardest), mean +- sd, paired diff vs "
              f"{ref}\n", f"| variant | at | all | diff vs {ref} | hardest-2 | diff vs {ref} |",
              "|---|---|---:|---|---:|---|"]
    for at, x_key, x in ((f"step {last}", "step", float(last)), (f"{budget:,.0f} generated tokens", TOKENS, budget)):
        acc = {name: {s: held_out(rows, hardest, x_key, x) for s, rows in runs.items()} for name, runs in
               variants.items()}
        for name, per_seed in acc.items():
            cells = []
            for what in ("all", "hardest-2"):
                col = {s: v[what] for s, v in per_seed.items()}
                cells += [_cell(col, ".1f"), "-" if name == ref else _diff(
                    col, {s: v[what] for s, v in acc[ref].items()}, "+.1f")]
            lines.append(f"| {name} | {at} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
