"""The algorithm-comparison study (da3po_megatron/studies/compare/, tools/compare_algorithms.py).

Fast tests build synthetic ``metrics.jsonl`` files with known curves (so every table value is computable by hand);
the slow test runs ``tools/compare_algorithms.py --smoke`` through the real trainer (megatron-core, vLLM, Ray) twice,
the second time checking that finished runs are skipped.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from da3po_megatron.eval.curves import read_metrics
from da3po_megatron.studies import compare as C

REPO = Path(__file__).resolve().parents[1]
BUCKETS = (1, 2, 3, 4)
START = {1: 0.9, 2: 0.7, 3: 0.5, 4: 0.25}  # starting policy's held-out avg@4 per bucket


def write_run(run_dir: Path, steps: int, samples_per_step: float, eval_acc, train_acc, eval_every: int = 2,
              start: dict[int, float] | None = None, filtered: float = 0.0, daa: float = 0.0) -> Path:
    """A fake run: eval_acc(step) / train_acc(step) give the overall values; bucket b gets value - 0.1 * (b - 1)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    start = start or START
    rows = [{"step": 0, "eval/synthetic/avg@4": sum(start.values()) / len(start), "eval/synthetic/greedy": 0.5,
             **{f"eval/synthetic/bucket{b}/avg@4": v for b, v in start.items()},
             **{f"eval/synthetic/bucket{b}/greedy": 0.5 for b in BUCKETS}}]
    for s in range(1, steps + 1):
        r = {"step": s, "acc/mean": train_acc(s), "gen/cumulative_samples": samples_per_step * s,
             "gen/cumulative_tokens": 10 * samples_per_step * s, "filter/frac_filtered": filtered,
             "daa/activation_frac": daa, "daa/lambda_mean": 2.0 if daa else 1.0, "time/step": 1.0,
             "theory/0.0-0.5/adv_correct_kept": 1.5, "theory/0.0-0.5/adv_correct_all": 1.0,
             "theory/0.0-0.5/alpha_plus": 1.4, "theory/0.0-0.5/adv_incorrect_kept": -1.2,
             "theory/0.0-0.5/adv_incorrect_all": -1.0, "theory/0.0-0.5/alpha_minus": 1.1,
             **{f"gen/acc_bucket/{b}": train_acc(s) - 0.1 * (b - 1) for b in BUCKETS}}
        if s % eval_every == 0 or s == steps:
            e = eval_acc(s)
            r.update({"eval/synthetic/avg@4": e, "eval/synthetic/greedy": e,
                      **{f"eval/synthetic/bucket{b}/avg@4": e - 0.1 * (b - 1) for b in BUCKETS},
                      **{f"eval/synthetic/bucket{b}/greedy": e for b in BUCKETS}})
        rows.append(r)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


# ---------------------------------------------------------------------------------------------------- methods, grid


def test_method_specs_map_to_the_config_overrides_of_each_preset():
    from da3po_megatron.algorithms.registry import preset_override_args

    m = C.parse_method("da3po:1.5")
    whole = tuple(preset_override_args("da3po"))
    assert whole[0] == "algorithm.name=da3po" and "algorithm.clip_ratio_high=0.28" in whole
    assert m.overrides == (*whole, "daa.mode=constant", "daa.lambda_=1.5") and m.daa
    assert m.baseline == "dapo" and m.filters and m.slug == "da3po_1.5"
    assert C.parse_method("da3po:adaptive").overrides == (*whole, "daa.mode=adaptive")
    assert C.parse_method("da3po").overrides == whole
    g = C.parse_method("grpo")
    assert "algorithm.clip_ratio_high=0.2" in g.overrides and "algorithm.overlong.enable=false" in g.overrides
    assert "daa.enable=false" in g.overrides and not g.daa and not g.filters
    g2 = C.parse_method("grpo:2")
    assert "daa.enable=true" in g2.overrides and "daa.enable=false" not in g2.overrides
    assert g2.daa and g2.baseline == "grpo"


def test_method_spec_errors_name_the_spec():
    with pytest.raises(ValueError, match="'ppo'"):
        C.parse_method("ppo")
    with pytest.raises(ValueError, match="da3po:big"):
        C.parse_method("da3po:big")
    with pytest.raises(ValueError, match="twice"):
        C.parse_methods("dapo,dapo")


def test_method_overrides_are_valid_config_for_the_real_loader():
    from da3po_megatron.algorithms.registry import preset_overrides
    from da3po_megatron.config import load_config

    for spec in ("grpo", "dapo", "gspo", "da3po:2.5", "da3po:adaptive", "gspo:2"):
        m = C.parse_method(spec)
        cfg = load_config(REPO / "examples/compare_cpu.yaml", ["model.path=x", *m.overrides])
        assert cfg.daa.enable == m.daa and cfg.algorithm.filter_groups == m.filters
        assert not [x for x in preset_overrides(cfg) if not x.startswith("daa.enable")]  # the whole preset, no leak
        if spec == "da3po:2.5":
            assert cfg.daa.lambda_ == 2.5 and cfg.daa.mode == "constant"
        if spec == "da3po:adaptive":
            assert cfg.daa.mode == "adaptive"


def test_grid_is_seed_major_and_commands_carry_seed_steps_and_method(tmp_path):
    specs = C.grid_specs(C.parse_methods("grpo,da3po:2"), [0, 1], 7, tmp_path)
    assert [(s.method.label, s.seed) for s in specs] == [("grpo", 0), ("da3po:2", 0), ("grpo", 1), ("da3po:2", 1)]
    cmd = C.train_command(specs[1], "base.yaml", "warm", ["eval.k=2"])
    assert cmd[1:5] == ["-m", "da3po_megatron.cli", "train", "--config"]
    for item in ("model.path=warm", f"trainer.run_dir={tmp_path / 'da3po_2' / 'seed0'}", "trainer.seed=0",
                 "trainer.total_steps=7", "daa.lambda_=2", "algorithm.name=da3po"):
        assert item in cmd
    assert cmd[-1] == "eval.k=2"  # user overrides last: they win


def test_resumability_status_from_done_marker_or_final_step(tmp_path):
    d = tmp_path / "run"
    assert C.run_status(d, 10) == "new"
    write_run(d, 4, 10, lambda s: 0.5, lambda s: 0.5)
    assert C.run_status(d, 10) == "partial" and C.last_step(d) == 4
    assert C.run_status(d, 4) == "done"  # the final step is in metrics.jsonl
    (d / "DONE").write_text(json.dumps({"total_steps": 10}))
    assert C.run_status(d, 10) == "done"
    assert C.run_status(d, 12) == "partial"  # more steps requested than the marker covers: resume
    (d / "DONE").write_text("garbage")
    assert C.run_status(d, 10) == "partial"


def test_run_grid_skips_finished_runs_without_starting_the_trainer(tmp_path):
    specs = C.grid_specs(C.parse_methods("grpo,da3po:2"), [0], 3, tmp_path)
    for s in specs:
        write_run(s.run_dir, 3, 10, lambda s: 0.5, lambda s: 0.5)
    lines: list[str] = []
    t0 = time.perf_counter()
    recs = C.run_grid(specs, "does-not-exist.yaml", "no-model", log=lines.append)
    assert time.perf_counter() - t0 < 1.0
    assert [r["status"] for r in recs] == ["done", "done"] and all("skipped" in x for x in lines)
    assert not (specs[0].run_dir / "train.log").exists()


def test_run_grid_records_a_failed_run_and_leaves_it_resumable(tmp_path):
    specs = C.grid_specs(C.parse_methods("dapo"), [0], 3, tmp_path)
    lines: list[str] = []
    recs = C.run_grid(specs, tmp_path / "missing.yaml", "no-model", log=lines.append)  # the real CLI: config error
    assert recs[0]["status"] == "failed" and recs[0]["rc"] == 2
    d = specs[0].run_dir
    assert not (d / "DONE").exists() and C.run_status(d, 3) == "partial"
    assert "config file not found" in (d / "train.log").read_text()
    info = json.loads((d / "compare_run.json").read_text())
    assert info["attempts"][0]["rc"] == 2 and "trainer.seed=0" in info["attempts"][0]["cmd"]
    assert "FAILED (exit 2" in lines[-1]


def test_grid_warmup_is_a_snapshot_that_a_later_rebuild_of_the_source_does_not_change(tmp_path):
    src = tmp_path / "shared_warmup"
    src.mkdir()
    (src / "warmup_report.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"weights-v1")
    dst = C.ensure_warmup(tmp_path / "runs/warmup", source=src, log=lambda m: None)
    digest = C.warmup_digest(dst)
    (src / "model.safetensors").write_bytes(b"weights-v2")  # someone rebuilds the shared warm-up mid-grid
    assert C.ensure_warmup(tmp_path / "runs/warmup", source=src, log=lambda m: None) == dst
    assert C.warmup_digest(dst) == digest != C.warmup_digest(src)
    assert (dst / "model.safetensors").read_bytes() == b"weights-v1"


def test_grid_refuses_a_starting_policy_with_another_hash(tmp_path):
    """issue 59: a rebuilt warm-up depends on the machine's float kernels; a study names its policy's sha256 and the
    grid refuses any other before a run starts (reused, copied or built alike)."""
    src = tmp_path / "warmup"
    src.mkdir()
    (src / "warmup_report.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"weights-v1")
    digest = C.warmup_digest(src)
    assert C.ensure_warmup(src, log=lambda m: None, expect_sha256=digest[:12].upper()) == src
    with pytest.raises(RuntimeError, match="not the expected 906100cc9c95"):
        C.ensure_warmup(tmp_path / "runs/warmup", source=src, log=lambda m: None, expect_sha256="906100cc9c95")


def test_report_warns_when_runs_did_not_start_from_the_same_policy(tmp_path):
    ms, specs = _grid(tmp_path, "dapo,da3po:2", lambda m, s: 0.5, seeds=(0, 1))
    text = C.build_report(specs, ms, tmp_path / "rep", figures=False).read_text()
    assert "all 4 runs start from the same policy" in text and "WARNING" not in text
    write_run(specs[-1].run_dir, 8, 16, lambda s: 0.5, lambda s: 0.5, start={1: 0.1, 2: 0.1, 3: 0.1, 4: 0.1})
    text = C.build_report(specs, ms, tmp_path / "rep", figures=False).read_text()
    assert "WARNING: the runs did not all start from the same policy" in text


# ---------------------------------------------------------------------------------------------------- statistics


def test_interpolation_is_linear_and_never_extrapolates():
    assert C.interp_at([0, 10, 20], [0.0, 1.0, 0.0], 5) == pytest.approx(0.5)
    assert C.interp_at([0, 10, 20], [0.0, 1.0, 0.0], 15) == pytest.approx(0.5)
    assert C.interp_at([0, 10], [0.2, 0.4], 10) == pytest.approx(0.4)
    assert C.interp_at([0, 10], [0.2, 0.4], 10.5) is None
    assert C.interp_at([5, 10], [0.2, 0.4], 0) is None
    assert C.interp_at([0, 10, 10], [0.0, 0.3, 0.5], 10) == pytest.approx(0.5)  # repeated x: last value wins
    assert C.interp_at([], [], 1) is None


def test_trailing_mean_and_mean_std():
    assert C.trailing_mean([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]
    m, s, n = C.mean_std([1.0, 2.0, 3.0])
    assert (m, s, n) == (2.0, 1.0, 3)
    assert C.mean_std([0.5]) == (0.5, 0.0, 1)
    assert math.isnan(C.mean_std([])[0])


def test_equal_samples_reads_each_run_at_the_same_generated_sample_budget(tmp_path):
    # "dapo" spends 2x samples per step. At step 10 both have eval 0.1*... but at 100 samples dapo is at step 5.
    grpo = write_run(tmp_path / "g", 10, 10, lambda s: 0.05 * s, lambda s: 0.05 * s)
    dapo = write_run(tmp_path / "d", 10, 20, lambda s: 0.06 * s, lambda s: 0.06 * s)
    rows_g, rows_d = read_metrics(grpo), read_metrics(dapo)
    key = "eval/synthetic/avg@4"
    start = sum(START.values()) / len(START)
    # equal steps: step 10
    assert C.curve_at(rows_g, key, 10) == pytest.approx(0.5)
    assert C.curve_at(rows_d, key, 10) == pytest.approx(0.6)
    # equal samples: 100 samples = grpo step 10, dapo step 5 (eval at 4 and 6: 80 and 120 samples -> midpoint)
    assert C.curve_at(rows_g, key, 100, "gen/cumulative_samples") == pytest.approx(0.5)
    assert C.curve_at(rows_d, key, 100, "gen/cumulative_samples") == pytest.approx((0.24 + 0.36) / 2)
    # between the starting eval (0 samples) and the first eval (step 2 = 40 samples)
    assert C.curve_at(rows_d, key, 20, "gen/cumulative_samples") == pytest.approx((start + 0.12) / 2)
    assert C.curve_at(rows_d, key, 201, "gen/cumulative_samples") is None
    # training accuracy: trailing mean over 2 steps, then interpolated in samples
    assert C.curve_at(rows_d, "acc/mean", 100, "gen/cumulative_samples", window=2) == pytest.approx(0.27)


def test_table_points_are_the_last_common_eval_step_and_the_largest_common_budget(tmp_path):
    specs = C.grid_specs(C.parse_methods("grpo,dapo"), [0, 1], 10, tmp_path)
    for s in specs:
        write_run(s.run_dir, 10 if s.seed == 0 else 9, 10 if s.method.label == "grpo" else 25, lambda s: 0.5,
                  lambda s: 0.5, eval_every=4)
    d = C.prepare(C.parse_methods("grpo,dapo"), C.load_grid(specs))
    assert d.metric == "avg@4" and d.groups == [f"b{b}" for b in BUCKETS] and d.train_buckets == list(BUCKETS)
    assert d.step_point.x == 8  # steps 4, 8 common; 10 and 9 are final evals of different runs
    assert [p.x for p in d.sample_points] == [45, 90]  # grpo seed 1 reached 9 x 10 samples
    assert d.hard == ["b4"]  # starting avg@4 < tau = 0.5 (strict: bucket 3 at 0.5 is not hard)
    strong = C.prepare(C.parse_methods("grpo,dapo"), C.load_grid(specs),
                       start_acc={"b1": 0.9, "b2": 0.6, "b3": 0.8, "b4": 0.7}, tau=0.5)
    assert strong.hard == ["b2"] and "lowest" in strong.hard_rule  # none below tau: the hardest quarter


def test_compare_means_screens_at_two_standard_errors():
    c = C.compare_means("a", [0.60, 0.62, 0.64], "b", [0.50, 0.52, 0.54])
    assert c.diff == pytest.approx(0.10) and c.se == pytest.approx(math.sqrt(2 * 0.02**2 / 3))
    assert c.outcome == "better"
    assert C.compare_means("a", [0.50, 0.52, 0.54], "b", [0.60, 0.62, 0.64]).outcome == "worse"
    noisy = C.compare_means("a", [0.50, 0.60, 0.70], "b", [0.45, 0.55, 0.65])  # diff 0.05, SE ~0.082
    assert noisy.outcome == "no significant difference"
    assert C.compare_means("a", [0.5], "b", [0.4, 0.5]).outcome == "undetermined"
    assert C.compare_means("a", [0.5, 0.5], "b", [0.5, 0.5]).outcome == "no significant difference"


def _grid(tmp_path, methods: str, eval_of, seeds=(0, 1, 2), steps=8, spp=None):
    ms = C.parse_methods(methods)
    specs = C.grid_specs(ms, list(seeds), steps, tmp_path / "runs")
    for s in specs:
        e = eval_of(s.method.label, s.seed)
        write_run(s.run_dir, steps, (spp or {}).get(s.method.label, 16), lambda st, e=e: min(1.0, e * st / steps),
                  lambda st, e=e: min(1.0, e * st / steps), filtered=0.3 if s.method.filters else 0.0,
                  daa=0.1 if s.method.daa else 0.0)
    return ms, specs


def test_report_verdict_says_better_when_daa_beats_its_baseline_beyond_two_se(tmp_path):
    ms, specs = _grid(tmp_path, "grpo,dapo,da3po:2",
                      lambda m, s: {"grpo": 0.5, "dapo": 0.5, "da3po:2": 0.7}[m] + 0.01 * s)
    report = C.build_report(specs, ms, tmp_path / "rep", command="python tools/compare_algorithms.py ...",
                            figures=False)
    text = report.read_text()
    assert "significantly better than its baseline in 4 of 4" in text  # {steps, samples} x {all, hard buckets}
    assert "da3po:2 vs dapo (its baseline): +20.0 pts" in text
    summary = json.loads((tmp_path / "rep/summary.json").read_text())
    assert summary["verdict"]["own_baseline_counts"]["better"] == 4
    assert summary["tables"]["step 8"]["heldout"]["da3po:2"]["all"][0] == pytest.approx(0.71)
    assert summary["tables"]["step 8"]["heldout"]["da3po:2"]["b2"][0] == pytest.approx(0.61)
    assert summary["tables"]["step 8"]["heldout"]["grpo"]["all"][1] == pytest.approx(0.01)


def test_report_verdict_says_no_significant_difference_within_two_se(tmp_path):
    noise = {0: -0.1, 1: 0.0, 2: 0.1}
    ms, specs = _grid(tmp_path, "dapo,da3po:2,da3po:adaptive",
                      lambda m, s: 0.5 + noise[s] + (0.02 if m.startswith("da3po") else 0.0))
    text = C.build_report(specs, ms, tmp_path / "rep", figures=False).read_text()
    assert "**No significant difference**: in all" in text
    assert "better" not in text.split("## Verdict")[1].split("## ")[0].replace("0 better", "")


def test_report_holds_equal_step_and_equal_sample_tables_per_bucket_figures_and_logs(tmp_path):
    ms, specs = _grid(tmp_path, "grpo,da3po:2", lambda m, s: 0.6, spp={"grpo": 16, "da3po:2": 32})
    page = tmp_path / "docs" / "results.md"
    C.build_report(specs, ms, tmp_path / "rep", page=page, base_config="examples/compare_cpu.yaml",
                   logs_dir=tmp_path / "logs")
    text = (tmp_path / "rep/report.md").read_text()
    assert "## Equal training steps (step 8)" in text
    assert "## Equal generated samples (128 samples)" in text and "## Equal generated samples (64 samples)" in text
    assert "| method | seeds | all | hard | b1 | b2 | b3 | b4 |" in text
    # at 128 samples da3po:2 (32/step) is at step 4: eval 0.6 * 4 / 8 = 0.3 overall
    summary = json.loads((tmp_path / "rep/summary.json").read_text())
    assert summary["tables"]["128 samples"]["heldout"]["da3po:2"]["all"][0] == pytest.approx(0.3)
    assert summary["tables"]["128 samples"]["heldout"]["grpo"]["all"][0] == pytest.approx(0.6)
    assert summary["hard_groups"] == ["b4"] and summary["group_kind"] == "bucket"
    for name in ("train_acc_vs_steps", "train_acc_vs_samples", "train_acc_vs_tokens", "heldout_vs_steps",
                 "heldout_vs_samples", "heldout_buckets_vs_samples", "heldout_by_bucket", "filtered_frac",
                 "daa_activation", "theory_diagnostic"):
        png = tmp_path / "rep/figures" / f"{name}.png"
        assert png.read_bytes()[:4] == b"\x89PNG", name
        assert f"](figures/{name}.png)" in text
    assert "](../rep/figures/heldout_by_bucket.png)" in page.read_text()
    raw = (specs[-1].run_dir / "metrics.jsonl").read_bytes()  # the raw logs: copied to logs_dir, never into the report
    assert (tmp_path / "logs/da3po_2/seed2.jsonl").read_bytes() == raw and not (tmp_path / "rep/logs").exists()
    assert summary["raw_logs"]["sha256"]["da3po_2/seed2.jsonl"] == hashlib.sha256(raw).hexdigest()


def test_report_shows_a_previous_reports_numbers_side_by_side(tmp_path):
    ms, specs = _grid(tmp_path / "old", "grpo,dapo,da3po:2",
                      lambda m, s: {"grpo": 0.5, "dapo": 0.5, "da3po:2": 0.7}[m] + 0.01 * s)
    C.build_report(specs, ms, tmp_path / "old_rep", figures=False)
    ms, specs = _grid(tmp_path / "new", "grpo,dapo,da3po:2", lambda m, s: 0.5 + 0.01 * s)
    text = C.build_report(specs, ms, tmp_path / "new_rep", figures=False, previous=tmp_path / "old_rep",
                          previous_note="The baselines are now true baselines.").read_text()
    section = text.split("## Compared with the previous report")[1].split("\n## ")[0]
    assert "The baselines are now true baselines." in section
    assert "| da3po:2 | 71.0 ± 1.0 | 51.0 ± 1.0 |" in section  # previous | this run, all buckets, equal steps
    assert "| da3po:2 vs dapo | equal steps, all | +20.0 (**better**) | +0.0 (n.s.) |" in section
    assert "previous 4 / 0 / 0; this run 0 / 0 / 4" in section


def test_report_names_missing_and_unfinished_runs(tmp_path):
    ms, specs = _grid(tmp_path, "dapo,da3po:2", lambda m, s: 0.5, seeds=(0,))
    extra = C.grid_specs(ms, [1], 8, tmp_path / "runs")
    write_run(extra[0].run_dir, 3, 16, lambda s: 0.5, lambda s: 0.5)
    text = C.build_report(specs + extra, ms, tmp_path / "rep", figures=False).read_text()
    assert "no metrics: da3po:2 seed 1" in text and "unfinished: dapo seed 1 (step 3 of 8)" in text
    assert "undetermined" in text  # 1 seed of da3po:2


def test_tool_report_only_rebuilds_from_existing_runs(tmp_path):
    runs = tmp_path / "runs"
    ms, specs = _grid(tmp_path, "dapo,da3po:2", lambda m, s: 0.5)
    r = subprocess.run([sys.executable, "tools/compare_algorithms.py", "--report-only", "--methods", "dapo,da3po:2",
                        "--seeds", "0,1,2", "--steps", "8", "--out", str(tmp_path / "rep"), "--runs-dir", str(runs),
                        "--no-figures"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "## Equal training steps (step 8)" in (tmp_path / "rep/report.md").read_text()
    (runs / "grid_command.txt").write_text("python tools/compare_algorithms.py --seeds 0,1,2 --out rep\n")
    r = subprocess.run([sys.executable, "tools/compare_algorithms.py", "--report-only", "--methods", "dapo,da3po:2",
                        "--seeds", "0,1,2", "--steps", "8", "--out", str(tmp_path / "rep"), "--runs-dir", str(runs),
                        "--no-figures"], cwd=REPO, capture_output=True, text=True, timeout=120)
    text = (tmp_path / "rep/report.md").read_text()
    assert "```bash\npython tools/compare_algorithms.py --seeds 0,1,2 --out rep\n```" in text  # the grid's command
    assert "rebuilt from the existing runs with" in text and "--report-only" in text


# ------------------------------------------------------------------------------------- any benchmark's metric keys

BENCH_START = {"aime24": 0.1, "amc": 0.4, "math500": 0.6}  # the starting policy's avg@k per benchmark


def write_bench_run(run_dir: Path, steps: int, samples_per_step: float, eval_acc, eval_every: int = 2) -> Path:
    """A fake run evaluated on math benchmarks (the keys of eval.runner.flat_metrics: eval/<bench>/avg@k, pass@k, k
    and their mean eval/avg/...), no synthetic keys and no per-bucket training accuracy. Benchmark b gets
    BENCH_START[b] + eval_acc(step); pass@k = avg@k + 0.1."""

    def evals(gain: float) -> dict:
        r: dict = {}
        for b, v in BENCH_START.items():
            r.update({f"eval/{b}/avg@k": v + gain, f"eval/{b}/pass@k": v + gain + 0.1, f"eval/{b}/k": 8.0})
        r["eval/avg/avg@k"] = sum(BENCH_START.values()) / len(BENCH_START) + gain
        r["eval/avg/pass@k"] = r["eval/avg/avg@k"] + 0.1
        return r

    run_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"step": 0, **evals(0.0)}]
    for s in range(1, steps + 1):
        r = {"step": s, "acc/mean": 0.5, "gen/cumulative_samples": samples_per_step * s,
             "gen/cumulative_tokens": 100 * samples_per_step * s, "time/step": 1.0}
        if s % eval_every == 0 or s == steps:
            r.update(evals(eval_acc(s)))
        rows.append(r)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_heldout_keys_are_discovered_for_the_synthetic_task_and_for_math_benchmarks(tmp_path):
    syn = C.discover(read_metrics(write_run(tmp_path / "s", 2, 8, lambda s: 0.5, lambda s: 0.5)))
    assert syn.names == ("avg@4", "greedy") and syn.overall == ("eval/synthetic/avg@4", "eval/synthetic/greedy")
    assert list(syn.groups) == ["b1", "b2", "b3", "b4"] and syn.key(0, "b3") == "eval/synthetic/bucket3/avg@4"
    math_rows = read_metrics(write_bench_run(tmp_path / "m", 2, 8, lambda s: 0.1))
    keys = C.discover(math_rows)
    assert keys.source == "benchmarks" and keys.group_kind == "benchmark"
    assert keys.names == ("avg@8", "pass@8") and keys.overall == ("eval/avg/avg@k", "eval/avg/pass@k")
    assert list(keys.groups) == ["aime24", "amc", "math500"] and keys.key(1, "amc") == "eval/amc/pass@k"
    one = C.discover([{"step": 0, "eval/amc23/avg@k": 0.3, "eval/amc23/k": 4.0}])  # one benchmark: it is "all"
    assert one.overall == ("eval/amc23/avg@k", None) and one.groups == {} and one.names == ("avg@4", "pass@4")
    both = math_rows + [{"eval/synthetic/avg@4": 0.5}]
    assert C.discover(both).source == "synthetic" and C.discover(both, prefer="benchmarks").source == "benchmarks"
    assert C.discover([{"step": 1, "acc/mean": 0.5}]) is None


def test_report_on_math_benchmark_keys_has_per_benchmark_columns_hard_benchmarks_and_a_verdict(tmp_path):
    ms = C.parse_methods("dapo,da3po:2")
    specs = C.grid_specs(ms, [0, 1, 2], 8, tmp_path / "runs")
    for s in specs:
        gain = (0.2 if s.method.daa else 0.1) + 0.01 * s.seed
        write_bench_run(s.run_dir, 8, 16, lambda st, g=gain: g * st / 8)
    C.build_report(specs, ms, tmp_path / "rep", figures=True)
    text = (tmp_path / "rep/report.md").read_text()
    assert "| method | seeds | all | hard | aime24 | amc | math500 |" in text
    assert "Held-out pass@8 (%):" in text and "- held-out metric: `avg@8` and `pass@8` on the math benchmarks" in text
    assert "**hard benchmarks** (starting held-out avg@8 < tau = 0.5, where DAA acts): aime24, amc" in text
    assert "da3po:2 vs dapo (its baseline): +10.0 pts" in text and "on hard benchmarks aime24, amc" in text
    summary = json.loads((tmp_path / "rep/summary.json").read_text())
    assert summary["verdict"]["own_baseline_counts"]["better"] == 4
    assert summary["tables"]["step 8"]["heldout"]["da3po:2"]["amc"][0] == pytest.approx(0.4 + 0.21)
    assert summary["tables"]["step 8"]["second"]["dapo"]["all"][0] == pytest.approx(1.1 / 3 + 0.11 + 0.1)
    for name in ("heldout_vs_steps", "heldout_vs_samples", "heldout_buckets_vs_samples", "heldout_by_bucket"):
        assert (tmp_path / "rep/figures" / f"{name}.png").read_bytes()[:4] == b"\x89PNG", name


def test_compare_variants_puts_each_variant_beside_the_reference_at_equal_steps_and_samples(tmp_path, capsys):
    """tools/compare_variants.py: one method run several ways; the second variant is 0.1 better at every eval and
    generates twice the samples per step, so at equal steps it is better and at the common sample budget it is
    compared where the reference reached it."""
    sys.path.insert(0, str(REPO / "tools"))
    import compare_variants

    for k, jitter in enumerate((0.0, 0.01, -0.01)):
        write_run(tmp_path / "sync" / f"seed{k}", 8, 10, lambda s, j=jitter: 0.5 + 0.01 * s + j, lambda s: 0.5)
        write_run(tmp_path / "fast" / f"seed{k}", 8, 20, lambda s, j=jitter: 0.6 + 0.01 * s + j, lambda s: 0.5)
    assert compare_variants.main([f"sync={tmp_path / 'sync'}", f"fast={tmp_path / 'fast'}"]) == 0
    out = capsys.readouterr().out
    assert "the 1 hard ones" in out  # bucket 4 starts below 0.5 (bucket 3 at it)
    assert "| sync | 3 | step 8 | 58.0 +- 1.0 | - |" in out
    assert "| fast | 3 | step 8 | 68.0 +- 1.0 | +10.0 (SE 0.8): better |" in out
    # the common budget is 80 samples: the reference's step 8 and the fast variant's step 4
    assert "| fast | 3 | 80 samples | 64.0 +- 1.0 | +6.0 (SE 0.8): better |" in out


# ---------------------------------------------------------------------------------------------------- real trainer


@pytest.mark.slow
@pytest.mark.long  # make test-long (CI budget); the report and grid tests of this file stay in make test
def test_smoke_grid_runs_through_the_real_trainer_and_skips_finished_runs_when_rerun(tmp_path, warm_model):
    out, runs = tmp_path / "rep", tmp_path / "runs"
    # GSPO in place of the smoke grid's GRPO: GRPO's real-trainer run is in test_trainer_e2e.py, GSPO's is this one
    cmd = [sys.executable, "tools/compare_algorithms.py", "--smoke", "--methods", "gspo,da3po:2", "--out", str(out),
           "--runs-dir", str(runs), "--warmup-dir", str(warm_model)]  # the session's short warm-up (conftest)
    ray_tmp = tempfile.mkdtemp(prefix="cmp", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DA3PO_RAY_TMP": ray_tmp}
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    logs = "\n".join(p.read_text()[-3000:] for p in runs.glob("*/seed0/train.log"))
    assert r.returncode == 0, r.stdout + r.stderr + logs
    for slug in ("gspo", "da3po_2"):
        assert C.run_status(runs / slug / "seed0", 2) == "done"
        assert not (out / "logs").exists() and (runs / slug / "seed0" / "metrics.jsonl").exists()
    gspo = [r for r in map(json.loads, (runs / "gspo/seed0/metrics.jsonl").read_text().splitlines())
            if "train/response_tokens" in r]  # the training steps (step 0 holds the starting policy's evaluation)
    assert [r["step"] for r in gspo] == [1, 2] and all(r["train/response_tokens"] > 0 for r in gspo)
    assert all(r["dynamic_sampling/rounds"] == 1 and r["daa/activation_frac"] == 0.0 for r in gspo)  # GSPO's preset
    text = (out / "report.md").read_text()
    assert "## Equal training steps (step 2)" in text and "## Verdict" in text
    t0 = time.perf_counter()
    r2 = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert r2.returncode == 0 and r2.stdout.count("done, skipped") == 2, r2.stdout + r2.stderr
    assert time.perf_counter() - t0 < 60
    shutil.rmtree(ray_tmp, ignore_errors=True)
