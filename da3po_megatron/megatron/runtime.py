"""Distributed and Megatron parallel-state initialisation: TP, PP, DP (and CP where the backend allows).

One function, :func:`init_parallel`, brings a process into the training world, whether it was started by ``torchrun``
(rank and rendezvous from the environment) or is a Ray actor (rank 0's address handed over by the controller and
passed in explicitly). The backend follows capability: NCCL with CUDA, gloo without; on CPU the patches of
:mod:`da3po_megatron.megatron.cpu_compat` are applied first.

Parallel layout (Megatron's): world = TP x CP x PP x DP, ranks ordered tp-cp-ep-dp-pp (Megatron's default order).
"""

from __future__ import annotations

import datetime
import os
import random
import socket
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from da3po_megatron.megatron import cpu_compat


@dataclass(frozen=True)
class ParallelLayout:
    """The sizes of each parallel dimension (Megatron names)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1  # EP: MoE experts split over ranks taken from DP (x CP); dense models 1
    expert_tensor_parallel_size: int | None = None  # ETP: each expert's MLP split; None = TP

    def data_parallel_size(self, world_size: int) -> int:
        """DP = world / (TP x PP x CP), after :meth:`validate`."""
        return world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                              * self.context_parallel_size)

    def validate(self, world_size: int) -> None:
        """Raise ValueError naming the numbers when the world cannot be split this way."""
        tp, pp, cp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size, self.context_parallel_size
        for name, v in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                        ("context_parallel_size", cp)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if world_size % (tp * pp * cp):
            raise ValueError(
                f"world size {world_size} is not divisible by tensor_model_parallel_size ({tp}) x "
                f"pipeline_model_parallel_size ({pp}) x context_parallel_size ({cp}) = {tp * pp * cp}")
        ep = self.expert_model_parallel_size
        etp = tp if self.expert_tensor_parallel_size is None else self.expert_tensor_parallel_size
        if ep < 1 or etp < 1:
            raise ValueError(f"expert_model_parallel_size ({ep}) and expert_tensor_parallel_size ({etp}) must be >= 1")
        if world_size % (etp * ep * pp):
            raise ValueError(f"world size {world_size} is not divisible by expert_tensor_parallel_size ({etp}) x "
                             f"expert_model_parallel_size ({ep}) x pipeline_model_parallel_size ({pp}); the expert "
                             "ranks are taken from the data-parallel ranks of each pipeline stage")
        if cp > 1 and not torch.cuda.is_available():
            raise ValueError(f"context_parallel_size={cp} needs CUDA (ring attention is not available on CPU/gloo)")


def free_port() -> int:
    """A TCP port that was free on this host a moment ago. Racy by nature -- another process may bind it before the
    caller does -- so the project's own groups never rendezvous on it: :func:`bind_rendezvous` binds first and hands
    the bound port over. Kept for callers that must name a port before anything binds (e.g. a collective engine
    group's address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def bind_rendezvous(world_size: int | None = None, timeout_s: float = 1800, port: int = 0) -> dist.TCPStore:
    """The rendezvous store of a new process group, bound here on a port the OS picks (port 0) before anyone is told
    it: the port is never free between a probe and a bind, which is how a fresh-clone CI run once died
    (``EADDRINUSE`` on the policy group's TCPStore, issue 55). The process holding it is the store's server for the
    group's life: rank 0 of a Ray policy group (``PolicyWorker.rendezvous_address``), or the parent of spawned
    conversion processes. Others join with :func:`join_rendezvous` at ``store.port``. A nonzero ``port`` (one handed
    out before the bind) brings the race back: only for callers that must."""
    return dist.TCPStore("0.0.0.0", port, world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def join_rendezvous(addr: str, port: int, world_size: int | None = None,
                    timeout_s: float = 1800) -> dist.TCPStore:
    """A client of the rendezvous store another process bound with :func:`bind_rendezvous`."""
    return dist.TCPStore(addr, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def node_ip() -> str:
    """This host's address as other nodes see it (Ray's view when available)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_parallel(
    layout: ParallelLayout,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    store: dist.Store | None = None,
    seed: int = 1234,
    timeout_s: int = 1800,
) -> None:
    """Join the process group and initialise Megatron's parallel state and RNG trackers.

    The rendezvous, in order of preference:
    - ``store``: a store bound before its port was handed out (:func:`bind_rendezvous` on the rank or parent that
      serves it, :func:`join_rendezvous` on the others) -- the project's policy groups and conversions;
    - a single-rank world binds its own store on a port the OS picks (nobody else needs the address);
    - otherwise ``master_addr`` / ``master_port`` or ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``
      (torchrun's environment: launch with ``torchrun --standalone``, whose agent binds port 0 itself).
    Idempotent within a process for the same layout.
    """
    from megatron.core import parallel_state as ps

    cpu_compat.apply_if_needed()
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    layout.validate(world_size)
    if not dist.is_initialized():
        if store is None and world_size == 1:
            store = bind_rendezvous(1, timeout_s)
        if store is None:
            os.environ["MASTER_ADDR"] = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
            if master_port or not os.environ.get("MASTER_PORT"):
                os.environ["MASTER_PORT"] = str(master_port or free_port())
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is not None:
            store.set_timeout(timeout)
            # the same prefix on every rank of a store-based world (torch adds its own only to rendezvous it made)
            store = dist.PrefixStore("da3po_world", store)
        dist.init_process_group(backend(), store=store, rank=rank, world_size=world_size, timeout=timeout)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=layout.tensor_model_parallel_size,
            pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
            context_parallel_size=layout.context_parallel_size,
            expert_model_parallel_size=layout.expert_model_parallel_size,
            expert_tensor_parallel_size=layout.expert_tensor_parallel_size,
        )
    set_seed(seed)


def set_seed(seed: int) -> None:
    """Seed python, numpy, torch and Megatron's model-parallel RNG tracker (different per TP rank, as Megatron does)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    # Pipeline stages get different seeds (Megatron-LM's convention) so dropout masks differ per stage.
    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    """Tear down Megatron's parallel state and the process group."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def ignore_job_sigterm() -> None:
    """In a Ray actor started under ``slurm/ray_node.sh`` (``DA3PO_IGNORE_SIGTERM=1``): ignore SIGTERM.

    Slurm ends a job by sending SIGTERM to every process of it, KillWait seconds before SIGKILL; the driver uses that
    time to checkpoint, for which the policy ranks and engines must still be alive. Ray's worker installs a SIGTERM
    handler that exits (and its process spawner unblocks the signal mask ray_node.sh set), so each actor sets the
    disposition itself, in its constructor (the main thread: the actors run with ``max_concurrency=1``)."""
    import signal

    if os.environ.get("DA3PO_IGNORE_SIGTERM") == "1":
        try:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        except ValueError:  # not the main thread
            pass


def numpy_rng_state() -> tuple:
    """numpy's global RNG state with its key array as a tensor (loads with ``torch.load(weights_only=True)``)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return name, torch.from_numpy(np.asarray(keys).astype(np.int64)), int(pos), int(has_gauss), float(cached)


def set_numpy_rng_state(state: tuple) -> None:
    """Restore :func:`numpy_rng_state` (or ``np.random.get_state()``'s own tuple)."""
    name, keys, *rest = state
    np.random.set_state((name, np.asarray(keys.numpy() if torch.is_tensor(keys) else keys, dtype=np.uint32), *rest))


def rng_state() -> dict:
    """All RNG states of this rank (python, numpy, torch, Megatron tracker) for exact resume."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {  # tensors and plain values only: loads with torch.load(weights_only=True)
        "python": random.getstate(),
        "numpy": numpy_rng_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(tuple(state["python"]))
    set_numpy_rng_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
