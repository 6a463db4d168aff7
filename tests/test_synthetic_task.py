"""The synthetic running-sums task: answers, difficulty buckets, disjoint splits, reward, and the warm-up CLI."""

from __future__ import annotations

import json

import pytest

from da3po_megatron.data.synthetic import (
    BUCKETS,
    make_synthetic_dataset,
    running_sums,
    split_of,
    synthetic_example,
    synthetic_reward,
)


def test_running_sums_mod_10():
    assert running_sums("359") == "387"
    assert running_sums("0") == "0"
    assert running_sums("99999999") == "98765432"
    with pytest.raises(ValueError, match="digit string"):
        running_sums("3a")


def test_example_prompt_answer_and_bucket_meta():
    ex = synthetic_example("359", "u")
    assert ex.prompt == [{"role": "user", "content": "sums 359_____"}]
    assert ex.answer == "387" and ex.source == "synthetic/len3"
    assert ex.meta["bucket"] == 3 and ex.meta["difficulty"] == 3 and ex.meta["digits"] == "359"


def test_datasets_are_deterministic_cover_all_buckets_and_splits_never_overlap():
    train = make_synthetic_dataset(40, "train", seed=1)
    assert [e.uid for e in train] == [e.uid for e in make_synthetic_dataset(40, "train", seed=1)]
    assert [e.meta["digits"] for e in train] != [e.meta["digits"] for e in make_synthetic_dataset(40, "train", 2)]
    held = make_synthetic_dataset(40, "heldout", seed=1)
    assert {e.meta["bucket"] for e in train} == set(BUCKETS) == {e.meta["bucket"] for e in held}
    assert len(train) == 40 * len(BUCKETS)
    assert not {e.meta["digits"] for e in train} & {e.meta["digits"] for e in held}
    assert all(split_of(e.meta["digits"]) == "heldout" for e in held)
    for e in list(train) + list(held):
        assert e.answer == running_sums(e.meta["digits"]) and len(e.answer) == e.meta["bucket"]
        assert len(e.prompt[0]["content"]) == 13  # short: fits the tiny char-level model easily
    long_bucket = [e.meta["digits"] for e in train if e.meta["bucket"] == 8]
    assert len(set(long_bucket)) == len(long_bucket)  # large buckets draw distinct strings


@pytest.mark.parametrize(
    "response, reward",
    [("387", 1.0), ("3 8 7", 1.0), (" 387\n", 1.0), ("388", -1.0), ("3870", -1.0), ("38", -1.0), ("", -1.0),
     ("Answer: 387", -1.0)],
)
def test_synthetic_reward_exact_digits_spaces_optional(response, reward):
    assert synthetic_reward(response, "387")[0] == reward


def test_warmup_cli_trains_saves_an_hf_checkpoint_and_reports_buckets(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from da3po_megatron.data.warmup import main

    out = tmp_path / "warm"
    assert main(["--out", str(out), "--steps", "3", "--batch-size", "8", "--eval-per-bucket", "2",
                 "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert "bucket  accuracy" in printed and "step    2" in printed
    report = json.loads((out / "warmup_report.json").read_text())
    assert set(report["accuracy_by_bucket"]) == {str(b) for b in BUCKETS}
    assert all(0.0 <= v <= 1.0 for v in report["accuracy_by_bucket"].values())
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (out / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    assert model.config.model_type == "qwen3" and tok.eos_token == "<|im_end|>"


def test_warmup_is_deterministic_by_seed(tmp_path):
    from safetensors.torch import load_file

    from da3po_megatron.data.warmup import WarmupConfig, run_warmup

    reports, weights = [], []
    for run in ("a", "b"):
        cfg = WarmupConfig(out=str(tmp_path / run), steps=2, batch_size=4, eval_per_bucket=2, threads=1)
        reports.append(run_warmup(cfg, log=lambda *a: None))
        weights.append(load_file(str(tmp_path / run / "model.safetensors")))
    assert reports[0]["accuracy_by_bucket"] == reports[1]["accuracy_by_bucket"]
    assert reports[0]["final_loss"] == reports[1]["final_loss"]
    assert weights[0].keys() == weights[1].keys()
    assert all((weights[0][k] == weights[1][k]).all() for k in weights[0])


def test_long_tailed_lengths_grow_with_difficulty_and_coin_answers_follow_the_bucket():
    """data.synthetic.response_tokens / coin_p (issue 37's benchmark task): per-prompt length caps whose median grows
    with the bucket (long-tailed within one), coin answers per bucket; the chosen prompts do not change."""
    import statistics

    from da3po_megatron.config import ConfigError, load_config

    plain = make_synthetic_dataset(64, "train", seed=3, buckets=range(1, 9))
    ds = make_synthetic_dataset(64, "train", seed=3, buckets=range(1, 9), response_tokens=(4, 64), max_tokens=128,
                                coin_p=[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2])
    assert [e.meta["digits"] for e in ds] == [e.meta["digits"] for e in plain]
    assert all("max_tokens" not in e.meta for e in plain)
    by = {b: [e.meta["max_tokens"] for e in ds if e.meta["bucket"] == b] for b in range(1, 9)}
    medians = [statistics.median(by[b]) for b in range(1, 9)]
    assert medians == sorted(medians) and medians[0] <= 6 and 40 <= medians[-1] <= 90, medians
    assert max(by[8]) > 1.8 * medians[-1] and all(1 <= x <= 128 for v in by.values() for x in v)  # the tail, capped
    assert {e.answer for e in ds if e.meta["bucket"] == 1} == {"coin:0.9"}
    assert {e.answer for e in ds if e.meta["bucket"] == 8} == {"coin:0.2"}
    again = make_synthetic_dataset(64, "train", seed=3, buckets=range(1, 9), response_tokens=(4, 64), max_tokens=128)
    assert [e.meta["max_tokens"] for e in again] == [e.meta["max_tokens"] for e in ds]  # deterministic by seed
    with pytest.raises(ValueError, match="coin_p"):
        make_synthetic_dataset(4, "train", buckets=range(1, 3), coin_p=[0.5])
    with pytest.raises(ConfigError, match="data.synthetic.coin_p"):
        load_config(None, ["model.path=x", "data.format=synthetic", "data.synthetic.coin_p=[0.5]"])
