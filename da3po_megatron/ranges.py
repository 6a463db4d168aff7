"""Named phase ranges for profilers: ``record_function`` (torch profiler) + NVTX on CUDA; a no-op when off.

A leaf module (torch only), so the policy ranks (``megatron/policy.py``) and the trainer's loop use the same ranges;
what turns them on and writes traces is :mod:`da3po_megatron.trainer.observability.profiling`. Cost when off: one dict
lookup and a shared ``nullcontext`` (``phase``) or one extra Python call (``ranged``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

PREFIX = "da3po/"
_NULL = nullcontext()
_state = {"active": False, "nvtx": False}  # module-level switches read by phase() (one dict lookup when off)


def set_active(active: bool, nvtx: bool | None = None) -> None:
    """Turn the phase ranges on or off in this process (``nvtx``: also NVTX ranges; default: when CUDA is there)."""
    _state["active"] = bool(active)
    _state["nvtx"] = bool(active) and (torch.cuda.is_available() if nvtx is None else nvtx)


def is_active() -> bool:
    return _state["active"]


class _Range:
    """record_function + (CUDA) NVTX range named ``da3po/<name>``."""

    __slots__ = ("name", "rf", "nvtx")

    def __init__(self, name: str) -> None:
        self.name = PREFIX + name
        self.rf = torch.profiler.record_function(self.name)
        self.nvtx = _state["nvtx"]

    def __enter__(self) -> _Range:
        self.rf.__enter__()
        if self.nvtx:
            torch.cuda.nvtx.range_push(self.name)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.nvtx:
            torch.cuda.nvtx.range_pop()
        self.rf.__exit__(*exc)


def phase(name: str) -> AbstractContextManager:
    """A named range for one phase of a step; a shared no-op when profiling is off."""
    return _Range(name) if _state["active"] else _NULL


def ranged(name: str) -> Callable:
    """Decorator: run the function inside ``phase(name)`` (for the policy rank's methods)."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if not _state["active"]:
                return fn(*args, **kwargs)
            with _Range(name):
                return fn(*args, **kwargs)

        return inner

    return wrap
