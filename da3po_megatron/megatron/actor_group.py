"""``PolicyGroup``: the policy world as Ray actors, one :class:`~da3po_megatron.megatron.policy.PolicyWorker` per rank.

The driver (the RL loop) sees one object with the worker's methods. Each call is sent to ALL ranks at once (they run
in lock-step: Megatron's collectives need every rank) and rank 0's result is returned. Set-up: rank 0's actor picks
the rendezvous address (its node's IP as Ray sees it and a free port) and every actor joins the torch.distributed
world with it (NCCL on GPU, gloo on CPU). Resources per actor: ``num_cpus`` / ``num_gpus``; optionally a placement
group, packed (ranks fill nodes in order, so Megatron's TP groups -- consecutive ranks -- stay within a node) or
spread over nodes, or one made by the trainer (``trainer/cluster/placement.py``: every bundle pinned to its planned
node, rank i on bundle i). Waiting for the ranks' start-up has a timeout whose error names the pending ranks and their
nodes. This follows the one-actor-per-rank "worker group" of verl and NeMo-RL, written here for
Megatron's :class:`PolicyWorker`.

Failures: when a rank's actor dies or raises, the world is broken (the other ranks would wait in a collective): the
group kills all its actors and raises :class:`PolicyGroupError` naming the rank, the method and the cause.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from da3po_megatron.config import Config
from da3po_megatron.megatron.arch import GPTArch
from da3po_megatron.megatron.batching import PolicyBatch, dp_shares
from da3po_megatron.megatron.policy import PolicyWorker

PLACEMENTS = (None, "pack", "spread", "strict_pack", "strict_spread")


class PolicyGroupError(RuntimeError):
    """A policy rank died or failed; the group has been shut down."""


class PolicyGroup:
    """``world_size`` Ray actors, one per rank, forming one Megatron world.

    Args:
        cfg: the run config (:class:`da3po_megatron.config.Config`, resolved); every rank gets it whole.
        arch: the model's architecture in Megatron terms (from the bridge: ``bridge.hf_config.gpt_arch(model_path)``).
        world_size: number of ranks (TP x PP x CP x DP); must equal ``cfg.policy_world_size``.
        num_cpus_per_rank / num_gpus_per_rank: Ray resources per actor (GPU default: 1 when the Ray cluster has at
            least ``world_size`` GPUs, else 0).
        placement: None (Ray's default scheduling) or a placement-group strategy: "pack", "spread", "strict_pack",
            "strict_spread" (one bundle per rank, rank i on bundle i).
        env: extra environment variables for the actors (``OMP_NUM_THREADS`` defaults to ``num_cpus_per_rank``).
        name_prefix: Ray actor names ``{prefix}-rank{i}`` (None = anonymous).
        start_timeout_s: how long to wait for resources / the placement group, and for the ranks' start-up
            (rendezvous + init) in :meth:`wait_ready`.
        placement_group: a ready placement group made elsewhere (rank i on bundle i; ``placement`` must be None).
        rank_hosts: the node each rank was placed on (named in start-up timeouts).
    """

    def __init__(self, cfg: Config, arch: GPTArch, world_size: int, *, num_cpus_per_rank: float = 1,
                 num_gpus_per_rank: float | None = None, placement: str | None = None,
                 env: dict[str, str] | None = None, name_prefix: str | None = None,
                 start_timeout_s: float = 600.0, wait: bool = True, placement_group: Any = None,
                 rank_hosts: list[str] | None = None) -> None:
        import ray

        from da3po_megatron.megatron.policy_config import validate_config

        if not ray.is_initialized():
            raise RuntimeError("PolicyGroup needs ray.init() first")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        # fail in the driver, before any actor starts (without importing megatron-core here: see validate_config)
        validate_config(cfg, arch, world_size, megatron_config=False)
        self.cfg, self.arch = cfg, arch
        self.world_size = world_size
        self.actors: list[Any] = []
        self._pg = None
        self._own_pg = placement_group is None
        self.start_timeout_s = start_timeout_s
        self.rank_hosts = list(rank_hosts) if rank_hosts else None
        if placement_group is not None and placement is not None:
            raise ValueError("give either placement (a strategy) or placement_group, not both")
        if num_gpus_per_rank is None:
            num_gpus_per_rank = 1.0 if ray.cluster_resources().get("GPU", 0) >= world_size else 0.0
        opts: dict[str, Any] = dict(num_cpus=num_cpus_per_rank, num_gpus=num_gpus_per_rank, max_restarts=0,
                                    max_concurrency=1)
        env_vars = {"OMP_NUM_THREADS": str(max(1, int(num_cpus_per_rank))),
                    # in the environment from process start, so the weight-sync NCCL groups only ever replace its
                    # value (rollout/collective.py: NCCL_ENV_AT_START, scoped_env); 0 is torch's default
                    "TORCH_NCCL_BLOCKING_WAIT": os.environ.get("TORCH_NCCL_BLOCKING_WAIT", "0"), **(env or {})}
        opts["runtime_env"] = {"env_vars": env_vars}
        if placement is not None:
            from ray.util.placement_group import placement_group as make_placement_group  # (the argument's name)

            bundle = {"CPU": num_cpus_per_rank, **({"GPU": num_gpus_per_rank} if num_gpus_per_rank else {})}
            self._pg = make_placement_group([dict(bundle) for _ in range(world_size)], strategy=placement.upper())
            ready, _ = ray.wait([self._pg.ready()], timeout=start_timeout_s)
            if not ready:
                raise PolicyGroupError(f"placement group of {world_size} x {bundle} ({placement}) not ready after "
                                       f"{start_timeout_s:.0f} s: not enough resources in the Ray cluster "
                                       f"({ray.cluster_resources()})")
        if placement_group is not None:
            self._pg = placement_group
        actor_cls = ray.remote(PolicyWorker)
        for rank in range(world_size):
            o = dict(opts)
            if name_prefix:
                o["name"] = f"{name_prefix}-rank{rank}"
            if self._pg is not None:
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                o["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=rank)
            self.actors.append(actor_cls.options(**o).remote())
        self._t0 = time.perf_counter()
        self.infos: list[dict] = []
        if wait:
            self.wait_ready()

    def wait_ready(self) -> PolicyGroup:
        """Rendezvous and initialise every rank (process groups, model, optimizer); blocks until all are ready.
        With ``wait=False`` the constructor only schedules the actors -- their resources are requested in order --
        so the caller can start the engines while the ranks import megatron-core and build the model."""
        if self.infos:
            return self
        deadline = time.monotonic() + self.start_timeout_s
        addr, port = self._gather([(0, self.actors[0].rendezvous_address.remote())], "rendezvous",
                                  deadline=deadline)[0]
        self.master_addr, self.master_port = addr, port
        self.infos = self._gather(
            [(r, a.init.remote(self.cfg, self.arch, rank=r, world_size=self.world_size, master_addr=addr,
                               master_port=port))
             for r, a in enumerate(self.actors)], "init", deadline=deadline)
        self.start_seconds = time.perf_counter() - self._t0
        return self

    # ------------------------------------------------------------------ construction from the run config
    @classmethod
    def from_config(cls, cfg: Any, arch: GPTArch, wait: bool = True, placement_group: Any = None,
                    num_gpus_per_rank: float | None = None, rank_hosts: list[str] | None = None) -> PolicyGroup:
        """Build from the run config, with its ``ray`` section's resources and timeouts (``wait``: see
        :meth:`wait_ready`). ``placement_group`` / ``num_gpus_per_rank`` / ``rank_hosts``: the trainer's plan
        (``trainer/cluster/placement.py``); without a placement group, ``ray.spread_policy_nodes`` spreads the ranks
        (STRICT_SPREAD) and ``ray.num_gpus_per_policy_rank`` (None = auto) is their GPU request."""
        return cls(cfg, arch, cfg.policy_world_size,
                   num_cpus_per_rank=cfg.ray.num_cpus_per_policy_rank,
                   num_gpus_per_rank=cfg.ray.num_gpus_per_policy_rank if num_gpus_per_rank is None
                   else num_gpus_per_rank,
                   placement="strict_spread" if cfg.ray.spread_policy_nodes and placement_group is None else None,
                   placement_group=placement_group, rank_hosts=rank_hosts,
                   start_timeout_s=cfg.ray.start_timeout_s, name_prefix=None, wait=wait)

    # ------------------------------------------------------------------ plumbing
    def _gather(self, pending: list[tuple[int, Any]], method: str, deadline: float | None = None) -> list[Any]:
        """Results of (rank, ref) pairs in rank order; the first failure shuts the group down and raises. With a
        ``deadline`` (``time.monotonic()``), ranks still pending then shut the group down and raise, named with
        their nodes."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        refs = {ref: rank for rank, ref in pending}
        results: dict[int, Any] = {}
        remaining = list(refs)
        while remaining:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, remaining = ray.wait(remaining, num_returns=1, timeout=timeout)
            if not done:
                late = sorted(refs[r] for r in remaining)
                self.shutdown()
                where = ", ".join(f"rank {r} on {self.rank_hosts[r]}" if self.rank_hosts else f"rank {r}"
                                  for r in late)
                raise PolicyGroupError(
                    f"policy ranks {late} did not finish {method} within {self.start_timeout_s:.0f} s "
                    f"(ray.start_timeout_s): still pending: {where}; Ray cluster resources "
                    f"{ray.cluster_resources()}, free {ray.available_resources()} (a rank without a placement group "
                    "waits here for resources no node has)")
            ref = done[0]
            rank = refs[ref]
            try:
                results[rank] = ray.get(ref)
            except RayActorError as e:
                self.shutdown()
                raise PolicyGroupError(f"policy rank {rank} died during {method}: {type(e).__name__}: "
                                       f"{str(e).splitlines()[0] if str(e) else ''}") from e
            except RayTaskError as e:
                self.shutdown()
                cause = e.cause if getattr(e, "cause", None) is not None else e
                raise PolicyGroupError(f"policy rank {rank} failed in {method}: {type(cause).__name__}: "
                                       f"{cause}") from e
        return [results[rank] for rank, _ in pending]

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every rank (lock-step) and return all ranks' results, in rank order."""
        if not self.actors:
            raise PolicyGroupError(f"policy group is shut down; cannot call {method}")
        return self._gather([(r, getattr(a, method).remote(*args, **kwargs)) for r, a in enumerate(self.actors)],
                            method)

    def start(self, method: str, *args: Any, **kwargs: Any) -> Callable[[], list[Any]]:
        """Start ``method`` on every rank without waiting; the returned function waits for all ranks' results (errors
        named as in :meth:`call_all`)."""
        if not self.actors:
            raise PolicyGroupError(f"policy group is shut down; cannot call {method}")
        pending = [(r, getattr(a, method).remote(*args, **kwargs)) for r, a in enumerate(self.actors)]
        return lambda: self._gather(pending, method)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on every rank and return rank 0's result."""
        return self.call_all(method, *args, **kwargs)[0]

    def run_on_all(self, fn, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(worker, *args, **kwargs)`` inside every rank's actor (e.g. the weight-sync push); all results."""
        return self.call_all("execute", fn, *args, **kwargs)

    # ------------------------------------------------------------------ batches: each DP rank gets its share
    @classmethod
    def attach(cls, cfg: Config, actors: list[Any], infos: list[dict[str, Any]]) -> PolicyGroup:
        """A group around actors that already exist and are initialised (``infos``: each rank's ``init`` / ``info``
        answer, with its ``dp_rank``): what ``da3po_megatron/bench/control_plane.py`` and
        ``tests/test_control_plane.py`` use to drive stand-in ranks through this dispatch code."""
        g = object.__new__(cls)
        g.cfg, g.arch, g.world_size, g.actors, g.infos = cfg, None, len(actors), list(actors), list(infos)
        g._pg, g._own_pg, g.start_timeout_s, g.rank_hosts = None, False, float(cfg.ray.start_timeout_s), None
        return g

    def _dp_ranks(self) -> list[int]:
        """Each rank's data-parallel rank (from its ``init`` answer)."""
        return [int(info["dp_rank"]) for info in self.infos]

    def _call_sharded(self, method: str, batch: PolicyBatch, mini_batch: int | None, **kwargs: Any) -> Any:
        """``method(share, **kwargs)`` on every rank, each rank getting only its data-parallel share of ``batch``.

        The driver splits the batch as the ranks do (:func:`batching.dp_shares`: the whole batch for log-probs,
        each mini-batch for training) and puts each DP share into the object store once (``ray.put``: every row is
        serialized exactly once per call, whatever the number of ranks); the ranks of one DP rank (its TP / PP
        ranks) receive the same object reference, which Ray resolves on their node (zero-copy for numpy buffers on
        one node). Only rank 0's answer is brought back (the others answer None). Before this (27dab78) the batch was
        an argument of every rank's ``.remote()``: serialized once per rank and unpickled whole by each.
        """
        import ray

        if not self.actors:
            raise PolicyGroupError(f"policy group is shut down; cannot call {method}")
        on_call = getattr(self, "on_call", None)  # the trainer's record of device-memory events (OffloadCycle.watch)
        if on_call is not None:
            on_call(method)
        dp_of = self._dp_ranks()
        dp = max(dp_of) + 1
        shares = dp_shares(batch.lengths(), dp, mini_batch)
        parts = [batch.share(rows) for rows in shares]
        refs = [ray.put(p) for p in parts]
        self.sent_bytes = getattr(self, "sent_bytes", {})
        self.put_counts = getattr(self, "put_counts", {})
        self.sent_bytes[method] = self.sent_bytes.get(method, 0) + sum(p.nbytes for p in parts)
        self.put_counts[method] = self.put_counts.get(method, 0) + len(refs)
        pending = [(r, a.execute.remote(_on_share, method, refs[dp_of[r]], r == 0, kwargs))
                   for r, a in enumerate(self.actors)]
        return self._gather(pending, method)[0]

    # ------------------------------------------------------------------ the worker's API
    def compute_logprobs(self, batch: PolicyBatch, return_entropy: bool = False, packing: bool | None = None):
        """Per-token log-probs of every response as a float32 :class:`~.batching.Ragged` (a pair with
        ``return_entropy``), each DP rank computing its share."""
        return self._call_sharded("compute_logprobs", batch, None, return_entropy=return_entropy, packing=packing,
                                  as_arrays=True)

    def train_step(self, batch: PolicyBatch) -> dict[str, float]:
        """One RL update; each DP rank receives the rows it trains on (its share of every mini-batch)."""
        return self._call_sharded("train_step", batch, self.cfg.ppo_mini_batch_responses)

    def save(self, path: str, fully_parallel: bool = False) -> None:
        self.call("save", str(path), fully_parallel=fully_parallel)

    def load(self, path: str, load_optimizer: bool | None = None, fully_parallel: bool = False) -> dict[str, Any]:
        return self.call("load", str(path), load_optimizer=load_optimizer, fully_parallel=fully_parallel)

    def save_model(self, path: str) -> None:
        self.call("save_model", str(path))

    def load_model(self, path: str) -> None:
        self.call("load_model", str(path))

    def info(self) -> list[dict[str, Any]]:
        """Every rank's :meth:`PolicyWorker.info` (rank order)."""
        return self.call_all("info")

    def shutdown(self) -> None:
        """Kill the actors (and the placement group). Idempotent."""
        import ray

        actors, self.actors = self.actors, []
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        if self._pg is not None and self._own_pg:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._pg)
            except Exception:  # noqa: BLE001
                pass
            self._pg = None

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        if os.environ.get("DA3PO_KEEP_ACTORS") != "1" and getattr(self, "actors", None):
            try:
                self.shutdown()
            except Exception:  # noqa: BLE001
                pass


def _on_share(worker: Any, method: str, batch: PolicyBatch, keep: bool, kwargs: dict[str, Any]) -> Any:
    """Run inside a rank (``PolicyWorker.execute``): ``method`` on its share; the answer only where ``keep``. Routes
    by reference (``rollout/route_refs.RouteRefs``) are fetched here, by the rank, from the object store: the
    driver sent refs only (issue 60)."""
    if hasattr(batch.routed_experts, "fetch"):
        batch.routed_experts = batch.routed_experts.fetch()
    out = getattr(worker, method)(batch, **kwargs)
    return out if keep else None
