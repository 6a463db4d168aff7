"""Dataset readers (DAPO-Math-17K parquet schema, generic jsonl/parquet), bad-row handling, resumable iteration."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from da3po_megatron.data import (
    DAPO_TEMPLATE,
    BadRowError,
    PromptDataset,
    format_prompt,
    load_prompts,
    read_dapo_math,
    read_prompt_file,
    render_prompt,
)

# The published DAPO-Math-17K schema (BytedTsinghua-SIA/DAPO-Math-17k, data/dapo-math-17k.parquet).
DAPO_SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
    ("extra_info", pa.struct([("index", pa.string())])),
])


def dapo_row(i: int, problem: str, answer: str | None) -> dict:
    content = DAPO_TEMPLATE.replace("{problem}", problem)
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": content, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": f"idx-{i}"},
    }


def write_dapo(path, rows):
    pq.write_table(pa.Table.from_pylist(rows, schema=DAPO_SCHEMA), path)
    return path


def test_dapo_parquet_reader_keeps_prompt_answer_source_and_index(tmp_path):
    path = write_dapo(tmp_path / "dapo-math-17k.parquet",
                      [dapo_row(0, "What is $1+1$?", "2"), dapo_row(1, "Compute $\\frac{6}{4}$.", "\\frac{3}{2}")])
    ds = read_dapo_math(path)
    assert len(ds) == 2 and ds.stats.rows == 2 and ds.stats.kept == 2 and ds.stats.skipped == 0
    ex = ds[1]
    assert ex.uid == "idx-1" and ex.answer == "\\frac{3}{2}" and ex.source == "math_dapo"
    assert ex.prompt == [{"role": "user", "content": DAPO_TEMPLATE.replace("{problem}", "Compute $\\frac{6}{4}$.")}]
    assert ex.meta["ability"] == "MATH" and ex.meta["style"] == "rule-lighteval/MATH_v2" and ex.meta["row"] == 1
    assert "Compute" in ex.problem_text
    assert [e.uid for e in load_prompts(path)] == ["idx-0", "idx-1"]  # auto-detects the DAPO schema


def test_dapo_reader_dedups_the_published_repetitions_and_counts_them(tmp_path):
    rows = [dapo_row(i, f"Problem {i % 2}", str(i % 2)) for i in range(6)]
    ds = read_dapo_math(write_dapo(tmp_path / "d.parquet", rows), dedup=True)
    assert [e.uid for e in ds] == ["idx-0", "idx-1"] and ds.stats.duplicates == 4


def test_malformed_dapo_row_names_file_row_and_field(tmp_path):
    path = write_dapo(tmp_path / "bad.parquet", [dapo_row(0, "ok", "1"), dapo_row(1, "no answer", None)])
    with pytest.raises(BadRowError) as e:
        read_dapo_math(path)
    assert e.value.row == 1 and e.value.field == "reward_model.ground_truth"
    assert str(e.value) == f"{path}: row 1, field 'reward_model.ground_truth': missing or null"


def test_skip_mode_skips_and_counts_bad_rows_by_field(tmp_path):
    rows = [dapo_row(0, "ok", "1"), dapo_row(1, "empty answer", "  "), dapo_row(2, "fine", "3"),
            dapo_row(3, "no answer", None)]
    rows[2]["prompt"] = []
    ds = read_dapo_math(write_dapo(tmp_path / "bad.parquet", rows), on_bad_row="skip")
    assert [e.uid for e in ds] == ["idx-0"]
    assert ds.stats.rows == 4 and ds.stats.skipped == 3 and ds.stats.kept == 1
    assert ds.stats.skipped_by_field == {"reward_model.ground_truth": 2, "prompt": 1}
    assert "row 1, field 'reward_model.ground_truth': empty" in ds.stats.first_errors[0]


def test_generic_jsonl_reader_with_custom_columns_templates_and_errors(tmp_path):
    path = tmp_path / "gsm.jsonl"
    recs = [{"question": "2+2?", "final": 4, "src": "gsm8k", "id": "a"},
            {"question": "Half of 1?", "final": "0.5", "src": "gsm8k", "id": "b", "level": 3}]
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n\n")
    ds = read_prompt_file(path, prompt_key="question", answer_key="final", source_key="src", uid_key="id",
                          template="boxed")
    assert [e.uid for e in ds] == ["a", "b"] and ds[0].answer == "4" and ds[1].meta["level"] == 3
    assert ds[0].prompt == format_prompt("2+2?", "boxed") and ds[0].meta["problem"] == "2+2?"
    assert ds[0].prompt[0]["content"].endswith("within \\boxed{}.")

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(recs[0]) + "\n" + "{not json\n" + json.dumps({"question": "x", "final": [1]}) + "\n")
    with pytest.raises(BadRowError, match=r"bad.jsonl: row 1 \(line 2\), field '<json>': not valid JSON"):
        read_prompt_file(bad, prompt_key="question", answer_key="final", source_key="src")
    ds = read_prompt_file(bad, prompt_key="question", answer_key="final", source_key="src", on_bad_row="skip",
                          default_source="gsm8k")
    assert len(ds) == 1 and ds.stats.skipped == 2
    assert ds.stats.skipped_by_field == {"<json>": 1, "final": 1}
    assert "expected str or int or float, got list" in ds.stats.first_errors[1]


def test_generic_parquet_with_chat_message_prompts(tmp_path):
    path = tmp_path / "msgs.parquet"
    rows = [{"prompt": [{"role": "user", "content": "Say 3"}], "answer": "3", "source": "toy"}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    ds = load_prompts(path)
    assert ds[0].prompt == rows[0]["prompt"] and ds[0].uid == "msgs:0" and ds[0].source == "toy"
    with pytest.raises(BadRowError, match=r"msgs.parquet: row 0, field 'origin': missing or null"):
        read_prompt_file(path, source_key="origin")


def test_render_prompt_applies_the_chat_template():
    from da3po_megatron.tiny import build_tokenizer

    tok = build_tokenizer()
    text = render_prompt(tok, format_prompt("1+1?", "none"))
    assert text == "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt(tok, format_prompt("1+1?", "none"), use_chat_template=False) == "1+1?"


def _toy(n: int) -> PromptDataset:
    from da3po_megatron.data import Example

    return PromptDataset([Example(f"u{i}", [{"role": "user", "content": str(i)}], str(i), "toy") for i in range(n)])


def test_shuffle_is_a_pure_function_of_seed_and_epoch():
    ds = _toy(50)
    a, b = ds.iterator(seed=7), ds.iterator(seed=7)
    first = [e.uid for e in a.take(120)]
    assert first == [e.uid for e in b.take(120)]
    assert sorted(first[:50]) == sorted(e.uid for e in ds)  # each epoch is a permutation
    assert first[:50] != first[50:100]  # epochs differ
    assert first[:50] != [e.uid for e in ds.iterator(seed=8).take(50)]
    assert [e.uid for e in ds.iterator(shuffle=False).take(3)] == ["u0", "u1", "u2"]


def test_iterator_resumes_exactly_mid_epoch():
    ds = _toy(13)
    it = ds.iterator(seed=3)
    it.take(20)  # one epoch and 7 items into the second
    state = json.loads(json.dumps(it.state_dict()))  # survives a JSON checkpoint
    expected = [e.uid for e in it.take(30)]
    fresh = ds.iterator(seed=999)
    fresh.load_state_dict(state)
    assert [e.uid for e in fresh.take(30)] == expected
    assert fresh.consumed == 50 and fresh.epoch == 3
    with pytest.raises(ValueError, match="num_examples"):
        _toy(12).iterator().load_state_dict(state)


def test_max_epochs_ends_iteration():
    it = _toy(4).iterator(max_epochs=2)
    assert len(it.take(100)) == 8 and list(it) == []


def test_run_config_data_dedup_trains_on_unique_problems_and_epochs_count_them(tmp_path):
    """data.dedup in the run config reaches the reader (as in the paper recipes): 3 problems x 4 published copies ->
    an epoch is 3 prompts and the iterator position counts unique problems."""
    from da3po_megatron.config import load_config
    from da3po_megatron.trainer.inputs import load_train_data

    path = write_dapo(tmp_path / "dapo-math-17k.parquet",
                      [dapo_row(i, f"Problem {i % 3}", str(i % 3)) for i in range(12)])
    base = ["model.path=unused", "data.format=dapo", f"data.train_files=[{path}]", "reward.kind=math"]
    full = load_train_data(load_config("examples/tiny_cpu_da3po.yaml", base))
    assert len(full) == 12 and full.stats.duplicates == 0
    ds = load_train_data(load_config("examples/tiny_cpu_da3po.yaml", base + ["data.dedup=true"]))
    assert len(ds) == 3 and ds.stats.as_dict()["duplicates"] == 9 and ds.stats.rows == 12
    it = ds.iterator(seed=0)
    first_epoch = {e.answer for e in it.take(3)}
    assert first_epoch == {"0", "1", "2"} and it.state_dict()["epoch"] == 0 and it.state_dict()["position"] == 3
    it.take(1)
    assert (it.state_dict()["epoch"], it.state_dict()["position"]) == (1, 1)


def test_paper_recipes_train_on_unique_problems_and_keep_the_best_checkpoint():
    from pathlib import Path

    from da3po_megatron.config import load_config

    recipes = sorted(Path("examples").glob("qwen3_*.yaml")) + sorted(Path("examples/ablation").glob("*.yaml"))
    assert len(recipes) >= 12
    for recipe in recipes:
        cfg = load_config(recipe, [])
        assert cfg.data.dedup, recipe
        assert cfg.trainer.keep_best_metric == "eval/avg/avg@k" and cfg.eval.every > 0, recipe
