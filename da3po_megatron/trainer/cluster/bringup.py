"""Building a run's parts before the :class:`~da3po_megatron.trainer.run.Run` exists: Ray start-up, the placement
(resources checked and reserved before any actor starts, ``trainer/cluster/placement.py``), the engine config, the
training data (read and checked before any actor starts) and the parallel-size / memory preflight.

Device decisions (the engines' KV-cache budget and sleep mode, the policy's memory budget) come from what one engine /
one policy rank sees (``placement.probe_devices``); this process, the driver, never initialises CUDA."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

from da3po_megatron.config import Config
from da3po_megatron.data.datasets import PromptDataset, ReadStats, load_prompts
from da3po_megatron.megatron.arch import GPTArch
from da3po_megatron.megatron.memory_host import route_fraction
from da3po_megatron.rollout.types import EngineConfig
from da3po_megatron.trainer.observability.console import ray_init_kwargs


def _pin(_worker: Any, spec: str) -> list[int]:
    from da3po_megatron.affinity import pin_process

    return pin_process(spec)


def _hostname(_worker: Any = None) -> str:
    import socket

    return socket.gethostname()


# What ray.init raises when the raylet has not registered with the GCS within Ray's fixed 30 s (ray/_private/node.py).
RAY_START_TIMEOUT = "timed out during startup"


def start_local_ray(temp_dir: str | None, num_cpus: int, attempts: int = 2, **kwargs: Any) -> None:
    """Start a single-node Ray (loopback address, no dashboard, ``num_cpus`` logical CPUs, its sockets and logs under
    ``temp_dir``: None = ``$DA3PO_RAY_TMP`` or /tmp/da3po_ray, created), trying again when Ray's own start-up wait runs
    out.

    Ray gives the new raylet a fixed 30 s to register with the GCS (not configurable in Ray 2.x); on an overloaded
    host the GCS answers late and ``ray.init`` raises "The current node timed out during startup" although nothing
    is wrong. Seen once in a fresh-clone CI run (2026-12-01): the fault suite's first launch started Ray while the
    other test worker started vLLM engines and policy ranks on the same 2 cores. The failed start's processes (GCS,
    raylet, log monitor, reaper) are children of this process and are killed before the next attempt, so a retry
    leaves nothing behind; any other error is raised at once."""
    import ray

    if temp_dir is None:
        temp_dir = os.environ.get("DA3PO_RAY_TMP", "/tmp/da3po_ray")
        Path(temp_dir).mkdir(parents=True, exist_ok=True)
    for attempt in range(1, attempts + 1):
        before = _child_pids()
        try:
            ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, _temp_dir=temp_dir,
                     num_cpus=num_cpus, **kwargs)
            return
        except Exception as e:
            if RAY_START_TIMEOUT not in str(e) or attempt == attempts:
                raise
            killed = _kill_children_since(before)
            ray.shutdown()
            print(f"warning: Ray's local start-up timed out (attempt {attempt} of {attempts}: {e}); "
                  f"stopped the {killed} process(es) it had started, starting it again", file=sys.stderr, flush=True)


def _child_pids() -> set[int]:
    import psutil

    return {c.pid for c in psutil.Process().children(recursive=True)}


def _kill_children_since(before: set[int], wait_s: float = 10.0) -> int:
    """SIGKILL this process's child processes that were not in ``before`` (what a failed ``ray.init`` started), wait
    for them to exit, and return how many there were."""
    import psutil

    new = [c for c in psutil.Process().children(recursive=True) if c.pid not in before]
    for c in new:
        try:
            c.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(new, timeout=wait_s)
    return len(new)


def init_ray(cfg: Config) -> None:
    import ray

    if ray.is_initialized():
        return
    if cfg.ray.address == "local":
        need = cfg.policy_world_size * cfg.ray.num_cpus_per_policy_rank + \
            cfg.rollout.num_engines * cfg.rollout.num_cpus_per_engine
        # no prestarted workers: every actor of the run has its own runtime env (env vars), so Ray starts a worker
        # for it anyway and the num_cpus idle ones it prestarts for the first driver (each importing ray) only take
        # CPU from the actors' start-up -- 3 processes on the tiny 2-core launch (Ray's prestart_worker_first_driver)
        from da3po_megatron.trainer.cluster.reaper import start_reaper

        # the Ray processes this driver starts end with it, even after a kill -9 (trainer/cluster/reaper.py); started
        # first, so that they inherit its tag
        start_reaper()
        start_local_ray(None, max(os.cpu_count() or 1, math.ceil(need) + 1),
                        _system_config={"prestart_worker_first_driver": False}, **ray_init_kwargs())
    else:
        ray.init(address=cfg.ray.address, include_dashboard=False, **ray_init_kwargs())


def plan_for_cluster(cfg: Config) -> Any:
    """The run's :class:`~da3po_megatron.trainer.cluster.placement.Plan` on the connected Ray cluster, checked in
    seconds before any actor starts (PlacementError, exit 2, naming the numbers and the setting to change). A
    ``train_only`` replay (``trainer/generation/replay.py``) plans no engine: nothing is reserved for one."""
    from dataclasses import replace

    from da3po_megatron.trainer.cluster.placement import cluster_nodes, plan_placement, resources_for_config
    from da3po_megatron.trainer.generation.replay import engineless

    if engineless(cfg):
        cfg = replace(cfg, rollout=replace(cfg.rollout, num_engines=0, colocate=False))
    nodes = cluster_nodes()
    return plan_placement(resources_for_config(cfg, sum(n.gpus for n in nodes)), nodes)


def engine_config(cfg: Config, engine_cuda: bool = False, moe: bool = False) -> EngineConfig:
    """The training engines' :class:`~da3po_megatron.rollout.EngineConfig`. They return the log-probs of the
    distribution they sample from (vLLM ``processed_logprobs``: after ``rollout.temperature``, and after the nucleus
    renormalisation when ``rollout.top_p`` < 1), which the policy scores with the same temperature (see
    ``megatron.policy.loss_setup``). ``engine_cuda``: whether an engine sees CUDA (asked of one,
    ``placement.probe_devices``): with it vLLM sizes its KV cache from ``rollout.gpu_memory_utilization`` and
    colocated engines get sleep mode; without it the KV cache is capped at ``rollout.kv_cache_memory_bytes`` (vLLM's CPU
    default takes 0.9 x RAM) and there is no sleep mode (a no-op on CPU). ``moe``: the model has experts; the
    engines then return routes when something reads them (``memory_host.route_fraction``: R3, or the agreement
    metric's sample -- ``moe.router_agreement_fraction``; never for streaming engines, which return none)."""
    r = cfg.rollout
    return EngineConfig(
        model_path=cfg.model.path, tensor_parallel_size=r.tensor_parallel_size,
        dtype=cfg.model.params_dtype if r.dtype == "auto" else r.dtype,
        max_model_len=r.max_prompt_length + r.max_response_length,
        kv_cache_memory_bytes=None if engine_cuda else r.kv_cache_memory_bytes,
        gpu_memory_utilization=r.gpu_memory_utilization, seed=cfg.trainer.seed,
        enable_sleep_mode=r.colocate and engine_cuda,
        logprobs_mode="processed_logprobs",
        return_routed_experts=moe and route_fraction(cfg.moe, r.mode == "streaming") > 0)


def load_train_data(cfg: Config) -> PromptDataset:
    d = cfg.data
    if d.format == "synthetic":
        from da3po_megatron.data.synthetic import make_synthetic_dataset

        s = d.synthetic
        return make_synthetic_dataset(s.train_per_bucket, "train", cfg.trainer.seed,
                                      buckets=range(s.min_digits, s.max_digits + 1),
                                      response_tokens=s.response_tokens, max_tokens=cfg.rollout.max_response_length,
                                      coin_p=s.coin_p)
    missing = [f for f in d.train_files if not Path(f).exists()]
    if missing:
        hint = ""
        if any(Path(f).name.lower() == "dapo-math-17k.parquet" for f in missing):
            hint = ("; no downloads happen at run time: fetch it first on a machine with internet, e.g. "
                    "`huggingface-cli download --repo-type dataset BytedTsinghua-SIA/DAPO-Math-17k --local-dir .` "
                    "(writes data/dapo-math-17k.parquet), or set data.train_files")
        raise FileNotFoundError(f"data.train_files: not found: {', '.join(missing)}{hint}")
    from da3po_megatron.data.datasets import BadRowError
    from da3po_megatron.trainer.inputs import InputError

    try:
        if d.format == "dapo":
            parts = [load_prompts(f, format="dapo", on_bad_row=d.on_bad_row, dedup=d.dedup) for f in d.train_files]
        else:
            parts = [load_prompts(f, format="generic", prompt_key=d.prompt_key, answer_key=d.answer_key,
                                  on_bad_row=d.on_bad_row, template=d.template, default_source=Path(f).stem,
                                  dedup=d.dedup)
                     for f in d.train_files]
    except BadRowError:
        raise
    except (ValueError, OSError) as e:  # an unreadable file (not parquet, not JSON, unsupported suffix)
        raise InputError(f"data.train_files: {e}") from None
    for f, part in zip(d.train_files, parts):
        s = part.stats
        print(f"data: {f}: {s.rows} rows, {s.kept} prompts"
              + (f", {s.duplicates} repeated rows dropped (data.dedup)" if s.duplicates else "")
              + (f", {s.skipped} malformed rows skipped (data.on_bad_row=skip)" if s.skipped else ""), flush=True)
    if len(parts) == 1:
        return parts[0]
    stats = ReadStats(path="+".join(d.train_files), rows=sum(p.stats.rows for p in parts),
                      kept=sum(p.stats.kept for p in parts), skipped=sum(p.stats.skipped for p in parts),
                      duplicates=sum(p.stats.duplicates for p in parts))
    return PromptDataset([ex for p in parts for ex in p], stats, name="+".join(p.name for p in parts))


def preflight(cfg: Config) -> GPTArch:
    """The policy's architecture, read through the bridge from the model's config.json, and the check that needs it,
    before the run writes or starts anything: the parallel sizes divide the model (heads, query groups, MLP, layers).
    A config the bridge cannot read as a ``GPTArch`` is an ``InputError`` (exit 2), like a damaged one. (The memory
    check needs to know the ranks' device: :func:`memory_preflight`, once the placement is reserved.)"""
    from da3po_megatron.bridge.hf_config import gpt_arch
    from da3po_megatron.trainer.inputs import InputError

    config = Path(cfg.model.path) / "config.json"
    try:  # trainer.inputs.load_tokenizer has checked that the file is there and parses
        arch = gpt_arch(cfg.model.path)
    except (ValueError, KeyError) as e:  # an unsupported family / activation / RoPE scaling, a missing field
        raise InputError(f"{config}: not a model this recipe builds ({type(e).__name__}: {e})") from None
    p = cfg.parallel
    try:
        arch.check_parallel_sizes(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                  p.expert_model_parallel_size, p.expert_tensor_parallel_size)
    except ValueError as e:
        raise ValueError(f"parallel: {e} ({config})") from None
    return arch


def memory_preflight(cfg: Config, arch: GPTArch, seen: dict[str, Any], plan: Any) -> int:
    """The policy's estimated peak memory per rank against what policy rank 0's bundle sees (``seen``: its
    ``probe_devices`` answer: device, free memory, layer spec), before any policy actor starts
    (``actor.memory_check``; "fit" lowers ``actor.max_tokens_per_microbatch``). Returns the token budget. Then
    what host memory carries (``megatron/memory_host.py``): the MoE routes a step moves, and whether the node can
    stage asynchronous saves (else ``trainer.async_save`` falls back to synchronous, said)."""
    from da3po_megatron.megatron.memory import check_policy_memory, estimate_for_config
    from da3po_megatron.megatron.memory_host import check_async_save_memory, route_plan_line

    def say(m: str) -> None:
        print(m, flush=True)

    per_node = max(plan.rank_node.count(i) for i in set(plan.rank_node))
    device, te = "cuda" if seen["cuda"] else "cpu", seen.get("use_te", False)
    tokens = check_policy_memory(cfg, arch, available=seen["free_bytes"], where=seen["memory_where"], log=say,
                                 device=device, te=te, local_ranks=per_node)
    if arch.is_moe:
        say(f"memory: {route_plan_line(cfg, arch)}")
    host = seen.get("host_available_bytes", seen["free_bytes"] if device == "cpu" else None)
    check_async_save_memory(cfg, arch, per_node, host, device, te, say,
                            policy_bytes_per_rank=estimate_for_config(cfg, arch, tokens, device, te).total)
    return tokens
