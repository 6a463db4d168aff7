#!/usr/bin/env python
"""Does DAA help? Run a {method} x {seed} grid through the real trainer and write a compute-matched report.

    python tools/compare_algorithms.py --base examples/compare_cpu.yaml \\
        --methods grpo,dapo,gspo,da3po:1.5,da3po:2,da3po:2.5,da3po:adaptive --seeds 0,1,2 --steps 30 \\
        --out reports/cpu_compare [--page docs/results_cpu.md] [section.key=value ...]

    python tools/compare_algorithms.py --smoke --out /tmp/compare_smoke     # 2 methods x 1 seed x 2 steps

Methods: ``grpo``, ``dapo``, ``gspo``, ``da3po`` (the config's lambda), ``da3po:<lambda>``, ``da3po:adaptive``, and
``grpo:<lambda>`` / ``gspo:<lambda>`` (DAA on top of GRPO / GSPO). Extra ``section.key=value`` arguments go to every
run.
Runs live in ``--runs-dir`` (default ``runs/compare/<basename of --out>``, with checkpoints); the report directory holds
only ``report.md``, ``summary.json`` and ``figures/`` (raw logs stay in the runs, or ``--logs-dir``). Re-running the
same command skips finished runs and resumes unfinished ones; ``--report-only`` rebuilds the report from what exists.
The implementation is the study package ``da3po_megatron.studies.compare`` (modules grid, stats, report and
plots); run it under ``nice -n 10`` on a shared machine.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from da3po_megatron.studies import compare as C

DEFAULT_METHODS = "grpo,dapo,gspo,da3po:1.5,da3po:2,da3po:2.5,da3po:adaptive"
SMOKE_METHODS = "grpo,da3po:2"
# The tiniest settings that still go through every part of a step (dynamic sampling, DAA, eval, checkpoint).
SMOKE_OVERRIDES = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=4",
                   "data.synthetic.max_digits=3", "data.synthetic.train_per_bucket=16",
                   "data.synthetic.eval_per_bucket=2", "eval.every=1", "eval.k=2", "algorithm.max_generation_rounds=8",
                   "trainer.save_every=0", "trainer.tensorboard=false"]
# The smoke grid shares the demo's starting policy (same warm-up command and defaults as scripts/demo.sh): a shorter
# warm-up leaves a policy that never answers, so dynamic sampling could not fill a batch.
SMOKE_WARMUP_DIR = Path("outputs/demo/warmup")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="examples/compare_cpu.yaml", help="base YAML config of every run")
    p.add_argument("--methods", default=None, help=f"comma-separated (default: {DEFAULT_METHODS})")
    p.add_argument("--seeds", default=None, help="comma-separated trainer seeds (default: 0,1,2; smoke: 0)")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the base config's total_steps)")
    p.add_argument("--out", required=True, type=Path, help="report directory")
    p.add_argument("--runs-dir", type=Path, default=None, help="where the runs live (default runs/compare/<out name>)")
    p.add_argument("--logs-dir", type=Path, default=None,
                   help="also copy each run's metrics.jsonl to LOGS_DIR/<method>/seed<k>.jsonl (default: none; the "
                        "report records their sha256 and never holds them)")
    p.add_argument("--warmup-dir", type=Path, default=None, help="starting policy to use (built there if missing); "
                                                                    "copied once to <runs-dir>/warmup, which every "
                                                                    "run loads (default: built in <runs-dir>/warmup)")
    p.add_argument("--warmup-args", default="", help="extra arguments of `python -m da3po_megatron.data.warmup`")
    p.add_argument("--warmup-sha256", default="", help="refuse to run unless the starting policy's weights hash to "
                                                       "this (a prefix, as the reports print it)")
    p.add_argument("--page", type=Path, default=None, help="also write the report here (figure links relative to it)")
    p.add_argument("--smoke", action="store_true", help=f"{SMOKE_METHODS} x seed 0 x 2 steps, tiniest settings; "
                                                        f"warm-up shared with the demo ({SMOKE_WARMUP_DIR})")
    p.add_argument("--report-only", action="store_true", help="do not train: rebuild the report from existing runs")
    p.add_argument("--no-figures", action="store_true", help="skip the PNG figures (faster report)")
    p.add_argument("--run-timeout", type=float, default=0, help="seconds per run before SIGTERM (checkpoint + exit; "
                                                                "the next invocation resumes); 0 = none")
    p.add_argument("--window", type=int, default=5, help="trailing-mean window (steps) of training accuracy")
    p.add_argument("--z", type=float, default=2.0, help="significance screen: |diff| > z standard errors")
    p.add_argument("--heldout", choices=("synthetic", "benchmarks"), default=None,
                   help="which held-out metrics the report reads when the runs logged both (default: synthetic); "
                        "with math benchmarks (eval.benchmarks) the groups are the benchmarks")
    p.add_argument("--previous", type=Path, default=None, help="an earlier report directory (with summary.json): its "
                                                                  "numbers are shown side by side with the new ones")
    p.add_argument("--previous-note", type=Path, default=None,
                   help="a Markdown file saying what changed since --previous (shown above the side-by-side tables)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides applied to every run")
    a = p.parse_args(argv)

    try:
        methods = C.parse_methods(a.methods or (SMOKE_METHODS if a.smoke else DEFAULT_METHODS))
        seeds = [int(s) for s in (a.seeds or ("0" if a.smoke else "0,1,2")).split(",") if s.strip()]
    except ValueError as e:
        print(f"compare_algorithms: error: {e}", file=sys.stderr)
        return 2
    overrides = (SMOKE_OVERRIDES if a.smoke else []) + list(a.overrides)
    steps = a.steps or (2 if a.smoke else _base_steps(a.base, overrides))
    if steps is None:
        return 2
    runs_dir = a.runs_dir or Path("runs/compare") / a.out.name
    # Every run of the grid starts from <runs-dir>/warmup: built there, or a snapshot of --warmup-dir taken once (a
    # shared directory rebuilt by someone else mid-grid must not change the starting policy of later runs).
    warmup_dir = runs_dir / "warmup"
    warmup_source = a.warmup_dir or (SMOKE_WARMUP_DIR if a.smoke else None)
    warmup_args = shlex.split(a.warmup_args)
    specs = C.grid_specs(methods, seeds, steps, runs_dir)
    command = shlex.join(["python", "tools/compare_algorithms.py", *argv])

    t0 = time.perf_counter()
    records = None
    rebuilt_with = ""
    grid_cmd = runs_dir / "grid_command.txt"  # the command that trained the runs, for --report-only rebuilds
    if a.report_only:
        if grid_cmd.exists():
            command, rebuilt_with = grid_cmd.read_text().strip(), command
    else:
        runs_dir.mkdir(parents=True, exist_ok=True)
        grid_cmd.write_text(command + "\n")
        try:
            C.ensure_warmup(warmup_dir, warmup_args, source=warmup_source, expect_sha256=a.warmup_sha256)
        except RuntimeError as e:
            print(f"compare_algorithms: error: {e}", file=sys.stderr)
            return 1
        try:
            records = C.run_grid(specs, a.base, warmup_dir, overrides, timeout_s=a.run_timeout or None)
        except C.Stop as e:
            print(f"compare_algorithms: stopped: {e}; re-run the same command to resume", flush=True)
            return 143
    report = C.build_report(specs, methods, a.out, command=command, rebuilt_with=rebuilt_with, base_config=a.base,
                            records=records,
                            window=a.window, z=a.z, warmup_dir=warmup_dir, page=a.page, prefer=a.heldout,
                            previous=a.previous,
                            previous_note=a.previous_note.read_text().strip() if a.previous_note else "",
                            figures=not a.no_figures, logs_dir=a.logs_dir)
    print(f"report: {report} ({time.perf_counter() - t0:.0f} s)" + (f"; page: {a.page}" if a.page else ""))
    failed = [r for r in records or [] if r["status"] == "failed"]
    return 1 if failed else 0


def _base_steps(base: str, overrides: list[str]) -> int | None:
    from da3po_megatron.config import ConfigError, load_config

    try:
        return load_config(base, overrides + ["model.path=unused"]).trainer.total_steps
    except ConfigError as e:
        print(f"compare_algorithms: error: {e}", file=sys.stderr)
        return None


if __name__ == "__main__":
    sys.exit(main())
