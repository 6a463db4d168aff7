"""The driver's side of the update guard (``megatron/update_guard.py`` decides per optimizer update on the policy
ranks): count refused updates, warn naming the step and why, and stop the run -- before the weight sync and any
checkpoint -- once ``trainer.max_consecutive_skipped_updates`` updates in a row were refused (counted at step ends).

An update is refused for a non-finite loss or gradient, or for its size: ||delta theta|| / ||theta|| above
``trainer.max_update_ratio`` (a learning rate far too large, a gradient spike, a loss-scale bug). A run stopped for
its update size says the ratio, the learning rate and the gradient norm, so the cause is named where it happens rather
than as a dynamic-sampling failure of the next step, when the destroyed policy no longer solves anything.
"""

from __future__ import annotations

from typing import Any

from da3po_megatron.config import TrainerConfig


class UpdateSizeError(FloatingPointError):
    """Too many optimizer updates in a row were refused, the last ones for their size (the message names it)."""


def refusal_reasons(m: dict[str, Any], limit: float) -> str:
    """What refused the step's updates, e.g. ``non-finite loss in 2`` or ``update ratio ||dtheta||/||theta|| 31.6 >
    trainer.max_update_ratio=0.1 in 2 (lr 1000, grad norm 0.53)``."""
    parts = [f"non-finite {k} in {int(m[f'nonfinite_{k}_updates'])}" for k in ("loss", "grad")
             if m.get(f"nonfinite_{k}_updates")]
    if m.get("update_ratio_refused_updates"):
        parts.append(f"update ratio ||dtheta||/||theta|| {m.get('update_ratio', float('nan')):.3g} > "
                     f"trainer.max_update_ratio={limit:g} in {int(m['update_ratio_refused_updates'])} (lr "
                     f"{m.get('lr', float('nan')):.3g}, grad norm {m.get('grad_norm', float('nan')):.3g})")
    return ", ".join(parts) or "non-finite loss scale"


def check_update(totals: dict[str, int], step: int, m: dict[str, Any], t: TrainerConfig) -> None:
    """Count step ``step``'s refused updates (train metrics ``m``) into ``totals``; warn; raise after too many in a row
    (:class:`UpdateSizeError` when the last step's were refused for their size, else ``FloatingPointError``)."""
    skipped, n = int(m.get("skipped_updates", 0)), int(m.get("num_updates", 0))
    totals["skipped_updates"] += skipped
    totals["consecutive_skipped_updates"] = totals["consecutive_skipped_updates"] + n if skipped == n else \
        int(m.get("trailing_skipped_updates", 0))
    if not skipped:
        return
    what = refusal_reasons(m, t.max_update_ratio)
    row = totals["consecutive_skipped_updates"]
    print(f"warning: step {step}: skipped {skipped} of {n} optimizer updates: {what} (weights unchanged by them; "
          f"{row} in a row, limit trainer.max_consecutive_skipped_updates={t.max_consecutive_skipped_updates})",
          flush=True)
    if row < t.max_consecutive_skipped_updates:
        return
    if m.get("update_ratio_refused_updates"):
        raise UpdateSizeError(
            f"step {step}: {row} optimizer updates in a row refused, the last for their size: {what} "
            f"(trainer.max_consecutive_skipped_updates={t.max_consecutive_skipped_updates}); stopping before the "
            "weights are synced or saved. Lower optim.lr (or raise trainer.max_update_ratio if such updates are "
            "intended), or resume from the last checkpoint.")
    raise FloatingPointError(
        f"step {step}: {row} optimizer updates in a row skipped for a {what} (trainer.max_consecutive_skipped_updates="
        f"{t.max_consecutive_skipped_updates}); stopping before the weights are synced or saved. Lower optim.lr, "
        "check the data and rewards, or resume from the last checkpoint.")
