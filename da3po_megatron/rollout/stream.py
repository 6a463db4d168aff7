"""Per-request streaming with abort on one engine: the ``stream`` / ``stream_abort_all`` methods of
:class:`~da3po_megatron.rollout.engine.VLLMEngine` (mixed in), used by streaming dynamic sampling
(``rollout.mode=streaming``, driven by ``trainer/generation/collect.py`` and ``trainer/generation/async_rollout.py``).

It runs vLLM's own request-level engine loop (``LLMEngine.add_request`` / ``step`` / ``abort_request``, what
``LLM.generate`` runs inside) for a bounded number of engine steps per call, so the driver adds and aborts requests
between calls while the engine batches continuously. Why not ``AsyncLLM``: in vLLM 0.32 it always runs its engine core
in another process (``AsyncMPClient``; ~20 s start-up on CPU against ~3 s in-process) and its batches depend on
request arrival times, so seeded sampling would no longer be reproducible; here an engine's batches depend only on the
sequence of calls it receives. The asynchrony lives across engines (one Ray actor each) and between the driver and its
engines. Each sample of a group is its own request with seed ``seed_for(prompt) + j``, the seed vLLM's ``n`` fan-out
gives sample j, so a group samples what ``generate`` samples.

Partial rollouts (``rollout.partial_rollouts``, driven by ``trainer/generation/async_rollout.py``): ``interrupt`` aborts
groups *keeping* what they decoded (tokens, log-probs, which samples finished), and a submission may carry a
continuation (``cont``: per sample the response so far, whether it is already finished, and the seed of its next
segment): each unfinished sample becomes a request from prompt + its prefix with ``max_tokens`` reduced by the prefix's
length. The engine returns segments; the driver stitches them and records which policy version produced each token.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from da3po_megatron.rollout.types import Completion, RolloutError, SamplingConfig


def seed_for(sampling: SamplingConfig, prompt_index: int) -> int | None:
    """Request seed of prompt ``prompt_index``: ``seed + i * n`` (vLLM adds the sample index for each of the n)."""
    return None if sampling.seed is None else sampling.seed + prompt_index * sampling.n


def _delta_kind():
    from vllm.sampling_params import RequestOutputKind

    return RequestOutputKind.DELTA


class _StreamGroup:
    """The n requests of one streamed group: tokens, log-probs and text accumulated from vLLM's delta outputs."""

    def __init__(self, index: int, prompt_ids: list[int], n: int, cont: dict | None = None) -> None:
        self.index, self.prompt_ids, self.n = index, prompt_ids, n
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[float]] = [[] for _ in range(n)]
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.reasons = [""] * n
        self.finished = [bool(d) for d in cont["done"]] if cont else [False] * n
        self.ran = [not f for f in self.finished]  # the samples this segment runs (routes: only theirs)
        self.prefix: list[list[int]] | None = [list(map(int, x)) for x in cont["prefix"]] if cont else None
        self.decoded = 0

    def extend(self, j: int, sample: Any, finished: bool, logprobs: bool) -> int:
        new = list(sample.token_ids)
        self.tokens[j] += new
        if logprobs and sample.logprobs:
            self.logprobs[j] += [float(step[t].logprob) for t, step in zip(new, sample.logprobs)]
        self.texts[j].append(sample.text)
        if finished:
            self.finished[j], self.reasons[j] = True, str(sample.finish_reason)
        self.decoded += len(new)
        return len(new)

    @property
    def done(self) -> bool:
        return all(self.finished)


class StreamingMixin:
    """``stream`` / ``stream_abort_all`` for an engine holding ``self.llm`` (a ``vllm.LLM``), ``self._streams``,
    ``self._stale``, ``self.engine_index``, ``self.generated_tokens`` and ``prompt_token_ids`` / ``sampling_params``."""

    def stream(self, submit: list[tuple], sampling: SamplingConfig, abort: list[str] | None = None,
               max_steps: int = 16, interrupt: list[str] | None = None) -> dict[str, Any]:
        """Add groups, abort groups, then run engine steps until a group finishes or ``max_steps`` steps ran.

        ``submit``: ``(key, prompt, prompt_index, max_tokens or None)`` per group; its ``sampling.n`` samples are
        requests ``key/j`` seeded ``seed_for(sampling, prompt_index) + j``. ``abort``: group keys to drop (their decoded
        tokens are reported, their samples never). Returns ``{"finished": [(key, [Completion] * n)], "aborted":
        {key: decoded tokens}, "running": groups still unfinished, "decoded": tokens decoded by this call}``.

        Partial rollouts: a ``submit`` entry may carry a fifth item, ``cont = {"prefix": [tokens so far] * n, "done":
        [bool] * n, "seeds": [seed] * n}``; its finished Completions then hold only this segment's tokens (a sample
        done before: empty) and, for the samples it ran, the text of the whole response. ``interrupt``: group keys to
        abort keeping their segments, returned as ``"interrupted": {key: {"token_ids", "logprobs", "finished",
        "reasons", "texts"}}`` (per sample; the engine holds nothing of them afterwards).
        """
        sampling.validate()
        if self._stale:
            raise RolloutError(self._stale)
        eng = self.llm.llm_engine
        aborted = self._stream_abort(abort or [])
        interrupted = self._stream_interrupt(interrupt or [], sampling)
        for key, prompt, index, max_tokens, *rest in submit:
            cont = rest[0] if rest else None
            if key in self._streams:
                raise RolloutError(f"engine {self.engine_index}: stream group {key!r} is already running")
            ids = self.prompt_token_ids(prompt, sampling.apply_chat_template)
            group = self._streams[key] = _StreamGroup(index, ids, sampling.n, cont)
            base = seed_for(sampling, index)
            for j in range(sampling.n):
                if group.finished[j]:  # a continuation: this sample finished in an earlier segment
                    continue
                params = self.sampling_params(replace(sampling, n=1), index)
                params.seed = None if base is None else base + j
                params.output_kind = _delta_kind()
                cap = int(max_tokens) if max_tokens is not None else sampling.max_tokens
                if max_tokens is not None:
                    params.max_tokens = cap
                request_ids = ids
                if cont is not None:  # continue from prompt + the response so far, with the segment's own seed
                    request_ids = ids + group.prefix[j]
                    params.seed = cont["seeds"][j]
                    params.max_tokens = cap - len(group.prefix[j])
                    if params.max_tokens < 1:
                        raise RolloutError(f"engine {self.engine_index}: continuation of {key!r} sample {j} has "
                                           f"{len(group.prefix[j])} tokens already, its cap is {cap}")
                eng.add_request(f"{key}/{j}", {"prompt_token_ids": request_ids}, params)
            if group.done:  # nothing left to run (cannot happen for a group interrupted while running)
                raise RolloutError(f"engine {self.engine_index}: continuation of {key!r} has every sample finished")
            del group
        finished: list[tuple[str, list[Completion]]] = []
        decoded = steps = 0
        while not finished and steps < max_steps and eng.has_unfinished_requests():
            steps += 1
            for out in eng.step():
                key, _, j = out.request_id.rpartition("/")
                group = self._streams.get(key)
                if group is None:  # a request aborted in this call may still report its last tokens
                    continue
                decoded += group.extend(int(j), out.outputs[0], out.finished, sampling.logprobs)
                if group.done:
                    finished.append((key, self._stream_completions(key, self._streams.pop(key), sampling)))
        self.generated_tokens += decoded
        out = {"finished": finished, "aborted": aborted, "running": len(self._streams), "decoded": decoded}
        if interrupt is not None:
            out["interrupted"] = interrupted
        return out

    def stream_abort_all(self) -> dict[str, Any]:
        """Abort every running stream group; ``{"aborted": {key: decoded tokens}, "running": 0}`` (the engine is idle
        afterwards: RolloutError if vLLM still holds requests)."""
        aborted = self._stream_abort(list(self._streams))
        eng = self.llm.llm_engine
        steps = 0
        while eng.has_unfinished_requests() and steps < 4:  # let the engine core drop the aborted requests
            eng.step()
            steps += 1
        left = eng.get_num_unfinished_requests()
        if left:
            raise RolloutError(f"engine {self.engine_index}: {left} requests still running after abort")
        return {"aborted": aborted, "running": len(self._streams)}

    def _stream_abort(self, keys: list[str]) -> dict[str, int]:
        out, ids = {}, []
        for key in keys:
            group = self._streams.pop(key, None)
            if group is None:
                continue
            out[key] = group.decoded
            ids += [f"{key}/{j}" for j in range(group.n) if not group.finished[j]]
        if ids:
            self.llm.llm_engine.abort_request(ids)
        return out

    def _stream_interrupt(self, keys: list[str], sampling: SamplingConfig) -> dict[str, dict[str, Any]]:
        """Abort the running samples of ``keys`` and hand back what each group decoded in this segment."""
        out = {}
        for key in keys:
            group = self._streams.get(key)
            if group is None:
                continue
            comps = self._stream_completions(key, group, sampling)
            out[key] = {"token_ids": [c.token_ids for c in comps], "logprobs": [c.logprobs for c in comps],
                        "finished": list(group.finished), "reasons": list(group.reasons),
                        "texts": [c.text for c in comps], "routed_experts": [c.routed_experts for c in comps]}
        self._stream_abort(list(out))
        return out

    def _stream_routes(self, key: str, group: _StreamGroup, sampling: SamplingConfig) -> list[Any]:
        """MoE engines with ``return_routed_experts`` (worker capture): the routes of the group's samples that ran
        in this segment and finished (request ``key/j``: prompt + its prefix + this segment's tokens), selected by
        ``SamplingConfig.routes_fraction``, by reference (``route_refs.by_reference``); None for the others (a
        sample finished in an earlier segment keeps that segment's, ``async_partial.Partial``). Captures of the
        samples not taken (interrupted, aborted) are dropped with the next weight update (``worker_ext``)."""
        from da3po_megatron.rollout.route_refs import by_reference
        from da3po_megatron.rollout.routes import routes_selected
        from da3po_megatron.rollout.worker_ext import routes_from_wire

        take = [j for j in range(group.n) if group.ran[j] and group.finished[j]]
        if getattr(self, "routes", None) is None or self.routes.get("source") != "worker" or not take:
            return [None] * group.n
        wanted = [(f"{key}/{j}", None, [int(t) for t in (*group.prompt_ids, *(group.prefix[j] if group.prefix
                                                                               else ()), *group.tokens[j])][:-1])
                  for j in take]
        keep = [routes_selected(group.index, j, sampling.routes_fraction) for j in take]
        got = routes_from_wire(self.llm.collective_rpc("da3po_routes_take", args=(wanted, keep))[0])
        rows: list[Any] = [None] * group.n
        for j, r in zip(take, got):
            rows[j] = r
        return by_reference([rows], [len(group.prompt_ids)])[0]

    def _stream_completions(self, key: str, group: _StreamGroup, sampling: SamplingConfig) -> list[Completion]:
        routes = self._stream_routes(key, group, sampling)
        comps = []
        for j in range(group.n):
            tokens, lps = group.tokens[j], group.logprobs[j]
            if sampling.logprobs and len(lps) != len(tokens):
                raise RolloutError(f"engine {self.engine_index}: stream group {key!r} sample {j}: log-probs missing "
                                   f"for some of its {len(tokens)} tokens")
            text = "".join(group.texts[j])
            if group.prefix is not None:  # a continuation: the whole response's text (segments may split a character)
                text = self.tokenizer.decode(group.prefix[j] + tokens, skip_special_tokens=True) if (
                    tokens or group.texts[j]) else ""
            comps.append(Completion(prompt_index=group.index, sample_index=j, prompt_token_ids=list(group.prompt_ids),
                                    token_ids=tokens, text=text, logprobs=lps,
                                    finish_reason=group.reasons[j], num_tokens=len(tokens),
                                    routed_experts=routes[j]))
        return comps
