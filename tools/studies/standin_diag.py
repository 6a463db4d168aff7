"""Why the asynchronous producer idles its engines (issue 47): ``tools/standin_engines.bench_standin`` (the real
producer against stand-in engines, NOT vLLM) instrumented from outside, one setting per invocation.

Printed besides the bench's row: stream calls and engine steps per call, the engines' occupancy (mean groups running
per engine step, of ``--groups`` slots: the stand-in's throughput is proportional to it), and, each time the staleness
bound held admission, the producer's queue: kept groups released (the loop takes B of them), kept groups decided but
waiting behind an earlier one, groups in flight, and how often the FIFO head (the next group to release) was still
undecided -- a long group at the head that the loop waits for while the bound's k batches of look-ahead are spent
behind it (head-of-line blocking).

    python tools/studies/standin_diag.py --engines 4 --partial        # as da3po bench async --standin, 4 engines
    python tools/studies/standin_diag.py --engines 4 --partial --k 4  # a longer look-ahead
    python tools/studies/standin_diag.py --engines 4 --sigma 0        # every prompt 47 tokens: no length tail
    python tools/studies/standin_diag.py --engines 4 --stop-admission-at-take  # drain: no admission from take() to sync
    python tools/studies/standin_diag.py --engines 1 --partial --depth 1  # one stream call in flight (pre-693eaff)

``--stop-admission-at-take`` (an experiment, not a producer option): without partial rollouts, admission stops when the
loop takes its batch, so the running groups drain while the stand-in trainer trains.
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import threading
import time

from da3po_megatron.testing import standin_engines as S
from da3po_megatron.trainer.generation.async_rollout import AsyncRollout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--partial", action="store_true", help="partial rollouts (interrupt); else drain")
    ap.add_argument("--k", type=int, default=2, help="rollout.staleness")
    ap.add_argument("--sigma", type=float, default=None, help="log-normal sigma of the lengths (0: all 47 tokens)")
    ap.add_argument("--groups", type=int, default=4, help="groups in flight per engine (= batch / engines)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--stop-admission-at-take", action="store_true")
    ap.add_argument("--depth", type=int, default=None, help="stream calls in flight per engine (1: as before 693eaff)")
    args = ap.parse_args(argv)

    calls, steps, occupancy, held = collections.Counter(), collections.Counter(), collections.Counter(), []
    lock = threading.Lock()
    engines_of: list[S.StandInStreamEngines] = []
    init, run_call = S.StandInStreamEngines.__init__, S.StandInStreamEngines._run
    submissions = AsyncRollout._submissions

    def s_init(self, *a, **kw):
        init(self, *a, **kw)
        engines_of.append(self)

    def s_run(self, e, gen, call, submit, max_steps, interrupt):
        res = run_call(self, e, gen, call, submit, max_steps, interrupt)
        with lock:
            calls[max_steps] += 1
        return res

    class Clock:  # the stand-in's time module: counts the groups running at each engine step
        perf_counter, monotonic = staticmethod(time.perf_counter), staticmethod(time.monotonic)

        @staticmethod
        def sleep(s: float) -> None:
            name = threading.current_thread().name
            if name.startswith("standin-engine") and engines_of:
                e = int(name.split("_")[0].split("-")[2])
                occupancy[e] += len(engines_of[-1].running[e])
                steps[e] += 1
            time.sleep(s)

    def p_submissions(self, e):
        if getattr(self, "_diag_no_admission", False):
            return []
        out = submissions(self, e)
        if self._held:
            held.append((self.released_kept, self.decided_kept, len(self.partials), self.release_j in self.partials))
        return out

    def p_quiesce(self):  # pauses that find a group at max_versions_per_response (drained, not interrupted)
        with self._cv:
            at_max.append(any(self.partials[j].span >= self.max_versions for r in self._running for j in r))
        return quiesce(self)

    at_max: list[bool] = []
    quiesce = AsyncRollout._quiesce
    S.StandInStreamEngines.__init__, S.StandInStreamEngines._run, S.time = s_init, s_run, Clock
    AsyncRollout._submissions, AsyncRollout._quiesce = p_submissions, p_quiesce
    if args.depth:
        from da3po_megatron.trainer.generation import async_engines

        calls_init = async_engines.EngineCalls.__init__
        async_engines.EngineCalls.__init__ = (lambda self, client, sampling, steps, timeout_s, depth=2:
                                              calls_init(self, client, sampling, steps, timeout_s, args.depth))
    if args.stop_admission_at_take:
        take, resume = AsyncRollout.take, AsyncRollout.resume

        def p_take(self, step):
            r = take(self, step)
            self._diag_no_admission = True
            return r

        def p_resume(self, version):
            self._diag_no_admission = False
            return resume(self, version)

        AsyncRollout.take, AsyncRollout.resume = p_take, p_resume
    if args.sigma is not None:
        lognorm = random.Random.lognormvariate
        random.Random.lognormvariate = (lambda self, mu, sigma: lognorm(self, mu, args.sigma) if args.sigma > 0
                                        else 47.0)
    r = S.bench_standin(args.engines, args.partial, groups_per_engine=args.groups, step_s=0.01, train_s=0.2,
                        sync_s=0.05, steps=args.steps, warmup=args.warmup, steps_per_call=8, seed=args.seed, k=args.k)
    n_calls = sum(calls.values())
    early = ", no admission from take" if args.stop_admission_at_take else ""
    print(f"{args.engines} engines, {'interrupt' if args.partial else 'drain'}, k {args.k}, sigma "
          f"{'0.7' if args.sigma is None else args.sigma}{early}: pause {r['pause_s']:.3f} s (floor "
          f"{r['pause_floor_s']:.3f}), engine idle {r['idle_frac']:.1%}, driver "
          f"idle {r['driver_idle_frac']:.1%} (bound {r['bound_idle_frac']:.1%}), {r['trained_tok_s']:,.0f} trained "
          f"tok/s, {r['step_s']:.2f} s/step; pauses finding a group at max_versions_per_response: "
          f"{sum(at_max)} of {len(at_max)}")
    print(f"  stream calls {n_calls} (max_steps: {dict(sorted(calls.items()))}), engine steps per call "
          f"{sum(steps.values()) / max(n_calls, 1):.2f}; occupancy (groups running per engine step, of {args.groups}): "
          f"{', '.join(f'{occupancy[e] / max(steps[e], 1):.2f}' for e in sorted(steps))}")
    if held:
        m = lambda i: sum(h[i] for h in held) / len(held)  # noqa: E731
        print(f"  while the bound held admission ({len(held)} samples; B = {args.groups * args.engines}): kept "
              f"released {m(0):.1f}, kept decided behind the head {m(1):.1f}, in flight {m(2):.1f}; FIFO head "
              f"undecided {m(3):.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
