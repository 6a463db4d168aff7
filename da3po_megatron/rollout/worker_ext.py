"""vLLM worker extension: receive HF-named weights in bounded safetensors buckets and load them in place.

vLLM mixes the class named by ``LLM(worker_extension_cls=...)`` into every worker, and ``llm.collective_rpc(name,
args)`` calls its methods by name on every worker (in-process, in vLLM's worker processes, inside a Ray actor), so no
pickled callables are needed.

One update is a session, the same one vLLM's own weight-transfer engines run (``vllm/distributed/weight_transfer``):

1. :meth:`da3po_begin_weight_update` -- ``initialize_layerwise_reload``: each layer's kernel tensors are remembered
   and its weight loaders wrapped, so a layer is (re)processed once all of its checkpoint tensors arrived. Layers
   that hold only non-persistent buffers (RoPE's ``cos_sin_cache``: derived from the config, never in a checkpoint)
   expect nothing (see :func:`_expect_nothing_from_derived_layers`), and so does a tied output head, which receives
   no tensor of its own (:func:`tied_followers`);
2. :meth:`da3po_load_bucket` -- ``model.load_weights`` on the tensors of one bucket (any number of buckets; a layer
   whose tensors straddle two buckets waits for the second);
3. :meth:`da3po_finish_weight_update` -- ``finalize_layerwise_reload``, the tied layers refreshed
   (:func:`refresh_tied_layers`), cache resets, and a check that every model parameter was written.

Tied embeddings (Qwen3-0.6B/1.7B/4B, SmolLM2, Llama-3.2): vLLM's output head shares its ``weight`` Parameter with the
input embedding and receives no tensor of its own (its loader skips ``lm_head.*``). The session writes the new
embedding into that shared Parameter, but the head is a layer of its own: it gets no ``process_weights_after_loading``
and keeps whatever that step derived from the OLD weight -- on CPU the prepacked GEMM weight behind
``layer.cpu_linear`` -- so the engine samples from the new embedding with the old head. ``refresh_tied_layers`` re-runs
the weight post-processing of every layer that shares a Parameter with a written one and received nothing itself (a
no-op on CUDA's unquantized head, which reads ``layer.weight`` directly). The "every parameter written" check cannot see
the head (``named_parameters`` lists a shared Parameter once), so the tests compare log-probs of tied models.

This is what ``Worker.reload_weights(weights_iterator=...)`` does in one call; splitting it keeps the memory bound of a
bucket while a layer's q/k/v or gate/up still land in one fused parameter correctly. Plain ``model.load_weights``
outside a session fails on CPU (vLLM repacks weights; parameters become size 0), see the shared notes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from da3po_megatron.rollout.collective_receive import CollectiveReceiverMixin
from da3po_megatron.rollout.ipc import IpcReceiverMixin


def _unpack(payload) -> dict:
    """The tensors of one bucket payload (see :meth:`WeightSyncExtension.da3po_load_bucket`)."""
    import warnings

    import torch

    if isinstance(payload, dict):
        return payload
    if isinstance(payload, (bytes, bytearray, memoryview)):
        from safetensors.torch import load as st_load

        return st_load(bytes(payload))
    arrays, meta = payload
    if len(arrays) != len(meta):
        raise ValueError(f"packed bucket: {len(arrays)} buffers for {len(meta)} tensor descriptions")
    out = {}
    with warnings.catch_warnings():  # read-only views of Ray's shared memory: only read, then copied into params
        warnings.simplefilter("ignore", UserWarning)
        for raw, (name, dtype, shape) in zip(arrays, meta):
            flat = raw if isinstance(raw, torch.Tensor) else torch.from_numpy(raw)
            out[name] = flat.view(getattr(torch, dtype)).view(shape)
    return out


def _expect_nothing_from_derived_layers(model) -> int:
    """Mark layers whose only tensors are non-persistent buffers as loading nothing; returns how many.

    vLLM 0.32's layerwise reload counts every parameter AND buffer of a layer as loadable, so a ``RotaryEmbedding``
    (one non-persistent ``cos_sin_cache`` buffer, computed from rope_theta / head_dim) waits for a tensor that no
    checkpoint holds. At finalize vLLM puts the remembered cache back -- the values stay right -- but logs
    "RotaryEmbedding: Failed to load weights" on every sync. With nothing expected (``load_numel_total = 0``) finalize
    takes the same restore path without the warning. Parameters and persistent buffers (real checkpoint tensors,
    e.g. a tied model's head) are untouched, so a layer that should have received weights still warns.
    """
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    n = 0
    for layer in model.modules():
        info = get_layerwise_info(layer)
        if info.kernel_tensors is None or not info.can_load():
            continue
        params, buffers = info.kernel_tensors
        if not params and buffers and set(buffers) <= info.kernel_non_persistent_buffers:
            info.load_numel_total = 0
            n += 1
    return n


def tied_followers(model) -> list:
    """The layers whose every parameter is a Parameter another layer owns under its canonical name (a tied model's
    output head: ``named_parameters`` lists the shared embedding weight once, under the embedding). Called before a
    reload session starts, while the layers still share the Parameter objects."""
    canonical = {id(p): n for n, p in model.named_parameters()}  # a shared Parameter: listed once, first owner
    followers = []
    for mname, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        if own and all(canonical.get(id(p)) not in (None, f"{mname}.{n}") for n, p in own):
            followers.append(module)
    return followers


def _expect_nothing_from_tied_followers(followers: list) -> None:
    """A tied head receives no tensor (the checkpoint's ``lm_head.weight`` is skipped; the embedding's tensor lands in
    the shared Parameter), so its layer would wait for a load that never comes and finalize would log
    "ParallelLMHead: Failed to load weights". With nothing expected, finalize puts its kernel tensors (the shared
    Parameter) back without the warning; :func:`refresh_tied_layers` then re-derives what it computed from them."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    for layer in followers:
        get_layerwise_info(layer).load_numel_total = 0


def refresh_tied_layers(model, loaded: set[str]) -> list[str]:
    """Re-run ``quant_method.process_weights_after_loading`` on layers that share a Parameter with another layer and
    had none of their own names in ``loaded`` (the tied output head); returns the refreshed layers' names."""
    owners: dict[int, list[tuple[str, str, object]]] = {}
    for mname, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((mname, pname, module))
    refreshed = []
    for shared in owners.values():
        if len(shared) < 2 or not any(f"{m}.{p}" in loaded for m, p, _ in shared):
            continue
        for mname, pname, module in shared:
            method = getattr(module, "quant_method", None)
            if f"{mname}.{pname}" in loaded or not hasattr(method, "process_weights_after_loading"):
                continue
            method.process_weights_after_loading(module)
            refreshed.append(mname)
    return refreshed


def _cpu_moe_layers(model) -> list[tuple[str, object, object]]:
    """``(name, layer, cpu_experts)`` of every fused-MoE layer whose kernel is vLLM's CPU grouped GEMM."""
    out = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or "CPU" not in type(experts).__name__ or not hasattr(module, "w13_weight"):
            continue
        out.append((name, module, experts))
    return out


def cpu_moe_prepack_on_update(model) -> Callable[[], list[str]]:
    """Make a weight update run the CPU MoE kernel's weight step on the new experts; returns the undo function
    (which returns the names of the layers it applied to). Install it before a layerwise-reload session starts
    and undo it after the session is finalised (:class:`WeightSyncExtension` does both; so does
    :meth:`WeightSyncExtension.da3po_reload_from_path` around ``Worker.reload_weights``).

    Why (vLLM 0.32): on the FIRST load ``UnquantizedFusedMoEMethod._setup_kernel``
    (``layers/fused_moe/unquantized_fused_moe_method.py`` 187-205) calls the CPU experts'
    ``process_weights_after_loading`` (``fused_moe/experts/cpu_moe.py`` 208-218), which zero-pads each expert's
    intermediate dimension to the kernel's alignment (``_pad_moe_intermediate`` 220-239, ``round_up(I, 32)`` for the
    vec and AMX kernels, ``_padded_intermediate_size`` 105-109) and prepacks ``w13_weight`` [E, 2I', H] and
    ``w2_weight`` [E, H, I'] into the grouped-GEMM layout. On a weight update (``is_weight_update``) it skips that
    step. A layerwise reload (``model_loader/reload/layerwise.py``) remembers the live, padded and prepacked
    tensors as the layer's kernel tensors (line 109), rebuilds the layer in checkpoint shape [E, 2I, H] from the
    metadata recorded before the first processing, loads, runs ``quant_method.process_weights_after_loading``
    (line 388: no padding, no prepack) and copies the result into the kernel tensors
    (``_copy_and_restore_kernel_tensors``, line 425). So:

    - when ``I`` is not a multiple of the alignment (tiny Qwen3-MoE at real proportions: I=48 -> I'=64) the copy
      fails: "The size of tensor a (128) must match the size of tensor b (96) at non-singleton dimension 1";
    - when it is (Qwen3-30B-A3B: 768; the old tiny model: 64) the copy succeeds but leaves raw, unpacked experts
      in the kernel's tensors: a reload of the same weights moved log-probs by up to ~8.

    Here the layer's ``quant_method.process_weights_after_loading`` gets (as an instance attribute, for the session
    only) the skipped CPU step appended, so padding and prepacking happen on the freshly loaded layer BEFORE vLLM
    copies it into the kernel tensors -- same shapes, packed data, the first load's exact path. A layer that
    receives nothing keeps its kernel tensors untouched (they are already packed). CUDA kernels take their
    weights from ``convert_to_unquantized_kernel_format``, which the update does run, and are left alone; the
    zentorch path returns early inside the same call (cpu_moe.py 209-211).
    """
    patched = []
    for name, module, experts in _cpu_moe_layers(model):
        method = module.quant_method
        original = method.process_weights_after_loading  # bound method of the class

        def process(layer, _original=original, _experts=experts):
            _original(layer)
            _experts.process_weights_after_loading(layer)  # pad + prepack, as on the first load
            applied.append(name_of[id(layer)])

        method.process_weights_after_loading = process
        patched.append((name, module, method))
    name_of = {id(m): n for n, m, _ in patched}
    applied: list[str] = []

    def undo() -> list[str]:
        for _, _, method in patched:
            method.__dict__.pop("process_weights_after_loading", None)
        return sorted(set(applied))

    return undo


def routes_to_wire(routes: list) -> list:
    """Routes as ``(bytes, shape, dtype)`` (None stays None) for ``collective_rpc``'s answer. An engine of TP > 1 runs
    its core in another process: vLLM 0.32 msgpack-encodes a utility call's arguments and answer
    (``v1/serial_utils.py`` 211-218: an untyped answer without ``VLLM_ALLOW_INSECURE_SERIALIZATION``) and its
    multiprocessing executor pickles them to the workers, so numpy arrays came back as raw buffers or failed ("cannot
    pickle memoryview objects", found by the 30B recipe's engine TP 4 in tests/test_shipped_layouts.py). Bytes, lists
    and strings cross every hop; :func:`routes_from_wire` undoes it (and passes arrays of an in-process core)."""
    return [None if r is None else (r.tobytes(), list(r.shape), r.dtype.str) for r in routes]


def routes_from_wire(routes: list) -> list:
    """Inverse of :func:`routes_to_wire`."""
    import numpy as np

    return [r if r is None or isinstance(r, np.ndarray) else
            np.frombuffer(bytes(r[0]), dtype=np.dtype(r[2])).reshape(r[1]).copy() for r in routes]


class WeightSyncExtension(CollectiveReceiverMixin, IpcReceiverMixin):
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.model_runner``, ``self.vllm_config``)."""

    def _da3po_model(self):
        return self.model_runner.get_model()

    def da3po_begin_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if getattr(self, "_da3po_session", None) is not None:
            raise RuntimeError("a weight update session is already open on this worker (begin called twice)")
        model = self._da3po_model()
        followers = tied_followers(model)
        undo_moe = cpu_moe_prepack_on_update(model)
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)
        _expect_nothing_from_derived_layers(model)
        _expect_nothing_from_tied_followers(followers)
        self._da3po_session = {"loaded": set(), "bytes": 0, "t0": time.perf_counter(), "undo_moe": undo_moe}

    def da3po_load_bucket(self, payload, begin: bool = False, finish: bool = False, strict: bool = True) -> dict:
        """Load one bucket of HF-named tensors. ``payload``: a dict of tensors (in-process engines), a packed
        ``([uint8 arrays], [(name, dtype, shape)])`` pair (Ray transport, see ``client.pack_bucket``), or
        safetensors bytes. ``begin`` / ``finish``: open the session before / close it after this bucket (one call
        for a one-bucket sync); the report then carries the finish report too."""
        if begin:
            self.da3po_begin_weight_update()
        report = self._da3po_load(payload)
        if finish:
            report.update(self.da3po_finish_weight_update(strict=strict))
        return report

    def _da3po_load(self, payload) -> dict:
        from vllm.config import set_current_vllm_config

        session = getattr(self, "_da3po_session", None)
        if session is None:
            raise RuntimeError("da3po_load_bucket called outside a weight update session (call begin first)")
        tensors = _unpack(payload)
        n_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        model = self._da3po_model()
        with set_current_vllm_config(self.vllm_config):
            try:
                loaded = model.load_weights(iter(tensors.items()))
            except (KeyError, AssertionError, ValueError, RuntimeError) as e:
                names = sorted(tensors)
                raise RuntimeError(f"vLLM could not load the bucket with HF tensors {names[:4]}"
                                   f"{'...' if len(names) > 4 else ''} ({len(names)} tensors): "
                                   f"{type(e).__name__}: {e}") from e
        if loaded:
            session["loaded"].update(loaded)
        session["bytes"] += n_bytes
        return {"tensors": len(tensors), "bytes": n_bytes}

    def da3po_finish_weight_update(self, strict: bool = True) -> dict:
        """Finalise the session; with ``strict``, raise naming the vLLM parameters no bucket wrote."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        session = getattr(self, "_da3po_session", None)
        if session is None:
            raise RuntimeError("da3po_finish_weight_update called without an open session")
        model = self._da3po_model()
        try:
            with set_current_vllm_config(self.vllm_config):
                finalize_layerwise_reload(model, self.vllm_config.model_config)
                refreshed = refresh_tied_layers(model, session["loaded"])
        finally:
            prepacked = session["undo_moe"]()  # the CPU MoE step ran inside the session (see the function)
            self._da3po_session = None
        self._da3po_reset_routes()
        runner = self.model_runner
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(runner, reset, None)
            if callable(fn):
                fn()
        expected = {name for name, _ in model.named_parameters()}
        missing = sorted(expected - session["loaded"])
        if strict and missing:
            raise RuntimeError(f"weight update left {len(missing)} vLLM parameters unwritten (they keep their old "
                               f"values): {missing[:8]}{'...' if len(missing) > 8 else ''}")
        return {"missing": missing, "bytes": session["bytes"], "seconds": time.perf_counter() - session["t0"],
                "refreshed_tied": refreshed, "prepacked_moe": prepacked}

    def da3po_abort_weight_update(self) -> None:
        """Drop an open session after a failed bucket (finalise so every layer gets its kernel tensors back)."""
        if getattr(self, "_da3po_session", None) is not None:
            try:
                self.da3po_finish_weight_update(strict=False)
            finally:
                self._da3po_session = None

    def da3po_weights_checksum(self) -> float:
        """Sum of all parameters in float64 (tests: did an update reach this worker?)."""
        return float(sum(p.double().sum().item() for p in self._da3po_model().parameters() if p.numel()))

    def da3po_reload_from_path(self, path: str) -> float:
        """Reload every weight from an HF checkpoint directory on disk (the slow baseline of the sync benchmark)."""
        t0 = time.perf_counter()
        model = self._da3po_model()
        undo_moe = cpu_moe_prepack_on_update(model)  # vLLM's reload runs the same layerwise session
        try:
            self.reload_weights(weights_path=path, is_checkpoint_format=True)
        finally:
            undo_moe()
        # vLLM's own reload leaves a tied head stale too (see the module docstring)
        refresh_tied_layers(model, {name for name, _ in model.named_parameters()})
        self._da3po_reset_routes()
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ routed experts (R3, rollout/routes.py)
    def da3po_routes_enable(self) -> dict:
        """Capture the experts every MoE layer routes each token to (idempotent); returns the routes' shape."""
        from da3po_megatron.rollout.routes import RouteCapture

        if getattr(self, "_da3po_routes", None) is None:
            self._da3po_routes = RouteCapture(self.model_runner)
        r = self._da3po_routes
        return {"moe_layers": r.num_layers, "top_k": r.top_k, "dtype": str(r.dtype)}

    def da3po_routes_take(self, wanted: list, keep: list | None = None) -> list:
        """The routes of finished requests (``RouteCapture.take``), None where ``keep`` is False (taken and dropped
        here, so that they never leave the worker)."""
        got = self._da3po_routes.take(wanted)
        return routes_to_wire(got if keep is None else [r if k else None for r, k in zip(got, keep)])

    def _da3po_reset_routes(self) -> None:
        """New weights: the captured routes and the prefix store belong to the old ones."""
        if getattr(self, "_da3po_routes", None) is not None:
            self._da3po_routes.reset()
