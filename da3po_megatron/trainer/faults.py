"""Fault injection for the reliability tests (``tests/test_reliability_faults.py``, docs/reliability.md).

``DA3PO_FAULT_INJECT="ACTION@PHASE@STEP[,...]"`` makes the trainer hurt itself when it enters ``PHASE`` of RL step
``STEP``; unset (always, outside tests) every call here is a dictionary lookup that finds nothing. Phases: the loop's
``generate``, ``reward``, ``old_logprobs``, ``train``, ``weight_sync``, and ``checkpoint`` (inside a save, after the
policy part is written and before the trainer state, manifest and ``COMPLETE``), and ``partial_rollout`` (the
asynchronous producer of ``trainer/generation/async_rollout.py`` has just sent interrupted partial rollouts back to an
engine to continue under the weights of step STEP - 1, i.e. while step STEP's batches are generated). Actions:

- ``kill`` / ``term`` / ``usr1`` / ``int``: SIGKILL / SIGTERM / SIGUSR1 / SIGINT to the driver itself;
- ``kill_engine``: SIGKILL the process of rollout engine 0 (its Ray actor);
- ``kill_reward_worker``: SIGKILL reward worker 0 a moment (20 ms) after scoring starts;
- ``nan``: the step's pi_old log-probs become NaN, so its loss is non-finite (``old_logprobs`` phase only);
- ``skip``: the phase does nothing (``weight_sync`` only: the engines keep the previous weights -- the stale-engine
  case ``rollout.replay_mode=compare`` must report, tests/test_replay.py).

Each entry fires once per process.
"""

from __future__ import annotations

import math
import os
import signal
import threading
from typing import Any

ENV = "DA3PO_FAULT_INJECT"
_SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "usr1": signal.SIGUSR1, "int": signal.SIGINT}
_fired: set[str] = set()


def _due(action: str, phase: str, step: int) -> bool:
    key = f"{action}@{phase}@{step}"
    spec = {s.strip() for s in os.environ.get(ENV, "").split(",") if s.strip()}
    if key not in spec or key in _fired:
        return False
    _fired.add(key)
    print(f"fault injection: {key}", flush=True)
    return True


def fault_point(phase: str, step: int, run: Any = None) -> None:
    """Called when the driver enters ``phase`` of ``step``: fires the injected faults that match."""
    if not os.environ.get(ENV):
        return
    for action, sig in _SIGNALS.items():
        if _due(action, phase, step):
            os.kill(os.getpid(), sig)
    if run is not None and _due("kill_engine", phase, step):
        pid = int(run.rollout.health()[0]["pid"])
        os.kill(pid, signal.SIGKILL)
    if run is not None and _due("kill_reward_worker", phase, step):
        pid = run.rewards.worker_pids[0]
        threading.Timer(0.02, lambda: os.kill(pid, signal.SIGKILL)).start()


def poisoned(logprobs: list[list[float]], step: int) -> list[list[float]]:
    """``logprobs`` with every value NaN when ``nan@old_logprobs@STEP`` is injected, else unchanged."""
    if os.environ.get(ENV) and _due("nan", "old_logprobs", step):
        return [[math.nan] * len(row) for row in logprobs]
    return logprobs


def skipped(phase: str, step: int) -> bool:
    """Whether ``skip@PHASE@STEP`` is injected (the caller then leaves the phase out); False outside fault tests."""
    return bool(os.environ.get(ENV)) and _due("skip", phase, step)
