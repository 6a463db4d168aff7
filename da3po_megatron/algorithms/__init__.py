"""DA3PO algorithm core in pure torch: advantages + DAA, reward shaping, dynamic sampling, losses, theory.

Paper equations: Eq. 3 (group advantages), Eq. 4/5/9/11 (clipped surrogate and its aggregations), Eq. 8 (overlong
shaping), Eq. 14 (DAA), Thm 3.1 / Cor 3.2 (alpha+, alpha-, gamma); not from the paper: truncated importance sampling
for the rollout / training mismatch (``rollout_correction.py``, off by default).
``registry.py`` defines each algorithm (grpo, dapo, gspo, da3po) once: the one place that says what distinguishes
them. This package imports nothing of the project (only torch and the standard library), so every function is
unit-testable against its formula.
"""

from .advantages import (
    STD_MODES,
    adaptive_daa_lambda,
    apply_daa,
    broadcast_to_tokens,
    daa_mask,
    daa_stats,
    group_advantages,
    group_p_hat,
)
from .dynamic_sampling import (
    ALL_CORRECT,
    ALL_WRONG,
    KEEP,
    REASON_NAMES,
    DynamicSamplingBuffer,
    GroupFilter,
    filter_groups,
)
from .losses import LOSS_AGG_MODES, RATIO_LEVELS, policy_loss
from .registry import (
    ADVANTAGE_FN_ARGS,
    ALGORITHM_REGISTRY,
    ALGORITHMS,
    POLICY_LOSS_FN_ARGS,
    Algorithm,
    get_algorithm,
    load_function,
    preset_override_args,
    preset_overrides,
    preset_values,
    resolve_presets,
)
from .reward_shaping import accuracy_reward, overlong_penalty, shaped_reward
from .rollout_correction import tis_weights
from .theory import (
    MonteCarloResult,
    alpha_minus,
    alpha_plus,
    exact_conditional_advantages,
    gamma,
    monte_carlo_conditional_advantages,
)

__all__ = [
    "ADVANTAGE_FN_ARGS",
    "ALGORITHMS",
    "ALGORITHM_REGISTRY",
    "ALL_CORRECT",
    "ALL_WRONG",
    "KEEP",
    "LOSS_AGG_MODES",
    "POLICY_LOSS_FN_ARGS",
    "RATIO_LEVELS",
    "REASON_NAMES",
    "STD_MODES",
    "Algorithm",
    "DynamicSamplingBuffer",
    "GroupFilter",
    "MonteCarloResult",
    "accuracy_reward",
    "adaptive_daa_lambda",
    "alpha_minus",
    "alpha_plus",
    "apply_daa",
    "broadcast_to_tokens",
    "daa_mask",
    "daa_stats",
    "exact_conditional_advantages",
    "filter_groups",
    "gamma",
    "get_algorithm",
    "group_advantages",
    "group_p_hat",
    "load_function",
    "monte_carlo_conditional_advantages",
    "overlong_penalty",
    "policy_loss",
    "preset_override_args",
    "preset_overrides",
    "preset_values",
    "resolve_presets",
    "shaped_reward",
    "tis_weights",
]
