"""The trainer's handle on its generation engines: data-parallel rollout and bucketed weight updates.

``RolloutClient.local(cfg, num_engines)`` builds in-process engines (evaluation, tests);
``RolloutClient.ray(cfg, num_engines, ...)`` one Ray actor per engine (training). Both give the same API:

- ``generate(prompts, sampling)`` -> ``list[list[Completion]]``: prompts are split into contiguous shards, one per
  engine (data-parallel rollout), results come back in prompt order, and every prompt is checked to have exactly n
  completions (a short answer is an error, never silently fewer samples);
- ``update_weights(named_tensors, bucket_mb)``: HF-named tensors are grouped into buckets of at most ``bucket_mb``
  MiB (a tensor larger than that travels alone) and loaded by every engine inside one layerwise reload session; with
  Ray each bucket is one flat buffer, ``ray.put`` once and shared by all engines, and the next bucket is packed while
  the engines load the current one (at most two buckets alive). The prefix cache is reset afterwards;
- failure handling: a dead actor raises :class:`EngineDeadError` naming the engine; with ``restart_on_failure`` the
  engine is restarted, the last synced weights are replayed into it (their bucket refs are kept in Ray's object
  store) and its shard is generated again.

This follows the slime / verl / NeMo-RL shape (a driver-side client over engine actors, bucketed in-memory sync) with
our own code.
"""

from __future__ import annotations

import os
from typing import Any

from da3po_megatron.rollout.buckets import iter_buckets, iter_buckets_marked, pack_bucket, serialize_bucket
from da3po_megatron.rollout.client_weights import MiB, WeightUpdates
from da3po_megatron.rollout.engine import VLLMEngine
from da3po_megatron.rollout.engine_setup import engine_env
from da3po_megatron.rollout.types import (
    Completion,
    EngineConfig,
    EngineDeadError,
    RolloutError,
    SamplingConfig,
)


def _split(n_items: int, n_parts: int) -> list[range]:
    """Contiguous, balanced shards (the first ``n_items % n_parts`` get one more)."""
    base, extra = divmod(n_items, n_parts)
    out, start = [], 0
    for i in range(n_parts):
        end = start + base + (1 if i < extra else 0)
        out.append(range(start, end))
        start = end
    return out


def assemble(completions: list[Completion], num_prompts: int, n: int,
             owner: dict[int, int] | None = None) -> list[list[Completion]]:
    """Per-prompt lists of n completions in sample order; RolloutError naming the prompt (and engine) otherwise."""
    groups: list[list[Completion]] = [[] for _ in range(num_prompts)]
    for c in completions:
        if not 0 <= c.prompt_index < num_prompts:
            raise RolloutError(f"completion for unknown prompt index {c.prompt_index} (have {num_prompts} prompts)")
        groups[c.prompt_index].append(c)
    for i, g in enumerate(groups):
        g.sort(key=lambda c: c.sample_index)
        if [c.sample_index for c in g] != list(range(n)):
            where = f" (engine {owner[i]})" if owner and i in owner else ""
            raise RolloutError(f"prompt {i}{where} got samples {[c.sample_index for c in g]}, expected n={n} "
                               f"samples 0..{n - 1}")
    return groups


def actor_env(config: EngineConfig, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment an engine actor starts with (its Ray ``runtime_env``, set before its process starts):
    :func:`~da3po_megatron.rollout.engine_setup.engine_env`, the names the weight-sync NCCL groups override
    (:data:`~da3po_megatron.rollout.collective.NCCL_ENV_AT_START`, so their construction only replaces a value, see
    ``collective.scoped_env``), then ``extra``."""
    from da3po_megatron.rollout.collective import NCCL_ENV_AT_START

    at_start = {k: os.environ.get(k, v) for k, v in NCCL_ENV_AT_START.items()}
    return {**at_start, **engine_env(config), **(extra or {})}


# -------------------------------------------------------------------------------------------- client
class RolloutClient(WeightUpdates):
    """Data-parallel generation over ``num_engines`` engines + weight updates. Build with :meth:`local` / :meth:`ray`.
    """

    def __init__(self, config: EngineConfig, engines: list[Any], mode: str, restart_on_failure: bool = False,
                 actor_options: dict | None = None):
        self.config = config
        self.engines = engines
        self.mode = mode
        self.restart_on_failure = restart_on_failure
        self._actor_options = actor_options or {}
        self._last_update_refs: list[Any] = []  # Ray: bucket refs of the last sync, replayed into restarted engines
        self._pending_refs: list[Any] = []
        self.restarts = 0
        self.weights_version = 0
        self.resync: Any = None
        """Called (no arguments) after a restart when the last sync cannot be replayed from this client (pushed from
        other processes or through the collective transport): the trainer's ``sync_weights``."""
        self.on_call: Any = None
        """Called with "generate" at every generation round and "restart" at every engine restart (the trainer's
        record of device-memory events, ``trainer/cluster/colocation.py`` ``OffloadCycle.watch``)."""

    def __getstate__(self) -> dict:
        # a copy sent to a policy actor pushes buckets; replay refs stay with the driver's client
        state = dict(self.__dict__)
        state["_last_update_refs"] = []
        state["_pending_refs"] = []
        state["resync"] = None
        state["on_call"] = None
        return state

    # ------------------------------------------------------------------ construction
    @classmethod
    def local(cls, config: EngineConfig, num_engines: int = 1) -> RolloutClient:
        """In-process engines (one ``vllm.LLM`` each) in this process."""
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        return cls(config, [VLLMEngine(config, engine_index=i) for i in range(num_engines)], mode="local")

    @classmethod
    def ray(cls, config: EngineConfig, num_engines: int = 1, *, num_cpus_per_engine: float = 1,
            num_gpus_per_engine: float | None = None, placement_group: Any = None,
            placement_bundle_offset: int = 0, restart_on_failure: bool = False, name_prefix: str | None = None,
            env: dict[str, str] | None = None, wait: bool = True, start_timeout_s: float | None = None,
            engine_hosts: list[str] | None = None, placement_bundle_stride: int = 1,
            engine_envs: list[dict[str, str]] | None = None) -> RolloutClient:
        """One Ray actor per engine. Ray must already be initialised (``ray.init``).

        ``num_gpus_per_engine`` defaults to ``tensor_parallel_size`` when the Ray cluster has GPUs and 0 without
        (decided from the cluster, not from this process: a driver never initialises CUDA). With a
        ``placement_group``, engine i takes bundle ``placement_bundle_offset + i x placement_bundle_stride``
        (colocated engines of TP > 1: the first of their policy ranks' bundles); ``engine_envs[i]``: more
        environment for engine i (its ``CUDA_VISIBLE_DEVICES``: ``placement.colocated_engine_envs``).
        ``start_timeout_s``: how long :meth:`wait_ready` waits for the engines' start-up before raising with the
        pending engines (and their ``engine_hosts``, when given); None = no limit. ``restart_on_failure``: restart a
        dead engine, replay the last synced weights into it and retry its prompts once. ``wait=False``: return once
        the actors are scheduled (they start in the background); :meth:`wait_ready` blocks until every engine answers.
        """
        import ray

        if not ray.is_initialized():
            raise RuntimeError("RolloutClient.ray needs ray.init() first")
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        config.validate()
        if num_gpus_per_engine is None:
            has_gpus = ray.cluster_resources().get("GPU", 0) > 0
            num_gpus_per_engine = float(config.tensor_parallel_size) if has_gpus else 0.0
        options = dict(num_cpus=num_cpus_per_engine, num_gpus=num_gpus_per_engine,
                       placement_group=placement_group, bundle_offset=placement_bundle_offset,
                       name_prefix=name_prefix, env=dict(env or {}), stride=placement_bundle_stride,
                       engine_envs=list(engine_envs or []))
        client = cls(config, [], mode="ray", restart_on_failure=restart_on_failure, actor_options=options)
        client.start_timeout_s, client.engine_hosts = start_timeout_s, engine_hosts
        client.engines = [client._start_actor(i) for i in range(num_engines)]
        return client.wait_ready() if wait else client

    def wait_ready(self) -> RolloutClient:
        """Block until every engine answers (start-up failures surface with the engine's name)."""
        if self.mode != "ray":
            return self
        self._await_start([(i, h.health.remote()) for i, h in enumerate(self.engines)], "start-up")
        return self

    def _await_start(self, pending: list[tuple[int, Any]], what: str) -> None:
        """Wait for the (engine index, health ref) pairs of freshly started actors, at most ``start_timeout_s``
        (None: no limit) -- at start-up and after a restart, where the new actor waits for its placement-group
        bundle to be free again (27dab78 waited for it without a limit) -- then gather them (errors name the
        engine). On timeout: RolloutError naming the pending engines, their hosts and what Ray has free."""
        timeout = getattr(self, "start_timeout_s", None)
        if timeout is not None:
            import ray

            refs = [r for _, r in pending]
            _, late = ray.wait(refs, num_returns=len(refs), timeout=timeout)
            if late:
                hosts = getattr(self, "engine_hosts", None)
                names = [f"engine {i}" + (f" on {hosts[i]}" if hosts else "") for i, r in pending if r in late]
                raise RolloutError(f"{len(late)} of {len(refs)} engines did not start within {timeout:.0f} s "
                                   f"(ray.start_timeout_s) during {what}: still pending: {', '.join(names)}; Ray "
                                   f"cluster resources {ray.cluster_resources()}, free {ray.available_resources()}")
        self._gather(pending, what)

    def _start_actor(self, index: int):
        import ray

        o = self._actor_options
        per_engine = o.get("engine_envs") or []
        env = actor_env(self.config, {**o["env"], **(per_engine[index] if index < len(per_engine) else {})})
        opts: dict[str, Any] = dict(num_cpus=o["num_cpus"], num_gpus=o["num_gpus"], max_concurrency=1,
                                    runtime_env={"env_vars": env}, max_restarts=0)
        if o["name_prefix"]:
            opts["name"] = f"{o['name_prefix']}-{index}-{self.restarts}"
        if o["placement_group"] is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=o["placement_group"],
                placement_group_bundle_index=o["bundle_offset"] + index * o.get("stride", 1))
        actor_cls = ray.remote(VLLMEngine)
        return actor_cls.options(**opts).remote(self.config, index)

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    # ------------------------------------------------------------------ plumbing
    def _call(self, index: int, method: str, *args, **kwargs):
        """Start ``method`` on engine ``index``: a Ray ref (ray mode) or the result (local mode)."""
        engine = self.engines[index]
        if self.mode == "ray":
            return getattr(engine, method).remote(*args, **kwargs)
        try:
            return getattr(engine, method)(*args, **kwargs)
        except RolloutError:
            raise
        except Exception as e:
            raise RolloutError(f"rollout engine {index} failed in {method}: {type(e).__name__}: {e}") from e

    def _gather(self, pending: list[tuple[int, Any]], what: str) -> list[Any]:
        """Results of (engine index, ref-or-value) pairs; a dead Ray actor becomes EngineDeadError naming it."""
        if self.mode != "ray":
            return [v for _, v in pending]
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        out = []
        for index, ref in pending:
            try:
                out.append(ray.get(ref))
            except RayActorError as e:
                raise EngineDeadError(index, f"Ray actor lost during {what}: {type(e).__name__}: "
                                             f"{str(e).splitlines()[0] if str(e) else ''}") from e
            except GetTimeoutError as e:  # pragma: no cover - only with timeouts
                raise EngineDeadError(index, f"no answer during {what}") from e
            except RayTaskError as e:
                cause = e.cause if getattr(e, "cause", None) is not None else e
                raise RolloutError(f"rollout engine {index} failed in {what}: {type(cause).__name__}: "
                                   f"{cause}") from e
        return out

    def _restart(self, index: int, cause: BaseException) -> None:
        """Replace engine ``index`` with a fresh actor and replay the last synced weights into it."""
        if self.mode != "ray" or not self.restart_on_failure:
            raise cause
        import ray

        try:
            ray.kill(self.engines[index], no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass
        self.restarts += 1
        print(f"rollout: engine {index} lost ({type(cause).__name__}: {str(cause)[:200]}); restarting it "
              f"(rollout.restart_on_failure; restart {self.restarts} of this run)", flush=True)
        handle = self._start_actor(index)
        self.engines[index] = handle
        self._await_start([(index, handle.health.remote())], "restart")
        if self.on_call is not None:
            self.on_call("restart")
        if self.weights_version > 0 and not self._last_update_refs and self.resync is not None:
            self.resync()
            return
        if self.weights_version > 0 and not self._last_update_refs:
            raise EngineDeadError(index, f"restarted after {type(cause).__name__}, but the new engine holds the "
                                         "initial checkpoint and the last weight sync cannot be replayed (its buckets "
                                         "were pushed from another process); sync weights again") from cause
        if self._last_update_refs:
            self._gather([(index, handle.begin_bucket_update.remote())], "restart: weight replay")
            for ref in self._last_update_refs:
                self._gather([(index, handle.load_bucket.remote(ref))], "restart: weight replay")
            self._gather([(index, handle.finish_bucket_update.remote())], "restart: weight replay")

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[str] | list[list[int]] | list[Any], sampling: SamplingConfig,
                 max_tokens: list[int | None] | None = None) -> list[list[Completion]]:
        """n completions per prompt, in prompt order; prompts are spread over the engines in contiguous shards.
        ``max_tokens``: a per-prompt cap replacing ``sampling.max_tokens`` where not None (benchmarks)."""
        sampling.validate()
        prompts = list(prompts)
        if not prompts:
            return []
        if self.on_call is not None:
            self.on_call("generate")
        shards = [s for s in _split(len(prompts), self.num_engines)]
        owner = {i: e for e, s in enumerate(shards) for i in s}
        extra = (lambda s: (None if max_tokens is None else [max_tokens[i] for i in s],))
        results: list[Completion] = []
        if self.mode == "local":
            for e, s in enumerate(shards):
                if len(s):
                    results.extend(self._call(e, "generate", [prompts[i] for i in s], list(s), sampling, *extra(s)))
        else:
            pending = [(e, self._call(e, "generate", [prompts[i] for i in s], list(s), sampling, *extra(s)))
                       for e, s in enumerate(shards) if len(s)]
            for e, ref in pending:
                try:
                    results.extend(self._gather([(e, ref)], "generate")[0])
                except EngineDeadError as err:
                    if not self.restart_on_failure:
                        raise
                    self._restart(e, err)
                    s = shards[e]
                    results.extend(self._gather(
                        [(e, self._call(e, "generate", [prompts[i] for i in s], list(s), sampling, *extra(s)))],
                        "generate (after restart)")[0])
        return assemble(results, len(prompts), sampling.n, owner)

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every engine; the results in engine order."""
        return self._gather([(i, self._call(i, method, *args)) for i in range(self.num_engines)], method)

    # ------------------------------------------------------------------ streaming
    def stream_start(self, index: int, submit: list[tuple], sampling: SamplingConfig,
                     abort: list[str] | None = None, max_steps: int = 16, interrupt: list[str] | None = None) -> Any:
        """Start one :meth:`VLLMEngine.stream` call on engine ``index`` (add / abort / interrupt groups, run a few
        engine steps): a Ray ref in ray mode, the result itself in local mode. Collect it with :meth:`stream_wait`.
        ``interrupt`` (partial rollouts): abort those groups keeping their tokens (returned under "interrupted")."""
        if interrupt is None:
            return self._call(index, "stream", submit, sampling, abort, max_steps)
        return self._call(index, "stream", submit, sampling, abort, max_steps, interrupt)

    def stream_wait(self, pending: list[tuple[int, Any]]) -> tuple[int, dict[str, Any]]:
        """The first call of ``pending`` (engine index, ref) to finish: ``(its position in pending, its result)``.
        Ray mode waits for whichever engine answers first; local mode takes them in order."""
        if not pending:
            raise ValueError("stream_wait: nothing pending")
        if self.mode != "ray":
            return 0, pending[0][1]
        import ray

        ready, _ = ray.wait([ref for _, ref in pending], num_returns=1)
        pos = next(i for i, (_, ref) in enumerate(pending) if ref == ready[0])
        return pos, self._gather([pending[pos]], "stream")[0]

    def stream_abort_all(self) -> list[dict[str, Any]]:
        """Abort every streamed group on every engine (none is left running); each engine's ``{"aborted": {key:
        decoded tokens}, "running": 0}``."""
        return self._gather([(i, self._call(i, "stream_abort_all")) for i in range(self.num_engines)], "stream abort")

    def sleep(self, level: int = 1) -> None:
        """GPU colocated mode: every engine frees its KV cache and offloads (1) or drops (2) its weights."""
        self._gather([(i, self._call(i, "sleep", level)) for i in range(self.num_engines)], "sleep")

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo :meth:`sleep` (``tags``: "weights", "kv_cache"; None = everything)."""
        self._gather([(i, self._call(i, "wake_up", tags)) for i in range(self.num_engines)], "wake_up")

    def reset_prefix_cache(self) -> None:
        self._gather([(i, self._call(i, "reset_prefix_cache")) for i in range(self.num_engines)], "prefix reset")

    def weights_checksums(self) -> list[float]:
        return self._gather([(i, self._call(i, "weights_checksum")) for i in range(self.num_engines)], "checksum")

    def health(self) -> list[dict]:
        """One dict per engine (``ok``, ``weights_version``, ``generated_tokens``, ``pid``...); a dead engine is
        reported as ``{"engine_index": i, "ok": False, "error": ...}`` instead of raising."""
        out = []
        for i in range(self.num_engines):
            try:
                out.append(self._gather([(i, self._call(i, "health"))], "health")[0])
            except (EngineDeadError, RolloutError) as e:
                out.append({"engine_index": i, "ok": False, "error": str(e)})
        return out

    def check_transport(self, transport: str) -> None:
        """Every engine checks that the installed vLLM has what ``transport`` needs (RolloutError naming it)."""
        self._gather([(i, self._call(i, "check_transport", transport)) for i in range(self.num_engines)],
                     "transport check")

    def shutdown(self) -> None:
        """Stop every engine (kill the actors / free the in-process engines)."""
        engines, self.engines = self.engines, []
        self._last_update_refs = []
        if self.mode == "ray":
            import ray

            for h in engines:
                try:
                    ray.kill(h, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
        else:
            for e in engines:
                e.shutdown()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


__all__ = ["RolloutClient", "iter_buckets", "iter_buckets_marked", "pack_bucket", "serialize_bucket", "assemble",
           "MiB"]
