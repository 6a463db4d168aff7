"""What MoE runs move and stage in host memory (issue 46 M3, M7): the routes a step moves, which completions carry
them, when engines capture them at all, and the asynchronous-save staging of the 30B layout per node. Pure
functions of the shipped recipes and Qwen3-30B-A3B's config (no model, no engine); the end-to-end route path is
tests/test_moe_replay.py's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_moe import QWEN3_30B_A3B

from da3po_megatron.bridge.hf_config import gpt_arch
from da3po_megatron.config import load_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RECIPES_30B = sorted(EXAMPLES.glob("qwen3_30b_a3b_*.yaml"))
GiB = 2**30


def _cfg(recipe: Path, tmp_path: Path, *overrides: str):
    return load_config(recipe, ["model.path=/x", f"trainer.run_dir={tmp_path}", *overrides])


@pytest.mark.parametrize("recipe", RECIPES_30B, ids=lambda p: p.stem)
def test_the_30b_recipes_move_routes_under_the_budget_and_r3_would_move_every_route(recipe, tmp_path):
    """384 B per position (48 MoE layers x top-8, uint8). At HEAD every route travelled whenever router_agreement
    was on (the default): 512 x 16 x 6143 positions = ~18 GiB per step."""
    from da3po_megatron.megatron.memory_host import (
        ROUTE_BUDGET_BYTES,
        route_bytes_per_position,
        route_bytes_per_step,
        route_plan_line,
    )

    arch = gpt_arch(QWEN3_30B_A3B)
    cfg = _cfg(recipe, tmp_path)
    assert route_bytes_per_position(arch) == 384
    assert cfg.moe.router_agreement and cfg.moe.routing_replay == "none"
    got = route_bytes_per_step(cfg, arch)
    assert 0 < got <= ROUTE_BUDGET_BYTES, route_plan_line(cfg, arch)
    r3 = _cfg(recipe, tmp_path, "moe.routing_replay=rollout", "model.recompute_granularity=null",
              "model.recompute_method=null", "model.recompute_num_layers=null")  # R3 refuses full recomputation
    every = route_bytes_per_step(r3, arch)
    assert every == 512 * 16 * (2048 + 4096 - 1) * 384  # R3: every route, ~18.0 GiB
    assert got == pytest.approx(every * cfg.moe.router_agreement_fraction)
    print(route_plan_line(cfg, arch))
    assert route_bytes_per_step(_cfg(recipe, tmp_path, "moe.router_agreement=false"), arch) == 0


def test_engines_capture_routes_only_when_something_reads_them(tmp_path):
    """engine_config's return_routed_experts: on for the agreement sample or R3; off with agreement off, with a
    zero fraction, and for streaming engines (rollout/stream.py returns no routes: at HEAD they captured anyway)."""
    from da3po_megatron.trainer.cluster.bringup import engine_config

    recipe = EXAMPLES / "tiny_cpu_moe.yaml"

    def capture(*o: str) -> bool:
        return engine_config(_cfg(recipe, tmp_path, *o), moe=True).return_routed_experts

    assert capture() and capture("moe.routing_replay=rollout")
    assert not capture("moe.router_agreement=false") and not capture("moe.router_agreement_fraction=0")
    assert not capture("rollout.mode=streaming", "algorithm.filter_groups=false")
    assert not engine_config(_cfg(recipe, tmp_path), moe=False).return_routed_experts


def test_the_completions_that_carry_routes_are_a_deterministic_fraction():
    from da3po_megatron.rollout.routes import routes_selected

    picks = [routes_selected(p, j, 0.05) for p in range(2000) for j in range(16)]
    assert abs(sum(picks) / len(picks) - 0.05) < 0.006  # 32,000 completions: 5 % within ~2.5 SE
    assert picks == [routes_selected(p, j, 0.05) for p in range(2000) for j in range(16)]
    assert all(routes_selected(3, j, 1.0) for j in range(16)) and not any(routes_selected(3, j, 0.0) for j in range(16))


def test_a_batch_with_some_routes_sends_them_as_the_agreement_sample_and_checkpoints_them():
    """Only some responses carry routes: the batch itself carries none (the training forwards do not replay), the
    sample (indices in the batch's group-major order + one array) goes to the agreement forward, and a group with
    missing routes survives the checkpoint's weights-only round trip."""
    import io

    from da3po_megatron.data.datasets import Example
    from da3po_megatron.trainer import batch as B

    def group(routes):
        return B.Group(example=Example(uid="u", prompt="p", answer="1", source="t"), prompt_ids=[1, 2],
                       response_ids=[[3, 4, 5], [6, 7]], texts=["a", "b"], rollout_logprobs=[[-1.0] * 3, [-1.0] * 2],
                       finish_reasons=["stop", "stop"], acc=[1.0, -1.0], rewards=[1.0, -1.0], advantages=[1.0, -1.0],
                       routed_experts=routes)

    r = np.arange(4 * 2 * 2, dtype=np.uint8).reshape(4, 2, 2)
    groups = [group([None, r]), group(None)]
    assert B.policy_batch(groups).routed_experts is None
    idx, rows = B.route_sample(groups)
    assert idx == [1] and np.array_equal(rows.values, r)
    assert B.route_sample([group([r[:4], r[:3]])]) is None  # all carry routes: they travel in the batch
    assert B.policy_batch([group([r[:4], r[:3]])]).routed_experts is not None
    buf = io.BytesIO()
    torch.save(B.group_to_dict(groups[0]), buf)
    back = B.group_from_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert back.routed_experts[0] is None and np.array_equal(back.routed_experts[1], r)


def test_async_save_staging_of_the_30b_layout_is_planned_per_node_and_falls_back_to_synchronous(tmp_path):
    """~53 GB per rank at TP 4 x PP 2 x EP 4 (bf16 weights + fp32 main weights and Adam moments of its experts,
    expert DP 1): 8 ranks of a node stage ~420 GB. A node with 2 TB keeps asynchronous saves; one with 256 GiB falls
    back to synchronous saves and says so. (HEAD: nothing planned it.)"""
    from da3po_megatron.megatron.memory_host import async_save_staging_bytes, check_async_save_memory

    arch = gpt_arch(QWEN3_30B_A3B)
    recipe = EXAMPLES / "qwen3_30b_a3b_da3po.yaml"
    cfg = _cfg(recipe, tmp_path, "trainer.async_save=true")
    per_rank = async_save_staging_bytes(cfg, arch, "cuda", te=True)
    assert 45e9 < per_rank < 60e9, per_rank / 1e9
    said: list[str] = []
    assert check_async_save_memory(cfg, arch, 8, 2048 * GiB, "cuda", True, said.append)
    assert cfg.trainer.async_save and "stage ~" in said[-1]
    assert not check_async_save_memory(cfg, arch, 8, 256 * GiB, "cuda", True, said.append)
    assert not cfg.trainer.async_save and "SYNCHRONOUSLY" in said[-1] and "8 rank(s)" in said[-1]
    off = _cfg(recipe, tmp_path, "trainer.async_save=false")
    assert not check_async_save_memory(off, arch, 8, 1 * GiB, "cuda", True, said.append)
