"""A quiet console for `da3po train`: the terminal shows our lines (set-up summary, one progress line per step,
checkpoints, errors); third-party chatter goes to the run's log files under ``run_dir/logs/``:

- ``worker-<pid>.log``: everything a Ray worker process writes (policy ranks: megatron-core's Transformer-Engine /
  Apex fallback warnings; rollout engines: vLLM's start-up logs, and the vLLM processes they start, which inherit the
  descriptors). A Ray ``worker_process_setup_hook`` (:func:`redirect_worker_output`) points the worker's stdout and
  stderr there at file-descriptor level, so C-level and child-process output is caught too;
- ``driver.log``: a copy of the driver's console plus the third-party Python logs and warnings it did not show.

``da3po train --verbose`` (or ``DA3PO_VERBOSE=1``) shows everything on the console as before (Ray's log_to_driver on,
workers not redirected, third-party logs on stderr); ``driver.log`` still gets the copy. Errors are never hidden: an
exception raised in a worker reaches the driver through Ray with its traceback, and the driver prints it.

Slurm / multi-node (``ray.address=auto``): the hook travels in the job's runtime_env, so workers on every node write to
``run_dir/logs`` (a shared filesystem, as checkpoints already assume).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import IO, Any

LOG_DIR_ENV = "DA3PO_LOG_DIR"
VERBOSE_ENV = "DA3PO_VERBOSE"
HOOK = "da3po_megatron.trainer.observability.console.redirect_worker_output"
# Our own loggers stay on the console; every other logger writes to driver.log only (unless --verbose).
OWN_LOGGERS = ("da3po_megatron",)


class _Tee:
    """A text stream writing to the console stream and to a log file."""

    def __init__(self, stream: IO[str], log: IO[str]) -> None:
        self.stream, self.log = stream, log

    def write(self, s: str) -> int:
        self.log.write(s)
        return self.stream.write(s)

    def flush(self) -> None:
        self.log.flush()
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(self.stream, name)


def is_verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "0") == "1"


def configure(run_dir: str | Path, verbose: bool = False) -> Path:
    """Set up the driver for one run: ``run_dir/logs/``, the console copy in ``driver.log``, third-party Python logs
    and warnings to the file (and to the console only when ``verbose``), and the environment that
    :func:`ray_init_kwargs` and the worker hook read. Returns the log directory."""
    log_dir = Path(run_dir).resolve() / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    os.environ[LOG_DIR_ENV] = str(log_dir)
    os.environ[VERBOSE_ENV] = "1" if verbose else "0"
    log = (log_dir / "driver.log").open("a", encoding="utf-8", buffering=1)
    if not isinstance(sys.stdout, _Tee):
        sys.stdout, sys.stderr = _Tee(sys.stdout, log), _Tee(sys.stderr, log)
    logging.captureWarnings(True)  # warnings.warn(...) -> the "py.warnings" logger -> handlers below
    root = logging.getLogger()
    root.setLevel(min(root.level or logging.WARNING, logging.INFO))
    to_file = logging.StreamHandler(log)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(to_file)
    if verbose:
        root.addHandler(logging.StreamHandler(sys.__stderr__))
    else:
        quiet_third_party_loggers()
    return log_dir


def quiet_third_party_loggers() -> None:
    """Detach the console handlers that libraries imported so far attached to their own loggers (Ray, transformers,
    ...) and let them propagate to the root logger, i.e. to driver.log. Called by :func:`configure` and again by
    :func:`ray_init_kwargs` (Ray configures its logger when imported)."""
    for name in list(logging.root.manager.loggerDict):
        lg = logging.getLogger(name)
        if name.startswith(OWN_LOGGERS) or not isinstance(lg, logging.Logger) or not lg.handlers:
            continue
        for h in [h for h in lg.handlers if isinstance(h, logging.StreamHandler)
                  and not isinstance(h, logging.FileHandler)]:
            lg.removeHandler(h)
        lg.propagate = True


def ray_init_kwargs(verbose: bool | None = None) -> dict[str, Any]:
    """Arguments for ``ray.init``: quiet runs send worker output to ``run_dir/logs`` (the setup hook) instead of the
    console (log_to_driver off). ``DA3PO_RAY_LOG_TO_DRIVER`` still overrides log_to_driver (the tests set 0)."""
    verbose = is_verbose() if verbose is None else verbose
    log_dir = os.environ.get(LOG_DIR_ENV)
    kwargs: dict[str, Any] = {"log_to_driver": os.environ.get("DA3PO_RAY_LOG_TO_DRIVER", "1" if verbose else "0")
                              == "1"}
    if log_dir and not verbose:
        kwargs["runtime_env"] = {"worker_process_setup_hook": HOOK, "env_vars": {LOG_DIR_ENV: log_dir}}
        quiet_third_party_loggers()
    return kwargs


def redirect_worker_output() -> None:
    """Ray worker_process_setup_hook: send this process's stdout/stderr (file descriptors 1 and 2, so also C-level
    writes and child processes) to ``$DA3PO_LOG_DIR/worker-<pid>.log``. A no-op without DA3PO_LOG_DIR."""
    log_dir = os.environ.get(LOG_DIR_ENV)
    if not log_dir:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(os.path.join(log_dir, f"worker-{os.getpid()}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
