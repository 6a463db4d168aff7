"""Stop requests: SIGTERM, SIGUSR1, SIGINT or a file ``run_dir/PREEMPT`` -> checkpoint the last completed step, exit.

The contract (docs/reliability.md, docs/slurm.md):

- **SIGTERM** (``scancel``, preemption, ``kill``), **SIGUSR1** (``slurm/train.sbatch``'s time-limit warning) and the
  **first SIGINT** (Ctrl-C) all ask the run to stop: the step in progress is *abandoned* if it has not reached the
  policy update yet (generation, rewards, old log-probs: nothing of it is kept, a resumed run redoes it exactly, with
  the same seeds), or *finished* if the update has started (an update is a collective over all policy ranks and is
  not interrupted half-way); then a checkpoint of the last completed step is written (skipped if it exists) and the
  process exits 0. Time bound: the rest of one update + weight sync, plus one checkpoint save.
- A **second SIGINT** exits at once (status 130), without a checkpoint; Ray actors and reward workers are still shut
  down. Further SIGTERM / SIGUSR1 are ignored while the checkpoint is written.

Handlers must be installed after ``ray.init`` (it replaces the SIGTERM handler with its own, which exits without a
checkpoint) and from the main thread; :meth:`StopSignals.install` is called by :class:`~da3po_megatron.trainer.run.Run`
right after Ray starts. Abandoning works by raising :class:`StepAbandoned` (a ``KeyboardInterrupt``, the one exception
``ray.get`` and blocking waits let through) from the handler while the driver is inside
:meth:`StopSignals.abandonable`.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StepAbandoned(KeyboardInterrupt):  # noqa: N818 - a KeyboardInterrupt so that ray.get / waits let it through
    """The step in progress was abandoned on a stop request (nothing of it is kept)."""


class StopSignals:
    """The run's stop requests; ``requested`` is True after a signal or while ``preempt_file`` exists."""

    def __init__(self, preempt_file: Path | None = None) -> None:
        self.preempt_file = preempt_file
        self.signum: int | None = None
        self.abandoned = False
        self.exit_now = False
        self._abandonable = False
        self._sigints = 0

    def install(self) -> None:
        """(Re)install the handlers; call after ``ray.init`` and from the main thread (no-op elsewhere)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    @property
    def requested(self) -> bool:
        return self.signum is not None or (self.preempt_file is not None and self.preempt_file.exists())

    def describe(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else f"{self.preempt_file} exists"

    def _handle(self, signum: int, frame: object) -> None:  # noqa: ARG002
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            self._sigints += 1
            if self._sigints >= 2:
                print("received SIGINT again: exiting now, without a checkpoint", flush=True)
                self.exit_now = True
                raise KeyboardInterrupt
        if self.signum is not None:
            print(f"received {name}: already stopping", flush=True)
            return
        self.signum = signum
        if self._abandonable:
            self._abandonable = False
            self.abandoned = True
            print(f"received {name}: abandoning the step in progress; checkpointing the last completed step, then "
                  "exiting" + (" (SIGINT again: exit now)" if signum == signal.SIGINT else ""), flush=True)
            raise StepAbandoned(name)
        print(f"received {name}: will checkpoint after this step and exit"
              + (" (SIGINT again: exit now)" if signum == signal.SIGINT else ""), flush=True)

    @contextmanager
    def abandonable(self) -> Iterator[None]:
        """Code in this block may be cut short by a stop request (it must not change what a checkpoint holds)."""
        if self.requested:
            self.abandoned = True
            raise StepAbandoned(self.describe())
        self._abandonable = True
        try:
            yield
        finally:
            self._abandonable = False
