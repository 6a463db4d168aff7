"""What decides the GPU stack, run on CPU: the optimizer state primed before a resume, the layer spec chosen when
Transformer-Engine is broken, the Triton kernel probe that lets ``backend="auto"`` pick the fused kernel.

Each of these only takes its GPU branch on a GPU; the code that decides is the same here, so these tests run it
with the real megatron-core / torch / Triton (interpreter) and, where only a GPU library could produce the input,
with a stand-in named as such (TE's ``FusedAdam``, a ``transformer_engine`` package whose PyTorch extension fails).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from da3po_megatron.megatron.checkpoint_adam import prime_optimizer_state, restore_adam_step

ROOT = Path(__file__).resolve().parents[1]


class _Wrapper:
    """What ``prime_optimizer_state`` sees of megatron's optimizer: an object whose ``.optimizer`` is the inner one
    (``DistributedOptimizer`` / ``FP32Optimizer`` both hold it there)."""

    def __init__(self, inner):
        self.optimizer = inner


def _params(n: int = 3) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 5, generator=g)) for _ in range(n)]


def _megatron_adam_class(decoupled_weight_decay: bool = True) -> type:
    """The Adam class megatron-core 0.16.1 builds on this machine (``megatron/core/optimizer/__init__.py`` 12-34,
    352-360): TE's / Apex's ``FusedAdam`` when they import, else torch's AdamW / Adam."""
    import megatron.core.optimizer as mo

    if mo.USING_PYTORCH_OPTIMIZER:
        return torch.optim.AdamW if decoupled_weight_decay else torch.optim.Adam
    return mo.Adam


@pytest.mark.parametrize("amsgrad", [False, True])
def test_primed_optimizer_state_has_exactly_the_keys_the_optimizers_own_step_creates(amsgrad):
    cls = _megatron_adam_class()
    assert cls in (torch.optim.Adam, torch.optim.AdamW), "CPU machines have no TE / Apex: megatron picks torch's Adam"
    fresh = cls(_params(), lr=1e-3, weight_decay=0.1, amsgrad=amsgrad)
    stepped_params = _params()
    stepped = cls(stepped_params, lr=1e-3, weight_decay=0.1, amsgrad=amsgrad)
    for p in stepped_params:
        p.grad = torch.ones_like(p)
    stepped.step()

    prime_optimizer_state(_Wrapper(fresh))

    for pf, ps in zip(fresh.param_groups[0]["params"], stepped_params):
        got, want = fresh.state[pf], stepped.state[ps]
        assert set(got) == set(want), (set(got), set(want))
        for k in want:
            assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype and got[k].device == want[k].device
            assert not got[k].any(), f"{k}: a primed placeholder is zero"
    # what megatron's DistributedOptimizer.state_dict() asserts on a torch optimizer (distrib_optimizer.py 640-643)
    assert len({s["step"].item() for s in fresh.state_dict()["state"].values()}) == 1
    # and the step a checkpoint carries in param_groups comes back into every parameter's state
    restore_adam_step(_Wrapper(fresh), {"optimizer": {"param_groups": [{"step": 7}]}})
    assert {s["step"].item() for s in fresh.state.values()} == {7.0}


class StandInTEFusedAdam(torch.optim.Optimizer):
    """A stand-in for Transformer-Engine's ``FusedAdam`` (not TE: TE does not import without CUDA), faithful in the
    one behaviour that broke every GPU resume: ``state_dict`` casts every per-parameter state entry through
    ``get_unscaled_state``, which looks the entry's name up in ``name_to_dtype_map`` = {exp_avg, exp_avg_sq,
    master_param} (TransformerEngine v2.11 ``transformer_engine/pytorch/optimizers/fused_adam.py`` 192-196,
    295-304, 421-441) -- a ``step`` entry raises ``KeyError: 'step'``. Its step lives in ``param_groups``."""

    def __init__(self, params, lr: float = 1e-3):
        super().__init__(params, {"lr": lr, "bias_correction": True})
        self.name_to_dtype_map = {"exp_avg": torch.float32, "exp_avg_sq": torch.float32,
                                  "master_param": torch.float32}

    def get_unscaled_state(self, param, state_name):
        dtype = self.name_to_dtype_map[state_name]
        return self.state[param][state_name].to(dtype)

    def state_dict(self):
        sd = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        for k, v in sd["state"].items():
            sd["state"][k] = {name: self.get_unscaled_state(params[k], name) for name in v}
        return sd


def test_priming_leaves_a_fused_optimizer_alone_with_stand_in_te_fused_adam():
    inner = StandInTEFusedAdam(_params())
    prime_optimizer_state(_Wrapper(inner))
    assert all(not inner.state[p] for p in inner.param_groups[0]["params"]), \
        "only torch's Adam/AdamW are primed: megatron allocates a fused optimizer's state itself"
    inner.state_dict()  # what DistributedOptimizer.state_dict() calls while building the state dict to load into


# ---------------------------------------------------------------------------------------------------- layer spec

def _stand_in_te(root: Path, error: str) -> None:
    """A ``transformer_engine`` package like TE 2.x's, not TE: its top-level ``__init__`` swallows an ImportError of
    ``.pytorch`` (TransformerEngine v2.11 ``transformer_engine/__init__.py`` 13-16), whose import raises ``error``."""
    (root / "transformer_engine" / "pytorch").mkdir(parents=True, exist_ok=True)
    (root / "transformer_engine" / "__init__.py").write_text(
        "try:\n    from . import pytorch\nexcept ImportError:\n    pass\n")
    (root / "transformer_engine" / "pytorch" / "__init__.py").write_text(f"raise {error}\n")
    info = root / "transformer_engine-2.11.0.dist-info"  # megatron-core reads TE's version from its metadata
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: transformer-engine\nVersion: 2.11.0\n")

_SPEC_PROBE = textwrap.dedent("""
    import json, logging, sys
    import torch
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    if sys.argv[1] == "cuda":
        torch.cuda.is_available = lambda: True  # a stand-in for a GPU machine: only the layer-spec decision runs
    from da3po_megatron.config import ModelConfig
    from da3po_megatron.megatron.arch import GPTArch
    from da3po_megatron.megatron.model import import_megatron_core, layer_spec, transformer_config, use_te
    options = ModelConfig(use_transformer_engine=json.loads(sys.argv[2]))
    import_megatron_core(require_te=options.use_transformer_engine is True)  # what a policy rank does first
    arch = GPTArch(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2, num_query_groups=1,
                   kv_channels=16, vocab_size=64, max_sequence_length=32)
    te = use_te(options)
    qkv = layer_spec(transformer_config(arch, options), te).submodules.self_attention.submodules.linear_qkv
    import megatron.core.optimizer as mo
    print(json.dumps({"te": te, "spec": qkv.__name__, "adam": mo.Adam.__module__ + "." + mo.Adam.__name__}))
""")


def _spec_probe(tmp_path: Path, te_error: str | None, device: str, use_transformer_engine: bool | None = None
                ) -> tuple[subprocess.CompletedProcess, dict | None]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if te_error:
        _stand_in_te(tmp_path, te_error)
        env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{ROOT}"
    r = subprocess.run([sys.executable, "-c", _SPEC_PROBE, device, json.dumps(use_transformer_engine)],
                       capture_output=True, text=True, env=env, timeout=240)
    out = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else None
    return r, out


BROKEN_TE = {  # how a TE whose PyTorch part cannot load fails (both make `import megatron.core` fail on e6f0361)
    "missing extension": "ModuleNotFoundError(\"No module named 'transformer_engine_torch'\")",
    "built for another torch": "ImportError('libtransformer_engine_torch.so: undefined symbol: _ZN3c10')",
}
LOCAL = {"te": False, "spec": "ColumnParallelLinear", "adam": "torch.optim.adamw.AdamW"}


@pytest.mark.parametrize("case", list(BROKEN_TE))
def test_layer_spec_falls_back_to_local_when_te_pytorch_fails_with_stand_in_te_package(tmp_path, case):
    """megatron-core 0.16.1 imports ``transformer_engine.pytorch`` unguarded once ``import transformer_engine``
    works (``fp8_utils.py`` 24-48): without the fallback, ``import megatron.core`` fails inside TE."""
    r, out = _spec_probe(tmp_path, BROKEN_TE[case], "cuda")
    assert r.returncode == 0, r.stderr[-3000:]
    assert out == LOCAL, out
    lines = [ln for ln in r.stderr.splitlines() if "Transformer-Engine not usable" in ln]
    assert len(lines) == 1, r.stderr[-3000:]  # one clear line: which import failed, and why
    assert "`import transformer_engine.pytorch` failed:" in lines[0] and "local layer spec" in lines[0]
    assert ("transformer_engine_torch" if case == "missing extension" else "undefined symbol") in lines[0]


def test_required_te_that_cannot_load_is_an_error_with_stand_in_te_package(tmp_path):
    r, _ = _spec_probe(tmp_path, BROKEN_TE["built for another torch"], "cuda", use_transformer_engine=True)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: model.use_transformer_engine=True but Transformer-Engine is not usable: "
                           "`import transformer_engine.pytorch` failed: ImportError"), last


def test_layer_spec_is_local_without_te(tmp_path):
    r, out = _spec_probe(tmp_path, None, "cpu")
    assert r.returncode == 0, r.stderr[-3000:]
    assert out == LOCAL, out
    assert "Transformer-Engine not usable" not in r.stderr


# ---------------------------------------------------------------------------------------------------- loss kernel

def test_triton_probe_passes_through_its_own_code_in_the_interpreter():
    """The probe that decides ``backend="auto"`` on a GPU (``_cuda_triton_works`` = ``probe_triton("cuda")``), run
    here on CPU tensors in Triton's interpreter (conftest sets TRITON_INTERPRET=1): the same kernels, the same calls.
    On e6f0361 the probe called ``triton_vocab_parallel_logprobs(logits, targets)`` with a bare tensor and failed with
    ``AttributeError: 'Tensor' object has no attribute 'targets'``, so ``auto`` never picked the kernel."""
    from da3po_megatron.kernels.dispatch import probe_triton

    assert probe_triton("cpu") is None


def test_triton_probe_names_a_broken_kernel_call(monkeypatch):
    import da3po_megatron.kernels.triton_loss as tl

    def broken(logits, inputs, **kw):  # the e6f0361 mistake: a bare tensor where LogprobInputs belongs
        return tl.triton_vocab_parallel_logprobs.__wrapped__(logits, inputs.targets, **kw)

    original = tl.triton_vocab_parallel_logprobs
    broken.__wrapped__ = original  # type: ignore[attr-defined]
    monkeypatch.setattr(tl, "triton_vocab_parallel_logprobs", broken)
    from da3po_megatron.kernels.dispatch import probe_triton

    assert probe_triton("cpu") == "AttributeError: 'Tensor' object has no attribute 'targets'"


# ---------------------------------------------------------------------------------------------------- update guard

class _LargestOutput(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest tensor any torch op allocates while active (views of its inputs do not count)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:  # views allocate nothing
                self.largest = max(self.largest, t.numel())
        return out


class _MegatronLikeOptimizer:
    """What ``update_guard`` reads of megatron's optimizer: the inner torch optimizer and the grad-stats group."""

    def __init__(self, inner, tp_group=None):
        self.optimizer, self.tp_group = inner, tp_group

    def get_grad_stats_parallel_group(self):
        return None


def test_update_guard_allocates_nothing_the_size_of_a_parameter_buffer():
    """Issue 26 finding 5: on e6f0361 ``nonfinite.py`` ran ``torch.isfinite(t).all()`` over whole grad and parameter
    buffers -- a bool tensor the size of the buffer each update (~2 G elements for a TP=2 shard of a 4B model). The
    weight check and the update-size prediction now work in sums and 1M-element chunks (megatron/update_guard.py)."""
    from da3po_megatron.megatron.update_guard import CHUNK, check_finite_weights, update_norms

    n = 3 * CHUNK + 12345
    p = torch.nn.Parameter(torch.randn(n))
    p.tensor_model_parallel = True  # a TP shard: counted by megatron's grad-norm filter without a TP group
    model = torch.nn.Module()
    model.register_parameter("w", p)
    inner = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1)
    p.grad = torch.randn(n)
    inner.step()  # a stepped optimizer: its moments exist
    p.grad = torch.randn(n)
    with _LargestOutput() as mode:
        check_finite_weights(model, "1.1")
    assert mode.largest < n // 8, mode.largest
    with _LargestOutput() as mode:
        norms = update_norms(_MegatronLikeOptimizer(inner))
    assert norms is not None and mode.largest <= CHUNK, mode.largest
    # and the prediction is the update AdamW then applies
    before = p.detach().double()
    inner.step()
    delta = (p.detach().double() - before).norm().item()  # float32 weights ~1 hold a ~1e-3 step to ~1e-4 relative
    assert norms[0] == pytest.approx(delta, rel=1e-3) and norms[1] == pytest.approx(before.norm().item(), rel=1e-5)


def test_te_spec_check_compares_float32_policies_against_its_1e_3_tolerance():
    """tools/gpu/check_gpu_stack.py te-spec (gpu_check.sh step te_spec) says float32 and holds the two layer specs'
    log-probs to 1e-3; the run config's default params_dtype is bfloat16, where they differ far more. On 27dab78 the
    check built both policies with the default (bf16)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_gpu_stack", ROOT / "tools" / "gpu" / "check_gpu_stack.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    for te in (True, False):
        cfg = tool.te_spec_config("/x", te)
        assert (cfg.model.params_dtype, cfg.model.use_transformer_engine) == ("float32", te)
    assert tool.TE_SPEC_TOLERANCE == 1e-3
