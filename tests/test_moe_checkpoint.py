"""MoE checkpoints (issue 46 M2): the same keys on both layer specs, and the layout that decides the optimizer state.

- The norm keys of a MoE layer: megatron-core 0.16.1's Transformer-Engine spec is built here with a stand-in for
  ``TESpecProvider`` (TE does not import on CPU; the stand-in returns local modules under TE's roles -- a fused
  LayerNorm+Linear class for ``column_parallel_layer_norm_linear`` -- so only the spec's structure and its
  ``sharded_state_dict_keys_map`` are read, nothing of TE runs), and compared with our local block spec's MoE layer.
- Real tiny checkpoints (torchrun, 2 gloo ranks, ``tests/_moe_ckpt_job.py``): saved at DP 2 x EP 2, loaded at EP 2
  (optimizer state loaded) and at EP 1 (model only, said); the trainer's pre-Ray check refuses the EP change naming
  the field, or with ``--allow-config-change`` says the model alone loads; a checkpoint with the MoE norm under the
  old local-spec name loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from da3po_megatron import tiny

JOB = Path(__file__).with_name("_moe_ckpt_job.py")


def _norm_keys(layer_spec) -> set[str]:
    """The checkpoint keys of a layer spec's norms: a norm module of its own -> ``{name}.weight``; a fused
    LayerNorm+Linear (TE's ``column_parallel_layer_norm_linear``) -> ``{path}.layer_norm_weight``; then the spec's
    ``sharded_state_dict_keys_map`` (prefix renames, as ``TransformerLayer.sharded_state_dict`` applies them)."""
    from megatron.core.transformer.identity_op import IdentityOp

    sub = layer_spec.submodules
    keys = set()
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        m = getattr(sub, name)
        if m is not IdentityOp and getattr(m, "module", m) is not IdentityOp:
            keys.add(f"{name}.weight")

    def fused(cls) -> bool:
        cls = getattr(cls, "module", cls)
        return cls is not None and "LayerNorm" in cls.__name__ and "Linear" in cls.__name__

    if fused(sub.self_attention.submodules.linear_qkv):
        keys.add("self_attention.linear_qkv.layer_norm_weight")
    mlp_sub = getattr(sub.mlp, "submodules", None)
    if mlp_sub is not None and fused(getattr(mlp_sub, "linear_fc1", None)):
        keys.add("mlp.linear_fc1.layer_norm_weight")
    out = set()
    for k in keys:
        for old, new in sub.sharded_state_dict_keys_map.items():
            if k.startswith(old):
                k = new + k[len(old):]
                break
        out.add(k)
    return out


def _te_moe_layer_spec_with_stand_in_provider(monkeypatch):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    class TELayerNormColumnParallelLinearStandIn:  # TE's fused norm + column-parallel linear (a role, not run)
        pass

    class TENormStandIn:  # TE's norm module (a role, not run)
        pass

    class TESpecProviderStandIn(specs.LocalSpecProvider):
        def fuse_layernorm_and_linear(self) -> bool:
            return True

        def column_parallel_layer_norm_linear(self):
            return TELayerNormColumnParallelLinearStandIn

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False):
            return TENormStandIn

    monkeypatch.setattr(specs, "TESpecProvider", TESpecProviderStandIn, raising=False)
    return specs.get_gpt_layer_with_transformer_engine_spec(num_experts=8, moe_grouped_gemm=True, qk_layernorm=True), \
        specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)


def test_moe_layers_save_the_transformer_engine_norm_keys_on_the_local_spec(monkeypatch):
    """Both specs save a MoE layer's pre-MLP norm as ``pre_mlp_layernorm.weight`` (TE's own name) and a dense
    layer's as ``mlp.linear_fc1.layer_norm_weight``. At HEAD (before checkpoint_keys.unify_moe_norm_keys) the local
    spec's MoE layer said ``mlp.linear_fc1.layer_norm_weight``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from da3po_megatron.megatron.checkpoint_keys import is_moe_layer_spec, unify_moe_norm_keys

    te_moe, te_dense = _te_moe_layer_spec_with_stand_in_provider(monkeypatch)
    assert is_moe_layer_spec(te_moe) and not is_moe_layer_spec(te_dense)
    assert _norm_keys(te_moe) == {"self_attention.linear_qkv.layer_norm_weight", "pre_mlp_layernorm.weight"}
    assert _norm_keys(te_dense) == {"self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"}
    local_moe = get_gpt_layer_local_spec(num_experts=8, qk_layernorm=True, normalization="RMSNorm")
    local_dense = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    block = unify_moe_norm_keys(TransformerBlockSubmodules(layer_specs=[local_moe, local_dense]))
    assert _norm_keys(block.layer_specs[0]) == _norm_keys(te_moe)
    assert _norm_keys(block.layer_specs[1]) == _norm_keys(te_dense)
    assert _norm_keys(local_moe) == {"self_attention.linear_qkv.layer_norm_weight",
                                     "mlp.linear_fc1.layer_norm_weight"}  # megatron's own local spec: the mismatch


def _launch(out: Path, *args: str) -> dict:

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(JOB.parent), str(JOB.parents[1])])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(JOB), "--out", str(out), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return {**json.loads(out.read_text()), "log": proc.stdout + proc.stderr}


@pytest.fixture(scope="module")
def ep_checkpoints(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("moe_ckpt")
    hf = tiny.build_moe_model(d / "hf", seed=3)
    common = ["--hf", str(hf), "--dir", str(d)]
    return {"dir": d, "hf": hf, "save": _launch(d / "save.json", *common, "--ep", "2", "--save"),
            "ep2": _launch(d / "ep2.json", *common, "--ep", "2"), "ep1": _launch(d / "ep1.json", *common, "--ep", "1")}


def test_a_real_moe_checkpoint_records_ep_etp_and_spec_and_loads_its_optimizer_only_at_that_layout(ep_checkpoints):
    r = ep_checkpoints
    keys = r["save"]["layer_keys"]
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in keys  # MoE layer: TE's name (HEAD: linear_fc1's)
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in keys  # dense layer: unchanged
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" not in keys
    meta = json.loads((r["dir"] / "ck_ep2" / "meta.json").read_text())["layout"]
    assert {k: meta[k] for k in ("expert_model_parallel_size", "expert_tensor_parallel_size", "layer_spec",
                                 "params_dtype", "distributed_optimizer", "expert_data_parallel_size")} == {
        "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1, "layer_spec": "local",
        "params_dtype": "float32", "distributed_optimizer": True, "expert_data_parallel_size": 1}
    assert r["ep2"]["load"]["loaded_optimizer"] and r["ep2"]["load"]["restored_rng"]
    # HEAD loaded the optimizer state here too (TP x PP x CP matched) into buffers of another expert layout
    assert not r["ep1"]["load"]["loaded_optimizer"]
    assert "MODEL ONLY" in r["ep1"]["log"] and "expert_model_parallel_size: 2 -> 1" in r["ep1"]["log"]
    # a checkpoint with the MoE norm under the local spec's old name loads (renamed at load), bit-exact
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in r["save"]["old_names_keys"]
    assert r["save"]["old_names_max_diff"] == 0.0


def test_resume_at_another_ep_is_refused_before_ray_naming_the_field(ep_checkpoints, tmp_path):
    """resume/config_drift.check_checkpoint_config (called before init_ray) reads the checkpoint's policy layout:
    EP 2 -> 1 is refused naming the field; --allow-config-change goes on and says the model alone loads; the same
    layout passes. (HEAD: no layout check; the EP change was not even a config warning's 'defining' field.)"""
    import shutil

    from da3po_megatron.config import standalone_policy_config
    from da3po_megatron.trainer.resume.config_drift import ConfigDriftError, check_checkpoint_layout

    ck = tmp_path / "checkpoints" / "step_1"
    shutil.copytree(ep_checkpoints["dir"] / "ck_ep2", ck / "policy",
                    ignore=shutil.ignore_patterns("model", "optimizer"))

    def cfg(ep: int):
        return standalone_policy_config(ep_checkpoints["hf"], ["model.params_dtype=float32",
                                                               "parallel.data_parallel_size=2",
                                                               f"parallel.expert_model_parallel_size={ep}",
                                                               f"trainer.run_dir={tmp_path}"])

    with pytest.raises(ConfigDriftError, match=r"expert_model_parallel_size: 2 -> 1"):
        check_checkpoint_layout(cfg(1), ck)
    said: list[str] = []
    assert check_checkpoint_layout(cfg(1), ck, allow=True, log=said.append) == ["expert_model_parallel_size: 2 -> 1"]
    assert "MODEL ONLY" in said[0]
    assert check_checkpoint_layout(cfg(2), ck) == []
    with pytest.raises(ConfigDriftError, match=r"params_dtype: float32 -> bfloat16"):
        check_checkpoint_layout(standalone_policy_config(ep_checkpoints["hf"], [
            "model.params_dtype=bfloat16", "parallel.data_parallel_size=2", "parallel.expert_model_parallel_size=2",
            f"trainer.run_dir={tmp_path}"]), ck)
