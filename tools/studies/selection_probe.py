"""Probe a warm-up checkpoint for the selective-rollout comparison (issue 50): per difficulty bucket, the per-response
accuracy at the rollout temperature and the share of groups that would be all-correct / all-wrong.

For each bucket it samples ``--n`` responses (the rollout's G) for each of ``--per-bucket`` prompts of a split (the
training prompts of ``--seed`` by default, as the trainer builds them: ``make_synthetic_dataset(per_bucket, "train",
trainer.seed)``) with HF ``generate`` at ``--temperature`` (top-k/top-p off, as the rollout samples), and prints

    bucket  acc  all-correct-groups  all-wrong-groups  prompts-with-any-correct  rare (0 < p_hat <= 0.1)

so a regime can be chosen before paying for a comparison (a hard tail with RARE correct responses: all-wrong most of
the time, but not always). Plain transformers on CPU, no Ray / vLLM; ~10-30 s for the tiny model.

    python tools/studies/selection_probe.py runs/compare/sel50r3_warmup --temperature 0.7 --per-bucket 16 --n 8
"""

from __future__ import annotations

import argparse


def probe(model_dir: str, temperature: float, per_bucket: int, n: int, split: str, seed: int,
          buckets: list[int]) -> list[dict[str, float]]:
    """One row per bucket: acc (per response), all_correct / all_wrong (share of groups), any_correct (share of
    prompts with at least one correct response), rare (share of prompts with 0 < p_hat <= 0.1)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from da3po_megatron.data.synthetic import make_synthetic_dataset, synthetic_reward
    from da3po_megatron.data.templates import render_prompt

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    for b in buckets:
        ds = make_synthetic_dataset(per_bucket, split, seed, buckets=[b])
        enc = tok([render_prompt(tok, ex.prompt) for ex in ds], return_tensors="pt", padding=True,
                  add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                 max_new_tokens=b + 2, num_return_sequences=n, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id)
        texts = tok.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
        p_hats = []
        for i, ex in enumerate(ds):
            ok = [synthetic_reward(t, ex.answer)[0] > 0 for t in texts[i * n:(i + 1) * n]]
            p_hats.append(sum(ok) / n)
        k = len(p_hats)
        rows.append({"bucket": b, "acc": sum(p_hats) / k, "all_correct": sum(p >= 1 for p in p_hats) / k,
                     "all_wrong": sum(p <= 0 for p in p_hats) / k, "any_correct": sum(p > 0 for p in p_hats) / k,
                     "rare": sum(0 < p <= 0.1 for p in p_hats) / k})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--per-bucket", type=int, default=16)
    ap.add_argument("--n", type=int, default=8, help="responses per prompt (the rollout's G)")
    ap.add_argument("--split", default="train", choices=["train", "heldout"])
    ap.add_argument("--seed", type=int, default=0, help="the dataset seed (the trainer uses trainer.seed)")
    ap.add_argument("--buckets", default="1,2,3,4,5,6,7,8")
    a = ap.parse_args(argv)
    rows = probe(a.model_dir, a.temperature, a.per_bucket, a.n, a.split, a.seed,
                 [int(x) for x in a.buckets.split(",")])
    print(f"{a.model_dir}: {a.split} split seed {a.seed}, {a.per_bucket} prompts x {a.n} responses per bucket, "
          f"temperature {a.temperature}")
    print("bucket  acc %  all-correct %  all-wrong %  any-correct %  rare (0 < p_hat <= 0.1) %")
    for r in rows:
        print(f"  {r['bucket']}    {100 * r['acc']:5.1f}  {100 * r['all_correct']:12.1f}  {100 * r['all_wrong']:10.1f}"
              f"  {100 * r['any_correct']:12.1f}  {100 * r['rare']:12.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
