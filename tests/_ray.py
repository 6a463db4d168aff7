"""One way for the tests to start a real single-node Ray: loopback address, no dashboard, actor logs kept off the
test output, and a temp dir directly under /tmp, because Ray puts its unix sockets there and their paths must stay
under 107 bytes (pytest's tmp_path is too deep). A helper rather than only a fixture: the rollout and weight-sync
tests keep one Ray for a whole module (the ``ray_session`` fixture in conftest.py), the DP=2 policy test only for
itself."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import pytest

from da3po_megatron.trainer.cluster.bringup import start_local_ray


@contextmanager
def local_ray(num_cpus: int, num_gpus: int = 0) -> Iterator[ModuleType]:
    """Start Ray with ``num_cpus`` logical CPUs (what the actors of the test reserve, not the cores of the machine)
    and ``num_gpus`` logical GPUs (Ray hands out their ids; no device behind them), yield the ``ray`` module and shut
    Ray down on the way out, also when the test fails. Skips without Ray."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the driver and the actors it starts: one thread each on 2 cores
    temp = tempfile.mkdtemp(prefix="ray_test_", dir="/tmp")
    gpus = {"num_gpus": num_gpus} if num_gpus else {}
    start_local_ray(temp, num_cpus, log_to_driver=False, **gpus)  # the trainer's start, with its retry
    try:
        yield ray
    finally:
        ray.shutdown()
