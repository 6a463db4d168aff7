"""Stand-in stream engines (NOT vLLM) for the asynchronous producer's tests and ``da3po bench async --standin``.

``StandInStreamEngines(num_engines, n, step_s)`` has the ``RolloutClient`` surface the producer uses (``num_engines``,
``stream_start`` / ``stream_wait``, ``restart_on_failure`` / ``_restart`` / ``resync``) and behaves like
``rollout/stream.py`` on a Ray actor with ``max_concurrency=1``: each engine has one worker thread, so calls on
different engines run at once and calls on one engine queue behind each other; ``stream_start`` returns a
``concurrent.futures.Future``. One engine step sleeps ``step_s`` (a list: per engine, engines of different speeds; the
GIL is released, as a real engine waits for its device) and decodes one token of every running sample; a sample of the
prompt ``L<n>:<kind>`` finishes after n tokens (token id 9, log-prob -1). ``interrupt`` keeps the decoded tokens and, as
the real engine, ignores keys it does not run. Faults: ``die_at[engine] = (call, steps)`` -- the engine's first call
from number ``call`` on that runs groups raises ``EngineDeadError`` after ``steps`` engine steps, and the engine stays
dead until restarted; ``replayable=False``: a restarted engine's weights cannot be replayed here (``resync`` is called,
as ``RolloutClient._restart`` does for weights pushed by the policy ranks); ``hang_at[(engine, call)]`` -- that call
blocks (until ``release`` is set, at most 60 s). ``busy_s[e]``: seconds engine e spent inside calls.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from da3po_megatron.rollout.types import Completion, EngineDeadError


class StandInStreamEngines:
    mode = "local"

    def __init__(self, num_engines: int, n: int, step_s: float | list[float] = 0.0, restart_on_failure: bool = False,
                 replayable: bool = True) -> None:
        self.num_engines, self.n, self.step_s, self.replayable = num_engines, n, step_s, replayable
        self.restart_on_failure, self.resync, self.restarts, self.weights_version = restart_on_failure, None, 0, 0
        self.pools = [ThreadPoolExecutor(1, thread_name_prefix=f"standin-engine-{e}") for e in range(num_engines)]
        self.running: list[dict[str, dict]] = [{} for _ in range(num_engines)]
        self.calls = [0] * num_engines
        self.inflight = [0] * num_engines
        self.max_inflight = [0] * num_engines
        self.busy_s = [0.0] * num_engines
        self.step_s_sum, self.step_count = 0.0, 0  # wall time of the engine steps taken (sleep + decode; load shows)
        self.intervals: list[list[tuple[float, float]]] = [[] for _ in range(num_engines)]  # (start, end) per call
        self.dead = [False] * num_engines
        self.generation = [0] * num_engines
        self.die_at: dict[int, tuple[int, int]] = {}
        self.hang_at: set[tuple[int, int]] = set()
        self.release = threading.Event()
        self.lock = threading.Lock()

    def stream_start(self, e: int, submit: list[tuple], sampling: Any, abort: Any = None, max_steps: int = 8,
                     interrupt: list[str] | None = None) -> Future:
        with self.lock:
            self.calls[e] += 1
            self.inflight[e] += 1
            self.max_inflight[e] = max(self.max_inflight[e], self.inflight[e])
            call, gen = self.calls[e], self.generation[e]
        return self.pools[e].submit(self._call, e, gen, call, list(submit), max_steps, interrupt)

    def stream_wait(self, pending: list[tuple[int, Any]]) -> tuple[int, dict[str, Any]]:
        ref = pending[0][1]
        return 0, ref.result() if isinstance(ref, Future) else ref

    def _restart(self, e: int, cause: BaseException) -> None:
        """As ``RolloutClient._restart``: a fresh engine (nothing running), the last synced weights replayed."""
        if not self.restart_on_failure:
            raise cause
        with self.lock:
            self.restarts += 1
            self.generation[e] += 1
            self.dead[e] = False
            self.running[e] = {}
            self.inflight[e] = 0
        self.pools[e] = ThreadPoolExecutor(1, thread_name_prefix=f"standin-engine-{e}-r{self.restarts}")
        if not self.replayable and self.resync is not None:  # weights pushed by the policy ranks: sync them again
            self.resync()

    def remaining_steps(self) -> int:
        """Engine steps the longest group on any engine still needs: what a drain must wait for at the least."""
        with self.lock:
            runs = [list(r.values()) for r in self.running]
        return max([g["length"] - min(g["pos"]) for r in runs for g in r] or [0])

    def mean_step_s(self) -> float:
        """The mean wall time of an engine step so far (``step_s`` plus what the machine's load adds)."""
        with self.lock:
            return self.step_s_sum / self.step_count if self.step_count else self._step_s(0)

    def _step_s(self, e: int) -> float:
        return self.step_s[e] if isinstance(self.step_s, list) else self.step_s

    def shutdown(self) -> None:
        self.release.set()
        for p in self.pools:
            p.shutdown(wait=False, cancel_futures=True)

    def _call(self, e: int, gen: int, call: int, submit: list[tuple], max_steps: int,
              interrupt: list[str] | None) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            return self._run(e, gen, call, submit, max_steps, interrupt)
        finally:
            with self.lock:
                if self.generation[e] == gen:
                    self.inflight[e] -= 1
                    self.busy_s[e] += time.perf_counter() - t0
                    self.intervals[e].append((t0, time.perf_counter()))

    def _run(self, e: int, gen: int, call: int, submit: list[tuple], max_steps: int,
             interrupt: list[str] | None) -> dict[str, Any]:
        if self.dead[e] or gen != self.generation[e]:
            raise EngineDeadError(e, "stand-in engine is dead")
        if (e, call) in self.hang_at:
            self.release.wait(60)
        run = self.running[e]
        interrupted = {}
        for key in interrupt or []:
            if key not in run:  # as rollout/stream.py: keys it does not run are ignored
                continue
            g = run.pop(key)
            interrupted[key] = {"token_ids": [[9] * s for s in g["seg"]], "logprobs": [[-1.0] * s for s in g["seg"]],
                                "finished": list(g["done"]), "reasons": ["stop" if d else "" for d in g["done"]],
                                "texts": [g["prompt"] if d else "" for d in g["done"]]}
        for key, prompt, index, _cap, *rest in submit:
            cont = rest[0] if rest else None
            if key in run:
                raise RuntimeError(f"stand-in engine {e}: group {key!r} is already running")
            run[key] = {"index": index, "length": int(prompt.split(":")[0][1:]), "prompt": prompt,
                        "pos": [len(x) for x in cont["prefix"]] if cont else [0] * self.n, "seg": [0] * self.n,
                        "done": list(cont["done"]) if cont else [False] * self.n}
        finished, steps, die = [], 0, self.die_at.get(e)
        die = die[1] if die is not None and call >= die[0] and run else None
        while run and not finished and steps < max_steps:
            if die is not None and steps >= die:
                self.dead[e] = True
                del self.die_at[e]
                raise EngineDeadError(e, f"stand-in engine killed during stream (call {call}, after {steps} steps)")
            steps += 1
            t_step = time.perf_counter()
            if self._step_s(e):
                time.sleep(self._step_s(e))
            for key in list(run):
                g = run[key]
                for j in range(self.n):
                    if not g["done"][j]:
                        g["pos"][j] += 1
                        g["seg"][j] += 1
                        g["done"][j] = g["pos"][j] >= g["length"]
                if all(g["done"]):
                    run.pop(key)
                    finished.append((key, [Completion(g["index"], j, [1], [9] * g["seg"][j], g["prompt"],
                                                      [-1.0] * g["seg"][j], "stop", g["seg"][j])
                                           for j in range(self.n)]))
            with self.lock:
                self.step_s_sum += time.perf_counter() - t_step
                self.step_count += 1
        out = {"finished": finished, "aborted": {}, "running": len(run), "decoded": 0}
        if interrupt is not None:
            out["interrupted"] = interrupted
        return out


# ------------------------------------------------------------------------------------------- the bench (stand-ins)
def standin_run(engines: StandInStreamEngines, lengths: list[int], batch: int, k: int, partial: bool,
                inflight: int, steps_per_call: int, seed: int = 1, release_order: str = "fifo") -> Any:
    """A run object with what :class:`AsyncRollout` reads (config, prompt stream, stand-in reward): prompt i has
    ``lengths[i]`` tokens per response; the stand-in reward makes a group informative unless i % 5 == 4."""
    from types import SimpleNamespace

    from da3po_megatron.config import load_config
    from da3po_megatron.data.datasets import Example, PromptDataset
    from da3po_megatron.trainer import batch as B

    cfg = load_config(None, ["model.path=x", "data.format=synthetic", f"data.train_batch_size={batch}",
                             f"rollout.n={engines.n}", "actor.ppo_mini_batch_size=1", "rollout.mode=streaming",
                             f"rollout.staleness={k}", f"rollout.partial_rollouts={str(partial).lower()}",
                             f"rollout.max_inflight_prompts={inflight}", "algorithm.name=dapo",
                             "algorithm.rollout_correction=tis", f"rollout.stream_steps_per_call={steps_per_call}",
                             "algorithm.max_generation_rounds=64", f"rollout.release_order={release_order}"])
    data = PromptDataset([Example(f"u{i:05d}", [{"role": "user", "content": f"L{n}:{'all' if i % 5 == 4 else 'mix'}"}],
                                  "all" if i % 5 == 4 else "mix", "s", {"bucket": n}) for i, n in enumerate(lengths)])
    prompts = data.iterator(shuffle=False)

    def score(examples, completions):
        acc = [1.0 if (ex.answer == "all" or j == 0) else -1.0 for ex, cs in zip(examples, completions)
               for j, _ in enumerate(cs)]
        return B.make_groups(examples, completions, acc, 64, None)

    return SimpleNamespace(cfg=cfg, rollout=engines, prompts=prompts, next_prompts=prompts.take,
                           render_prompts=lambda exs: [ex.problem_text for ex in exs],
                           sampling_config=lambda s: SimpleNamespace(seed=s, n=engines.n),
                           sampling_seed=lambda s, r: seed, score=score, totals={"kept_groups": 0})


def bench_standin(num_engines: int, partial: bool, *, groups_per_engine: int = 4, n: int = 8, k: int = 2,
                  step_s: float = 0.002, train_s: float = 0.05, sync_s: float = 0.02, steps: int = 8,
                  warmup: int = 2, steps_per_call: int = 4, seed: int = 1, release_order: str = "fifo"
                  ) -> dict[str, float]:
    """The producer (``trainer/generation/async_rollout.py``, the real code) against ``num_engines`` stand-in engines
    and a stand-in trainer (``train_s`` of sleep per step, ``sync_s`` per weight sync): batch = groups_per_engine x
    engines kept groups, as many in flight. Per measured step: the pause before the sync, the engines' idle fraction
    outside the pause (engine-side: 1 - time inside stream calls / wall time, over every engine), the producer's own
    ``rollout/async/engine_idle_frac`` (driver side: no call in flight) and the part of it in which the staleness
    bound held admission (``engine_idle_bound_frac``: the engine had nothing it was allowed to run), trained tokens
    per second, and the drain's floor: the engine steps the longest group on the engines still needed when the pause
    was asked for, x the engine steps' mean wall time so far (``step_s`` plus what the machine's load adds): no drain
    can be shorter; it grows with the groups in flight, a maximum over them."""
    import random

    from da3po_megatron.trainer.generation.async_rollout import AsyncRollout

    rng = random.Random(seed)
    lengths = [max(4, min(400, int(rng.lognormvariate(3.6, 0.7)))) for _ in range(20000)]  # median ~37, long tail
    engines = StandInStreamEngines(num_engines, n, step_s)
    batch = groups_per_engine * num_engines
    run = standin_run(engines, lengths, batch, k, partial, batch, steps_per_call, seed, release_order)
    producer = AsyncRollout(run, 0)
    pause_s, floor_s, windows, driver_idle, bound_idle, tokens, wall = [], [], [], [], [], 0, 0.0
    try:
        for step in range(1, warmup + steps + 1):
            t0 = time.perf_counter()
            r = producer.take(step)
            time.sleep(train_s)  # the stand-in trainer: pi_old + the update
            t1 = time.perf_counter()
            floor = engines.remaining_steps() * engines.mean_step_s()
            producer.pause()
            t2 = time.perf_counter()
            time.sleep(sync_s)  # the stand-in weight sync
            producer.resume(step)
            if step <= warmup:
                continue
            pause_s.append(t2 - t1)
            floor_s.append(floor)
            windows.append((t0, t1))  # this step outside the pause and the sync
            driver_idle.append(r.stats.get("rollout/async/engine_idle_frac", float("nan")))
            bound_idle.append(r.stats.get("rollout/async/engine_idle_bound_frac", float("nan")))
            tokens += int(r.stats["rollout/kept_tokens"])
            wall += time.perf_counter() - t0
    finally:
        producer.close()
        engines.shutdown()
    mean = lambda x: sum(x) / len(x)  # noqa: E731
    # engine-side idle: 1 - (time inside stream calls overlapping the window) / (window x engines), per step
    idle = [1.0 - sum(max(0.0, min(b, y) - max(a, x)) for iv in engines.intervals for x, y in iv)
            / ((b - a) * num_engines) for a, b in windows]
    return {"engines": num_engines, "partial": partial, "pause_s": mean(pause_s), "pause_s_max": max(pause_s),
            "pause_floor_s": mean(floor_s), "idle_frac": mean(idle), "driver_idle_frac": mean(driver_idle),
            "bound_idle_frac": mean(bound_idle), "trained_tok_s": tokens / wall, "step_s": wall / steps}
