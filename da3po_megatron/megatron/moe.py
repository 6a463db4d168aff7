"""Mixture-of-Experts support of the policy that is not a megatron-core config field: the two fixes megatron-core
0.16.1's MoE needs off the CUDA + Transformer-Engine path, and routing replay (R3) around its ``RouterReplay``.

:func:`patch_megatron_moe` (idempotent, called by the model builder for MoE models):

* ``transformer/moe/moe_utils.py`` 24-39 imports ``te_general_gemm`` inside ``try: ... except ImportError: HAVE_TE =
  False`` and then tests ``if te_general_gemm is not None`` (1192, 1225) -- a ``NameError`` for every router forward
  without TE (local spec, CPU, or a GPU without TE). Defining the name as None selects the plain-torch path that
  follows those tests.
* The alltoall dispatcher hands its split sizes to ``all_to_all_single`` after ``maybe_move_tensor_to_cpu(...,
  as_numpy=True)`` (``token_dispatcher.py`` 876-882), which converts only CUDA tensors (``moe_utils.py`` 1093); on a
  CPU process the splits stay tensors and ``ProcessGroup.all_to_all_single`` refuses them (pybind wants a sequence of
  ints). The wrapper returns the numpy array for CPU tensors too; CUDA tensors take the original path unchanged.
"""

from __future__ import annotations

_patched = False


def patch_megatron_moe() -> None:
    """The two fixes of the module doc (idempotent)."""
    global _patched
    if _patched:
        return
    import torch
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not getattr(moe_utils, "HAVE_TE", True) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    _patched = True
