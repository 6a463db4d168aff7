"""What the run reads before any actor starts, checked: the model directory's config, the tokenizer, the data.

Every problem here is an :class:`InputError`: one line naming the file (and row or field), exit status 2 from
``da3po train``, raised before Ray, the policy or the engines start. Malformed data rows follow ``data.on_bad_row``
(``data/datasets.py``: ``error`` names file, row and field; ``skip`` skips and counts them).

Prompts longer than ``rollout.max_prompt_length`` tokens (after the chat template) are malformed rows too: with
``data.on_bad_row=error`` the run stops naming the first one (uid, length), with ``skip`` they are dropped and counted
in ``data/skipped_rows``. They are never truncated (a cut prompt is a different question). Long responses are cut by
the engines at ``rollout.max_response_length`` (``finish_reason`` "length", penalised by the overlong shaping of
Eq. 8 when enabled); long ground-truth answers are scored like any other under the per-item time limit
``reward.timeout_s`` (a timed-out item scores -1 and is counted).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from da3po_megatron.config import Config
from da3po_megatron.data.datasets import PromptDataset, ReadStats, load_prompts


class InputError(ValueError):
    """A bad input file (model config, tokenizer, data) found before any actor starts."""


OUTPUT_DIRS = ("trainer.run_dir", "rollout.dump_dir")  # the directories a run writes into, when set


def check_output_dirs(cfg: Config) -> None:
    """Every directory the run will write (``trainer.run_dir``; ``rollout.dump_dir`` when set) can be made: its
    nearest existing ancestor is a directory this process may write into (or the directory exists and is writable).
    Called before the run directory's lock is taken, so a bad path ends in one line naming the field, exit 2, with
    nothing written (a ``dump_dir`` under a file used to end in a ``NotADirectoryError`` traceback after the run
    directory was made)."""
    import os

    for field in OUTPUT_DIRS:
        section, name = field.split(".")
        value = getattr(getattr(cfg, section), name)
        if not value:
            continue
        path = Path(value).absolute()
        probe = path
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        if not probe.is_dir():
            raise InputError(f"{field} = {value!r}: {probe} is not a directory, so {path} cannot be made")
        if not os.access(probe, os.W_OK | os.X_OK):
            raise InputError(f"{field} = {value!r}: {probe} is not writable by this user")


def load_tokenizer(cfg: Config) -> Any:
    """The model directory's tokenizer, after checking that its ``config.json`` is there and parses."""
    path = Path(cfg.model.path)
    config = path / "config.json"
    if not config.exists():
        raise InputError(
            f"model.path={cfg.model.path!r} is not a Hugging Face checkpoint directory (no config.json); no "
            "downloads happen at run time: fetch it first, e.g. `huggingface-cli download Qwen/Qwen3-4B-Base "
            "--local-dir checkpoints/Qwen3-4B-Base`, and point model.path there")
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{config}: not valid JSON ({e}); the model directory is damaged") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise InputError(f"{config}: not a Hugging Face model config (no 'model_type')")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a damaged tokenizer
        detail = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        raise InputError(f"{path}: the tokenizer does not load ({type(e).__name__}: {detail[:300]})") from None


def check_prompts(dataset: PromptDataset, tokenizer: Any, cfg: Config) -> PromptDataset:
    """The dataset without prompts longer than ``rollout.max_prompt_length`` (``data.on_bad_row=skip``: dropped and
    counted) or an :class:`InputError` naming the first one (``error``); an empty dataset is an error either way."""
    from da3po_megatron.data.templates import render_prompt

    files = ", ".join(cfg.data.train_files) if cfg.data.format != "synthetic" else "synthetic task"
    if len(dataset) == 0:
        skipped = dataset.stats.skipped if dataset.stats is not None else 0
        raise InputError(f"data ({files}): no usable rows" + (f" ({skipped} malformed rows skipped)" if skipped else
                                                                "; is the file empty?"))
    limit = cfg.rollout.max_prompt_length
    keep, dropped = [], []
    for ex in dataset:
        n = len(tokenizer(render_prompt(tokenizer, ex.prompt, cfg.data.apply_chat_template))["input_ids"])
        if n <= limit:
            keep.append(ex)
            continue
        where = f"row {ex.meta['row']}" if "row" in ex.meta else f"uid {ex.uid!r}"
        if cfg.data.on_bad_row == "error":
            raise InputError(f"data ({files}): {where} (uid {ex.uid!r}): the prompt has {n} tokens, more than "
                             f"rollout.max_prompt_length={limit}; raise it, or set data.on_bad_row=skip to skip and "
                             "count such rows")
        dropped.append(ex)
    if not dropped:
        return dataset
    print(f"data: skipped {len(dropped)} prompts longer than rollout.max_prompt_length={limit} tokens "
          "(data.on_bad_row=skip)", flush=True)
    if not keep:
        raise InputError(f"data ({files}): every prompt is longer than rollout.max_prompt_length={limit}")
    old = dataset.stats or ReadStats(path=files)
    stats = ReadStats(path=old.path, rows=old.rows, kept=len(keep), skipped=old.skipped + len(dropped),
                      duplicates=old.duplicates,
                      skipped_by_field={**old.skipped_by_field, "<prompt_length>": len(dropped)},
                      first_errors=list(old.first_errors))
    return PromptDataset(keep, stats, name=dataset.name)


def load_train_data(cfg: Config) -> PromptDataset:
    d = cfg.data
    if d.format == "synthetic":
        from da3po_megatron.data.synthetic import make_synthetic_dataset

        s = d.synthetic
        return make_synthetic_dataset(s.train_per_bucket, "train", cfg.trainer.seed,
                                      buckets=range(s.min_digits, s.max_digits + 1),
                                      response_tokens=s.response_tokens, max_tokens=cfg.rollout.max_response_length,
                                      coin_p=s.coin_p)
    missing = [f for f in d.train_files if not Path(f).exists()]
    if missing:
        hint = ""
        if any(Path(f).name.lower() == "dapo-math-17k.parquet" for f in missing):
            hint = ("; no downloads happen at run time: fetch it first on a machine with internet, e.g. "
                    "`huggingface-cli download --repo-type dataset BytedTsinghua-SIA/DAPO-Math-17k --local-dir .` "
                    "(writes data/dapo-math-17k.parquet), or set data.train_files")
        raise FileNotFoundError(f"data.train_files: not found: {', '.join(missing)}{hint}")
    from da3po_megatron.data.datasets import BadRowError

    try:
        if d.format == "dapo":
            parts = [load_prompts(f, format="dapo", on_bad_row=d.on_bad_row, dedup=d.dedup) for f in d.train_files]
        else:
            parts = [load_prompts(f, format="generic", prompt_key=d.prompt_key, answer_key=d.answer_key,
                                  on_bad_row=d.on_bad_row, template=d.template, default_source=Path(f).stem,
                                  dedup=d.dedup)
                     for f in d.train_files]
    except BadRowError:
        raise
    except (ValueError, OSError) as e:  # an unreadable file (not parquet, not JSON, unsupported suffix)
        raise InputError(f"data.train_files: {e}") from None
    for f, part in zip(d.train_files, parts):
        s = part.stats
        print(f"data: {f}: {s.rows} rows, {s.kept} prompts"
              + (f", {s.duplicates} repeated rows dropped (data.dedup)" if s.duplicates else "")
              + (f", {s.skipped} malformed rows skipped (data.on_bad_row=skip)" if s.skipped else ""), flush=True)
    if len(parts) == 1:
        return parts[0]
    stats = ReadStats(path="+".join(d.train_files), rows=sum(p.stats.rows for p in parts),
                      kept=sum(p.stats.kept for p in parts), skipped=sum(p.stats.skipped for p in parts),
                      duplicates=sum(p.stats.duplicates for p in parts))
    return PromptDataset([ex for p in parts for ex in p], stats, name="+".join(p.name for p in parts))
