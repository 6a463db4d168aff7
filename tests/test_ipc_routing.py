"""The "ipc" transport's routing (rollout/ipc_routing.py) as a pure function over GPU UUID strings and layouts: which
policy rank's CUDA-IPC handles reach which engine worker, for policy TP / PP / DP x engines x engine TP, and the
layouts that must be refused with an error naming engine, worker and GPU. No GPU needed: UUIDs are strings. Since
issue 49 every policy rank holds every bucket (rollout/ipc.py ipc_buckets; proven over gloo in test_ipc_layouts.py),
so any policy TP x PP x DP is served from the rank on each engine worker's GPU."""

from __future__ import annotations

import itertools

import pytest

from da3po_megatron.rollout.ipc_routing import merge_handles, pick_handle, plan_ipc_routes

GPU = [f"GPU-{i:08x}-0000-4000-8000-00000000000{i}" for i in range(8)]


def megatron_ranks(tp: int, pp: int, dp: int, gpus: list[str] | None = None) -> list[dict]:
    """One policy rank per GPU in Megatron's default order (TP fastest, then DP, then PP)."""
    gpus = gpus or GPU
    out = []
    for p, d, t in itertools.product(range(pp), range(dp), range(tp)):
        rank = t + tp * (d + dp * p)
        out.append({"rank": rank, "uuid": gpus[rank], "tp": t, "pp": p, "dp": d})
    return out


def engines_over(n_gpus: int, engine_tp: int) -> list[list[str]]:
    return [GPU[e * engine_tp:(e + 1) * engine_tp] for e in range(n_gpus // engine_tp)]


def test_one_gpu_one_engine_the_sender_ships_its_own_handle():
    routes = plan_ipc_routes(megatron_ranks(1, 1, 1), [[GPU[0]]])
    assert routes.serves == {0: [(0, 0)]} and routes.shipper == 0 and routes.by_gpu == {GPU[0]: 0}
    assert routes.role(0) == "ship"


@pytest.mark.parametrize("engine_tp", [1, 2, 4, 8])
def test_policy_dp8_every_rank_exports_for_the_engine_worker_on_its_gpu(engine_tp):
    engines = engines_over(8, engine_tp)
    routes = plan_ipc_routes(megatron_ranks(1, 1, 8), engines)
    assert routes.shipper == 0
    # rank r runs on GPU r; the worker on GPU r is worker r % engine_tp of engine r // engine_tp
    assert routes.serves == {r: [(r // engine_tp, r % engine_tp)] for r in range(8)}
    assert [routes.role(r) for r in range(8)] == ["ship"] + ["export"] * 7


def test_holders_on_gpus_without_engines_take_part_in_the_gather_only():
    routes = plan_ipc_routes(megatron_ranks(1, 1, 4), [[GPU[0]], [GPU[1]]])
    assert routes.serves == {0: [(0, 0)], 1: [(1, 0)]}
    assert [routes.role(r) for r in range(4)] == ["ship", "export", "hold", "hold"]


def test_policy_tp2_serves_an_engine_on_tp_rank_1s_gpu_from_that_rank():
    """On 2b6e185 an engine on TP rank 1's GPU was refused (only TP rank 0 gathered the full tensors); now every rank
    holds every bucket (TP all-gather) and exports for its own GPU."""
    ranks = megatron_ranks(2, 1, 2)  # ranks 0,1 = DP replica 0 (TP 0, 1), ranks 2,3 = replica 1; GPU i = rank i
    routes = plan_ipc_routes(ranks, [[GPU[0]], [GPU[1]], [GPU[3]]])
    assert routes.serves == {0: [(0, 0)], 1: [(1, 0)], 3: [(2, 0)]}
    assert [routes.role(r) for r in range(4)] == ["ship", "export", "hold", "export"]


def test_several_ranks_on_one_gpu_the_lowest_exports():
    ranks = [{"rank": 0, "uuid": GPU[0], "tp": 0, "pp": 0, "dp": 0},
             {"rank": 1, "uuid": GPU[0], "tp": 0, "pp": 1, "dp": 0}]  # PP=2, both stages on one GPU
    routes = plan_ipc_routes(ranks, [[GPU[0]]])
    assert routes.by_gpu == {GPU[0]: 0} and routes.shipper == 0 and routes.serves == {0: [(0, 0)]}


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 4), (2, 1, 2), (1, 2, 2), (2, 2, 1), (4, 1, 1), (1, 4, 1)])
@pytest.mark.parametrize("engine_tp", [1, 2, 4])
def test_four_colocated_gpus_every_policy_layout_serves_every_engine_worker_from_its_own_gpu(tp, pp, dp, engine_tp):
    """Every policy TP x PP x DP on 4 GPUs x engines of TP 1, 2, 4 (on 2b6e185 every layout with TP or PP > 1 was
    refused here): each engine worker is served by the rank on its GPU."""
    engines = engines_over(4, engine_tp)
    routes = plan_ipc_routes(megatron_ranks(tp, pp, dp), engines)
    served = sorted(ew for pairs in routes.serves.values() for ew in pairs)
    assert served == sorted((e, w) for e in range(len(engines)) for w in range(engine_tp))
    assert routes.by_gpu == {GPU[r]: r for r in range(4)}


def test_engines_on_gpus_without_a_policy_rank_are_refused_as_not_colocated():
    with pytest.raises(ValueError, match=rf"engine 1 worker 0 runs on GPU {GPU[5]}, where no policy rank runs"):
        plan_ipc_routes(megatron_ranks(1, 1, 2), [[GPU[0]], [GPU[5]]])


def test_two_workers_of_one_engine_on_one_gpu_and_an_engine_without_workers_are_refused():
    with pytest.raises(ValueError, match="engine 0 has two workers on one GPU"):
        plan_ipc_routes(megatron_ranks(1, 1, 2), [[GPU[0], GPU[0]]])
    with pytest.raises(ValueError, match="every engine needs at least one worker GPU"):
        plan_ipc_routes(megatron_ranks(1, 1, 1), [])


def test_handles_merge_by_gpu_and_a_worker_picks_its_own_or_names_the_gpus_that_got_one():
    merged = merge_handles([{GPU[0]: ("h0",)}, {}, {GPU[1]: ("h1",)}])
    assert merged == {GPU[0]: ("h0",), GPU[1]: ("h1",)}
    assert pick_handle(merged, GPU[1]) == ("h1",)
    with pytest.raises(ValueError, match=rf"no IPC handle for engine worker 3 on GPU {GPU[2]}; handles came for"):
        pick_handle(merged, GPU[2], where="engine worker 3")
    with pytest.raises(ValueError, match="two ranks exported a handle for GPU"):
        merge_handles([{GPU[0]: 1}, {GPU[0]: 2}])


def test_handles_cross_vllms_msgpack_hop_to_an_out_of_process_core_only_as_bytes():
    """P3 of issue 57 in milliseconds (the TP 2 engine itself: tests/test_weight_sync_collective.py): the utility call a
    ``collective_rpc("da3po_ipc_load", ...)`` becomes (``v1/engine/core_client.py:1010-1014, 1091-1098``), encoded
    by vLLM's own ``MsgpackEncoder``: refused with a CUDA tensor's ``reduce_tensor`` args shaped as
    ``reductions.py:357-375`` builds them (class, ``torch.Size``, ``torch.dtype``), carried as ``handles_to_wire``'s
    bytes, which ``handle_from_wire`` turns back into the same args."""
    import torch
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from da3po_megatron.rollout.ipc_routing import handle_from_wire, handles_to_wire

    args = (torch.Tensor, torch.Size([8]), (1,), 0, torch.UntypedStorage, torch.uint8, 0, b"h", 8, 0, False, b"r", 0,
            b"e", True)
    meta = [["model.norm.weight", "float32", [2], 0, 8]]

    def call(handles):
        return (0, 1, "collective_rpc", ("da3po_ipc_load", None, (handles, meta), None))

    with pytest.raises(TypeError, match="is not serializable"):
        MsgpackEncoder().encode(call({GPU[0]: args}))
    frames = MsgpackEncoder().encode(call(handles_to_wire({GPU[0]: args})))
    handles = MsgpackDecoder().decode(frames)[3][2][0]
    assert handle_from_wire(pick_handle(handles, GPU[0])) == args
    assert handle_from_wire(list(args)) == args  # a caller in the worker's process passes the args as they are


def test_ipc_push_ships_each_bucket_to_the_worker_of_its_gpu_with_stand_ins_for_cuda_ipc(monkeypatch):
    """The GPU-only push and load code of rollout/ipc.py run end to end in this process, so a slip in them shows here
    and not first on a GPU: CUDA-IPC export / rebuild, the GPU UUIDs and device syncs are stand-ins (the "handle" is
    the buffer itself), the routing, packing, shipping, handle pick (and the device index rewrite) and load are the
    real code."""
    import torch
    import torch.multiprocessing.reductions as reductions

    from da3po_megatron.rollout import ipc

    monkeypatch.setattr(ipc, "require_ipc", lambda what: None)
    monkeypatch.setattr(ipc, "gpu_uuid", lambda index=None: GPU[0])
    monkeypatch.setattr(ipc, "_cuda_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: None)
    # reduce_tensor's 15 rebuild args (reductions.py:221-375); the stand-in puts the buffer where the handle goes
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: (None, (None,) * 7 + (t,) + (None,) * 7))
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *args: args[7] if args[6] == 0 else None)  # own index

    g = torch.Generator().manual_seed(0)
    named = [(f"model.layers.{i}.w", torch.randn(40, generator=g)) for i in range(12)]
    loaded: dict[str, torch.Tensor] = {}

    class Worker(ipc.IpcReceiverMixin):  # the worker extension's IPC half; load_weights is the stand-in
        def _da3po_cuda_index(self):
            return 0

        def da3po_load_bucket(self, tensors):
            loaded.update({k: v.clone() for k, v in tensors.items()})
            return {"tensors": len(tensors)}

    worker = Worker()
    calls = []

    class Client:  # the engines' side of RolloutClient: one call per bucket, run in place
        num_engines = 1

        def _call(self, i, method, handles, meta):
            calls.append((i, method, sorted(handles)))
            return worker.da3po_ipc_load(handles, meta)

        def _gather(self, pending, what):
            return [v for _, v in pending]

    class Rank:  # a policy rank: TP 0, PP 0, DP 0, its HF stream
        tp_rank = pp_rank = dp_rank = 0

        def hf_stream(self):
            return iter(named)

    routes = plan_ipc_routes([ipc._ipc_place(Rank())], [[GPU[0]]])
    stats = ipc._ipc_push(Rank(), Client(), 512, None, routes)
    assert stats["buckets"] == len(calls) >= 4 and stats["tensors"] == len(named)
    assert {c[:2] for c in calls} == {(0, "ipc_load_bucket")} and all(c[2] == [GPU[0]] for c in calls)
    for n, t in named:
        assert torch.equal(loaded[n], t)


def test_colocated_engines_start_after_the_policy_and_wake_after_its_cache_release_recorded_with_stand_in_actors(
        monkeypatch):
    """Colocated on CUDA (issue 34, items 2 and 3), as a recorded call sequence: the engines are started only after
    the policy's checkpoint prewarm finished and every rank returned its cached blocks (vLLM sizes its KV cache from
    the device-wide free memory it profiles), and at each step boundary the policy releases its cache before the
    engines' weights wake and again before their KV cache does. The policy group and the engines' client are
    recording stand-ins (no CUDA here); the ordering code is the real one (``trainer/cluster/colocation.py``,
    ``rollout/ipc.py: ipc_sync``). On 27dab78 the engines started beside the policy's build and no release ran."""
    from da3po_megatron.rollout import ipc
    from da3po_megatron.trainer.cluster.colocation import engines_after_policy, start_engines_after_policy

    log: list[tuple[str, str]] = []

    class Policy:
        def run_on_all(self, fn, *args):
            log.append(("policy", fn.__name__))
            if fn is ipc._ipc_place:
                return [{"rank": 0, "uuid": GPU[0], "tp": 0, "pp": 0, "dp": 0}]
            if fn is ipc._ipc_push:
                return [{"bytes": 8, "buckets": 1, "tensors": 1, "max_bucket_bytes": 8}]
            return [fn(None, *args)]

    class Client:
        def call_all(self, method):
            log.append(("engines", method))
            return [[GPU[0]]]

        def wake_up(self, tags=None):
            log.append(("engines", f"wake_up {tags}"))

        def __getattr__(self, method):  # begin / finish / abort_weight_update
            return lambda *a, **k: log.append(("engines", method))

    assert engines_after_policy(colocate=True, engine_cuda=True)
    assert not engines_after_policy(colocate=True, engine_cuda=False)  # CPU: a fixed KV cache, side by side
    assert not engines_after_policy(colocate=False, engine_cuda=True)  # engines on GPUs of their own
    client = start_engines_after_policy(Policy(), lambda: log.append(("policy", "prewarm finished")),
                                        lambda: log.append(("engines", "start")) or Client())
    assert log == [("policy", "prewarm finished"), ("policy", "release_cached_memory"), ("engines", "start")]
    print("start-up:", log)

    log.clear()
    monkeypatch.setattr(ipc, "require_ipc", lambda what: None)
    ipc.ipc_sync(Policy(), client)
    print("step boundary:", log)
    assert log == [("policy", "_ipc_place"), ("engines", "worker_gpu_uuids"), ("policy", "release_cached_memory"),
                   ("engines", "wake_up ['weights']"), ("engines", "begin_weight_update"), ("policy", "_ipc_push"),
                   ("engines", "finish_weight_update"), ("policy", "release_cached_memory"),
                   ("engines", "wake_up ['kv_cache']")]
    assert ipc.release_cached_memory() == {"reserved_before": 0, "reserved_after": 0}  # no CUDA: nothing to release


def test_context_parallel_ranks_other_than_cp_rank_0_neither_send_nor_ship_a_stage():
    """CP ranks hold the same weights as CP rank 0 (CP splits the sequence): only CP rank 0 of TP rank 0 of DP
    replica 0 sends a stage (``weight_sync.sender_stage``); the IPC routing has one shipper (rank 0) whatever the
    layout. On 27dab78 a CP-rank-1 rank was a sender too (the stage pushed twice)."""
    from types import SimpleNamespace

    from da3po_megatron.rollout.ipc_routing import colocated_layout
    from da3po_megatron.rollout.weight_sync import sender_stage

    assert sender_stage(SimpleNamespace(tp_rank=0, dp_rank=0, pp_rank=1, cp_rank=0)) == 1
    assert sender_stage(SimpleNamespace(tp_rank=0, dp_rank=0, pp_rank=1, cp_rank=1)) is None
    assert sender_stage(SimpleNamespace(tp_rank=0, dp_rank=0, pp_rank=0)) == 0  # a sender without CP attributes
    ranks, engines = colocated_layout(world_size=4, tp=1, pp=1, num_engines=1, cp=2)  # CP=2 x DP=2
    assert [(r.cp, r.dp) for r in ranks] == [(0, 0), (1, 0), (0, 1), (1, 1)]  # Megatron's order: CP before DP
    routes = plan_ipc_routes(ranks, engines)
    assert routes.shipper == 0 and routes.serves == {0: [(0, 0)]}
