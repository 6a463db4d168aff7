"""Weight-transport pieces that need no engine: the transport choice per placement (``rollout.weight_transfer``),
its config validation, and the flat-bucket packing of the collective / IPC transports (bounded buffers, aligned
offsets, dtypes including bf16, views that round-trip exactly) and the bucket-buffer pool (reused only when no view of
a buffer is alive anywhere)."""

from __future__ import annotations

import pytest
import torch

from da3po_megatron.config import Config, ConfigError, resolve, validate
from da3po_megatron.rollout.collective import ALIGN, BufferPool, iter_flat_buckets, unpack_flat
from da3po_megatron.rollout.weight_sync import choose_transport


@pytest.mark.parametrize("setting,cuda,colocate,policy,engines,expected", [
    ("auto", False, False, ["n1"], ["n1"], "bytes"),              # one CPU node: Ray's shared-memory object store
    ("auto", False, False, ["n1", "n2"], ["n3"], "collective"),   # an engine on a node without policy ranks
    ("auto", False, False, ["n1", "n2"], ["n2"], "bytes"),
    ("auto", True, False, ["n1"], ["n1"], "collective"),          # CUDA, engines on GPUs of their own
    ("auto", True, True, ["n1"], ["n1"], "ipc"),                  # CUDA, colocated
    ("collective", False, False, ["n1"], ["n1"], "collective"),
    ("bytes", True, False, ["n1"], ["n2"], "bytes"),
])
def test_transport_choice_follows_the_placement(setting, cuda, colocate, policy, engines, expected):
    assert choose_transport(setting, has_cuda=cuda, colocate=colocate, policy_hosts=policy,
                            engine_hosts=engines) == expected


def test_transports_the_placement_cannot_run_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="rollout.weight_transfer='ipc' needs CUDA and rollout.colocate"):
        choose_transport("ipc", has_cuda=False, colocate=True, policy_hosts=["a"], engine_hosts=["a"])
    with pytest.raises(ValueError, match="NCCL refuses two ranks on one GPU"):
        choose_transport("collective", has_cuda=True, colocate=True, policy_hosts=["a"], engine_hosts=["a"])
    cfg = Config()
    cfg.model.path = "x"
    resolve(cfg)
    cfg.rollout.weight_transfer = "ipc"
    with pytest.raises(ConfigError, match="rollout.weight_transfer"):
        validate(cfg)
    cfg.rollout.weight_transfer = "carrier-pigeon"
    with pytest.raises(ConfigError, match="rollout.weight_transfer"):
        validate(cfg)


def test_flat_buckets_are_bounded_aligned_and_round_trip_every_dtype():
    g = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(10, 7, generator=g)), ("b", torch.randn(33, generator=g).to(torch.bfloat16)),
             ("c", torch.arange(5, dtype=torch.int64)), ("big", torch.randn(300, generator=g)),
             ("d", torch.randn(3, 3, generator=g).t())]  # non-contiguous
    bucket = 512
    buckets = list(iter_flat_buckets(iter(named), bucket, torch.device("cpu")))
    got = {}
    for buf, meta in buckets:
        assert buf.dtype == torch.uint8 and (buf.numel() <= bucket or len(meta) == 1)  # "big" (1200 B) alone
        assert all(off % ALIGN == 0 for _, _, _, off, _ in meta)
        got.update({k: v.clone() for k, v in unpack_flat(buf, meta).items()})
    assert list(got) == [n for n, _ in named]
    for n, t in named:
        assert got[n].dtype == t.dtype and torch.equal(got[n], t)
    cast = list(iter_flat_buckets(iter(named[:1]), bucket, torch.device("cpu"), dtype=torch.bfloat16))
    assert unpack_flat(*cast[0])["a"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="'a' appears twice"):
        list(iter_flat_buckets(iter([named[0], named[0]]), bucket, torch.device("cpu")))


def test_only_the_last_bucket_is_marked_last_so_one_sender_can_close_the_session_with_it():
    from da3po_megatron.rollout.client import iter_buckets_marked

    tensors = [(f"w{i}", torch.full((256,), float(i))) for i in range(5)]  # 1 KiB each
    marked = list(iter_buckets_marked(tensors, bucket_bytes=2048))
    assert [sorted(b) for b, _ in marked] == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    assert [last for _, last in marked] == [False, False, True]
    (only, last), = iter_buckets_marked(tensors[:1], bucket_bytes=2048)
    assert last and list(only) == ["w0"]
    assert list(iter_buckets_marked([], bucket_bytes=2048)) == []


def test_buffer_pool_reuses_a_buffer_only_when_no_view_of_it_is_alive():
    pool = BufferPool(torch.device("cpu"), keep=2)
    a = pool.take(1000)
    a_ptr = a.data_ptr()
    b = pool.take(1000)  # `a` is still held: a second buffer
    assert b.data_ptr() != a_ptr and pool.fresh == 2
    held = a[100:200].view(torch.float32)  # a view of `a` outlives `a` (what vLLM keeps for an incomplete layer)
    del a
    c = pool.take(800)
    assert c.data_ptr() not in (a_ptr, b.data_ptr()) and pool.fresh == 3  # not handed out while `held` lives
    del held, c
    d = pool.take(800)
    assert d.data_ptr() == a_ptr and d.numel() == 800 and pool.reused == 1
    del d
    e = pool.take(5000)  # larger than every pooled buffer: a fresh one replaces a free (too small) one
    assert pool.fresh == 4 and e.numel() == 5000
    del b, e
    assert pool.take(4000).numel() == 4000 and pool.reused == 2


def test_pooled_flat_buckets_stay_intact_while_a_consumer_holds_some_of_them():
    """A consumer that keeps views of some buckets (vLLM's layerwise reload keeps a layer's tensors until the layer is
    complete) must never see them overwritten by later buckets, and buckets it dropped are reused."""
    g = torch.Generator().manual_seed(1)
    sizes = torch.randint(10, 200, (60,), generator=g).tolist()
    named = [(f"t{i}", torch.randn(n, generator=g)) for i, n in enumerate(sizes)]
    pool = BufferPool(torch.device("cpu"), keep=2)
    kept, got = {}, {}
    for k, (buf, meta) in enumerate(iter_flat_buckets(iter(named), 1024, torch.device("cpu"), pool=pool)):
        views = unpack_flat(buf, meta)
        if k % 3 == 0:
            kept.update(views)  # held to the end, like a pending layer
        got.update({n: v.clone() for n, v in views.items()})
        del buf, meta, views
    assert pool.reused > 0 and pool.fresh < len(got)
    for n, t in named:
        assert torch.equal(got[n], t)
        if n in kept:
            assert torch.equal(kept[n], t), f"{n} was overwritten by a later bucket"
