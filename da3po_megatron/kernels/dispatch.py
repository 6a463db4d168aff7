"""One entry point for the DAA policy loss (Eq. 5/11 surrogate, Eq. 14 DAA, Eq. 9 token sum) and for log-probs.

`backend` selects the implementation; all four compute the same function (tests hold them to the reference):

* "reference": pure torch, materialises float32 [tokens x V_local] tensors (ground truth; small inputs only);
* "chunked":   torch, bounded memory (token chunks, recompute in backward); the CPU path;
* "triton":    fused Triton kernels (CUDA; on CPU only with TRITON_INTERPRET=1, slow);
* "auto":      "triton" when the logits are on CUDA and a Triton kernel compiles and runs there, else "chunked".

Imports nothing of the project; Triton is imported only when the Triton path is used or probed.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .chunked import chunked_daa_policy_loss, chunked_vocab_parallel_logprobs
from .common import LogprobInputs, LossInputs, LossOutputs
from .reference import reference_daa_policy_loss, reference_vocab_parallel_logprobs

BACKENDS = ("auto", "triton", "chunked", "reference")


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure (missing driver libs, ...) means "no Triton"
        return False
    return True


def probe_triton(device: str | torch.device) -> str | None:
    """Run the Triton kernels once on a tiny input on ``device`` through the public entry points, exactly as the
    policy calls them, and compare them with the reference: None when they agree, else what went wrong (one line).

    Checked: ``triton_vocab_parallel_logprobs`` (log-probs + entropy) and ``triton_daa_policy_loss`` forward and
    backward (loss, log-probs and the logits' gradient, with DAA and both clips active). On CUDA Triton compiles the
    kernels; on a CPU the same call runs them in Triton's interpreter (``TRITON_INTERPRET=1`` set before triton was
    first imported), which is how the CPU suite tests this very probe -- a call that no longer matches the kernels'
    signature fails there as it would on a GPU.
    """
    device = torch.device(device)
    if not _triton_importable():
        return "triton is not importable"
    try:
        from .triton_loss import interpreter_ready, triton_daa_policy_loss, triton_vocab_parallel_logprobs

        if device.type != "cuda" and not interpreter_ready():
            return (f"Triton kernels need CUDA, or TRITON_INTERPRET=1 set before triton is imported, to run on "
                    f"{device.type}")
        g = torch.Generator().manual_seed(0)
        t, v = 6, 37
        logits = (3 * torch.randn(t, v, generator=g)).to(device)
        targets = torch.tensor([0, 5, 36, 17, 2, 30], device=device)
        got, got_ent = triton_vocab_parallel_logprobs(logits, LogprobInputs(targets, compute_entropy=True))
        want, want_ent = reference_vocab_parallel_logprobs(logits, LogprobInputs(targets, compute_entropy=True))
        if not (torch.allclose(got, want, atol=1e-4) and torch.allclose(got_ent, want_ent, atol=1e-4)):
            return (f"log-prob kernel disagrees with the reference on {device.type} (max |diff| "
                    f"{(got - want).abs().max().item():.3g})")
        inputs = LossInputs(
            targets=targets, old_logprobs=(want.detach() + 0.3 * torch.randn(t, generator=g).to(device)),
            advantages=torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], device=device),
            mask=torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0], device=device), clip_ratio_low=0.2,
            clip_ratio_high=0.28, correct=torch.tensor([True, False, True, False, True, False], device=device),
            p_hat=torch.full((t,), 0.25, device=device), daa_lambda=2.0, daa_tau=0.5)
        outs = []
        for fn in (triton_daa_policy_loss, reference_daa_policy_loss):
            x = logits.clone().requires_grad_(True)
            out = fn(x, inputs)
            out.loss_sum.backward()
            outs.append((out.loss_sum.detach(), out.logprobs.detach(), x.grad))
        for name, a, b in zip(("loss", "log-probs", "dlogits"), *outs):
            if not torch.allclose(a, b, atol=1e-4, rtol=1e-4):
                return (f"DAA-loss kernel's {name} disagree with the reference on {device.type} (max |diff| "
                        f"{(a - b).abs().max().item():.3g})")
    except Exception as e:  # noqa: BLE001 - a compile, launch or call failure is the probe's answer
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return None


@functools.cache
def _cuda_triton_works() -> bool:
    """:func:`probe_triton` on CUDA, once per process; a failure is said once (and ``auto`` uses the chunked path)."""
    if not torch.cuda.is_available():
        return False
    err = probe_triton("cuda")
    if err is not None:
        warnings.warn(f"Triton kernels do not run on this GPU ({err}); backend='auto' uses the chunked torch path "
                      "(bounded memory, slower)", RuntimeWarning, stacklevel=2)
    return err is None


def triton_available() -> bool:
    """Can the Triton kernels run here? True with CUDA + a working Triton compile, or when the interpreter is usable
    (TRITON_INTERPRET=1 set before triton was first imported)."""
    if not _triton_importable():
        return False
    from .triton_loss import interpreter_ready

    return interpreter_ready() or _cuda_triton_works()


def resolve_backend(backend: str, logits: torch.Tensor) -> str:
    """Map "auto" to a concrete backend for tensors on `logits.device`; validate the name."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    return "triton" if logits.is_cuda and _cuda_triton_works() else "chunked"


# the implementation options each backend's functions take (the others do not apply to it)
_OPTIONS = {"reference": (), "chunked": ("chunk_tokens", "inplace_backward"), "triton": ("block_v", "inplace_backward")}


def _implementation(backend: str, logits: torch.Tensor, loss: bool, **options: Any) -> Callable:
    """`backend`'s loss (or log-prob) function ("auto" resolved for the logits' device), with its own options bound."""
    name = resolve_backend(backend, logits)
    if name == "reference":
        fns = (reference_daa_policy_loss, reference_vocab_parallel_logprobs)
    elif name == "chunked":
        fns = (chunked_daa_policy_loss, chunked_vocab_parallel_logprobs)
    else:
        from .triton_loss import triton_daa_policy_loss, triton_vocab_parallel_logprobs

        fns = (triton_daa_policy_loss, triton_vocab_parallel_logprobs)
    return functools.partial(fns[0] if loss else fns[1], **{k: options[k] for k in _OPTIONS[name]})


def daa_policy_loss(
    logits_shard: torch.Tensor, inputs: LossInputs, *, backend: str = "auto", chunk_tokens: int | None = None,
    block_v: int | None = None, inplace_backward: bool = False,
) -> LossOutputs:
    """Token-level DAPO/DA3PO clipped surrogate on vocab-parallel logits; returns (loss_sum, logp, entropy, metrics).

    Args:
        logits_shard: [..., V_local] logits of this TP rank's vocab columns [vocab_start, vocab_start + V_local)
            (any float dtype; never upcast as a whole).
        inputs: targets, old log-probs, advantages, mask, clip ratios, DAA, vocab shard, entropy flag
            (:class:`LossInputs`).
        backend: "auto" | "triton" | "chunked" | "reference" (see the module docstring).
        chunk_tokens: tokens per chunk of the chunked path (default: ~128 MiB per float32 chunk buffer).
        block_v: vocab block width of the Triton kernels (default: next power of 2 of V_local, at most 4096).
        inplace_backward: chunked/Triton: write dlogits into the logits' storage (only for logits not used later).

    Returns:
        :class:`LossOutputs` (loss_sum, logprobs, entropy or None, metrics); divide loss_sum by the global
        valid-token count for Eq. 9's mean.
    """
    fn = _implementation(backend, logits_shard, True, chunk_tokens=chunk_tokens, block_v=block_v,
                         inplace_backward=inplace_backward)
    return fn(logits_shard, inputs)


def vocab_parallel_logprobs(
    logits_shard: torch.Tensor, inputs: LogprobInputs, *, backend: str = "auto", chunk_tokens: int | None = None,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log pi(y_t) (and entropy) from vocab-parallel logits [..., V_local]: (logp [...], entropy or None).

    The log-prob path without a loss (old-logprob recomputation, evaluation); differentiable in every backend.
    """
    fn = _implementation(backend, logits_shard, False, chunk_tokens=chunk_tokens, block_v=block_v,
                         inplace_backward=False)
    return fn(logits_shard, inputs)
