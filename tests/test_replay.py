"""Rollout dump and replay end to end (issue 48): a 3-step ``da3po train`` dumps its rollouts; replayed
``train_only`` it trains bit-identically (metrics and final weights; gloo, float32) without starting an engine, and
replayed in ``compare`` mode the engines regenerate every recorded group exactly (token match ratio 1.0 at
temperature 1 with the recorded seeds) until a weight sync is skipped on purpose, which the next step reports.
Three trainer runs share the module's dump; the units (manifest refusals, disk bound) are in test_replay_units.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from da3po_megatron.trainer.observability.metrics import is_wall_clock

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "DA3PO_RAY_LOG_TO_DRIVER": "0"}
# test_trainer_e2e's tiny run, 3 steps; lr 1e-3 so that one step changes what the engines sample (the stale check)
TINY = ["data.synthetic.max_digits=3", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "rollout.n=4",
        "rollout.max_response_length=8", "algorithm.overlong.buffer_length=2", "eval.every=0",
        "trainer.tensorboard=false", "algorithm.max_generation_rounds=8", "trainer.total_steps=3",
        "trainer.save_every=0", "trainer.save_hf_every=3", "optim.lr=1e-3"]


def train(model: Path, run_dir: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "da3po_megatron.cli", "train", "--config", str(ROOT / "examples/tiny_cpu_da3po.yaml"),
           f"model.path={model}", f"trainer.run_dir={run_dir}", *TINY, *overrides]
    p = subprocess.run(cmd, cwd=ROOT, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        print(p.stdout[-4000:], p.stderr[-6000:])
    assert p.returncode == 0
    return p


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def trained(record: dict) -> dict:
    """What a step computed from its rollout: everything but wall-clock values and the weight sync's own counters
    (a train_only replay syncs nothing) and the replay's comparison."""
    return {k: v for k, v in record.items() if not is_wall_clock(k) and not k.startswith(("sync/", "replay/"))}


def final_weights(run_dir: Path) -> dict:
    return load_file(str(next((run_dir / "checkpoints/step_000003/hf").glob("*.safetensors"))))


@pytest.fixture(scope="module")
def dumped(warm_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("dump")
    train(warm_model, root / "run", f"rollout.dump_dir={root / 'dump'}")
    return root


@pytest.mark.slow
def test_train_only_replay_trains_bit_identically_and_starts_no_engine(warm_model, dumped, tmp_path):
    assert sorted(p.name for p in (dumped / "dump").iterdir()) == [
        "manifest.json", "step_000001.pt", "step_000002.pt", "step_000003.pt"]
    p = train(warm_model, tmp_path / "run", f"rollout.replay_dir={dumped / 'dump'}", "rollout.replay_mode=train_only")
    assert "policy (1 ranks) and 0 engine(s) ready" in p.stdout and "weight transfer: none" in p.stdout
    # no engine process: none in the placement record, and no vLLM engine start-up in any Ray worker's log
    assert json.loads((tmp_path / "run/placement.json").read_text())["engines"] == []
    workers = "".join(f.read_text() for f in (tmp_path / "run/logs").glob("worker-*.log"))
    assert "Initializing a V1 LLM engine" not in workers and "RolloutEngine" not in workers
    original, replayed = metrics(dumped / "run"), metrics(tmp_path / "run")
    assert [r["step"] for r in replayed] == [1, 2, 3]
    assert [trained(r) for r in replayed] == [trained(r) for r in original]
    assert all(r["train/grad_norm"] > 0 for r in replayed)  # it trained
    a, b = final_weights(dumped / "run"), final_weights(tmp_path / "run")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)  # bit-identical weights


@pytest.mark.slow
def test_compare_reproduces_every_token_then_reports_a_skipped_weight_sync(warm_model, dumped, tmp_path):
    """Temperature 1 with the recorded seeds: vLLM seeds each request (prompt i of a round: seed + i n, sample j:
    + j), and on CPU a seeded request samples the same tokens from the same weights, so the expected ratio is
    exactly 1.0 -- step 1 under the initial weights, step 2 under weights the sync delivered. The sync after step 2
    is skipped (fault hook ``skip@weight_sync@2``): step 3 regenerates under step 1's weights and is reported."""
    p = train(warm_model, tmp_path / "run", f"rollout.replay_dir={dumped / 'dump'}", "rollout.replay_mode=compare",
              env={"DA3PO_FAULT_INJECT": "skip@weight_sync@2"})
    rows = metrics(tmp_path / "run")
    ratios = [r["replay/token_match_ratio"] for r in rows]
    assert ratios[:2] == [1.0, 1.0] and [r["replay/logprob_diff_max"] < 1e-4 for r in rows[:2]] == [True, True]
    assert ratios[2] < 0.9 and rows[2]["replay/match_below_threshold"] == 1.0, ratios
    assert "step 3: token match ratio" in p.stdout and "BELOW rollout.replay_match_threshold=0.9" in p.stdout
    assert [r["replay/match_below_threshold"] for r in rows[:2]] == [0.0, 0.0]
    # training consumed the recording: the same updates as the dumping run
    assert [trained(r) for r in rows] == [trained(r) for r in metrics(dumped / "run")]
