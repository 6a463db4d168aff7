"""MoE checkpoints across layouts and layer-spec key spellings: a torchrun job of tests/test_moe_checkpoint.py.

``python -m torch.distributed.run --nproc-per-node 2 tests/_moe_ckpt_job.py --hf HF --dir D --ep E --out JSON
[--save]``: the real PolicyWorker on the tiny Qwen3-MoE at DP 2 x EP ``E`` (float32, local spec). With ``--save``
it writes a full checkpoint (model + optimizer) to ``D/ck_ep{E}``, lists the model's checkpoint keys, and writes the
model once more with the MoE norm under the local spec's pre-issue-46 name (``mlp.linear_fc1.layer_norm_weight``) to
``D/old_names``, which it loads back (the load accepts either spelling). Without ``--save`` it loads ``D/ck_ep2`` at
its own EP and reports whether the optimizer state was loaded.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

from da3po_megatron.testing.policy_job import finish


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--save", action="store_true")
    a = ap.parse_args()

    from da3po_megatron.bridge.export import load_policy_hf
    from da3po_megatron.bridge.hf_config import gpt_arch
    from da3po_megatron.config import standalone_policy_config
    from da3po_megatron.megatron import checkpoint, checkpoint_adam
    from da3po_megatron.megatron.policy import PolicyWorker

    cfg = standalone_policy_config(a.hf, [
        "model.params_dtype=float32", "parallel.data_parallel_size=2", f"parallel.expert_model_parallel_size={a.ep}",
        "actor.loss_backend=torch", "actor.ppo_mini_batch_size=512", "data.train_batch_size=512"])
    w = PolicyWorker(cfg, gpt_arch(a.hf))
    d = Path(a.dir)
    res: dict = {"rank_layout": checkpoint._layout(w.model, w.optimizer)}
    if a.save:
        assert load_policy_hf(w, a.hf)
        keys = sorted(v.key for v in w._bare.sharded_state_dict().values() if hasattr(v, "key"))
        res["layer_keys"] = [k for k in keys if k.startswith("decoder.layers.")]
        checkpoint_adam.prime_optimizer_state(w.optimizer)  # never stepped: Adam's state as after a step (zeros)
        w.save(str(d / "ck_ep2"))
        # the same weights under the old local-spec name of the MoE norm, as a checkpoint of before the fix
        from megatron.core import dist_checkpointing

        sd = w._bare.sharded_state_dict()
        for v in sd.values():
            if getattr(v, "key", "").endswith("0.pre_mlp_layernorm.weight"):  # layer 0 is the MoE layer
                v.key = v.key.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
        if dist.get_rank() == 0:
            (d / "old_names").mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(sd, str(d / "old_names"))
        dist.barrier()
        from da3po_megatron.megatron.checkpoint_keys import saved_tensor_keys

        res["old_names_keys"] = sorted(k for k in saved_tensor_keys(str(d / "old_names")) if "layernorm" in k
                                       or "layer_norm" in k)
        before = {n: p.detach().clone() for n, p in w._bare.named_parameters()}
        with torch.no_grad():
            for p in w._bare.parameters():
                p.add_(1.0)
        checkpoint.load_model(w._bare, d / "old_names")
        res["old_names_max_diff"] = max(float((p - before[n]).abs().max()) for n, p in w._bare.named_parameters())
    else:
        res["load"] = w.load(str(d / "ck_ep2"))
    return finish(w, res, a.out)


if __name__ == "__main__":
    raise SystemExit(main())
