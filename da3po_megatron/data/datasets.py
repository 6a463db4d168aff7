"""Prompt datasets: readers for DAPO-Math-17K and generic jsonl/json/parquet files, and a resumable shuffled iterator.

Formats:
  * DAPO-Math-17K (the paper's training set; published parquet schema, as in ``BytedTsinghua-SIA/DAPO-Math-17k``):
    ``data_source: str``, ``prompt: list<{content: str, role: str}>`` (already wrapped in DAPO's instruction),
    ``ability: str``, ``reward_model: {ground_truth: str, style: str}``, ``extra_info: {index: str}``.
    The published file repeats every problem many times; ``dedup=True`` keeps the first copy (drops are counted).
  * generic: one record per row with a prompt (a problem string -- wrapped with a template from
    :mod:`.templates` -- or a list of chat messages), an answer and a source; column names are configurable and
    dotted names reach into nested columns (``reward_model.ground_truth``).

Every reader returns a :class:`PromptDataset` of :class:`Example` (uid, prompt messages, answer, source, meta).
Malformed rows (missing / null / empty field, wrong type, undecodable JSON line) raise :class:`BadRowError`
naming the file, the row (0-based record index; jsonl also gives the line number) and the field; with
``on_bad_row="skip"`` they are skipped and COUNTED in ``dataset.stats`` (``skipped``, ``skipped_by_field``, the first
few messages) -- never dropped silently. :func:`iter_records`, :class:`BadRows` and :func:`get_field` are public so that
other readers (``data/benchmarks.py``) share the same row-error machinery.

``PromptDataset.iterator()`` walks the dataset epoch after epoch, resumably
(:class:`~da3po_megatron.data.prompt_iterator.PromptIterator`).

Left out: streaming datasets that do not fit in memory (DAPO-Math-17K is 17K unique prompts), HF ``datasets``.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from da3po_megatron.data.prompt_iterator import PromptIterator
from da3po_megatron.data.templates import TEMPLATES, format_prompt

__all__ = [
    "BadRowError",
    "BadRows",
    "Example",
    "PromptDataset",
    "ReadStats",
    "get_field",
    "iter_records",
    "load_prompts",
    "read_dapo_math",
    "read_prompt_file",
]

OnBadRow = Literal["error", "skip"]
_MISSING = object()


class BadRowError(ValueError):
    """A malformed input row: names the file, the row (0-based record index), the jsonl line, and the field."""

    def __init__(self, path: str | Path, row: int, field: str, problem: str, line: int | None = None) -> None:
        self.path, self.row, self.field, self.problem, self.line = str(path), row, field, problem, line
        where = f"row {row}" + (f" (line {line})" if line is not None else "")
        super().__init__(f"{self.path}: {where}, field {field!r}: {problem}")


@dataclass
class ReadStats:
    """What a reader saw: ``rows`` read, ``kept``, ``skipped`` (malformed, by field), ``duplicates`` dropped."""

    path: str
    rows: int = 0
    kept: int = 0
    skipped: int = 0
    duplicates: int = 0
    skipped_by_field: dict[str, int] = field(default_factory=dict)
    first_errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "rows": self.rows, "kept": self.kept, "skipped": self.skipped,
                "duplicates": self.duplicates, "skipped_by_field": dict(self.skipped_by_field),
                "first_errors": list(self.first_errors)}


class BadRows:
    """The ``on_bad_row`` policy: ``"error"`` raises the :class:`BadRowError`, ``"skip"`` counts it in ``stats``."""

    MAX_MESSAGES = 5

    def __init__(self, on_bad_row: OnBadRow, stats: ReadStats) -> None:
        if on_bad_row not in ("error", "skip"):
            raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
        self.on_bad_row, self.stats = on_bad_row, stats

    def handle(self, err: BadRowError) -> None:
        if self.on_bad_row == "error":
            raise err
        self.stats.skipped += 1
        self.stats.skipped_by_field[err.field] = self.stats.skipped_by_field.get(err.field, 0) + 1
        if len(self.stats.first_errors) < self.MAX_MESSAGES:
            self.stats.first_errors.append(str(err))


def decode_lines(path: str | Path) -> Iterator[tuple[int, str | UnicodeDecodeError]]:
    """``(line number, text)`` of a text file read as bytes and decoded line by line, so that one line that is not
    UTF-8 is a bad row of its own (the text is then the :class:`UnicodeDecodeError`), not the end of the file."""
    with Path(path).open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield lineno, e


def iter_records(path: str | Path, bad: BadRows | None = None) -> Iterator[tuple[int, int | None, Any]]:
    """Yield ``(row, line, record)`` from a ``.jsonl`` / ``.json`` (list of objects) / ``.parquet`` file.

    ``row`` is the 0-based record index, ``line`` the 1-based jsonl line (None for other formats). Blank jsonl lines
    are not records. An undecodable jsonl line is a bad row (field ``<json>``): raised, or counted in ``bad``.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"dataset file not found: {p}")
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(p)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a damaged file
            raise ValueError(f"{p}: not a readable parquet file ({type(e).__name__}: {e})") from None
        row = 0
        for batch in pf.iter_batches(batch_size=8192):
            for rec in batch.to_pylist():
                yield row, None, rec
                row += 1
    elif suffix == ".jsonl":
        row = 0
        for lineno, text in decode_lines(p):
            if isinstance(text, str) and not text.strip():
                continue
            if isinstance(text, UnicodeDecodeError):
                problem = f"not valid UTF-8 (byte {text.start} of the line: {text.object[text.start:text.start + 4]!r})"
            else:
                try:
                    yield row, lineno, json.loads(text)
                    row += 1
                    continue
                except json.JSONDecodeError as e:
                    problem = f"not valid JSON ({e.msg} at column {e.colno})"
            err = BadRowError(p, row, "<json>", problem, line=lineno)
            if bad is None:
                raise err
            bad.stats.rows += 1
            bad.handle(err)
            row += 1
    elif suffix == ".json":
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{p}: not a valid UTF-8 JSON file ({e})") from None
        if not isinstance(data, list):
            raise ValueError(f"{p}: a .json dataset must be a list of objects, got {type(data).__name__}")
        yield from ((i, None, rec) for i, rec in enumerate(data))
    else:
        raise ValueError(f"{p}: unsupported dataset format {suffix!r}; expected .jsonl, .json or .parquet")


def get_field(
    rec: Any,
    name: str,
    path: str | Path,
    row: int,
    kind: type | tuple[type, ...] = str,
    *,
    line: int | None = None,
    default: Any = _MISSING,
) -> Any:
    """``rec[name]`` (dotted names reach into nested dicts), checked: present, not None, of ``kind``, not empty.

    Raises :class:`BadRowError` naming file, row and field; returns ``default`` instead when the field is absent or
    None and a default is given.
    """
    cur = rec
    for part in name.split("."):
        if not isinstance(cur, dict):
            raise BadRowError(path, row, name, f"expected an object at {part!r}, got {type(cur).__name__}", line)
        cur = cur.get(part, None)
        if cur is None:
            if default is not _MISSING:
                return default
            raise BadRowError(path, row, name, "missing or null", line)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(cur, bool) and bool not in kinds or not isinstance(cur, kinds):
        want = " or ".join(k.__name__ for k in kinds)
        raise BadRowError(path, row, name, f"expected {want}, got {type(cur).__name__} ({cur!r:.60})", line)
    if isinstance(cur, float) and not math.isfinite(cur):
        raise BadRowError(path, row, name, f"not a finite number ({cur})", line)
    if isinstance(cur, str | list | dict) and len(cur) == 0 or isinstance(cur, str) and not cur.strip():
        raise BadRowError(path, row, name, "empty", line)
    return cur


def _check_messages(messages: list[Any], path: Path, row: int, name: str, line: int | None) -> list[dict[str, str]]:
    out = []
    for j, m in enumerate(messages):
        f = f"{name}[{j}]"
        if not isinstance(m, dict):
            raise BadRowError(path, row, f, f"expected a chat message object, got {type(m).__name__}", line)
        role = m.get("role")
        if not isinstance(role, str) or not role.strip():
            raise BadRowError(path, row, f"{f}.role", f"expected a non-empty string, got {role!r:.60}", line)
        content = m.get("content")
        if not isinstance(content, str) or not content.strip():
            raise BadRowError(path, row, f"{f}.content", f"expected a non-empty string, got {content!r:.60}", line)
        out.append({"role": role, "content": content})
    return out


def _answer_str(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


@dataclass(frozen=True)
class Example:
    """One prompt: a stable unique ``uid``, the chat ``prompt`` messages, the ground-truth ``answer`` (string), the
    ``source`` (data_source / benchmark name), and ``meta`` (everything else: index, difficulty, original fields)."""

    uid: str
    prompt: list[dict[str, str]]
    answer: str
    source: str
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def problem_text(self) -> str:
        """The content of the last user message (for logging and tables)."""
        return next((m["content"] for m in reversed(self.prompt) if m["role"] == "user"), self.prompt[-1]["content"])


class PromptDataset(Sequence[Example]):
    """An in-memory list of :class:`Example` with unique uids and the :class:`ReadStats` of the file it came from."""

    def __init__(self, examples: Sequence[Example], stats: ReadStats | None = None, name: str = "") -> None:
        self.examples = list(examples)
        self.stats = stats
        self.name = name
        seen: set[str] = set()
        for ex in self.examples:
            if ex.uid in seen:
                raise ValueError(f"dataset {name or '<unnamed>'}: duplicate uid {ex.uid!r}")
            seen.add(ex.uid)
        self._fingerprint: str | None = None

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i):  # type: ignore[override]
        return self.examples[i]

    def fingerprint(self) -> str:
        """A short hash of the uids in order: detects resuming an iterator on a different dataset."""
        if self._fingerprint is None:
            h = hashlib.sha1()
            for ex in self.examples:
                h.update(ex.uid.encode())
                h.update(b"\0")
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def iterator(self, seed: int = 0, shuffle: bool = True, max_epochs: int | None = None) -> PromptIterator:
        return PromptIterator(self, seed=seed, shuffle=shuffle, max_epochs=max_epochs)


def _finish(examples: list[Example], stats: ReadStats, name: str) -> PromptDataset:
    stats.kept = len(examples)
    return PromptDataset(examples, stats, name=name)


def _unique_uid(uid: str, row: int, used: set[str]) -> str:
    if uid in used:
        uid = f"{uid}@{row}"
    used.add(uid)
    return uid


def _seen_before(seen: set[bytes], messages: list, answer: str) -> bool:
    """Deduplication by (prompt messages, answer): True if this pair was already read, else remember it."""
    key = hashlib.sha1(json.dumps([messages, answer]).encode()).digest()
    if key in seen:
        return True
    seen.add(key)
    return False


def read_dapo_math(
    path: str | Path, *, on_bad_row: OnBadRow = "error", dedup: bool = False, limit: int | None = None
) -> PromptDataset:
    """Read DAPO-Math-17K's published parquet (schema in the module docstring) into a :class:`PromptDataset`.

    uid = ``extra_info.index`` (``@row`` appended if repeated; ``<file stem>:<row>`` if absent). The prompt messages
    are kept as published (they already carry DAPO's instruction). ``dedup`` drops repeated (prompt, answer) pairs,
    counted in ``stats.duplicates``. ``limit`` stops after that many kept examples.
    """
    p = Path(path)
    stats = ReadStats(str(p))
    bad = BadRows(on_bad_row, stats)
    examples: list[Example] = []
    used: set[str] = set()
    seen: set[bytes] = set()
    for row, line, rec in iter_records(p, bad):
        stats.rows += 1
        try:
            if not isinstance(rec, dict):
                raise BadRowError(p, row, "<row>", f"expected an object, got {type(rec).__name__}", line)
            source = get_field(rec, "data_source", p, row, str, line=line)
            messages = _check_messages(get_field(rec, "prompt", p, row, list, line=line), p, row, "prompt", line)
            answer = _answer_str(get_field(rec, "reward_model.ground_truth", p, row, (str, int, float), line=line))
            ability = get_field(rec, "ability", p, row, str, line=line, default="")
            style = get_field(rec, "reward_model.style", p, row, str, line=line, default="")
            index = get_field(rec, "extra_info.index", p, row, (str, int), line=line, default=None)
        except BadRowError as err:
            bad.handle(err)
            continue
        if dedup and _seen_before(seen, messages, answer):
            stats.duplicates += 1
            continue
        uid = _unique_uid(str(index) if index is not None else f"{p.stem}:{row}", row, used)
        meta = {"row": row, "ability": ability, "style": style, "index": index}
        examples.append(Example(uid=uid, prompt=messages, answer=answer, source=source, meta=meta))
        if limit is not None and len(examples) >= limit:
            break
    return _finish(examples, stats, p.name)


def read_prompt_file(
    path: str | Path,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    source_key: str | None = "source",
    uid_key: str | None = None,
    template: str = "dapo",
    default_source: str | None = None,
    on_bad_row: OnBadRow = "error",
    dedup: bool = False,
    limit: int | None = None,
) -> PromptDataset:
    """Read a generic jsonl / json / parquet file of (prompt, answer, source) records.

    ``prompt_key`` holds a problem string (wrapped with ``template``: dapo | boxed | none) or a list of chat messages
    (used as is). Answers may be strings or numbers (kept as strings: ``18``, ``0.5``). The source comes from
    ``source_key``; rows without it use ``default_source`` when given, else they are bad rows. uid = ``uid_key``'s
    value when given, else ``<file stem>:<row>``. Other columns are kept in ``meta``; a string prompt is kept as
    ``meta["problem"]``.
    """
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; expected one of {sorted(TEMPLATES)}")
    p = Path(path)
    stats = ReadStats(str(p))
    bad = BadRows(on_bad_row, stats)
    examples: list[Example] = []
    used: set[str] = set()
    seen: set[bytes] = set()
    top_keys = {k.split(".")[0] for k in (prompt_key, answer_key, source_key, uid_key) if k}
    for row, line, rec in iter_records(p, bad):
        stats.rows += 1
        try:
            if not isinstance(rec, dict):
                raise BadRowError(p, row, "<row>", f"expected an object, got {type(rec).__name__}", line)
            raw = get_field(rec, prompt_key, p, row, (str, list), line=line)
            if isinstance(raw, str):
                messages, problem = format_prompt(raw, template), raw
            else:
                messages, problem = _check_messages(raw, p, row, prompt_key, line), None
            answer = _answer_str(get_field(rec, answer_key, p, row, (str, int, float), line=line))
            if source_key is None:
                source = default_source or p.stem
            elif default_source is not None:
                source = get_field(rec, source_key, p, row, str, line=line, default=default_source)
            else:
                source = get_field(rec, source_key, p, row, str, line=line)
            uid = str(get_field(rec, uid_key, p, row, (str, int), line=line)) if uid_key else f"{p.stem}:{row}"
        except BadRowError as err:
            bad.handle(err)
            continue
        if dedup and _seen_before(seen, messages, answer):
            stats.duplicates += 1
            continue
        meta = {k: v for k, v in rec.items() if k not in top_keys}
        meta["row"] = row
        if problem is not None:
            meta["problem"] = problem
        examples.append(Example(uid=_unique_uid(uid, row, used), prompt=messages, answer=answer, source=source,
                                meta=meta))
        if limit is not None and len(examples) >= limit:
            break
    return _finish(examples, stats, p.name)


def _looks_like_dapo(path: Path) -> bool:
    if path.suffix.lower() != ".parquet":
        return False
    import pyarrow.parquet as pq

    names = set(pq.read_schema(path).names)
    return {"prompt", "reward_model", "data_source"} <= names


def load_prompts(path: str | Path, format: str = "auto", **kwargs: Any) -> PromptDataset:
    """Read ``path`` as ``dapo`` (DAPO-Math-17K parquet) or ``generic``; ``auto`` picks dapo for a parquet file with
    the DAPO columns (data_source, prompt, reward_model). Keyword arguments go to the reader."""
    p = Path(path)
    if format == "auto":
        format = "dapo" if _looks_like_dapo(p) else "generic"
    if format == "dapo":
        return read_dapo_math(p, **kwargs)
    if format == "generic":
        return read_prompt_file(p, **kwargs)
    raise ValueError(f"unknown dataset format {format!r}; expected auto, dapo or generic")
