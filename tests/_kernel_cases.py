"""Random inputs and comparison helpers for the DAA-loss tests and `da3po_megatron/bench/loss.py` (torch only).

`random_case` builds logits with a realistic spread, targets (optionally some outside the vocabulary, as padding ids
are), and old log-probs placed relative to the current log-probs so that a chosen clip regime is exercised:
"mixed" (ratios spread over ~[0.5, 2]: some tokens clipped low, some high, most not), "none" (r = 1),
"all_high" (r = e, every advantage > 0) and "all_low" (r = 1/e, every advantage < 0).
`run_loss` runs any backend's loss and backpropagates a fixed random combination of its three differentiable outputs
(loss_sum, logp, entropy), so that every backward path is compared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from da3po_megatron.kernels.common import LossInputs
from da3po_megatron.kernels.reference import reference_logprobs_2d


@dataclass
class Case:
    logits: torch.Tensor  # [B, T, V]
    targets: torch.Tensor  # [B, T]
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    correct: torch.Tensor  # [B, T] bool
    p_hat: torch.Tensor  # [B, T]
    g_loss: float
    g_logp: torch.Tensor  # upstream gradients used by run_loss
    g_entropy: torch.Tensor
    seed: int


def random_case(
    b: int,
    t: int,
    v: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    regime: str = "mixed",
    mask_frac: float = 0.2,
) -> Case:
    """Random [b, t, v] logits and per-token inputs; see the module docstring for `regime`."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, t, v, generator=g) * 2.0).to(dtype)
    targets = torch.randint(0, v, (b, t), generator=g)
    mask = (torch.rand(b, t, generator=g) > mask_frac).float()
    mask[:, 0] = 1.0
    logp, _ = reference_logprobs_2d(logits.reshape(-1, v), targets.reshape(-1))
    logp = logp.reshape(b, t)
    adv_mag = torch.rand(b, t, generator=g) + 0.1
    if regime == "mixed":
        old = logp - torch.randn(b, t, generator=g) * 0.35
        adv = torch.randn(b, t, generator=g)
    elif regime == "none":
        old, adv = logp.clone(), torch.randn(b, t, generator=g)
    elif regime == "all_high":
        old, adv = logp - 1.0, adv_mag
    elif regime == "all_low":
        old, adv = logp + 1.0, -adv_mag
    else:
        raise ValueError(f"regime must be mixed|none|all_high|all_low, got {regime!r}")
    correct = torch.rand(b, t, generator=g) > 0.5
    p_hat = torch.rand(b, t, generator=g)
    return Case(
        logits=logits, targets=targets, old_logprobs=old, advantages=adv, mask=mask, correct=correct, p_hat=p_hat,
        g_loss=float(torch.rand((), generator=g) + 0.5), g_logp=torch.randn(b, t, generator=g),
        g_entropy=torch.randn(b, t, generator=g), seed=seed,
    )


def loss_inputs(case: Case, **fields) -> LossInputs:
    """The case's targets, old log-probs, advantages and mask as a `LossInputs`, with the other fields given."""
    return LossInputs(case.targets, old_logprobs=case.old_logprobs, advantages=case.advantages, mask=case.mask,
                      **fields)


def run_loss(fn: Callable, case: Case, *, upstream: str = "all", **fields) -> dict[str, torch.Tensor | None]:
    """Call `fn(logits, loss_inputs(case, **fields))` and backprop; upstream in {"all", "loss"}."""
    x = case.logits.clone().requires_grad_(True)
    loss, logp, ent, metrics = fn(x, loss_inputs(case, **fields))
    total = loss * case.g_loss
    if upstream == "all":
        total = total + (logp * case.g_logp).sum()
        if ent is not None:
            total = total + (ent * case.g_entropy).sum()
    total.backward()
    out = {"loss": loss.detach(), "logp": logp.detach(), "entropy": ent.detach() if ent is not None else None,
           "dlogits": x.grad, "seed": case.seed}
    out.update({k: v.detach() for k, v in metrics.items()})
    return out  # type: ignore[return-value]


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def assert_same_outputs(want: dict, got: dict, dtype: torch.dtype, what: str = "") -> None:
    """Compare two `run_loss` results. Tolerances: float32 math is the same up to summation order (~1e-6); dlogits of
    bf16/fp16 logits are rounded to that dtype, so they may differ by one unit in the last place (relative 2^-7)."""
    tag = f"{what} (seed {want.get('seed', '?')})"
    torch.testing.assert_close(got["loss"], want["loss"], atol=2e-5, rtol=2e-5, msg=lambda m: f"loss {tag}: {m}")
    torch.testing.assert_close(got["logp"], want["logp"], atol=2e-5, rtol=1e-5, msg=lambda m: f"logp {tag}: {m}")
    if want["entropy"] is not None:
        torch.testing.assert_close(got["entropy"], want["entropy"], atol=2e-5, rtol=1e-5,
                                   msg=lambda m: f"entropy {tag}: {m}")
    for k in ("clip_low_count", "clip_high_count", "token_count"):
        assert got[k].item() == want[k].item(), f"{k} {tag}: {got[k].item()} != {want[k].item()}"
    low_precision = dtype in (torch.bfloat16, torch.float16)
    atol, rtol = (1e-5, 8e-3) if low_precision else (2e-6, 1e-5)
    assert got["dlogits"].dtype == want["dlogits"].dtype == dtype, f"dlogits dtype {tag}"
    torch.testing.assert_close(got["dlogits"].float(), want["dlogits"].float(), atol=atol, rtol=rtol,
                               msg=lambda m: f"dlogits {tag}: {m}")
