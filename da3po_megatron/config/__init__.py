"""The run configuration: one typed tree of documented sections, loaded from YAML + dotted overrides and validated.

    from da3po_megatron.config import load_config
    cfg = load_config("examples/qwen3_4b_da3po.yaml", ["trainer.total_steps=10", "daa.lambda_=2.5"])

This face only names the public parts; each lives in one module below it (torchtitan's ``config/__init__.py``):

- ``tree.py``     :class:`Config`, the root: one field per section, and the values derived from them
- ``policy.py``   sections of the policy: model, parallel, moe, optim, actor
- ``rollout.py``  the rollout section: engines, sampling, weight sync, staleness
- ``run.py``      sections of the algorithm and the run: algorithm, daa, data, reward, eval, ray, trainer
- ``load.py``     :func:`load_config` (YAML + overrides), :func:`resolve` (presets), :func:`describe`, :func:`to_dict`
- ``checks.py``   :func:`validate`: ranges and consistency, each error naming the field and its allowed range
- ``io.py``       the generic machinery (YAML ``defaults`` chains, overrides, type checks, :class:`ConfigError`)

Nothing here imports the rest of the project except ``algorithms/registry.py`` (the presets), which is below it.
"""

from da3po_megatron.config.checks import validate
from da3po_megatron.config.io import ConfigError, doc
from da3po_megatron.config.load import (
    algorithm_config,
    describe,
    load_config,
    resolve,
    standalone_policy_config,
    to_dict,
)
from da3po_megatron.config.policy import ActorConfig, ModelConfig, MoEConfig, OptimConfig, ParallelConfig
from da3po_megatron.config.rollout import RolloutConfig
from da3po_megatron.config.run import (
    AlgorithmConfig,
    DAAConfig,
    DataConfig,
    EvalConfig,
    OverlongConfig,
    ProfileConfig,
    RayConfig,
    RewardConfig,
    SyntheticTaskConfig,
    TrainerConfig,
)
from da3po_megatron.config.tree import Config

__all__ = ["ActorConfig", "AlgorithmConfig", "Config", "ConfigError", "DAAConfig", "DataConfig", "EvalConfig",
           "ModelConfig", "MoEConfig", "OptimConfig", "OverlongConfig", "ParallelConfig", "ProfileConfig", "RayConfig",
           "RewardConfig", "RolloutConfig", "SyntheticTaskConfig", "TrainerConfig", "algorithm_config", "describe",
           "doc", "load_config", "resolve", "standalone_policy_config", "to_dict", "validate"]
