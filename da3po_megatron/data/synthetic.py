"""A synthetic verifiable task with controllable per-prompt difficulty: running sums of digits mod 10.

The prompt holds n digits (n = the difficulty bucket, 1..8), left-aligned in a fixed-width field padded with ``_``;
the answer is their running sums mod 10, one digit per input digit: ``"sums 359_____"`` -> ``"387"``
(3, 3+5=8, 8+9=17 -> 7). The fixed width keeps input digit k at a constant distance from output digit k whatever n is,
so a tiny model learns the rule quickly (out_k = out_(k-1) + in_k mod 10). Output digit k depends on all inputs up to
k, so errors compound with n and success falls with the bucket -- which is what the algorithm comparison needs: prompts
where the policy succeeds often (p_hat > tau) and prompts where it rarely does (p_hat < tau, where DAA amplifies,
Eq. 14).

Strings stay short for the tiny char-level model (256-token context): every prompt is 13 characters.
Train and held-out splits never share a prompt: every digit string is assigned to one split by a hash of the string
(:func:`split_of`), so held-out accuracy measures generalisation, not memorisation.

Reward (:func:`synthetic_reward`, kind ``"synthetic"`` of :class:`da3po_megatron.rewards.RewardPool`): +1 iff the
response's digits, whitespace ignored, are exactly the answer; -1 otherwise (DAPO convention, like R_acc for math).

**Long-tailed lengths and a stand-in verifier** (benchmarks, ``da3po_megatron/bench/async_rl.py``; issue 37). In math RL
hard problems take long: response lengths are long-tailed and grow with difficulty, which is what asynchronous training
must not turn into a bias against hard prompts. ``response_tokens=(easy, hard)`` caps each prompt's responses at a
length drawn once per prompt (:func:`long_tailed_length`: a log-normal whose median grows geometrically with the bucket
from ``easy`` to ``hard`` tokens), stored as the example's ``meta["max_tokens"]``, which the engines honour per request
(with ``rollout.ignore_eos=true`` the responses are exactly that long). ``coin_p`` (one probability per bucket) replaces
each answer by ``coin:<p>`` for ``reward.kind=coin`` (:func:`coin_reward`: a response is correct with probability p by a
hash of its text), so a random-weight model sees the task's difficulty profile -- easy buckets mostly solved, hard ones
rarely -- without learning anything. The held-out split keeps the real answers.

Left out: curricula, other task families; the supervised warm-up that makes the task learnable from scratch lives in
:mod:`.warmup`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
import re
from collections.abc import Iterable, Sequence

from da3po_megatron.data.datasets import Example, PromptDataset
from da3po_megatron.data.templates import format_prompt

__all__ = [
    "BUCKETS",
    "HELDOUT_EVERY",
    "PAD",
    "PROMPT_PREFIX",
    "WIDTH",
    "long_tailed_length",
    "make_synthetic_dataset",
    "running_sums",
    "split_of",
    "synthetic_example",
    "synthetic_reward",
]

BUCKETS = tuple(range(1, 9))  # difficulty = number of digits
PROMPT_PREFIX = "sums "
WIDTH = 8  # digits field width = the largest bucket
PAD = "_"
HELDOUT_EVERY = 5  # about 1 in 5 digit strings is held out
_WS = re.compile(r"\s+")


def running_sums(digits: str) -> str:
    """``"359"`` -> ``"387"``: the running sums of the digits mod 10."""
    if not digits or not digits.isdigit():
        raise ValueError(f"running_sums expects a non-empty digit string, got {digits!r}")
    out, total = [], 0
    for c in digits:
        total = (total + int(c)) % 10
        out.append(str(total))
    return "".join(out)


def split_of(digits: str) -> str:
    """``"train"`` or ``"heldout"``: a fixed function of the digit string (a hash, not Python's salted ``hash``).

    For n = 1 the 10 strings split 6/4 (``0 7 8 9`` held out); every bucket has both splits.
    """
    h = int.from_bytes(hashlib.sha256(digits.encode()).digest()[:8], "big")
    return "heldout" if h % HELDOUT_EVERY == 0 else "train"


def synthetic_example(digits: str, uid: str) -> Example:
    """The :class:`Example` for one digit string (prompt with no template: the task is not maths prose)."""
    if len(digits) > WIDTH:
        raise ValueError(f"synthetic prompts hold at most {WIDTH} digits, got {digits!r}")
    text = PROMPT_PREFIX + digits.ljust(WIDTH, PAD)
    return Example(
        uid=uid,
        prompt=format_prompt(text, "none"),
        answer=running_sums(digits),
        source=f"synthetic/len{len(digits)}",
        meta={"task": "synthetic_running_sums", "difficulty": len(digits), "bucket": len(digits), "digits": digits,
              "split": split_of(digits)},
    )


def long_tailed_length(bucket: int, lo_bucket: int, hi_bucket: int, response_tokens: tuple[int, int],
                       max_tokens: int, rng: random.Random, sigma: float = 0.6) -> int:
    """A response-length cap for one prompt of ``bucket``: log-normal with median growing geometrically from
    ``response_tokens[0]`` (bucket ``lo_bucket``) to ``response_tokens[1]`` (``hi_bucket``), spread ``sigma`` (the
    long tail: ~10 % of draws exceed 2.2x the median at sigma 0.6), clipped to ``[1, max_tokens]``."""
    easy, hard = response_tokens
    if not (1 <= easy <= hard):
        raise ValueError(f"response_tokens must be (easy, hard) with 1 <= easy <= hard, got {response_tokens}")
    frac = (bucket - lo_bucket) / (hi_bucket - lo_bucket) if hi_bucket > lo_bucket else 1.0
    median = easy * (hard / easy) ** frac
    return max(1, min(int(max_tokens), round(median * math.exp(sigma * rng.gauss(0.0, 1.0)))))


def make_synthetic_dataset(
    n_per_bucket: int,
    split: str = "train",
    seed: int = 0,
    buckets: Iterable[int] = BUCKETS,
    response_tokens: Sequence[int] = (),
    max_tokens: int = 0,
    coin_p: Sequence[float] = (),
) -> PromptDataset:
    """``n_per_bucket`` prompts of each difficulty bucket from ``split`` ("train" | "heldout"), deterministic by seed.

    Prompts are distinct while the bucket has enough strings in the split; small buckets (n = 1, 2) repeat strings
    (with distinct uids ``syn-<split>-<seed>-<bucket>-<i>``). ``response_tokens=(easy, hard)`` with ``max_tokens``
    (the rollout's cap) gives every prompt a long-tailed length cap growing with the bucket (``meta["max_tokens"]``);
    ``coin_p`` (one probability per bucket) makes the answers ``coin:<p>`` (module docstring). The prompts chosen do
    not depend on either.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"synthetic split must be 'train' or 'heldout', got {split!r}")
    if n_per_bucket < 1:
        raise ValueError(f"n_per_bucket must be >= 1, got {n_per_bucket}")
    buckets = list(buckets)
    if response_tokens and (len(response_tokens) != 2 or max_tokens < 1):
        raise ValueError(f"response_tokens must be [easy, hard] with a max_tokens >= 1, got {list(response_tokens)}, "
                         f"max_tokens={max_tokens}")
    if coin_p and (len(coin_p) != len(buckets) or not all(0.0 <= p <= 1.0 for p in coin_p)):
        raise ValueError(f"coin_p must hold one probability in [0, 1] per bucket ({len(buckets)}: {buckets}), "
                         f"got {list(coin_p)}")
    rng = random.Random(f"synthetic:{split}:{seed}")
    lengths = random.Random(f"synthetic-lengths:{split}:{seed}")  # its own stream: the prompts stay the same
    examples = []
    for n in buckets:
        if not 1 <= n <= 8:
            raise ValueError(f"synthetic bucket must be in 1..8, got {n}")
        if 10**n <= 10_000:
            pool = [s for s in (str(i).zfill(n) for i in range(10**n)) if split_of(s) == split]
            rng.shuffle(pool)
            chosen = [pool[i % len(pool)] for i in range(n_per_bucket)]
        else:  # large spaces: rejection sampling, distinct strings
            seen: set[str] = set()
            chosen = []
            while len(chosen) < n_per_bucket:
                s = "".join(rng.choice("0123456789") for _ in range(n))
                if split_of(s) == split and s not in seen:
                    seen.add(s)
                    chosen.append(s)
        for i, s in enumerate(chosen):
            ex = synthetic_example(s, f"syn-{split}-{seed}-{n}-{i}")
            if response_tokens:
                ex.meta["max_tokens"] = long_tailed_length(n, buckets[0], buckets[-1],
                                                           (int(response_tokens[0]), int(response_tokens[1])),
                                                           max_tokens, lengths)
            if coin_p:
                ex = dataclasses.replace(ex, answer=f"coin:{float(coin_p[buckets.index(n)]):g}")
            examples.append(ex)
    return PromptDataset(examples, name=f"synthetic-{split}-{seed}")


def synthetic_reward(response: str, answer: str) -> tuple[float, dict[str, str]]:
    """+1 iff ``response`` with all whitespace removed equals ``answer`` exactly, else -1 (with the cleaned text)."""
    got = _WS.sub("", response)
    return (1.0 if got == _WS.sub("", answer) and got else -1.0), {"extracted": got[:64]}


def coin_reward(response: str, answer: str) -> tuple[float, dict[str, str]]:
    """The benchmark task's reward (``reward.kind=coin``): answer ``"coin:p"`` makes ``response`` correct (+1) with
    probability p, decided by a hash of its text (deterministic; independent across distinct responses), else -1.
    A prompt with p in {0, 1} is always filtered by dynamic sampling; one with p = 0.5 is kept with probability
    1 - 2 * 0.5^G, so the mix of prompts sets the keep rate (``da3po_megatron/bench/rl_step.py``)."""

    if not answer.startswith("coin:"):
        raise ValueError(f"coin reward: answer {answer!r} is not 'coin:<p>'")
    p = float(answer[5:])
    u = int.from_bytes(hashlib.blake2b(response.encode(), digest_size=8).digest(), "big") / 2**64
    return (1.0 if u < p else -1.0), {"u": f"{u:.4f}"}
