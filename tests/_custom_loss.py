"""A custom policy loss for the test of ``algorithm.policy_loss_fn`` on the real policy
(tests/_policy_token_weights.py): the built-in clipped surrogate at half scale, so that the test can tell it was
called."""

from __future__ import annotations

from da3po_megatron.algorithms.losses import policy_loss


def half_policy_loss(logprobs, old_logprobs, advantages, mask, **kw):
    loss, metrics = policy_loss(logprobs, old_logprobs, advantages, mask, **kw)
    return 0.5 * loss, metrics
