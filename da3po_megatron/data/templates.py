"""Prompt templates: DAPO's ``Answer:`` format, the ``\\boxed{}`` format, and the tokenizer's chat template.

* ``dapo``: the exact instruction of DAPO-Math-17K (each of its rows already carries it; use it to build the same
  prompt from a raw problem). The verifier reads the last ``Answer:`` line.
* ``boxed``: the Qwen-Math / DeepSeek evaluation instruction; the verifier reads the last ``\\boxed{}``.
* ``none``: the problem text as the whole user message (synthetic task, pre-templated data).

A prompt is a list of chat messages ``[{"role": "user", "content": ...}]`` until :func:`render_prompt` turns it into
the string the policy sees (the tokenizer's chat template with the generation prompt, or -- for base models without a
template -- the contents joined by newlines).
"""

from __future__ import annotations

from typing import Any

__all__ = ["BOXED_TEMPLATE", "DAPO_TEMPLATE", "TEMPLATES", "format_prompt", "render_prompt"]

DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
BOXED_TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}."
TEMPLATES: dict[str, str] = {"dapo": DAPO_TEMPLATE, "boxed": BOXED_TEMPLATE, "none": "{problem}"}

Messages = list[dict[str, str]]


def format_prompt(problem: str, template: str = "dapo", system: str | None = None) -> Messages:
    """Chat messages for ``problem`` with the named template (``dapo`` | ``boxed`` | ``none``)."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; expected one of {sorted(TEMPLATES)}")
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(f"format_prompt: problem must be a non-empty string, got {problem!r:.80}")
    messages: Messages = [{"role": "system", "content": system}] if system else []
    # str.replace, not str.format: problems contain braces ({x | x > 0}, \frac{1}{2}).
    text = TEMPLATES[template].replace("{problem}", problem)
    messages.append({"role": "user", "content": text})
    return messages


def render_prompt(tokenizer: Any, messages: Messages, use_chat_template: bool = True) -> str:
    """The prompt string the policy generates from: the tokenizer's chat template with the generation prompt.

    Falls back to the message contents joined by newlines when ``use_chat_template`` is False; a tokenizer without a
    chat template is an error (say ``use_chat_template=False`` explicitly for base models).
    """
    if not use_chat_template:
        return "\n".join(m["content"] for m in messages)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)!r} has no chat template; "
            "set use_chat_template=False to feed the raw prompt text"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
