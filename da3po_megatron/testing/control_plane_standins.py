"""The stand-in actors of :mod:`da3po_megatron.bench.control_plane` (split out of it): engines and policy ranks that do
no model compute but take, return and serialize what the real ones do (see that module's docstring).

MoE (``moe=`` a :class:`RouteShape`): the engine also returns, for each completion
``rollout/routes.routes_selected`` picks at ``SamplingConfig.routes_fraction`` (every one under R3), the routes the
real engine returns -- ``[P + R - 1, MoE layers, top_k]`` uint8 (``rollout/types.route_dtype``), the prompt's rows
shared by the group's samples as with the prefix cache -- by reference, as the real engine does in its Ray actor
(``rollout/route_refs.by_reference``: one object per group, refs in the completions); a rank fetches its share's
routes through the real dispatch (``actor_group._on_share``), reports their bytes, and answers ``routing_stats``
as the real ``PolicyWorker`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

VOCAB = 151_643  # Qwen's vocabulary (qwen.tiktoken ranks)
POOL_OFFSETS = 4096  # MoE stand-in: routes are slices of one random pool at offsets below this


@dataclass(frozen=True)
class RouteShape:
    """The routes of a named MoE: MoE layers x top-k, experts (uint8 up to 254)."""

    name: str
    layers: int
    top_k: int
    experts: int


MOE_MODELS = {"qwen3-30b-a3b": RouteShape("Qwen3-30B-A3B", 48, 8, 128)}


class StandInEngine:
    """A rollout engine that decodes nothing: completions of the recorded shape (see the module docstring)."""

    def __init__(self, index: int, max_response: int, mean_response: float, moe: RouteShape | None = None) -> None:
        self.index, self.max_response, self.mean_response, self.moe = index, max_response, mean_response, moe
        self._pool = None  # MoE: random routes to slice from (a real engine captures them; drawing is stand-in work)
        if moe is not None:
            rows = POOL_OFFSETS + max_response + 4096
            self._pool = np.random.default_rng(index).integers(0, moe.experts, (rows, moe.layers, moe.top_k),
                                                               dtype=np.uint8)

    def _routes(self, rng: Any, n: int) -> np.ndarray:
        """``n`` positions' routes: a slice of the pool at a random offset."""
        at = int(rng.integers(0, POOL_OFFSETS))
        return self._pool[at:at + n]

    def ready(self) -> bool:
        return True

    def generate(self, prompts: list, prompt_indices: list[int], sampling: Any, max_tokens: Any = None) -> list:
        from da3po_megatron.rollout.route_refs import by_reference
        from da3po_megatron.rollout.routes import routes_selected
        from da3po_megatron.rollout.types import Completion

        out = []
        for pid, gi in zip(prompts, prompt_indices):
            uid = int(pid[0])
            rng = np.random.default_rng([uid, int(sampling.seed or 0)])
            n = np.minimum(rng.gamma(2.0, self.mean_response / 2.0, sampling.n).astype(np.int64) + 1,
                           sampling.max_tokens)
            group, routes, prompt_rows = [], [], None
            for j in range(sampling.n):
                k = int(n[j])
                ids = rng.integers(0, VOCAB, k, dtype=np.int64).tolist()
                lps = (-rng.exponential(0.5, k)).tolist()
                text = ("step " * k)[: 4 * k]
                r = None
                if self.moe is not None and routes_selected(gi, j, getattr(sampling, "routes_fraction", 1.0)):
                    if prompt_rows is None:  # the prompt computed once, its routes shared (prefix cache)
                        prompt_rows = self._routes(rng, len(pid))
                    r = np.concatenate([prompt_rows, self._routes(rng, k - 1)])
                routes.append(r)
                group.append(Completion(prompt_index=gi, sample_index=j, prompt_token_ids=list(pid), token_ids=ids,
                                        text=text, logprobs=lps,
                                        finish_reason="length" if k >= sampling.max_tokens else "stop", num_tokens=k))
            # as VLLMEngine.generate: the group's routes put into the object store once, refs in the completions
            for c, r in zip(group, by_reference([routes], [len(pid)])[0]):
                c.routed_experts = r
            out += group
        return out

    def health(self) -> dict:
        return {"engine": self.index}


class StandInRank:
    """A policy rank that computes nothing: it keeps its data-parallel share as ``PolicyWorker`` does, touches each
    of its tokens, and acknowledges (``compute_logprobs`` answers in the worker's return format)."""

    def __init__(self, rank: int, dp: int, mini_batch_responses: int, keep_rows: bool = False) -> None:
        # Megatron's rank order with TP innermost: ranks dp_rank * tp .. dp_rank * tp + tp - 1 share one DP rank
        self.rank, self.dp, self.mini, self.keep_rows = rank, dp, mini_batch_responses, keep_rows
        self.dp_rank = rank // max(1, self.tp)
        self.received: list[dict] = []

    tp = 1

    def info(self) -> dict:
        return {"rank": self.rank, "dp_rank": self.dp_rank, "dp": self.dp, "tp_rank": self.rank % self.tp,
                "pp_rank": 0, "tp": self.tp, "pp": 1}

    def execute(self, fn, *args, **kwargs):
        return fn(self, *args, **kwargs)

    def _schedule(self):
        from da3po_megatron.megatron.schedule import ForwardSchedule

        return ForwardSchedule(model=None, device="cpu", te=False, thd=False, pad_id=0, dp=self.dp,
                               dp_rank=self.dp_rank, tp_rank=0)

    def _touch(self, batch, rows) -> int:
        tokens = 0
        routes = getattr(batch, "routed_experts", None)
        for i in rows:
            tokens += len(batch.prompt_ids[i]) + len(batch.response_ids[i])
            if routes is not None:  # the replayed routes of its share (R3)
                tokens += 0 * int(routes[i].shape[0])
            if batch.old_logprobs is not None:
                tokens += 0 * len(batch.old_logprobs[i])
        return tokens

    def _note(self, method: str, batch, rows) -> None:
        held = getattr(batch, "held_rows", None)
        routes = getattr(batch, "routed_experts", None)  # fetched by this rank (actor_group._on_share)
        self.received.append({"method": method, "rows": len(rows), "batch_rows": len(batch),
                              "held_rows": len(batch.response_ids) if held is None else int(len(held)),
                              "tokens": self._touch(batch, rows),
                              "route_bytes": 0 if routes is None else int(routes.values.nbytes)})
        if self.keep_rows:  # (tests) which rows it held and which it worked on
            self.received[-1].update(held=list(range(len(batch))) if held is None else [int(i) for i in held],
                                     worked=sorted(int(i) for i in rows))

    def compute_logprobs(self, batch, return_entropy: bool = False, packing: bool | None = None,
                         as_arrays: bool = False):
        shard = self._schedule().dp_shard(batch)
        self._note("compute_logprobs", batch, shard)
        return standin_logprobs(batch, as_arrays)

    def train_step(self, batch) -> dict:
        n = len(batch)
        sched = self._schedule()
        rows: list[int] = []
        for s in range(0, n, self.mini):
            rows += sched.dp_shard(batch, list(range(s, min(s + self.mini, n))))
        self._note("train_step", batch, rows)
        return {"loss": 0.0, "grad_norm": 1.0, "lr": 1e-6, "clipfrac_low": 0.0, "clipfrac_high": 0.0,
                "approx_kl": 0.0, "entropy": float("nan"), "response_tokens": float(batch.num_response_tokens()),
                "tokens_per_s": 0.0, "num_microbatches": 1, "num_updates": max(1, n // self.mini),
                "update_ratio": 1e-6, "skipped_updates": 0, "nonfinite_loss_updates": 0,
                "nonfinite_grad_updates": 0, "update_ratio_refused_updates": 0, "trailing_skipped_updates": 0,
                "step": 1, "time_s": 0.0, "loss_backend": "none"}

    def routing_stats(self) -> dict[str, float]:
        """The real worker's answer (``PolicyWorker.routing_stats``): here every route was "used"."""
        return {"router_agreement": 1.0, "router_agreement_own": 1.0, "route_pairs": 0.0}

    def report(self) -> list[dict]:
        return self.received


def _warm_rank(rank: StandInRank) -> bool:
    rank._schedule()
    return True


def standin_logprobs(batch, as_arrays: bool = False):
    """The worker's answer shape: every response's per-token log-probs (zeros here), lists or one float32 array."""
    from da3po_megatron.megatron import batching

    if as_arrays:  # arrays end to end (after issue 36)
        lens = batch.response_lengths()
        offsets = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        return batching.Ragged(np.zeros(int(offsets[-1]), dtype=np.float32), offsets)
    lens = [len(r) for r in batch.response_ids]
    flat = [0.0] * sum(lens)  # the real worker: packed.tolist(), then one slice per response
    out, o = [], 0
    for n in lens:
        out.append(flat[o:o + n])
        o += n
    return out


