"""The one place where megatron-core is made to run on a CPU-only torch build (gloo backend).

megatron-core 0.16.1 assumes CUDA in a handful of ways. Rather than scattering ``if cuda`` branches through the
project, this module patches those assumptions process-wide, once, and only when CUDA is absent
(:func:`apply_if_needed`). Nothing else in the project contains CPU-specific code paths for Megatron.

The patches (measured on megatron-core 0.16.1, see ``shared/notes/cpu-stack.md``):

1. ``torch.cuda.current_device()`` returns ``"cpu"`` (~175 allocation sites use it as a device).
2. A process-wide ``TorchFunctionMode`` maps ``device="cuda"`` / ``"cuda:N"`` to CPU in any torch call and makes
   ``Tensor.cuda()`` a no-op (hard-coded in ``pipeline_parallel/schedules.py`` and the optimizers). A
   ``TorchFunctionMode`` is thread-local: :func:`apply_if_needed` must run on the thread that later runs the model.
3. ``torch.cuda.synchronize()`` is a no-op (dist_checkpointing and pipeline p2p call it unconditionally).
4. Zero-argument ``Tensor.type()`` reports ``torch.cuda.FloatTensor`` (etc.) for CPU float tensors: the optimizers and
   ``clip_grads`` check this string. ``Tensor.type(dtype)`` casts as before.
5. A CPU RNG-state tracker replaces Megatron's CUDA one (its ``add`` calls ``torch.cuda.get_rng_state``), so
   ``model_parallel_cuda_manual_seed`` and dropout inside tensor-parallel regions work.
6. ``torch.cuda.Stream`` / ``current_stream()`` / ``stream(...)`` are one synchronous stand-in stream (the MoE
   alltoall token dispatcher moves its split sizes to the host on a side stream).

7. Sequence parallelism on Megatron's local spec (:func:`allow_sequence_parallel_torch_norm`, applied by the model
   builder whenever the local spec is built with ``sequence_parallel=True``): the local spec's norm is
   ``WrappedTorchNorm``, which asserts ``not config.sequence_parallel`` (megatron-core 0.16.1
   ``transformer/torch_norm.py`` 32; ``models/gpt/gpt_layer_specs.py`` 64-71 picks it when apex is absent). A norm
   is per token, so it computes the same on a slice of the sequence; what SP needs besides is that its weights'
   gradients, now from 1/TP of the tokens on each TP rank, are summed over TP: Megatron's own norms mark their
   parameters ``sequence_parallel`` (``fusions/fused_layer_norm.py`` 116-120, TE's norms likewise) and
   ``finalize_model_grads`` all-reduces the gradients of parameters so marked (``distributed/finalize_model_grads.py``
   354-366). The shim builds the same torch norm without the assert and marks its parameters the same way. The SP
   collectives (``all_gather_into_tensor``, ``reduce_scatter_tensor``: ``tensor_parallel/mappings.py`` 12-13) run on
   gloo with torch 2.13 as they are.

Not supported on CPU (checked by the runtime, not patched): the fused kernels (bias-activation, bias-dropout,
masked-softmax, RoPE, gradient-accumulation fusions).
"""

from __future__ import annotations

import contextlib
import threading

import torch

_applied = False
_mode = None
_mode_thread: int | None = None

_CPU_TO_CUDA_TYPE = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def needed() -> bool:
    """True when CUDA is absent, i.e. when megatron-core must be patched to run."""
    return not torch.cuda.is_available()


def _to_cpu(device):
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _enter_device_mode() -> None:
    global _mode, _mode_thread
    from torch.overrides import TorchFunctionMode

    class CudaToCpuMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is torch.Tensor.cuda:
                return args[0]
            if "device" in kwargs:
                kwargs["device"] = _to_cpu(kwargs["device"])
            if func is torch.Tensor.to and len(args) > 1:
                args = (args[0], _to_cpu(args[1]), *args[2:])
            return func(*args, **kwargs)

    _mode = CudaToCpuMode()
    _mode.__enter__()
    _mode_thread = threading.get_ident()


def _patch_tensor_type() -> None:
    original = torch.Tensor.type

    def type_(self, *args, **kwargs):
        if not args and not kwargs:
            name = original(self)
            return _CPU_TO_CUDA_TYPE.get(name, name)
        return original(self, *args, **kwargs)

    torch.Tensor.type = type_


def _install_cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    class CPURNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Megatron's RNG tracker with CPU generator states instead of CUDA ones."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise RuntimeError(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise RuntimeError(f"rng state {name} already exists")
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise RuntimeError(f"rng state {name} is not added")
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    mrandom._CUDA_RNG_STATE_TRACKER = CPURNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Activation recomputation (model.recompute_granularity=full, the 30B recipes) saves and restores the "device"
    # RNG state around each checkpointed chunk (tensor_parallel/random.py 443-460, 514: _get_all_rng_states ->
    # _get_cuda_rng_state -> torch.cuda.random.get_rng_state, "Torch not compiled with CUDA enabled" on CPU). On CPU
    # the device generator is the CPU one, as in the tracker above (found by tests/test_shipped_layouts.py).
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)


class _CPUStream:
    """The one "stream" of a CPU process: work is synchronous, so waiting, events and syncs are no-ops."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def record_event(self, event=None):
        return self

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CPU_STREAM = _CPUStream()


def _patch_streams() -> None:
    """``torch.cuda.Stream`` / ``current_stream`` / ``stream(...)`` as synchronous no-ops: megatron-core 0.16.1's
    alltoall MoE token dispatcher moves its split sizes to the host on a side stream (``token_dispatcher.py`` 444-445,
    864-898: ``torch.cuda.Stream()``, ``torch.cuda.stream(...)``, ``record_event().synchronize()``). One stream object
    is both "current" and the side stream, so no ``record_stream`` is attempted on CPU tensors."""
    import contextlib

    torch.cuda.Stream = _CPUStream  # type: ignore[misc,assignment]
    torch.cuda.current_stream = lambda *a, **k: _CPU_STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]


def apply_if_needed() -> bool:
    """Patch torch/megatron for CPU when CUDA is absent. Idempotent; returns True when the CPU patches are active.

    Call before building any Megatron model, on the thread that will run it (Ray actors: inside the actor).
    """
    global _applied
    if not needed():
        return False
    if not _applied:
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.synchronize = lambda *a, **k: None
        _patch_streams()
        _patch_tensor_type()
        _install_cpu_rng_tracker()
        _applied = True
    if _mode_thread != threading.get_ident():
        _enter_device_mode()
    return True


def cpu_safe_config_overrides() -> dict:
    """TransformerConfig fields that must be off on CPU (fused CUDA kernels; persistent layer norm)."""
    return dict(
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=True,
    )


_norm_patched = False


def allow_sequence_parallel_torch_norm() -> None:
    """Let megatron-core's ``WrappedTorchNorm`` (the local spec's norm) run with ``sequence_parallel=True`` and mark
    its parameters ``sequence_parallel`` so that their gradients are summed over TP (point 7 of the module doc).
    Idempotent; the same module on CPU and on a GPU without Transformer-Engine / apex (the local spec's torch norm is
    the same there); without SP the norm is built exactly as before."""
    global _norm_patched
    if _norm_patched:
        return
    import copy

    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                normalization="LayerNorm"):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
        plain = copy.copy(config)  # the same config, seen without SP by the assert only
        plain.sequence_parallel = False
        norm = original(cls, plain, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(__new__)  # type: ignore[method-assign]
    _norm_patched = True
