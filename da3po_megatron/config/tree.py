"""The root of the typed configuration tree: :class:`Config`, one field per section, and the values derived from them.

The sections live in :mod:`.policy` (model, parallel, moe, optim, actor), :mod:`.rollout` (rollout) and :mod:`.run`
(algorithm, daa, data, reward, eval, ray, trainer); loading and overrides are in :mod:`.load`, the range checks in
:mod:`.checks`. Every field is documented where it is defined, with its unit and the paper equation it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from da3po_megatron.config.policy import ActorConfig, ModelConfig, MoEConfig, OptimConfig, ParallelConfig
from da3po_megatron.config.rollout import RolloutConfig
from da3po_megatron.config.run import (
    AlgorithmConfig,
    DAAConfig,
    DataConfig,
    EvalConfig,
    RayConfig,
    RewardConfig,
    TrainerConfig,
)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    daa: DAAConfig = field(default_factory=DAAConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    # ---- derived values
    @property
    def ppo_mini_batch_responses(self) -> int:
        """Responses per optimizer step: actor.ppo_mini_batch_size prompts x rollout.n."""
        return self.actor.ppo_mini_batch_size * self.rollout.n

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps of the whole run, the LR schedule's horizon: trainer.total_steps x (data.train_batch_size
        / actor.ppo_mini_batch_size) x actor.ppo_epochs."""
        per_step = max(1, self.data.train_batch_size // max(1, self.actor.ppo_mini_batch_size))
        return self.trainer.total_steps * per_step * self.actor.ppo_epochs

    @property
    def policy_world_size(self) -> int:
        p = self.parallel
        return p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size * \
            p.data_parallel_size
