"""The comparison report: the Markdown tables (held-out primary / secondary metric per group: avg@k / greedy per
bucket of the synthetic task, avg@k / pass@k per math benchmark, see :mod:`~da3po_megatron.studies.compare.keys`;
training accuracy; cost), the verdict generated from the numbers, and :func:`build_report`, which writes
``report.md``, ``summary.json`` (with the sha256 of each run's raw log) and the figures; the raw logs stay with the
runs (or are copied under ``logs_dir``), never next to the report. It reads :class:`~.data.ReportData`, whose
points and hard groups :mod:`~da3po_megatron.studies.compare.data` chooses once. What the report holds and why is
described in :mod:`da3po_megatron.studies.compare`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from da3po_megatron.studies.compare.data import ReportData, prepare
from da3po_megatron.studies.compare.grid import Method, RunSpec, load_grid, warmup_digest
from da3po_megatron.studies.compare.keys import HeldOutKeys
from da3po_megatron.studies.compare.plots import plot_report
from da3po_megatron.studies.compare.previous import load_summary, side_by_side
from da3po_megatron.studies.compare.stats import Comparison, Point, compare_means, curve_at, mean_std, seed_values


def start_evals(grid: dict[str, dict[int, list[dict]]], key: str) -> dict[str, float]:
    """{"<method> seed <k>": step-0 value of ``key``} -- equal for all runs when they share the starting policy (the
    step-0 eval samples with a fixed seed)."""
    out = {}
    for label, runs in grid.items():
        for seed, rows in runs.items():
            if rows and rows[0].get("step") == 0 and isinstance(rows[0].get(key), int | float):
                out[f"{label} seed {seed}"] = float(rows[0][key])
    return out


def _fmt(m: float, s: float, n: int, pct: bool = True) -> str:
    if n == 0 or not math.isfinite(m):
        return "--"
    f = 100.0 if pct else 1.0
    return f"{m * f:.1f} ± {s * f:.1f}" if pct else f"{m:,.0f} ± {s:,.0f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _hard_value(rows: Sequence[dict], keys: HeldOutKeys, hard: Sequence[str], which: int, pt: Point) -> float | None:
    names = [keys.key(which, g) for g in hard]
    vals = [curve_at(rows, k, pt.x, pt.x_key) if k else None for k in names]
    return None if not vals or any(v is None for v in vals) else sum(vals) / len(vals)


def _values(d: ReportData, label: str, which: int, pt: Point, group: str | None = None) -> list[float]:
    key = d.keys.key(which, group) if d.keys else None
    return seed_values(d.grid, label, key, pt) if key else []


def _heldout_table(d: ReportData, pt: Point, which: int) -> tuple[str, dict]:
    """Held-out metric ``which`` (0 = primary, 1 = secondary) per method: all, hard groups, each group."""
    header = ["method", "seeds", "all"] + (["hard"] if d.hard else []) + d.groups
    rows, summ = [], {}
    for m in d.methods:
        runs = d.grid.get(m.label, {})
        all_v = _values(d, m.label, which, pt)
        row = [m.label, str(len(runs)), _fmt(*mean_std(all_v))]
        summ[m.label] = {"all": mean_std(all_v)}
        if d.hard:
            hv = [v for rows_ in runs.values() if (v := _hard_value(rows_, d.keys, d.hard, which, pt)) is not None]
            row.append(_fmt(*mean_std(hv)))
            summ[m.label]["hard"] = mean_std(hv)
        for g in d.groups:
            gv = _values(d, m.label, which, pt, g)
            row.append(_fmt(*mean_std(gv)))
            summ[m.label][g] = mean_std(gv)
        rows.append(row)
    return _table(header, rows), summ


def _train_table(d: ReportData, pt: Point) -> tuple[str, dict]:
    header = ["method", "acc (all)"] + [f"b{b}" for b in d.train_buckets] + ["samples", "tokens"]
    rows, summ = [], {}
    for m in d.methods:
        acc = seed_values(d.grid, m.label, "acc/mean", pt, d.window)
        row = [m.label, _fmt(*mean_std(acc))]
        summ[m.label] = {"all": mean_std(acc)}
        for b in d.train_buckets:
            bv = seed_values(d.grid, m.label, f"gen/acc_bucket/{b}", pt, d.window)
            row.append(_fmt(*mean_std(bv)))
            summ[m.label][f"b{b}"] = mean_std(bv)
        for key in ("gen/cumulative_samples", "gen/cumulative_tokens"):
            v = seed_values(d.grid, m.label, key, pt)
            row.append(_fmt(*mean_std(v), pct=False))
        rows.append(row)
    return _table(header, rows), summ


def _per_run_mean(runs: dict[int, list[dict]], key: str) -> list[float]:
    """Per run: the mean of ``key`` over its training steps (step > 0)."""
    out = []
    for rows in runs.values():
        v = [r[key] for r in rows if isinstance(r.get(key), int | float) and r.get("step", 0) > 0]
        if v:
            out.append(float(np.mean(v)))
    return out


def _per_step(runs: dict[int, list[dict]], key: str) -> list[float]:
    """Per run: the last value of a cumulative ``key`` divided by its step (e.g. samples per step)."""
    out = []
    for rows in runs.values():
        last = [r for r in rows if isinstance(r.get(key), int | float)]
        if last and last[-1]["step"] > 0:
            out.append(last[-1][key] / last[-1]["step"])
    return out


def _cost_table(d: ReportData, walls: dict[str, list[float]]) -> str:
    header = ["method", "final step", "samples / step", "tokens / step", "filtered %", "DAA activation %",
              "DAA lambda (mean)", "s / step", "run wall s"]
    rows = []
    for m in d.methods:
        runs = d.grid.get(m.label, {})
        finals = [rows_[-1]["step"] for rows_ in runs.values()]

        per_run = lambda key: _per_run_mean(runs, key)  # noqa: B023
        per_step = lambda key: _per_step(runs, key)  # noqa: B023
        rows.append([m.label, ", ".join(str(s) for s in sorted(set(finals))) or "--",
                     _fmt(*mean_std(per_step("gen/cumulative_samples")), pct=False),
                     _fmt(*mean_std(per_step("gen/cumulative_tokens")), pct=False),
                     _fmt(*mean_std(per_run("filter/frac_filtered"))),
                     _fmt(*mean_std(per_run("daa/activation_frac"))),
                     (lambda t: f"{t[0]:.2f}" if t[2] else "--")(mean_std(per_run("daa/lambda_mean"))),
                     (lambda t: f"{t[0]:.1f}" if t[2] else "--")(mean_std(per_run("time/step"))),
                     (lambda t: f"{t[0]:.0f}" if t[2] else "--")(mean_std(walls.get(m.label, [])))])
    return _table(header, rows)


def _comparisons(d: ReportData, pt: Point, subset: str) -> list[Comparison]:
    """Each DAA method vs its own baseline first, then vs the other non-DAA methods present."""
    out = []
    labels = {m.label for m in d.methods if d.grid.get(m.label)}
    baselines = [m for m in d.methods if not m.daa and m.label in labels]

    def vals(label: str) -> list[float]:
        if subset == "all":
            return _values(d, label, 0, pt)
        return [v for rows in d.grid.get(label, {}).values() if (v := _hard_value(rows, d.keys, d.hard, 0, pt))
                is not None]

    for m in d.methods:
        if not m.daa or m.label not in labels:
            continue
        own = [b for b in baselines if b.label == m.baseline]
        for b in own + [b for b in baselines if b.label != m.baseline]:
            out.append(compare_means(m.label, vals(m.label), b.label, vals(b.label), d.z))
    return out


def _describe_comparisons(cs: Sequence[Comparison], own: dict[str, str]) -> str:
    parts = []
    for c in cs:
        if c.outcome == "undetermined":
            parts.append(f"{c.a} vs {c.b}: undetermined (fewer than 2 seeds)")
            continue
        word = {"better": "**better**", "worse": "**worse**"}.get(c.outcome, "no significant difference")
        parts.append(f"{c.a} vs {c.b}{' (its baseline)' if own.get(c.a) == c.b else ''}: "
                     f"{c.diff * 100:+.1f} pts (SE {c.se * 100:.1f}) -> {word}")
    return "; ".join(parts)


def verdict(d: ReportData) -> tuple[str, dict]:
    """The verdict paragraph: generated from the comparisons (held-out primary metric, all groups and hard groups) at
    equal steps and at the full equal-samples budget."""
    metric = d.metric
    if d.keys is None:
        return "No held-out evaluation in the logs: no verdict.", {}
    own = {m.label: m.baseline for m in d.methods if m.daa}
    points = [p for p in ([d.step_point] + d.sample_points[-1:]) if p is not None]
    lines, counts, data = [], {"better": 0, "worse": 0, "no significant difference": 0, "undetermined": 0}, {}
    own_counts = dict.fromkeys(counts, 0)
    n_seeds = sorted({len(r) for r in d.grid.values()})
    for pt in points:
        for subset in ["all"] + (["hard"] if d.hard else []):
            cs = _comparisons(d, pt, subset)
            if not cs:
                continue
            data[f"{pt.name}|{subset}"] = [asdict(c) for c in cs]
            for c in cs:
                counts[c.outcome] += 1
                if own.get(c.a) == c.b:
                    own_counts[c.outcome] += 1
            where = f"all {d.kind}s" if subset == "all" else f"hard {d.kind}s {', '.join(d.hard)}"
            lines.append(f"- At **{'equal steps' if pt.x_key == 'step' else 'equal generated samples'} "
                         f"({pt.name})**, held-out {metric} on {where}: {_describe_comparisons(cs, own)}.")
    if not lines:
        return ("No method with DAA and no baseline both present: nothing to compare.", {})
    total_own = sum(own_counts.values())
    if total_own == 0:
        head = "No DAA method could be compared with its own baseline (not in the grid, or no runs)."
    elif own_counts["undetermined"] == total_own:
        head = "With fewer than 2 seeds per method no significance can be claimed."
    elif own_counts["better"] and not own_counts["worse"]:
        head = (f"DAA was significantly better than its baseline in {own_counts['better']} of {total_own} "
                f"comparisons and never significantly worse.")
    elif own_counts["worse"] and not own_counts["better"]:
        head = (f"DAA was significantly worse than its baseline in {own_counts['worse']} of {total_own} comparisons "
                f"and never significantly better.")
    elif own_counts["better"] and own_counts["worse"]:
        head = (f"Mixed: DAA was significantly better than its baseline in {own_counts['better']} and significantly "
                f"worse in {own_counts['worse']} of {total_own} comparisons.")
    else:
        head = (f"**No significant difference**: in all {total_own} comparisons of a DAA method with its own "
                f"baseline the difference of seed means is within {d.z:g} standard errors.")
    seeds_txt = "/".join(map(str, n_seeds))
    text = (f"{head} (Against all baselines: {counts['better']} better, {counts['worse']} worse, "
            f"{counts['no significant difference']} not significantly different, {counts['undetermined']} "
            f"undetermined.) The screen is a difference of seed means beyond {d.z:g} standard errors with "
            f"{seeds_txt} seed(s) per method, uncorrected for the number of comparisons: a coarse test -- read "
            "'no significant difference' as 'this budget cannot tell them apart', not as 'equal'.\n\n"
            + "\n".join(lines))
    return text, {"counts": counts, "own_baseline_counts": own_counts, "comparisons": data}


def build_report(specs: Sequence[RunSpec], methods: Sequence[Method], out_dir: str | Path, *, command: str = "",
                 rebuilt_with: str = "", base_config: str = "", records: Sequence[dict] | None = None,
                 window: int = 5, z: float = 2.0, tau: float = 0.5, warmup_dir: str | Path | None = None,
                 page: str | Path | None = None, prefer: str | None = None,
                 previous: str | Path | None = None, previous_note: str = "",
                 title: str = "Does DAA help? Compute-matched algorithm comparison", figures: bool = True,
                 logs_dir: str | Path | None = None) -> Path:
    """Write ``out_dir/report.md``, ``out_dir/figures/*.png`` and ``out_dir/summary.json`` from the runs of ``specs``
    (``summary.json``'s ``raw_logs``: the sha256 of every run's ``metrics.jsonl``; with ``logs_dir``, copies of them at
    ``logs_dir/<method>/seed<k>.jsonl``, outside the report so that reports stay small in git); with ``page``, also a
    copy of the report at that path whose figure links are relative to it (e.g. docs/results_cpu.md). The held-out
    metric is whatever the runs logged (synthetic task or math benchmarks; ``prefer`` chooses when both are there).
    ``previous``: an earlier report directory whose numbers are shown side by side (``previous.py``), after
    ``previous_note``. Returns the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    grid = load_grid(specs)
    start_acc = None
    warm = None
    if warmup_dir and (Path(warmup_dir) / "warmup_report.json").exists():
        warm = json.loads((Path(warmup_dir) / "warmup_report.json").read_text())
    d = prepare(methods, grid, window=window, z=z, tau=tau, start_acc=start_acc, prefer=prefer)
    metric, second = d.keys.names if d.keys else ("avg@k", "greedy")
    kind = d.kind

    raw_logs: dict[str, str] = {}  # <method>/seed<k>.jsonl -> sha256 of that run's metrics.jsonl
    for s in specs:
        src = s.run_dir / "metrics.jsonl"
        if src.exists():
            rel = f"{s.method.slug}/seed{s.seed}.jsonl"
            raw_logs[rel] = hashlib.sha256(src.read_bytes()).hexdigest()
            if logs_dir is not None:
                dst = Path(logs_dir) / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
    # without figures=True the report links the PNGs an earlier build left (a quick rebuild keeps its figures)
    order = ("train_acc", "heldout_vs", "heldout_b", "filtered", "daa", "theory")
    figs = plot_report(d, out / "figures") if grid and figures else sorted(
        (out / "figures").glob("*.png"), key=lambda f: (next((i for i, o in enumerate(order) if f.stem.startswith(o)),
                                                               9), f.stem))

    walls: dict[str, list[float]] = {}
    resumed = 0
    for s in specs:
        info = s.run_dir / "compare_run.json"
        if info.exists():
            data = json.loads(info.read_text())
            w = data.get("wall_s_total")
            if isinstance(w, int | float):
                walls.setdefault(s.method.label, []).append(float(w))
            resumed += sum(a.get("rc") == 0 for a in data.get("attempts", [])) > 1
    starts = start_evals(grid, d.keys.key(0)) if d.keys else {}
    missing = [f"{s.method.label} seed {s.seed}" for s in specs if s.seed not in grid.get(s.method.label, {})]
    short = [f"{s.method.label} seed {s.seed} (step {grid[s.method.label][s.seed][-1]['step']} of {s.steps})"
             for s in specs if s.seed in grid.get(s.method.label, {})
             and grid[s.method.label][s.seed][-1]["step"] < s.steps]
    failed = [f"{r['method']} seed {r['seed']} (exit {r['rc']})" for r in records or [] if r["status"] == "failed"]

    def body(fig_prefix: str) -> str:
        md: list[str] = [f"# {title}", ""]
        md += ["_Generated by `tools/compare_algorithms.py` from the runs' `metrics.jsonl` "
               "(da3po_megatron/studies/compare/); regenerate with the command below._", ""]
        if command:
            md += ["## Command", "", "Reproduce (finished runs are skipped, so re-running it only rebuilds this report "
                   "unless the runs directory is removed):", "", "```bash", command, "```", ""]
            if rebuilt_with:
                md += ["This report was rebuilt from the existing runs with:", "", "```bash", rebuilt_with, "```", ""]
        steps = sorted({s.steps for s in specs})
        seeds = sorted({s.seed for s in specs})
        md += ["## Setup", "",
               f"- base config: `{base_config}`" if base_config else "- base config: (not recorded)",
               "- methods: " + ", ".join(f"`{m.label}` ({' '.join(m.overrides)})" for m in methods),
               f"- seeds: {', '.join(map(str, seeds))}; steps per run: {', '.join(map(str, steps))}",
               f"- held-out metric: `{metric}` and `{second}` " + (
                   "(sampling; greedy accuracy) on the held-out split of the synthetic task, per difficulty bucket "
                   "(bucket = number of digits)" if d.keys is None or d.keys.source == "synthetic" else
                   f"on the math benchmarks {', '.join(d.groups) or 'of the runs'} (keys `{d.keys.key(0)}` ...)")]
        total_wall = sum(w for ws in walls.values() for w in ws)
        if total_wall:
            md.append(f"- training wall time, all runs together: {total_wall / 60:.0f} min (each run: its own trainer "
                      "process with Ray, vLLM and the Megatron policy; per-run times in the cost table)")
        if resumed:
            md.append(f"- {resumed} of {len(specs)} runs were trained in more than one invocation of the runner "
                      "(resumed from their checkpoints; per-attempt commands, steps and times in each run's "
                      "`compare_run.json`)")
        if d.start_acc:
            md.append("- starting policy (warm-up, shared by all runs), held-out "
                      f"{metric} per {kind} at step 0: " + ", ".join(f"{g} {100 * v:.1f}%" for g, v in
                                                                       d.start_acc.items()))
        if warmup_dir and list(Path(warmup_dir).glob("*.safetensors")):
            md.append(f"- starting-policy weights: `{warmup_dir}` (sha256 {warmup_digest(warmup_dir)[:12]})")
        if len({round(v, 9) for v in starts.values()}) > 1:
            md.append(f"- **WARNING: the runs did not all start from the same policy**: their step-0 held-out {metric} "
                      "differ (" + ", ".join(f"{k} {100 * v:.1f}%" for k, v in sorted(starts.items())) + "); the "
                      "comparison is not valid")
        elif starts:
            md.append(f"- all {len(starts)} runs start from the same policy: identical step-0 held-out {metric} "
                      f"({100 * next(iter(starts.values())):.1f}%)")
        if warm:
            md.append("- warm-up report (one temperature-1 sample per held-out prompt): " + ", ".join(
                f"b{b} {100 * v:.1f}%" for b, v in warm.get("accuracy_by_bucket", {}).items()))
        if d.hard:
            md.append(f"- **hard {kind}s** ({d.hard_rule}): {', '.join(d.hard)}; the `hard` column is their mean")
        if missing or short or failed:
            md += ["", "**Incomplete grid** -- the tables use what exists:"]
            md += [f"- no metrics: {', '.join(missing)}"] if missing else []
            md += [f"- unfinished: {', '.join(short)}"] if short else []
            md += [f"- failed in this invocation: {', '.join(failed)}"] if failed else []
        md.append("")
        md += ["## Verdict", "", verdict_text, ""]
        if previous:
            md += [f"## Compared with the previous report (`{previous}`)", "", previous_note, "",
                   side_by_side(load_summary(previous), summary), ""]
        if d.step_point:
            t, _ = _heldout_table(d, d.step_point, 0)
            g, _ = _heldout_table(d, d.step_point, 1)
            tr, _ = _train_table(d, d.step_point)
            md += [f"## Equal training steps ({d.step_point.name})", "",
                   f"Held-out {metric} (%, mean ± std over seeds):", "", t, "",
                   f"Held-out {second} (%):", "", g, "",
                   f"Training (rollout) accuracy (%, {d.window}-step trailing mean) per bucket, and what the runs "
                   "had generated by then (samples = responses, tokens = response tokens):", "", tr, ""]
        for pt in d.sample_points:
            t, _ = _heldout_table(d, pt, 0)
            g, _ = _heldout_table(d, pt, 1)
            tr, _ = _train_table(d, pt)
            md += [f"## Equal generated samples ({pt.name})", "",
                   f"Held-out {metric} (%), each run's eval curve interpolated linearly in cumulative generated "
                   "samples:", "", t, "", f"Held-out {second} (%):", "", g, "",
                   f"Training accuracy (%, {d.window}-step trailing mean, interpolated at the budget):", "", tr, ""]
        cost = _cost_table(d, walls)
        md += ["## Cost and dynamics (means over steps, then mean ± std over seeds)", "", cost, ""]
        md += ["## Figures", ""]
        captions = {
            "train_acc_vs_steps.png": "Training accuracy vs training steps.",
            "train_acc_vs_samples.png": "Training accuracy vs generated samples (the compute-matched view).",
            "train_acc_vs_tokens.png": "Training accuracy vs generated tokens.",
            "heldout_vs_steps.png": f"Held-out {metric} and {second} vs steps.",
            "heldout_vs_samples.png": f"Held-out {metric} and {second} vs generated samples.",
            "heldout_buckets_vs_samples.png": f"Held-out {metric} per {kind} vs generated samples.",
            "heldout_by_bucket.png": f"Held-out {metric} per {kind} at equal steps, with the starting policy.",
            "filtered_frac.png": "Fraction of generated groups thrown away by dynamic sampling (p_hat in {0, 1}).",
            "daa_activation.png": "DAA activation (fraction of responses amplified, Eq. 14) and mean lambda.",
            "theory_diagnostic.png": "Theorem 3.1: mean advantage of correct / incorrect responses on kept groups "
                                     "divided by that on all groups of the same p_hat bin, vs the predicted alpha+ / "
                                     "alpha- (dynamic-sampling methods). The theorem holds one prompt's success "
                                     "probability p fixed; the diagnostic pools prompts by observed p_hat, so prompts "
                                     "the policy cannot solve (true p ~ 0: all-wrong groups, zero advantage) pull the "
                                     "'all' mean of incorrect responses towards 0 and push that ratio above alpha-.",
        }
        for p in figs:
            md += [f"![{p.stem}]({fig_prefix}{p.name})", "", f"_{captions.get(p.name, p.stem)}_", ""]
        md += ["## Method", "",
               "- Every run is the real trainer (`python -m da3po_megatron.cli train`: megatron-core policy, vLLM "
               "engines, Ray), started from the same warm-up checkpoint; methods differ only by the overrides listed "
               "above; seeds change data order, sampling and nothing else.",
               "- Equal steps: values at the last step where every run logged a held-out evaluation.",
               "- Equal generated samples: budgets are the largest `gen/cumulative_samples` every run reached and half "
               "of it. Each run's curve is linearly interpolated in cumulative samples (responses generated, including "
               "groups filtered by dynamic sampling and discarded surplus); held-out curves between their evaluation "
               "points (step 0 = 0 samples), training curves after a trailing mean over "
               f"{d.window} steps. No extrapolation.",
               f"- Verdict screen: difference of seed means beyond {z:g} standard errors, SE = sqrt(s_a^2/n_a + "
               "s_b^2/n_b) with sample std (ddof=1); 'undetermined' with fewer than 2 seeds.",
               "- Raw logs: each run's `metrics.jsonl` in its run directory" + (
                   f", copied to `{logs_dir}/<method>/seed<k>.jsonl`" if logs_dir is not None else "")
               + "; not kept next to the report (their sha256: `raw_logs` in `summary.json`).",
               ""]
        return "\n".join(md)

    verdict_text, verdict_data = verdict(d)
    summary: dict[str, Any] = {"metric": metric, "second_metric": second, "group_kind": kind, "groups": d.groups,
                               "hard_groups": d.hard, "keys": asdict(d.keys) if d.keys else None,
                               "start_acc": {str(k): v for k, v in d.start_acc.items()}, "verdict": verdict_data,
                               "missing": missing, "unfinished": short, "failed": failed, "tables": {},
                               "raw_logs": {"sha256": raw_logs, "dir": str(logs_dir) if logs_dir is not None else None}}
    for pt in ([d.step_point] if d.step_point else []) + d.sample_points:
        summary["tables"][pt.name] = {"heldout": _heldout_table(d, pt, 0)[1],
                                      "second": _heldout_table(d, pt, 1)[1],
                                      "train": _train_table(d, pt)[1], "x_key": pt.x_key, "x": pt.x}
    report = out / "report.md"
    report.write_text(body("figures/"))
    if page:
        page = Path(page)
        page.parent.mkdir(parents=True, exist_ok=True)
        prefix = os.path.relpath(out / "figures", page.parent).replace(os.sep, "/") + "/"
        page.write_text(body(prefix))

    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float) + "\n")
    return report
