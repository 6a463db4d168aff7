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


# --------------------------------------------------------------------------------------------- routing replay
#
# R3 (rollout routing replay): the engine returns, for every token, the top-k experts each MoE layer routed it to;
# the policy's forwards (old log-probs and training) reuse exactly those experts. The router still computes its
# logits, and the replayed experts' probabilities are gathered from them (megatron-core 0.16.1
# ``transformer/moe/router_replay.py`` 132-161: ``scores.gather(1, top_indices)``, then the softmax over the top-k
# as without replay), so the router keeps its gradient; only the choice of experts is replayed. Needs
# ``moe_enable_routing_replay`` (``moe.routing_replay != none``): one ``RouterReplay`` per router.
#
# Token order: megatron's router flattens its [s, b, E] logits to [s * b, E] (``router.py`` 550), so a micro-batch's
# routes are laid out s-major; a packed (THD) micro-batch has b = 1 and the routes follow the packed tokens.
# Left out: ``REPLAY_BACKWARD`` (activation recomputation of MoE layers re-running the router), which the
# schedule would need to push once per micro-batch; replay with ``recompute_granularity=full`` is refused.


def routers(model) -> list:
    """This stage's MoE routers (megatron ``TopKRouter``), in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    bare = model
    while hasattr(bare, "module") and not hasattr(bare, "decoder"):
        bare = bare.module
    return [m for m in bare.modules() if isinstance(m, TopKRouter)]


def _replays(model) -> list:
    out = [r.router_replay for r in routers(model)]
    if any(r is None for r in out):
        raise RuntimeError("routing replay needs a model built with moe.routing_replay != none "
                           "(TransformerConfig.moe_enable_routing_replay)")
    return out


def record_routes(model) -> None:
    """Make the next forward record each router's top-k experts (read them with :func:`recorded_routes`)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for r in _replays(model):
        r.clear_indices()
        r.set_router_replay_action(RouterReplayAction.RECORD)


def recorded_routes(model):
    """The experts the last recorded forward chose: int tensor [tokens, moe layers of this stage, k]."""
    import torch

    got = [r.get_recorded_indices() for r in _replays(model)]
    if any(g is None for g in got):
        raise RuntimeError("no routes recorded: call record_routes(model) before the forward")
    return torch.stack([g.detach().to("cpu") for g in got], 1)


def replay_routes(model, routes) -> None:
    """Make the next forward use ``routes`` (int [tokens, moe layers of this stage, k], the forward's token order)
    instead of the routers' own top-k."""
    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = _replays(model)
    routes = torch.as_tensor(routes)
    if routes.dim() != 3 or routes.shape[1] != len(replays):
        raise ValueError(f"routes must be [tokens, {len(replays)} MoE layers of this stage, k], got "
                         f"{tuple(routes.shape)}")
    for i, r in enumerate(replays):
        r.clear_indices()
        r.set_target_indices(routes[:, i, :].to(torch.long).contiguous())
        r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def clear_routes(model) -> None:
    """Back to the routers' own top-k; recorded and target routes dropped."""
    for r in _replays(model):
        r.clear_indices()
        r.clear_router_replay_action()


def router_agreement(a, b) -> float:
    """The fraction of (token, layer) pairs whose top-k expert *sets* agree between two route arrays of the same
    shape [tokens, layers, k] (order within the top-k does not matter): the R3 agreement metric, 1.0 when the
    trainer routes every token like the engine did."""
    import torch

    a, b = torch.as_tensor(a), torch.as_tensor(b)
    if a.shape != b.shape:
        raise ValueError(f"route arrays differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.numel() == 0:
        return 1.0
    same = (a.sort(-1).values == b.sort(-1).values).all(-1)
    return float(same.float().mean())
