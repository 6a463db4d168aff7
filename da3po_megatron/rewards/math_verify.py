"""The math verifier: final-answer extraction + math-verify 0.9.0 equivalence -> R_acc (DAPO convention).

Implements the accuracy reward of the paper's reward (DAPO Eq. 7): ``R_acc = +1`` if the response's final answer is
mathematically equivalent to the ground truth, ``-1`` otherwise (no answer found, unparsable, wrong).
The overlong shaping term R_len (DAPO Eq. 8) is NOT here: the trainer adds it
(:func:`da3po_megatron.rewards.compute_rewards`, which calls ``algorithms.reward_shaping``).

Extraction (what counts as "the final answer"):
  * the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, or
  * the last DAPO-style ``Answer: ...`` line (the format DAPO-Math-17K's prompt asks for: "The last line of your
    response should be of the form Answer: $Answer"). ``Answer:`` counts only at the start of a line (case-insensitive;
    leading spaces and markdown emphasis such as ``**Answer:**`` allowed), never inside a sentence: MATH-500's own
    reference solution ``test/number_theory/1000.json`` ends "... \\boxed{44}\\pmod{83}. We may check our answer:
    $17\\cdot 44 = 748 ...", which DAPO's unanchored regex ``Answer\\s*:\\s*([^\\n]+)`` would read as the answer.
    Unlike DAPO we do not insist that it be the very last line (models often add a closing sentence),
  whichever starts later in the response (so ``Answer: \\boxed{5}`` uses the box).
  LaTeX after ``Answer:`` is wrapped in ``$...$`` before parsing: math-verify's plain-expression fallback otherwise
  reads ``2\\sqrt{2}`` as ``2`` and a wrong answer would score right (measured; see docs/data_and_rewards.md).
  The ground truth is wrapped the same way.

Normalisation before parsing (gold and prediction alike), only where the text has no other sensible math reading:
  * a currency sign in front of a number is dropped: ``\\$`` (also over-escaped ``\\\\$``), ``\\text{\\$}``, ``£``,
    ``€``, ``¥``. An escaped ``\\$`` is a literal dollar, not a math delimiter, so it no longer stops the ``$...$``
    wrapping: before, math-verify got ``\\$18.90`` unwrapped, read it as nothing, and MATH-500 golds such as
    ``\\$18.90`` could never be scored right. Now ``18.90``, ``\\$18.90`` and ``$18.90`` all equal that gold.
  * an unpaired bare ``$`` (``$18.90``, ``The total is $5``) is left to math-verify, which reads the number after it;
    treating it as currency and wrapping the rest in ``$...$`` would turn prose such as ``$5 dollars`` into a product.
  * a math-mode break ``$ $`` inside otherwise bare LaTeX (Minerva's published
    ``x_{0} \\cos (\\omega t)+$ $\\dot{x}_{0} ...``) is joined, when every unescaped ``$`` of the text is such a break.

Comparison: ``math_verify.parse`` + ``math_verify.verify`` (symbolic/numeric equivalence, sets, intervals, equations).
DAPO's own reference reward compares normalised strings instead; math-verify accepts more correct forms
(500/500 vs 453/500 MATH-500 reference solutions, shared notes). We follow verl/NeMo-RL in using math-verify.

Time limits: math-verify's own SIGALRM timeouts are switched off here (``timeout_seconds=None``), because they cancel
any outer alarm; the per-item limit is owned by the caller -- :class:`da3po_megatron.rewards.pool.RewardPool` arms one
timer per item in its worker process and kills workers that do not come back. Calling :func:`score_math` directly
therefore has NO time limit: use the pool for untrusted model output.

Deliberately left out: the last-300-characters truncation of DAPO's reference reward, Minerva-style string
normalisation, multiple-choice letter extraction, partial credit.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

__all__ = ["CORRECT", "INCORRECT", "extract_answer", "answers_equivalent", "score_math"]

CORRECT = 1.0
INCORRECT = -1.0

# math-verify logs a warning whenever its timeouts are disabled and one per swallowed error; both are expected here.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
# ``Answer:`` as a line of its own (DAPO's answer format), optionally behind spaces / markdown emphasis or a heading.
_ANSWER_RE = re.compile(r"(?im)^[ \t]*(?:[*_#>]+[ \t]*)?Answer[*_]*[ \t]*:[*_]*[ \t]*([^\n]+)")
_EXTRACTION = (LatexExtractionConfig(), ExprExtractionConfig())

_UNESCAPED_DOLLAR_RE = re.compile(r"(?<!\\)\$")  # the delimiter test math-verify's own LaTeX regexes use
_BEFORE_NUMBER = r"(?=(?:\s|~|\\[,;:! ])*[-+]?\.?\d)"  # spacing (\, \; \! ~ ...), an optional sign, then a digit
_CURRENCY_RE = re.compile(r"(?:\\+\$|\\(?:text|textrm|textnormal|mbox)\{\\?\$\}|[£€¥])" + _BEFORE_NUMBER)
_MATH_BREAK_RE = re.compile(r"(?<!\\)\$[ \t]+\$")


def _last_boxed(text: str) -> tuple[int, str] | None:
    """(start offset, content) of the last ``\\boxed{...}`` whose braces balance, else None."""
    for m in reversed(list(_BOX_RE.finditer(text))):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            c = text[i]
            if c == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
                i += 2  # escaped brace \{ or \} is content, not structure
                continue
            depth += (c == "{") - (c == "}")
            i += 1
        if depth == 0:
            content = text[m.end() : i - 1].strip()
            if content:
                return m.start(), content
    return None


def _last_answer_line(text: str) -> tuple[int, str] | None:
    matches = list(_ANSWER_RE.finditer(text))
    for m in reversed(matches):
        content = m.group(1).strip().rstrip("*").strip()  # "**Answer: 5**": the closing emphasis is not the answer
        if content:
            return m.start(), content
    return None


def extract_answer(response: str) -> tuple[str, str] | None:
    """The final answer of ``response`` as ``(text, how)`` with how in {"boxed", "answer_line"}, or None.

    The later of the last balanced ``\\boxed{}`` and the last ``Answer:`` line wins.
    """
    boxed = _last_boxed(response)
    line = _last_answer_line(response)
    if boxed is None and line is None:
        return None
    if line is None or (boxed is not None and boxed[0] >= line[0]):
        return boxed[1], "boxed"
    return line[1], "answer_line"


def _as_latex(text: str) -> str:
    """Wrap bare LaTeX in ``$...$`` so math-verify parses it as LaTeX (``2\\sqrt{2}`` must not become ``2``).

    Currency signs before numbers are dropped (math-verify misreads them) and ``$ $`` math-mode breaks inside bare LaTeX
    are joined (math-verify reads them as an empty formula); text that has math delimiters is otherwise left alone.
    An escaped ``\\$`` is not a delimiter. See the module doc.
    """
    t = _CURRENCY_RE.sub("", text).strip()
    breaks = len(_MATH_BREAK_RE.findall(t))
    if breaks and 2 * breaks == len(_UNESCAPED_DOLLAR_RE.findall(t)):
        t = _MATH_BREAK_RE.sub(" ", t)
    if _UNESCAPED_DOLLAR_RE.search(t) or "\\(" in t or "\\[" in t:
        return t
    return f"${t}$"


def _parse(text: str) -> list[Any]:
    return parse(_as_latex(text), extraction_config=_EXTRACTION, parsing_timeout=None, raise_on_error=False)


def answers_equivalent(predicted: str, ground_truth: str) -> bool:
    """True iff the answer text ``predicted`` is mathematically equivalent to ``ground_truth`` (math-verify)."""
    gold = _parse(ground_truth)
    if not gold:
        raise ValueError(f"ground truth {ground_truth!r} cannot be parsed by math-verify")
    pred = _parse(predicted)
    if not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=None, raise_on_error=False))


def score_math(response: str, answer: str) -> tuple[float, dict[str, Any]]:
    """R_acc of one response against the ground-truth ``answer``: (+1 | -1, info).

    info: ``extracted`` (the answer text or None), ``how`` ("boxed" | "answer_line" | None).
    No time limit here (see the module docstring); :class:`RewardPool` applies one.
    """
    found = extract_answer(response)
    if found is None:
        return INCORRECT, {"extracted": None, "how": None}
    text, how = found
    ok = answers_equivalent(text, answer)
    return (CORRECT if ok else INCORRECT), {"extracted": text, "how": how}


def warm_up() -> None:
    """Pay math-verify's one-off costs (lazy imports, LaTeX grammar construction: ~1 s) before the first timed item."""
    score_math("so \\boxed{\\frac{1}{2}}", "0.5")
    score_math("Answer: x = 2\\sqrt{2}", "\\sqrt{8}")
