"""Data: prompt datasets (DAPO-Math-17K, generic files), prompt templates, the synthetic task and its warm-up.

* :mod:`.datasets` -- readers returning :class:`PromptDataset` of :class:`Example`, row-error machinery
  (:class:`BadRowError`, :class:`BadRows`, :func:`get_field`, :func:`iter_records`).
* :mod:`.prompt_iterator` -- the resumable shuffled :class:`PromptIterator` over a dataset.
* :mod:`.templates` -- DAPO ``Answer:`` and ``\\boxed{}`` templates, :func:`render_prompt` (chat template).
* :mod:`.synthetic` -- running-sums-mod-10 task with difficulty buckets 1..8 and :func:`synthetic_reward`.
* :mod:`.warmup` -- supervised warm-up of a tiny model on the synthetic task (``python -m da3po_megatron.data.warmup``).
* :mod:`.benchmarks` -- evaluation benchmark readers (AIME, AMC, MATH-500, ...).
"""

from da3po_megatron.data.datasets import (
    BadRowError,
    BadRows,
    Example,
    PromptDataset,
    ReadStats,
    get_field,
    iter_records,
    load_prompts,
    read_dapo_math,
    read_prompt_file,
)
from da3po_megatron.data.prompt_iterator import PromptIterator
from da3po_megatron.data.synthetic import make_synthetic_dataset, running_sums, synthetic_reward
from da3po_megatron.data.templates import BOXED_TEMPLATE, DAPO_TEMPLATE, format_prompt, render_prompt

__all__ = [
    "BOXED_TEMPLATE",
    "DAPO_TEMPLATE",
    "BadRowError",
    "BadRows",
    "Example",
    "PromptDataset",
    "PromptIterator",
    "ReadStats",
    "format_prompt",
    "get_field",
    "iter_records",
    "load_prompts",
    "make_synthetic_dataset",
    "read_dapo_math",
    "read_prompt_file",
    "render_prompt",
    "running_sums",
    "synthetic_reward",
]
