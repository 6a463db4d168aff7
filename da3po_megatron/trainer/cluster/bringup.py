"""Bring-up: Ray started, the placement planned and reserved (resources checked before any actor starts,
``cluster/placement.py``), the parallel-size and memory preflight, the policy ranks and the engines started (in the
colocated order when they share GPUs), CPUs pinned, where the actors are reported, and the weight transport chosen --
all in :class:`Cluster`, which also closes what it started. A ``train_only`` replay starts no engine
(:func:`engineless`, :class:`NoEngines`).

Device decisions (the engines' KV-cache budget and sleep mode, the policy's memory budget) come from what one engine /
one policy rank sees (``placement_ray.probe_devices``); this process, the driver, never initialises CUDA."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

from da3po_megatron.config import Config
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

    from da3po_megatron.trainer.cluster.placement import plan_placement, resources_for_config
    from da3po_megatron.trainer.cluster.placement_ray import cluster_nodes

    if engineless(cfg):
        cfg = replace(cfg, rollout=replace(cfg.rollout, num_engines=0, colocate=False))
    nodes = cluster_nodes()
    return plan_placement(resources_for_config(cfg, sum(n.gpus for n in nodes)), nodes)


def engine_config(cfg: Config, engine_cuda: bool = False, moe: bool = False) -> EngineConfig:
    """The training engines' :class:`~da3po_megatron.rollout.EngineConfig`. They return the log-probs of the
    distribution they sample from (vLLM ``processed_logprobs``: after ``rollout.temperature``, and after the nucleus
    renormalisation when ``rollout.top_p`` < 1), which the policy scores with the same temperature (see
    ``megatron.policy_config.loss_setup``). ``engine_cuda``: whether an engine sees CUDA (asked of one,
    ``placement_ray.probe_devices``): with it vLLM sizes its KV cache from ``rollout.gpu_memory_utilization`` and
    colocated engines get sleep mode; without it the KV cache is capped at ``rollout.kv_cache_memory_bytes`` (vLLM's CPU
    default takes 0.9 x RAM) and there is no sleep mode (a no-op on CPU). ``moe``: the model has experts; the
    engines then return routes when something reads them (``memory_host.route_fraction``: R3, or the agreement
    metric's sample -- ``moe.router_agreement_fraction``; streaming engines only for R3)."""
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


def preflight(cfg: Config) -> GPTArch:
    """The policy's architecture, read through the bridge from the model's config.json, and the checks of the layout,
    before the run writes or starts anything: the parallel sizes divide the model (heads, query groups, MLP, layers);
    an explicit ``rollout.weight_transfer=ipc`` can serve the colocated layout (``placement.check_colocated_ipc``).
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
    if cfg.rollout.weight_transfer == "ipc":  # explicit: the colocated layout's gate, before Ray (auto: at planning)
        from da3po_megatron.trainer.cluster.placement import check_colocated_ipc, ipc_layout

        check_colocated_ipc(ipc_layout(cfg))
    return arch


def memory_preflight(cfg: Config, arch: GPTArch, seen: dict[str, Any], plan: Any) -> int:
    """The policy's estimated peak memory per rank against what policy rank 0's bundle sees (``seen``: its
    ``probe_devices`` answer: device, free memory, layer spec), before any policy actor starts
    (``actor.memory_check``; "fit" lowers ``actor.max_tokens_per_microbatch``). Returns the token budget. Then
    what host memory carries (``megatron/memory_host.py``): the MoE routes a step moves, and whether the node can
    stage asynchronous saves (else ``trainer.async_save`` falls back to synchronous, said). The device's total
    (``total_bytes``) sizes a colocated engine at ``gpu_memory_utilization x total``, vLLM's rule
    (``vllm/v1/worker/utils.py:724-726``), and replays the device-memory timeline (issue 57, P1)."""
    from da3po_megatron.megatron.memory import check_policy_memory, estimate_for_config
    from da3po_megatron.megatron.memory_host import check_async_save_memory, route_plan_line

    def say(m: str) -> None:
        print(m, flush=True)

    per_node = max(plan.rank_node.count(i) for i in set(plan.rank_node))
    device, te = "cuda" if seen["cuda"] else "cpu", seen.get("use_te", False)
    tokens = check_policy_memory(cfg, arch, available=seen["free_bytes"], where=seen["memory_where"], log=say,
                                 device=device, te=te, local_ranks=per_node, total=seen.get("total_bytes"))
    if arch.is_moe:
        say(f"memory: {route_plan_line(cfg, arch, engine_cuda=device == 'cuda')}")  # (engines on the policy's kind)
    host = seen.get("host_available_bytes", seen["free_bytes"] if device == "cpu" else None)
    check_async_save_memory(cfg, arch, per_node, host, device, te, say,
                            policy_bytes_per_rank=estimate_for_config(cfg, arch, tokens, device, te).total)
    return tokens


class NoEngines:
    """Stands in for the ``RolloutClient`` in ``rollout.replay_mode=train_only``: no engine exists; every call made
    to all engines answers for none of them, and generation is an error naming the mode."""

    num_engines = 0
    resync = None

    def wait_ready(self) -> None:
        return None

    def call_all(self, method: str, *args: Any) -> list[Any]:
        return []

    def check_transport(self, transport: str) -> None:
        return None

    def sleep(self, level: int = 1) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("rollout.replay_mode=train_only: no engine was started (nothing can generate; evaluation "
                           "is skipped in this mode)")


def engineless(cfg: Config) -> bool:
    """Whether the run starts no engine (a ``train_only`` replay)."""
    return bool(cfg.rollout.replay_dir) and cfg.rollout.replay_mode == "train_only"


class Cluster:
    """The run's actors and where they run: the reservation, the devices rank 0 and engine 0 see, the policy ranks,
    the engines, the weight transport. Filled in as :meth:`start` goes, so a failure half-way closes what exists."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.reservation: Any = None
        self.devices: dict[str, Any] = {}
        self.policy: Any = None
        self.rollout: Any = None
        self.weight_transfer = "none"  # rollout.weight_transfer resolved ("none": no engines)
        self.transport: Any = None  # the "collective" group, made at the first sync (colocation.push_weights)
        self.offload: Any = None  # the actor.offload cycle (colocation.OffloadCycle), made before the engines start

    def start(self, arch: GPTArch, run_dir: Path, prewarm_dir: Path, checkpoint: Path | None = None) -> None:
        """Plan, reserve, probe, memory preflight; then the policy ranks and the engines, side by side (or the engines
        after the policy, colocated on CUDA or with the offload cycle on); HF weights in; a resume's checkpoint
        (``checkpoint``, the policy's part: the driver's part is ``RunState.restore``'s) loaded while the whole
        device is the policy's; checkpointing prewarmed into ``prewarm_dir``; colocated with ``actor.offload``, the
        tier offloaded and the cached blocks released before the engines start (issue 57, P1: :attr:`offload`
        records the calls); CPUs pinned; ``run_dir/placement.json``; the transport chosen and checked against the
        installed vLLM."""
        import json
        import time

        from da3po_megatron.bridge.export import load_policy_hf
        from da3po_megatron.megatron.actor_group import PolicyGroup
        from da3po_megatron.rollout import RolloutClient
        from da3po_megatron.rollout.weight_sync import choose_transport
        from da3po_megatron.trainer.cluster.colocation import (
            OffloadCycle,
            engine_slots,
            engines_after_policy,
            engines_will_sleep,
            start_engines_after_policy,
        )
        from da3po_megatron.trainer.cluster.placement_ray import (
            actor_location,
            placement_report,
            probe_devices,
            reserve,
        )
        from da3po_megatron.trainer.observability.profiling import with_engine_profiler

        cfg = self.cfg
        t0 = time.perf_counter()
        plan = plan_for_cluster(cfg)  # PlacementError (exit 2) in seconds when the cluster cannot hold the run
        print(plan.describe(), flush=True)
        self.reservation = reserve(plan, cfg.ray.placement_timeout_s)
        self.devices = probe_devices(self.reservation, cfg.model)  # what rank 0 and engine 0 will see
        cfg.actor.max_tokens_per_microbatch = memory_preflight(cfg, arch, self.devices["policy"], plan)
        # policy ranks and engines start side by side: the ranks' resources are requested first, then the engines',
        # and each side's start-up (imports, process groups, model build / vLLM's load) overlaps the other's
        self.policy = PolicyGroup.from_config(cfg, arch, wait=False, placement_group=self.reservation.policy,
                                              num_gpus_per_rank=plan.rank_gpus,
                                              rank_hosts=[plan.host(i) for i in plan.rank_node])

        def start_engines() -> Any:
            if engineless(cfg):  # rollout.replay_mode=train_only: none planned (plan_for_cluster), none started
                return NoEngines()
            engines = engine_config(cfg, engine_cuda=self.devices["engine"]["cuda"], moe=arch.is_moe)
            return RolloutClient.ray(with_engine_profiler(engines, cfg, run_dir),  # trainer.profile.engines
                                     num_engines=cfg.rollout.num_engines,
                                     num_cpus_per_engine=cfg.rollout.num_cpus_per_engine,
                                     num_gpus_per_engine=plan.engine_gpus,
                                     placement_group=self.reservation.engines or self.reservation.policy,
                                     restart_on_failure=cfg.rollout.restart_on_failure, wait=False,
                                     start_timeout_s=cfg.ray.start_timeout_s, **engine_slots(plan, self.policy),
                                     engine_hosts=[plan.host(i) for i in plan.engine_node])

        has_cuda = self.devices["policy"]["cuda"] and self.devices["engine"]["cuda"]  # what the actors see
        r = cfg.rollout
        self.offload = cycle = OffloadCycle(  # actor.offload around generation (cluster/colocation.py)
            self.policy, cfg.actor.offload,
            not engineless(cfg) and engines_will_sleep(r.weight_transfer, has_cuda, r.colocate),
            cfg.actor.offload_without_sleep, r.staleness)
        cycle.log = os.environ.get("DA3PO_MEMORY_CALLS") or None  # the recorded calls, one a line (tests, GPU runs)
        # colocated on CUDA the engines size their KV cache from free device memory, and colocated with the offload
        # cycle on the policy offloads its tier first: they start once the policy on their GPUs has finished
        # allocating (cluster/colocation.py); otherwise both sides start side by side
        after_policy = engines_after_policy(r.colocate, self.devices["engine"]["cuda"], cycle.effective)
        cycle.record("phase:start-up")
        if not after_policy:
            self.rollout = start_engines()
            cycle.engines_started()
        self.policy.wait_ready()
        cycle.record("policy:build")
        if not all(self.policy.run_on_all(load_policy_hf, cfg.model.path)):  # HF weights in, through the bridge
            print(f"warning: no *.safetensors in {cfg.model.path}: the policy keeps its random initialisation",
                  flush=True)
        cycle.record("policy:load_hf")
        if checkpoint is not None:  # before the offload: dist_checkpointing loads into the storages as they are
            cycle.record("phase:resume-load")
            self.policy.load(str(checkpoint / "policy"))
            cycle.record("policy:load_checkpoint")
            cycle.record("phase:start-up")
        # the first checkpoint's one-time start-up (megatron-core's writer), done while the engines start
        prewarmed = self.policy.start("prewarm_checkpointing", str(prewarm_dir))
        if after_policy:  # prewarm, the tier offloaded, the policy's cached blocks released, then the engines
            self.rollout = start_engines_after_policy(self.policy, prewarmed, start_engines,
                                                      cycle.offload_before_start)
            cycle.record("policy:release_cached")
            cycle.engines_started()
            prewarmed = lambda: None  # noqa: E731 - waited for above
        cycle.engines = self.rollout
        cycle.watch(self.policy, self.rollout)  # forwards, train steps, generation rounds, restarts: recorded too
        cycle.record("phase:generate")  # what follows the start-up (a resume's sync records its own phase)
        self.rollout.wait_ready()
        prewarmed()
        print(f"policy ({cfg.policy_world_size} ranks) and {self.rollout.num_engines} engine(s) ready in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        self.pin_cpus()
        # where the actors say they are (their node, the GPU ids Ray gave them): printed and in run_dir/placement.json
        line, record = placement_report(plan, self.policy.run_on_all(actor_location),
                                        self.rollout.call_all("location"))
        print(line, flush=True)
        (run_dir / "placement.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"policy loss: {self.policy.info()[0]['loss_backend']} (actor.loss_backend={cfg.actor.loss_backend})",
              flush=True)
        self.weight_transfer = "none" if engineless(cfg) else choose_transport(
            cfg.rollout.weight_transfer, has_cuda=has_cuda, colocate=cfg.rollout.colocate,
            policy_hosts=[d["host"] for d in record["policy"]], engine_hosts=[d["host"] for d in record["engines"]])
        self.rollout.check_transport(self.weight_transfer)  # the installed vLLM has what it needs (names version)
        if cycle.engines_sleep != (self.weight_transfer == "ipc"):  # engines_will_sleep is choose_transport's rule
            assumed = "sleep" if cycle.engines_sleep else "never sleep"
            raise RuntimeError(f"bring-up: the offload cycle assumed engines that {assumed}, but the transport is "
                               f"{self.weight_transfer!r} (colocation.engines_will_sleep and "
                               "weight_sync.choose_transport disagree)")

    def pin_cpus(self) -> None:
        """Placement for overlap: engines on ``ray.engine_cpus``, policy ranks on ``ray.policy_cpus`` (disjoint cores:
        generation and training never compete for one). Prints the resulting affinity."""
        r = self.cfg.ray
        for name, spec in (("policy_cpus", r.policy_cpus), ("engine_cpus", r.engine_cpus)):
            try:
                if name == "policy_cpus":
                    cores = self.policy.run_on_all(_pin, spec) if spec else []
                else:
                    cores = self.rollout.call_all("pin_cpus", spec) if spec else []
            except Exception as e:  # noqa: BLE001 - name the field
                raise ValueError(f"ray.{name}={spec!r}: {e}") from e
            if spec:
                print(f"placement: {name.split('_')[0]} processes pinned to cores {cores}", flush=True)

    def close_transport(self) -> None:
        if self.transport is not None:
            try:
                self.transport.teardown(self.rollout)
            except Exception as e:  # noqa: BLE001 - closing must not hide the real error
                print(f"warning: closing the weight-transfer group failed: {e}", flush=True)
            self.transport = None
