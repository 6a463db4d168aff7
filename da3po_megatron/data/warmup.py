"""Supervised warm-up on the synthetic running-sums task: the starting policy of the CPU demo and algorithm comparison.

RL from a random policy gets no signal (every response of a group wrong -> zero advantage; dynamic sampling drops all
groups). This short supervised run (plain transformers + torch on CPU, a tiny Qwen3-shaped model from
:mod:`da3po_megatron.tiny`) leaves a policy that is good on easy buckets and weak but not hopeless on the hardest, so
every bucket has prompts with 0 < p_hat < 1 -- the regime where DAA (Eq. 14) acts for p_hat < tau.

Training: next-token cross-entropy on the answer digits and the end-of-turn token only (the chat-templated prompt is
context), prompts drawn uniformly over buckets from the TRAIN split; AdamW with linear warm-up + cosine decay.
Calibrated difficulty: each target step is replaced by a wrong digit with probability ``label_noise`` (later steps
continue from the corrupted sum, so the rule itself stays exact). A model fitted to this samples a wrong step with
probability ~``label_noise`` at temperature 1, so success falls like (1 - label_noise)^n with the bucket n -- set by
one number instead of by stopping training half-way through its (machine-sensitive) learning phase. RL then has room
to sharpen the policy on every bucket.
Evaluation: per bucket, ``eval_per_bucket`` HELD-OUT prompts, one sample each at temperature 1 (top-k/top-p off,
as the RL rollout samples), scored with :func:`da3po_megatron.data.synthetic.synthetic_reward`.

Output: an HF checkpoint dir (config.json, model.safetensors, tokenizer files, generation_config.json) plus
``warmup_report.json`` (per-bucket accuracy, settings, timings).

    python -m da3po_megatron.data.warmup --out runs/warmup

Left out: anything that makes this a general SFT trainer (packing, gradient accumulation, checkpoint resume).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from da3po_megatron.data.synthetic import BUCKETS, make_synthetic_dataset, running_sums, split_of, synthetic_example
from da3po_megatron.data.templates import render_prompt

__all__ = ["WarmupConfig", "evaluate_buckets", "main", "run_warmup"]


@dataclass
class WarmupConfig:
    """Settings of the warm-up (defaults: the tuned run documented in docs/data_and_rewards.md)."""

    out: str = "runs/warmup"
    seed: int = 0
    steps: int = 700  # optimizer steps
    batch_size: int = 64  # prompts per step
    lr: float = 5e-3  # peak AdamW learning rate
    warmup_steps: int = 20  # linear warm-up, then cosine decay to 10% of lr
    weight_decay: float = 0.0
    label_noise: float = 0.25  # probability of a corrupted target step: sets temperature-1 accuracy per bucket
    bucket_weights: list[float] = field(default_factory=lambda: [1.0] * len(BUCKETS))  # sampling weight per bucket
    hidden_size: int = 64  # tiny Qwen3: hidden size, layers (head_dim is fixed at 32 by da3po_megatron.tiny)
    num_layers: int = 2
    init_std: float = 0.02
    eval_per_bucket: int = 128  # held-out prompts per bucket, one temperature-1 sample each
    threads: int = 1  # torch intra-op threads (1: identical results on any machine; 0 = torch's default)


def _train_digits(rng: random.Random, weights: list[float]) -> str:
    n = rng.choices(BUCKETS, weights=weights)[0]
    while True:
        s = "".join(rng.choice("0123456789") for _ in range(n))
        if split_of(s) == "train":
            return s


def noisy_running_sums(digits: str, label_noise: float, rng: random.Random) -> str:
    """Running sums mod 10 where each step is replaced by a wrong digit with probability ``label_noise``; later digits
    continue from the corrupted sum, so the rule out_k = out_(k-1) + in_k (mod 10) holds everywhere except at the
    corrupted steps. A model fitted to this samples a wrong step with probability ~``label_noise`` at temperature 1."""
    out, total = [], 0
    for c in digits:
        total = (total + int(c)) % 10
        if label_noise > 0 and rng.random() < label_noise:
            total = (total + rng.randint(1, 9)) % 10
        out.append(str(total))
    return "".join(out)


def _encode_batch(tokenizer: Any, digit_strings: list[str], label_noise: float = 0.0,
                  rng: random.Random | None = None) -> tuple[Any, Any, Any]:
    """input_ids, attention_mask, labels (-100 except on the answer digits + end-of-turn token), right-padded."""
    import torch

    rng = rng or random.Random(0)
    seqs, labels = [], []
    for i, s in enumerate(digit_strings):
        prompt = render_prompt(tokenizer, synthetic_example(s, f"w{i}").prompt)
        p_ids = tokenizer(prompt, add_special_tokens=False).input_ids
        target = noisy_running_sums(s, label_noise, rng) if label_noise > 0 else running_sums(s)
        a_ids = tokenizer(target, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        seqs.append(p_ids + a_ids)
        labels.append([-100] * len(p_ids) + a_ids)
    width = max(map(len, seqs))
    pad = tokenizer.pad_token_id
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    lab = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (s, lb) in enumerate(zip(seqs, labels)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        lab[i, : len(lb)] = torch.tensor(lb)
    return ids, mask, lab


def evaluate_buckets(model: Any, tokenizer: Any, per_bucket: int = 64, seed: int = 0,
                     buckets: tuple[int, ...] = BUCKETS, split: str = "heldout") -> dict[int, float]:
    """Fraction of correct temperature-1 samples per bucket (one sample per prompt) with ``model.generate``."""
    import torch

    from da3po_megatron.data.synthetic import synthetic_reward

    model.eval()
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    acc: dict[int, float] = {}
    try:
        torch.manual_seed(seed)
        for n in buckets:
            ds = make_synthetic_dataset(per_bucket, split=split, seed=seed, buckets=[n])
            prompts = [render_prompt(tokenizer, ex.prompt) for ex in ds]
            enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                out = model.generate(
                    **enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=n + 2,
                    pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                )
            texts = tokenizer.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
            acc[n] = sum(synthetic_reward(t, ex.answer)[0] > 0 for t, ex in zip(texts, ds)) / len(ds)
    finally:
        tokenizer.padding_side = old_side
    return acc


def run_warmup(cfg: WarmupConfig, log: Any = print) -> dict[str, Any]:
    """Build the tiny model, train, evaluate per bucket, save checkpoint + ``warmup_report.json``; return the report."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from da3po_megatron.tiny import build_model

    if len(cfg.bucket_weights) != len(BUCKETS):
        raise ValueError(f"bucket_weights needs {len(BUCKETS)} values (buckets {BUCKETS}), got {cfg.bucket_weights}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t_start = time.perf_counter()
    out = Path(cfg.out)
    build_model(out, "qwen3", seed=cfg.seed, init_std=cfg.init_std, hidden_size=cfg.hidden_size,
                num_layers=cfg.num_layers)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    torch.manual_seed(cfg.seed)
    rng = random.Random(f"warmup:{cfg.seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    model.train()
    losses = []
    for step in range(cfg.steps):
        digits = [_train_digits(rng, cfg.bucket_weights) for _ in range(cfg.batch_size)]
        ids, mask, lab = _encode_batch(tokenizer, digits, cfg.label_noise, rng)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = model(input_ids=ids, attention_mask=mask, labels=lab).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == cfg.steps - 1:
            log(f"step {step:4d}  loss {loss.item():.4f}  lr {lr_at(step):.2e}")
    t_train = time.perf_counter() - t_start
    acc = evaluate_buckets(model, tokenizer, cfg.eval_per_bucket, seed=cfg.seed)
    t_total = time.perf_counter() - t_start
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    model.generation_config.save_pretrained(str(out))
    report = {"config": asdict(cfg), "accuracy_by_bucket": {str(k): v for k, v in acc.items()},
              "final_loss": losses[-1], "train_seconds": round(t_train, 1), "total_seconds": round(t_total, 1),
              "eval": "held-out prompts, one sample each, temperature 1, top-k/top-p off"}
    (out / "warmup_report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"bucket  accuracy (held-out, temperature 1, n={cfg.eval_per_bucket} per bucket)")
    for k, v in acc.items():
        log(f"  {k}     {v:6.1%}")
    log(f"saved {out} (train {t_train:.0f} s, total {t_total:.0f} s)")
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Supervised warm-up of a tiny Qwen3 on the synthetic running-sums task.")
    d = WarmupConfig()
    ap.add_argument("--out", default=d.out, help="checkpoint directory to write")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--label-noise", type=float, default=d.label_noise,
                    help="probability that a target step is corrupted (temperature-1 error per digit)")
    ap.add_argument("--hidden-size", type=int, default=d.hidden_size)
    ap.add_argument("--num-layers", type=int, default=d.num_layers)
    ap.add_argument("--eval-per-bucket", type=int, default=d.eval_per_bucket)
    ap.add_argument("--bucket-weights", type=str, default=None,
                    help=f"comma-separated sampling weights for buckets {BUCKETS}")
    ap.add_argument("--threads", type=int, default=d.threads, help="torch threads (0 = default)")
    a = ap.parse_args(argv)
    cfg = WarmupConfig(out=a.out, seed=a.seed, steps=a.steps, batch_size=a.batch_size, lr=a.lr,
                       label_noise=a.label_noise, hidden_size=a.hidden_size, num_layers=a.num_layers,
                       eval_per_bucket=a.eval_per_bucket, threads=a.threads)
    if a.bucket_weights:
        cfg.bucket_weights = [float(x) for x in a.bucket_weights.split(",")]
    run_warmup(cfg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
