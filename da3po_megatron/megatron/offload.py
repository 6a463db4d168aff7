"""Tiered trainer offload: the policy gives its device memory to the colocated engines while they generate.

``actor.offload`` (``config.policy.ActorConfig``) names what a policy rank releases between its training step and its
next forward, in tiers (each includes the ones before it):

- ``grads``: megatron-core's DDP gradient buffers, freed WITHOUT a copy through its own API
  (``DistributedDataParallel.offload_grad_buffers`` / ``restore_grad_buffers``,
  ``megatron/core/distributed/distributed_data_parallel.py:575-611``: ``grad_data.storage().resize_(0)`` and back,
  zeroed on restore, ``param_and_grad_buffer.py:964-994``). Gradients are dead between steps (the next mini-batch
  zeroes them first), so nothing is lost;
- ``grads+optimizer``: also the optimizer's state (Adam's ``exp_avg`` / ``exp_avg_sq``, every tensor of
  ``optimizer.state``) and its fp32 master weights where they are separate tensors (bf16 training; with fp32
  parameters the distributed optimizer's shards are views of the parameters and belong to the next tier);
- ``all``: also the model parameters (with the distributed optimizer, DDP's one contiguous ``param_data`` buffer).

Optimizer state and parameters go into persistent host buffers allocated ONCE, at the first offload, one per device
storage, pinned where CUDA exists (page-locked: the copy runs at the PCIe/NVLink-C2C rate; NeMo-RL #3976 measured
megatron-core's pageable ``offload_to_cpu`` at 1.8 GB/s vs 55 GB/s pinned); their device storage is released by
``untyped_storage().resize_(0)`` and re-grown by ``resize_(nbytes)`` + one copy back, so every tensor object, view,
``optimizer.state`` entry and DDP bucket view stays the same Python object and valid after the reload. Not
megatron-core's ``MegatronOptimizer.offload_to_cpu`` (``optimizer/optimizer.py:344-380``): it allocates a fresh
pageable copy every time (``.cpu()``) and re-binds ``p.data`` / ``state[k]`` to new tensors. Storages are handled
once each, however many views share them (a storage is identified by its data pointer).

A forward or a train step while parameters (or gradients / optimizer state) are offloaded raises
:class:`OffloadedError` naming ``actor.offload``. Host memory: one copy of the covered bytes (``host_bytes``), never
a second (the buffers are reused every cycle: ``host_pointers`` does not change). On CPU the "device" is host memory
too, so the cycle proves the bookkeeping and bit-exactness, not memory savings (``docs/colocation.md``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

TIERS = ("none", "grads", "grads+optimizer", "all")
PARTS = ("grads", "optimizer", "params")  # offload order; reload is the reverse


class OffloadedError(RuntimeError):
    """The policy was used while part of it is offloaded (``actor.offload``)."""


def tier_parts(tier: str) -> tuple[str, ...]:
    """The parts a tier releases: "none" -> (), "grads" -> (grads,), "grads+optimizer" -> (grads, optimizer),
    "all" -> (grads, optimizer, params)."""
    if tier not in TIERS:
        raise ValueError(f"actor.offload={tier!r} is not one of {', '.join(TIERS)}")
    return PARTS[:TIERS.index(tier)]


def _optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers under megatron-core's (chained for dense + expert parameters)."""
    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [s.optimizer for s in subs if getattr(s, "optimizer", None) is not None]


class _Storage:
    """One device storage with its persistent host buffer (allocated at the first offload, reused after)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor  # any tensor on the storage (keeps it alive; views share it)
        self.nbytes = tensor.untyped_storage().nbytes()
        self.host: torch.Tensor | None = None

    def _bytes(self) -> torch.Tensor:
        s = self.tensor.untyped_storage()
        return torch.empty(0, dtype=torch.uint8, device=self.tensor.device).set_(s, 0, (s.nbytes(),))

    def copy_out(self, pin: bool) -> None:
        if self.host is None:
            self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        self.host.copy_(self._bytes(), non_blocking=pin)

    def release(self) -> None:
        if not self.tensor.untyped_storage().resizable():
            raise RuntimeError(f"actor.offload: a storage of {self.nbytes} bytes (a {tuple(self.tensor.shape)} "
                               f"{self.tensor.dtype} tensor on it) cannot be resized, so it cannot be released -- "
                               "torch marks a storage non-resizable for good once a tensor on it was shared with "
                               "numpy (tensor.numpy()); share a copy instead")
        self.tensor.untyped_storage().resize_(0)

    def copy_in(self, pin: bool) -> None:
        self.tensor.untyped_storage().resize_(self.nbytes)
        self._bytes().copy_(self.host, non_blocking=pin)

    def size(self) -> int:
        return self.tensor.untyped_storage().nbytes()


def _unique(tensors: list[torch.Tensor], exclude: set[int] = frozenset()) -> list[_Storage]:
    seen, out = set(exclude), []
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        if t.untyped_storage().nbytes() and ptr not in seen:
            seen.add(ptr)
            out.append(_Storage(t))
    return out


class PolicyOffload:
    """The offload state of one policy rank: ``offload(parts)`` / ``reload()`` with a persistent host buffer per
    covered storage, a forward pre-hook that refuses a forward while parameters are offloaded, and a record of calls.

    ``model``: megatron-core's DDP wrapper (its ``module`` is the GPTModel stage); ``optimizer``: megatron-core's
    (chained) optimizer; ``tier``: ``actor.offload``. The storages are collected at the first offload (after the
    optimizer's first step has created its state, or before it: Adam's state appears lazily, so an offload before
    the first step covers the master weights only and the first offload after it adds the state).
    """

    def __init__(self, model: Any, optimizer: Any, tier: str) -> None:
        self.model, self.optimizer, self.tier = model, optimizer, tier
        self.parts = tier_parts(tier)
        self.pin = torch.cuda.is_available()
        self.offloaded: list[str] = []
        self.calls: list[str] = []  # "offload:grads", "reload:params", ... in order (tests, docs/colocation.md)
        self._storages: dict[str, list[_Storage]] = {}
        model.module.register_forward_pre_hook(self._forward_hook)

    # ------------------------------------------------------------------ what each part covers
    def _param_tensors(self) -> list[torch.Tensor]:
        return list(self.model.module.parameters())

    def _collect(self, part: str) -> list[_Storage]:
        params = {p.untyped_storage().data_ptr() for p in self._param_tensors()}
        if part == "params":
            return _unique(self._param_tensors())
        device = self._param_tensors()[0].device  # Adam's ``step`` is a host scalar on CUDA: left where it is
        tensors: list[torch.Tensor] = []
        for opt in _optimizers(self.optimizer):
            for g in opt.param_groups:
                tensors += [p for p in g["params"] if isinstance(p, torch.Tensor)]  # master weights (bf16 runs)
            for state in opt.state.values():
                tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.device == device]
        grads = {b.grad_data.untyped_storage().data_ptr() for b in self._grad_buffers() if b.grad_data is not None}
        return _unique(tensors, exclude=params | grads)

    def _grad_buffers(self) -> list[Any]:
        return list(self.model.buffers) + list(self.model.expert_parallel_buffers)

    def storages(self, part: str, refresh: bool = False) -> list[_Storage]:
        """The storages of ``part`` ("optimizer" / "params"; gradients are megatron-core's buffers); ``refresh``
        (at an offload, when everything is resident) adds optimizer state created since the last one."""
        if part not in self._storages:
            self._storages[part] = self._collect(part)
        elif part == "optimizer" and refresh:  # Adam's state is created at the first step: add what appeared since
            known = {s.tensor.untyped_storage().data_ptr() for s in self._storages[part]}
            self._storages[part] += [s for s in self._collect(part)
                                     if s.tensor.untyped_storage().data_ptr() not in known]
        return self._storages[part]

    # ------------------------------------------------------------------ the cycle
    def offload(self, parts: tuple[str, ...] | None = None) -> dict[str, int]:
        """Release ``parts`` (default: every part of the tier) not yet offloaded, in the order grads, optimizer,
        params; returns the device bytes released per part. Parts outside the tier are ignored."""
        wanted = [p for p in PARTS if p in self.parts and p not in self.offloaded and (parts is None or p in parts)]
        freed: dict[str, int] = {}
        cuda = self.model.module.parameters().__next__().is_cuda
        for part in wanted:
            if part == "grads":
                freed[part] = sum(b.grad_data.untyped_storage().nbytes() for b in self._grad_buffers()
                                  if b.grad_data is not None)
                self.model.offload_grad_buffers(synchronize=cuda, empty_cache=False)
            else:
                stores = self.storages(part, refresh=True)
                for s in stores:
                    s.copy_out(self.pin and cuda)
                if cuda:
                    torch.cuda.current_stream().synchronize()  # the copies are done before the storage goes
                for s in stores:
                    s.release()
                freed[part] = sum(s.nbytes for s in stores)
            self.offloaded.append(part)
            self.calls.append(f"offload:{part}")
        if wanted and cuda:
            torch.cuda.empty_cache()
        return freed

    def reload(self, parts: tuple[str, ...] | None = None) -> list[str]:
        """Bring the offloaded ``parts`` (default: every offloaded part) back (params first, gradients last), into the
        same storages; returns them. ``("params",)``: what a weight push needs (a resync after an engine restart,
        ``trainer/cluster/colocation.py`` OffloadCycle), the gradients and optimizer state staying off the device."""
        back = [p for p in reversed(PARTS) if p in self.offloaded and (parts is None or p in parts)]
        cuda = self.model.module.parameters().__next__().is_cuda
        for part in back:
            if part == "grads":
                self.model.restore_grad_buffers(synchronize=False)
            else:
                for s in self.storages(part):
                    s.copy_in(self.pin and cuda)
            self.offloaded.remove(part)
            self.calls.append(f"reload:{part}")
        if back and cuda:
            torch.cuda.current_stream().synchronize()
        return back

    @contextmanager
    def resident(self) -> Iterator[None]:
        """Everything on the device inside (a checkpoint save, an HF export), offloaded again after."""
        parts = tuple(self.offloaded)
        self.reload()
        try:
            yield
        finally:
            if parts:
                self.offload(parts)

    # ------------------------------------------------------------------ checks
    def require(self, what: str, parts: tuple[str, ...] = PARTS) -> None:
        """Raise :class:`OffloadedError` naming ``actor.offload`` when any of ``parts`` is offloaded."""
        out = [p for p in parts if p in self.offloaded]
        if out:
            raise OffloadedError(f"{what} while the policy's {', '.join(out)} are offloaded (actor.offload="
                                 f"{self.tier!r}): reload it first (PolicyWorker.reload_offloaded; the trainer "
                                 "does it when the engines go to sleep, trainer/run.py engines_idle)")

    def _forward_hook(self, module: Any, args: Any) -> None:  # noqa: ARG002 - torch hook signature
        self.require("a forward of the policy", ("params",))

    def sizes(self) -> dict[str, list[int]]:
        """The current byte size of every covered storage per part (0 while offloaded)."""
        out = {"grads": [b.grad_data.untyped_storage().nbytes() for b in self._grad_buffers()
                         if b.grad_data is not None]}
        for part in ("optimizer", "params"):
            if part in self._storages:
                out[part] = [s.size() for s in self._storages[part]]
        return out

    def host_bytes(self) -> int:
        """Bytes of host buffers held (one copy of the covered optimizer state / parameters, allocated once)."""
        return sum(s.host.numel() for v in self._storages.values() for s in v if s.host is not None)

    def host_pointers(self) -> list[int]:
        """Data pointers of the host buffers (unchanged across cycles: no second copy is ever allocated)."""
        return [s.host.data_ptr() for v in self._storages.values() for s in v if s.host is not None]


def ipc_sync_extra_bytes(arch: Any, bucket_bytes: int, bytes_per_param: int) -> tuple[int, int]:
    """(bucket, largest full tensor) bytes a colocated GPU holds beyond its own parameters during an IPC weight sync
    (``rollout/ipc.py``: every rank packs, sends or receives one bucket at a time; a packing rank also holds the
    stream's current full tensor, and its TP shards while they are all-gathered). Pure: from the HF architecture
    (``GPTArch``), the largest of the embedding / output layer (V x h), fused QKV, fused gate-up (2 f x h), router
    and one expert's fused gate-up. A tensor larger than the bucket travels alone, in a bucket of its size."""
    h, d, a, g = arch.hidden_size, arch.kv_channels, arch.num_attention_heads, arch.num_query_groups
    fused = [arch.vocab_size * h, (a + 2 * g) * d * h, 2 * arch.ffn_hidden_size * h]  # Megatron's full tensors
    pieces = [arch.vocab_size * h, a * d * h, arch.ffn_hidden_size * h]  # the largest HF tensor of each
    if getattr(arch, "is_moe", False):
        fused += [arch.num_moe_experts * h, 2 * arch.moe_ffn_hidden_size * h]
        pieces += [arch.num_moe_experts * h, arch.moe_ffn_hidden_size * h]
    return max(int(bucket_bytes), max(pieces) * bytes_per_param), max(fused) * bytes_per_param


def colocated_plan(static: dict[str, int], runtime: int, train_peak: int, device_bytes: int, engine_bytes: int,
                   tier: str, sync_bytes: tuple[int, int] | None = None) -> dict[str, Any]:
    """The time-multiplexed memory plan of one colocated GPU (pure; ``megatron/memory.py`` calls it).

    Two phases share the device: **training**, the policy's peak (``train_peak``) beside the sleeping engine (vLLM
    sleep level 2 frees its weights and KV cache), and **generation**, the engine's share (``engine_bytes`` =
    ``rollout.gpu_memory_utilization`` x the device) beside what the policy keeps resident: its ``runtime`` plus
    the parts of ``static`` ({"params", "grads", "optimizer"} bytes) its tier does not offload (activations are
    freed after the step). Returns ``train_fits``, ``resident`` bytes per tier, ``needed`` (the smallest tier whose
    generation phase fits, None if even "all" does not), ``fits`` (both phases fit at ``tier``) and ``message``.
    ``sync_bytes``: :func:`ipc_sync_extra_bytes`, printed as the weight sync's bound per GPU.
    """
    resident = {t: runtime + sum(v for k, v in static.items() if k not in tier_parts(t)) for t in TIERS}
    needed = next((t for t in TIERS if resident[t] + engine_bytes <= device_bytes), None)
    train_fits = train_peak <= device_bytes
    gen_fits = resident[tier] + engine_bytes <= device_bytes
    g = 2**30
    msg = (f"colocated plan: training {train_peak / g:.2f} GiB beside the sleeping engine (device "
           f"{device_bytes / g:.2f} GiB); generation: engine {engine_bytes / g:.2f} GiB + policy resident "
           + ", ".join(f"{t} {resident[t] / g:.2f}" for t in TIERS) + " GiB -> needs actor.offload="
           + (repr(needed) if needed else "more than 'all' (lower rollout.gpu_memory_utilization or add ranks)")
           + f" (configured {tier!r})")
    if sync_bytes is not None:
        bucket, full = sync_bytes
        msg += (f"; ipc weight sync: each GPU holds one bucket ({bucket / 2**20:.1f} MiB) + one full tensor "
                f"({full / 2**20:.1f} MiB, and its TP shards while gathered) beyond its own parameters")
    return {"train_fits": train_fits, "resident": resident, "needed": needed, "fits": train_fits and gen_fits,
            "message": msg}
