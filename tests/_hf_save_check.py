"""A one-process policy job of tests/test_operations.py: the policy's own log-probs of given sequences, from a run's
Megatron checkpoint (``step_N/policy``), to compare with the HF weights written at save time (``step_N/hf``).

    python tests/_hf_save_check.py CKPT_POLICY_DIR MODEL_DIR SEQUENCES_JSON OUT_JSON

``SEQUENCES_JSON``: ``{"prompts": [[ids]], "responses": [[ids]]}``. The policy is built as the trainer built it
(the run config recorded in the checkpoint's meta.json) at TP=PP=DP=1 and loaded with ``PolicyWorker.load``;
``OUT_JSON`` gets ``{"logprobs": [[...]], "step": N}``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from da3po_megatron.bridge.hf_config import gpt_arch
from da3po_megatron.config import standalone_policy_config
from da3po_megatron.megatron.batching import PolicyBatch
from da3po_megatron.megatron.policy import PolicyWorker


def main() -> None:
    ckpt, model_dir, seqs, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    meta = json.loads((ckpt / "meta.json").read_text())
    m = meta["run_config"]["model"]
    cfg = standalone_policy_config(model_dir, [f"model.params_dtype={m['params_dtype']}",
                                               f"model.make_vocab_size_divisible_by={m['make_vocab_size_divisible_by']}",
                                               "actor.max_tokens_per_microbatch=4096"])
    w = PolicyWorker(cfg, gpt_arch(model_dir), rank=0, world_size=1)  # one rank: binds port 0 itself
    loaded = w.load(ckpt)
    s = json.loads(seqs.read_text())
    lp = w.compute_logprobs(PolicyBatch(s["prompts"], s["responses"]))
    out.write_text(json.dumps({"logprobs": [list(map(float, row)) for row in lp], "step": loaded["step"]}))
    w.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
