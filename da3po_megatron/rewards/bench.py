"""Throughput of :class:`RewardPool` on typical math responses (~1 KB of reasoning + a final answer).

    python -m da3po_megatron.rewards.bench --items 512 --workers 2

Items are distinct (math-verify caches parses) and 4 of 5 are right, so the printed mean reward must be +0.60.
"""

from __future__ import annotations

import time

from da3po_megatron.rewards.pool import RewardPool, default_num_workers


def main(argv: list[str] | None = None) -> int:
    """Score ``--items`` synthetic-but-realistic math responses with ``--workers`` workers; print the throughput."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--items", type=int, default=512)
    ap.add_argument("--workers", type=int, default=default_num_workers())
    ap.add_argument("--timeout-s", type=float, default=5.0)
    a = ap.parse_args(argv)
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


if __name__ == "__main__":
    raise SystemExit(main())
