"""The math verifier (real math-verify 0.9.0): answer extraction and R_acc = +1 / -1."""

from __future__ import annotations

import pytest

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
