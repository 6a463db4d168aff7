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
    return torch.stack([g.detach() for g in got], 1).cpu()  # one device-to-host copy, not one per layer


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


# ------------------------------------------------------------------------- R3 in the trainer's forwards
#
# What the schedule uses (megatron/schedule.py): a micro-batch carries the engine's routes of its tokens
# (``MicroBatch.routes`` [tokens, all MoE layers, k] in the router's s-major order, ``route_mask`` True where the
# engine ran that position). :func:`use_routes` puts this stage's columns on its routers: with ``replay`` the masked
# tokens take the engine's experts and the others (padding, each sequence's last token, which no engine forward ran)
# the router's own top-k (:func:`_partial_replay_topk`); without, the routers only record their own choice. Either
# way :func:`route_counts` then counts, over the masked (token, layer) pairs, those whose experts used by the forward
# and those the router chose itself have the engine's top-k set.


def stage_moe_columns(model, moe_pattern: list[int]) -> list[int]:
    """For each MoE router of this stage (in :func:`routers` order), its MoE layer's index among ALL the model's
    MoE layers (the column of the engines' route arrays). ``moe_pattern``: ``GPTArch.moe_pattern()``."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    bare = model
    while hasattr(bare, "module") and not hasattr(bare, "decoder"):
        bare = bare.module
    column = {layer: i for i, layer in enumerate(k for k, m in enumerate(moe_pattern) if m)}
    return [column[layer.layer_number - 1] for layer in bare.decoder.layers if isinstance(layer.mlp, MoELayer)]


def _partial_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
    """``RouterReplay.get_replay_topk`` (megatron-core 0.16.1 ``router_replay.py`` 122-161) with a per-token mask:
    REPLAY_FORWARD takes ``target_topk_idx`` only where ``da3po_mask`` is True and the router's own top-k elsewhere,
    and records the router's own top-k in both cases. The probabilities are gathered from ``scores`` for the experts
    used, as megatron's REPLAY_FORWARD does (so the router keeps its gradient)."""
    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    mask = getattr(self, "da3po_mask", None)
    if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD or mask is None:
        return RouterReplay.get_replay_topk(self, scores, topk, num_groups, group_topk, default_compute_topk)
    _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
    self.record_indices(own)
    idx = torch.where(mask.to(scores.device)[:, None], self.target_topk_idx.to(scores.device), own)
    return scores.gather(1, idx), idx


def use_routes(model, routes, mask, replay: bool) -> None:
    """Before a forward: this stage's ``routes`` (int [tokens, this stage's MoE layers, k]) and ``mask`` (bool
    [tokens], where the engine's route exists); ``replay`` makes the routers use them, else they only record."""
    import types

    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = _replays(model)
    routes = torch.as_tensor(routes)
    if routes.dim() != 3 or routes.shape[1] != len(replays) or routes.shape[0] != mask.shape[0]:
        raise ValueError(f"routes must be [tokens, {len(replays)} MoE layers of this stage, k] with one mask entry "
                         f"per token, got {tuple(routes.shape)} and mask {tuple(mask.shape)}")
    mask = mask.to(torch.bool)
    for i, r in enumerate(replays):
        if not getattr(r, "da3po_partial", False):
            r.get_replay_topk = types.MethodType(_partial_replay_topk, r)
            r.da3po_partial = True
        r.clear_indices()
        target = routes[:, i, :].to(torch.long)
        r.da3po_engine, r.da3po_mask = target, mask
        if replay:
            r.set_target_indices(target)
            r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        else:
            r.set_router_replay_action(RouterReplayAction.RECORD)


def route_counts(model, replay: bool, columns: list[int] | None = None, moe_layers: int = 0):
    """After a forward prepared by :func:`use_routes`: float64 [3] = (masked pairs whose used experts match the
    engine's set, pairs whose router-chosen experts match, masked pairs); then back to plain routing. With
    ``columns`` (this stage's MoE columns, :func:`stage_moe_columns`) and ``moe_layers`` (all the model's): float64
    [1 + moe_layers, 3], row 0 the sum, row 1 + c MoE layer c's own counts (the agreement per layer: layer c's
    router input depends on the experts layers < c used, so only per layer can two runs be compared).

    Counted on the device the routes are on, and returned there: no device-to-host copy (issue 46 M6: the copies of
    the recorded, engine and mask tensors per MoE layer per micro-batch are gone; the caller sums the counts on the
    device and reads them once per step, ``PolicyWorker.routing_stats``)."""
    import torch

    per_layer = columns is not None
    shape = (1 + moe_layers, 3) if per_layer else (3,)
    out = None
    for i, r in enumerate(_replays(model)):
        engine, mask, own = getattr(r, "da3po_engine", None), getattr(r, "da3po_mask", None), r.recorded_topk_idx
        if engine is None or own is None:
            continue
        own = own.detach()  # engine and mask: on the device already (use_routes got the micro-batch's tensors)
        if out is None:
            out = torch.zeros(shape, dtype=torch.float64, device=own.device)
        used = torch.where(mask[:, None], engine, own) if replay else own
        key = engine.sort(-1).values
        c = torch.stack([((used.sort(-1).values == key).all(-1) & mask).sum(),
                         ((own.sort(-1).values == key).all(-1) & mask).sum(), mask.sum()]).to(torch.float64)
        if per_layer:
            out[0] += c
            out[1 + columns[i]] += c
        else:
            out += c
        r.da3po_engine = r.da3po_mask = None
    clear_routes(model)
    return torch.zeros(shape, dtype=torch.float64) if out is None else out
