"""The policy's DDP wrapper, optimizer and learning-rate schedule (megatron-core's own pieces, configured once).

- Megatron ``DistributedDataParallel`` with fp32 gradient reduction (no overlap: the CPU / gloo path and the GPU path
  run the same code);
- ``get_megatron_optimizer``: Adam with decoupled weight decay (Megatron's ``wd_mult`` keeps it off biases and
  norms), the distributed optimizer (ZeRO-1: optimizer state and fp32 master weights sharded over DP ranks) when
  asked, bf16 parameters with fp32 master weights on GPU and fp32 on CPU, gradient clipping by the global norm;
- ``OptimizerParamScheduler``, stepped once per optimizer step just BEFORE it (as Megatron-LM does): optimizer step k
  (1-based) uses lr * k / warmup during warmup, then constant or cosine decay to ``min_lr`` at ``total_steps``;
  weight decay is constant.

And the hooks Megatron's schedule needs: ``finalize_model_grads`` (DP reduce, tied-embedding and layer-norm grads
across stages), ``no_sync`` and the loss scale.
"""

from __future__ import annotations

from typing import Any

import torch


def build_ddp_optimizer(gpt: torch.nn.Module, optim: Any, *, total_steps: int, lr_decay_style: str
                        ) -> tuple[Any, Any, Any]:
    """Wrap the model stage ``gpt`` in DDP and build its optimizer and LR schedule -> (ddp model, optimizer,
    scheduler).

    ``optim`` has ``lr``, ``min_lr``, ``weight_decay``, ``adam_beta1``, ``adam_beta2``, ``adam_eps``, ``clip_grad``
    (0 = none), ``lr_warmup_steps`` and ``use_distributed_optimizer``; ``total_steps`` (optimizer steps of the run)
    is the schedule's horizon and ``lr_decay_style`` "constant" or "cosine".
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o = optim
    config = gpt.config
    dtype = config.params_dtype
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=o.use_distributed_optimizer,
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=gpt)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=o.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if o.lr_warmup_steps > 0 else o.lr,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.lr_warmup_steps,
        lr_decay_steps=total_steps,
        lr_decay_style=lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=total_steps,
        wd_incr_style="constant",
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    config.grad_scale_func = optimizer.scale_loss
    return model, optimizer, scheduler
