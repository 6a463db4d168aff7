"""Imported by the RewardPool's forkserver only: warm the verifier once so that every forked worker starts warm."""

from da3po_megatron.rewards.math_verify import warm_up

warm_up()
