"""Checks of the GPU stack that a first GPU run needs (``tools/gpu/gpu_check.sh`` steps ``resume`` and ``te_spec``).

``resume``: the optimizer state saved and loaded on this machine's device. Four train steps of a tiny policy without
interruption, then two steps, a checkpoint, a NEW policy (a fresh, never-stepped optimizer: what a Slurm requeue
starts with) loading it, and two more steps; the losses, gradient norms and the final log-probs must equal the
uninterrupted run's. It says which optimizer megatron-core built (Transformer-Engine's ``FusedAdam`` when TE
imports, else torch's AdamW): on e6f0361 a TE ``FusedAdam`` resume failed with ``KeyError: 'step'``
(``megatron/checkpoint_adam.py:prime_optimizer_state``).

``te-spec``: the same HF weights loaded into a Transformer-Engine-spec policy and a local-spec policy; their
log-probs on one batch must agree within 1e-3, both in float32 (``te_spec_config``: the config's default is bf16).
Needs CUDA and a usable Transformer-Engine; exits 0 with ``SKIP: ...`` otherwise, so the caller can record why.

One process, world size 1, a tiny random Qwen3 (``--hidden`` / ``--layers`` to scale it). Prints one JSON line.

    python tools/gpu/check_gpu_stack.py resume [--hidden 64 --layers 2]
    python tools/gpu/check_gpu_stack.py te-spec
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

TE_SPEC_DTYPE = "float32"
TE_SPEC_TOLERANCE = 1e-3  # max |log-prob difference| of the TE spec vs the local spec, float32 on both sides


def _config(hf: str, overrides: list[str]):
    from da3po_megatron.config import standalone_policy_config

    return standalone_policy_config(hf, ["optim.lr=1e-3", "algorithm.name=da3po", "actor.loss_backend=auto",
                                         "actor.max_tokens_per_microbatch=256", "rollout.n=2",
                                         "actor.ppo_mini_batch_size=2", "data.train_batch_size=4", *overrides])


def te_spec_config(hf: str, te: bool):
    """The config of one side of the te-spec check: the layer spec forced either way, and float32 parameters --
    ``model.params_dtype`` defaults to bfloat16, where two specs' log-probs differ far beyond TE_SPEC_TOLERANCE (on
    27dab78 the check claimed float32 but ran bf16 against 1e-3)."""
    return _config(hf, [f"model.use_transformer_engine={te}", f"model.params_dtype={TE_SPEC_DTYPE}"])


def _policy(hf: str, overrides: list[str], cfg=None):
    from da3po_megatron.bridge.export import load_policy_hf
    from da3po_megatron.bridge.hf_config import gpt_arch
    from da3po_megatron.megatron.policy import PolicyWorker

    cfg = cfg if cfg is not None else _config(hf, overrides)
    w = PolicyWorker(cfg, gpt_arch(hf))
    load_policy_hf(w, hf)
    return w


def _batch(vocab: int):
    import random

    from da3po_megatron.megatron.batching import PolicyBatch

    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab) for _ in range(12)] for _ in range(8)]
    responses = [[rng.randrange(10, vocab) for _ in range(20)] for _ in range(8)]
    return PolicyBatch(prompts, responses)


def _train(w, batch, steps: int) -> list[dict]:
    from da3po_megatron.megatron.batching import PolicyBatch

    out = []
    for _ in range(steps):
        old = w.compute_logprobs(batch)
        m = w.train_step(PolicyBatch(batch.prompt_ids, batch.response_ids, old,
                                     [1.0 if i % 2 else -1.0 for i in range(len(batch))]))
        out.append({k: m[k] for k in ("loss", "grad_norm", "loss_backend")})
    return out


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def check_resume(hf: str, work: str) -> dict:
    import megatron.core.optimizer as mo

    batch = _batch(100)
    w = _policy(hf, [])
    inner = type(w.optimizer.optimizer).__module__ + "." + type(w.optimizer.optimizer).__name__
    straight = _train(w, batch, 4)
    want_lp = w.compute_logprobs(batch)
    w.shutdown()

    w = _policy(hf, [])
    first = _train(w, batch, 2)
    w.save(os.path.join(work, "ckpt"))
    w.shutdown()
    w = _policy(hf, [])  # a fresh process's state: a never-stepped optimizer
    meta = w.load(os.path.join(work, "ckpt"))
    second = _train(w, batch, 2)
    got_lp = w.compute_logprobs(batch)
    w.shutdown()
    resumed = first + second
    diffs = {k: max(abs(a[k] - b[k]) for a, b in zip(straight, resumed)) for k in ("loss", "grad_norm")}
    diffs["logprobs_after"] = _max_diff(want_lp, got_lp)
    ok = meta["loaded_optimizer"] and all(v <= 1e-5 for v in diffs.values())
    return {"check": "resume", "ok": bool(ok), "optimizer": inner,
            "te_or_apex_optimizer": not mo.USING_PYTORCH_OPTIMIZER, "loaded_optimizer": meta["loaded_optimizer"],
            "max_diff": diffs, "straight": straight, "resumed": resumed}


def check_te_spec(hf: str) -> dict:
    import torch

    from da3po_megatron.megatron.model import import_megatron_core, te_import_error

    if not torch.cuda.is_available():
        return {"check": "te-spec", "skip": "no CUDA"}
    import_megatron_core()
    err = te_import_error()
    if err:
        return {"check": "te-spec", "skip": f"Transformer-Engine not usable: {err}"}
    batch = _batch(100)
    lps = {}
    for te in (True, False):
        w = _policy(hf, [], cfg=te_spec_config(hf, te))
        lps[te] = w.compute_logprobs(batch)
        w.shutdown()
    diff = _max_diff(lps[True], lps[False])
    return {"check": "te-spec", "ok": diff <= TE_SPEC_TOLERANCE, "max_abs_logprob_diff": diff,
            "tolerance": TE_SPEC_TOLERANCE, "dtype": TE_SPEC_DTYPE}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("check", choices=("resume", "te-spec"))
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args(argv)
    from da3po_megatron.tiny import build_model

    work = tempfile.mkdtemp(prefix="check_gpu_stack_")
    hf = str(build_model(os.path.join(work, "hf"), family="qwen3", seed=0, hidden_size=args.hidden,
                         num_layers=args.layers, ffn_hidden_size=2 * args.hidden, num_heads=4, num_kv_heads=2))
    result = check_resume(hf, work) if args.check == "resume" else check_te_spec(hf)
    print(json.dumps(result))
    if "skip" in result:
        print(f"SKIP: {result['skip']}")
        return 0
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
