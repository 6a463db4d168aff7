"""The typed configuration tree: YAML files + dotted command-line overrides, validated with clear messages.

    cfg = load_config("examples/qwen3_4b_da3po.yaml", ["trainer.total_steps=10", "daa.lambda_=2.5"])

Every field is documented where it is defined (``doc(...)`` below), with its unit and the paper equation it comes from.
Names follow Megatron for parallelism/model fields and verl/DAPO for RL fields; DA3PO's own fields live under ``daa``.

A YAML file may start with ``defaults: [other.yaml, ...]`` (paths relative to the file): those are loaded first and
this file's keys override theirs, so the paper's recipes share one base. Unknown keys are errors naming the key and
the closest valid one; values are type-checked (the generic machinery: :mod:`da3po_megatron.config_io`); ranges are
checked in :func:`validate` with the allowed range named. Fields an algorithm's preset decides are resolved once, in
:func:`resolve` (from ``algorithms/registry.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from da3po_megatron.algorithms.registry import (
    ADVANTAGE_FN_ARGS,
    ALGORITHMS,
    POLICY_LOSS_FN_ARGS,
    load_function,
    preset_overrides,
    resolve_presets,
)
from da3po_megatron.config_checks import validate
from da3po_megatron.config_io import ConfigError, build, nest, parse_override, read_yaml

__all__ = ["Config", "ConfigError", "algorithm_config", "describe", "load_config", "resolve",
           "standalone_policy_config", "to_dict", "validate"]

log = logging.getLogger(__name__)


def doc(default: Any, help_: str, **kw: Any) -> Any:
    """A dataclass field with its documentation attached (shown by ``da3po train --describe``)."""
    if isinstance(default, list | dict):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help_}, **kw)
    return field(default=default, metadata={"help": help_}, **kw)


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
                "(speed); not with sequence parallelism.")
    use_rollout_logprobs: bool = doc(False, "Use the engines' sampled-token log-probs as pi_old instead of "
                                            "recomputing them with the policy (cheaper, carries engine mismatch).")
    entropy: bool = doc(True, "Compute the mean token entropy of the policy for logging.")
    memory_check: Literal["refuse", "fit", "warn", "skip"] = doc(
        "refuse", "Before starting, estimate the policy's peak memory per rank (megatron/memory.py) from the model "
                  "shape, parallel layout, micro-batch token budget, layer spec, recomputation and loss backend, "
                  "print it, and compare it with the device: 'refuse' stops with what to change, 'fit' lowers "
                  "max_tokens_per_microbatch until it fits, 'warn' only prints, 'skip' skips it.")


@dataclass
class RolloutConfig:
    n: int = doc(16, "G: responses sampled per prompt (paper: 16). Eq. 3 normalises within these groups.")
    temperature: float = doc(1.0, "T: training rollouts sample from softmax(logits / T) (ours, as DAPO: the paper "
                                  "states none). The same T divides the policy's logits before every log-softmax "
                                  "(pi_old, pi_theta of the Eq. 5/11 ratio, the logged entropy), and the engines "
                                  "return log-probs after T (vLLM processed_logprobs): one distribution.")
    top_p: float = doc(1.0, "Nucleus sampling for training rollouts (ours, as DAPO). Below 1 the engines' log-probs "
                            "are renormalised over the nucleus, the policy's cover the whole vocabulary: the "
                            "rollout/policy log-prob diff and TIS weights then carry that gap.")
    max_prompt_length: int = doc(2048, "Prompts longer than this many tokens are rejected (paper: 2K).")
    max_response_length: int = doc(4096, "L_max of Eq. 8: generation stops here (paper: 4K).")
    num_engines: int = doc(1, "vLLM engines (data-parallel rollout); prompts are spread across them.")
    tensor_parallel_size: int = doc(1, "vLLM tensor parallelism per engine.")
    dtype: Literal["auto", "float32", "bfloat16"] = doc("auto", "Engine dtype ('auto' = the policy's).")
    gpu_memory_utilization: float = doc(0.5, "GPU: fraction of memory vLLM may take (KV cache included).")
    kv_cache_memory_bytes: int = doc(256 * 2**20, "CPU: KV-cache budget per engine in bytes (vLLM's default takes "
                                                  "0.9 x RAM).")
    weight_sync_bucket_mb: int = doc(512, "Weight sync streams HF-named tensors in buckets of at most this size.")
    weight_transfer: Literal["auto", "bytes", "collective", "ipc"] = doc(
        "auto", "How weights reach the engines after a step. 'bytes': buckets through Ray's object store (one pull "
                "per engine). 'collective': a private gloo (CPU) / NCCL (CUDA) group from each PP stage's sender to "
                "every engine worker, flat buckets broadcast (rollout/collective.py). 'ipc': CUDA IPC handles, "
                "colocated on CUDA only. 'auto': 'collective' when engines and policy are on different nodes or "
                "(CUDA, not colocated) different GPUs, 'ipc' colocated on CUDA, 'bytes' on one CPU node (measured "
                "there: Ray's shared-memory object store is as fast as gloo over loopback; docs/rollout.md).")
    weight_sync_timeout_s: float = doc(600.0, "Collective transport: group set-up and per-broadcast timeout; a sync "
                                              "whose sender stops sending fails after at most this long.")
    logprob_check_fraction: float = doc(0.05, "With actor.use_rollout_logprobs: fraction of responses whose rollout "
                                              "log-probs are recomputed by the policy and compared (mean/max abs diff "
                                              "logged). Without it every response is compared (pi_old is recomputed "
                                              "anyway).")
    logprob_drift_factor: float = doc(10.0, "Alert (a warning and rollout/logprob_drift_alert=1) when a step's mean "
                                            "rollout/policy log-prob mismatch exceeds this multiple of the fresh-sync "
                                            "level (the first step's, floored by dtype: rollout/consistency.py "
                                            "DriftMonitor). 0 = no alert; the ratio is logged either way.")
    colocate: bool = doc(False, "Engines share GPUs with the policy (CUDA IPC sync + sleep/wake) instead of separate: "
                                "engine i and policy rank i take half of one GPU each (trainer/placement.py).")
    engine_placement: Literal["any", "same_nodes", "other_nodes"] = doc(
        "any", "Nodes the engines may use: 'other_nodes' = only nodes without policy ranks (the paper's layout: "
               "policy on one 8-GPU node, engines on the second), 'same_nodes' = only nodes with policy ranks, 'any'. "
               "Enforced by node-pinned placement-group bundles (trainer/placement.py).")
    num_cpus_per_engine: float = doc(1, "Ray resources per engine actor.")
    restart_on_failure: bool = doc(False, "Restart an engine that died (else the step fails with a clear error).")
    mode: Literal["rounds", "streaming"] = doc("rounds", "Dynamic sampling: 'rounds' (the paper's; whole rounds until "
        "the batch is full) or 'streaming' (groups scored as they finish, the rest aborted; docs/rollout.md).")
    stream_order: Literal["submission", "completion"] = doc("submission", "Streaming batch = the first kept groups in "
        "prompt order (unbiased, reproducible) or in finishing order (biased to short responses).")
    max_inflight_prompts: int = doc(0, "Streaming: prompts in flight across all engines (0 = data.train_batch_size).")
    stream_steps_per_call: int = doc(8, "Streaming: engine steps per driver round trip (bounds how long aborts wait).")
    staleness: int = doc(0, "k: a group whose generation started under policy version v is trained at a version <= v + "
                            "k. 0: the paper's synchronous loop; 1: step t+1 generated while t trains (exactly "
                            "reproducible); >= 2 (or partial_rollouts): the engines generate continuously beside the "
                            "loop and admission of new prompts waits when the bound could break (pacing: nothing is "
                            "discarded for being late; trainer/async_rollout.py, docs/async.md).")
    partial_rollouts: bool = doc(False, "At a weight update, interrupt the running requests (tokens kept) and continue "
                                        "them under the new weights from prompt + tokens so far, instead of letting "
                                        "them finish before the sync. Every token records the version that sampled it "
                                        "(TIS and the drift check use it). Needs mode=streaming, staleness >= 1.")
    late_policy: Literal["pace", "discard"] = doc(
        "pace", "The asynchronous producer's staleness bound: 'pace' (admission waits, nothing is discarded) or "
                "'discard' (for comparison only: groups released in completion order, and a kept group that would be "
                "trained more than staleness versions after it started is thrown away, counted per difficulty "
                "bucket in rollout/async/discarded_late/*; hard prompts, the long ones, are the ones it starves).")
    max_versions_per_response: int = doc(4, "Partial rollouts: a response may span at most this many policy versions; "
                                            "a group that reached it is finished under its weights at the next update "
                                            "(the sync waits for it) instead of being interrupted again.")
    ignore_eos: bool = doc(False, "Generate exactly max_response_length tokens, ignoring EOS (benchmarks only).")


@dataclass
class OverlongConfig:
    enable: bool | None = doc(None, "DAPO overlong reward shaping (Eq. 8). None = the algorithm's preset (on for dapo/"
                                    "da3po; off for grpo/gspo, our choice).")
    buffer_length: int = doc(512, "L_cache of Eq. 8 (tokens): penalty ramps linearly over the last L_cache tokens "
                                  "before L_max = rollout.max_response_length.")


@dataclass
class AlgorithmConfig:
    name: Literal[ALGORITHMS] = doc(  # type: ignore[valid-type]
        "da3po", "The algorithm (algorithms/registry.py): grpo = symmetric clip, per-sample mean (Eq. 4); dapo = "
                 "clip-higher + token-level loss (Eq. 9) + dynamic sampling + overlong shaping (Eq. 8); gspo = "
                 "sequence-level ratio; da3po = dapo + DAA (Eq. 14). It decides every field below documented as "
                 "'None = the preset's'; an explicit value overrides the preset (reported at load).")
    clip_ratio_low: float | None = doc(None, "eps_low of Eq. 5/11: ratio clipped below at 1 - eps_low. None = the "
                                             "preset's (0.2; gspo 3e-4).")
    clip_ratio_high: float | None = doc(None, "eps_high of Eq. 11 (clip-higher). None = the preset's (grpo 0.2, "
                                              "dapo/da3po 0.28, gspo 4e-4).")
    ratio_level: Literal["token", "sequence"] | None = doc(
        None, "Importance ratio per token (Eq. 5/11) or per sequence (GSPO). None = the preset's.")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean"] | None = doc(
        None, "Loss aggregation: token-mean (Eq. 9) or seq-mean-token-mean (Eq. 4). None = the preset's (token-mean "
              "for dapo/da3po, seq-mean-token-mean for grpo/gspo).")
    filter_groups: bool | None = doc(None, "Dynamic sampling: keep only groups with 0 < p_hat < 1 and over-sample "
                                           "until the batch is full. None = the preset's (on for dapo/da3po; off for "
                                           "grpo/gspo, our choice).")
    policy_loss_fn: str = doc("", "Custom policy loss by import path, 'package.module:function' or "
                                  "'path/to/file.py:function' ('' = algorithms/losses.py policy_loss). Called like "
                                  "policy_loss (algorithms/registry.py POLICY_LOSS_FN_ARGS, docs/algorithms.md); the "
                                  "fused kernel is then not used for the loss.")
    advantage_fn: str = doc("", "Custom advantage estimator replacing Eq. 3, by import path: fn(rewards, group_size, "
                                "*, eps) -> advantages ('' = group z-scores, Eq. 3). DAA is applied to its output.")
    max_generation_rounds: int = doc(8, "Dynamic sampling gives up after this many generation rounds per step "
                                        "(clear error with the observed keep rate).")
    surplus: Literal["drop", "carry"] = doc("drop", "Kept groups beyond the batch: dropped (verl) or carried to the "
                                                    "next step.")
    advantage_eps: float = doc(1e-6, "epsilon added to std(R) in Eq. 3.")
    rollout_correction: Literal["none", "tis"] = doc(
        "none", "Correction for the engine / policy log-prob mismatch (not in the DA3PO paper): 'tis' = truncated "
                "importance sampling (Yao, Liu et al. 2025; verl rollout_is, slime --use-tis): each token's surrogate "
                "term (Eq. 5/11) is multiplied by the detached w_t = min(pi_old(y_t) / pi_rollout(y_t), tis_cap). "
                "Needs pi_old recomputed by the policy; token-ratio algorithms only (not gspo).")
    tis_cap: float = doc(2.0, "C of TIS: the importance weight is truncated at this value (verl / slime: 2.0).")
    overlong: OverlongConfig = field(default_factory=OverlongConfig)


@dataclass
class DAAConfig:
    enable: bool | None = doc(None, "Direct Advantage Amplification (Eq. 14). None = the preset's (on for da3po only); "
                                    "may be turned on for grpo/gspo/dapo too.")
    lambda_: float = doc(2.0, "lambda of Eq. 14: correct responses of hard prompts (p_hat < tau) get lambda x A "
                              "(paper: 2; ablation 1, 1.5, 2, 2.5).")
    tau: float = doc(0.5, "tau of Eq. 14: difficulty threshold on p_hat, strict (paper: 0.5).")
    mode: Literal["constant", "adaptive"] = doc(
        "constant", "'adaptive' derives lambda per group from gamma(p_hat, G) of Thm 3.1 (lambda = 1/gamma), clipped "
                    "to [lambda_min, lambda_max].")
    lambda_min: float = doc(1.0, "Adaptive mode: lower clip of lambda.")
    lambda_max: float = doc(3.0, "Adaptive mode: upper clip of lambda.")


@dataclass
class SyntheticTaskConfig:
    min_digits: int = doc(1, "Easiest prompt: this many digits.")
    max_digits: int = doc(8, "Hardest prompt: this many digits (difficulty buckets = digit counts).")
    train_per_bucket: int = doc(512, "Training prompts per difficulty bucket.")
    eval_per_bucket: int = doc(32, "Held-out evaluation prompts per bucket (never in the training split).")
    response_tokens: list[int] = doc([], "[easy, hard]: long-tailed response lengths growing with difficulty, as in "
                                         "math RL (benchmarks, tools/bench_async.py). Each training prompt's responses "
                                         "are capped at a length drawn once per prompt from a log-normal (sigma 0.6) "
                                         "whose median grows geometrically from easy (min_digits) to hard "
                                         "(max_digits) tokens, clipped to rollout.max_response_length; with "
                                         "rollout.ignore_eos=true they are exactly that long. Empty: responses end "
                                         "where the policy ends them (one digit per input digit).")
    coin_p: list[float] = doc([], "One probability per bucket (min_digits..max_digits): training answers become "
                                  "'coin:<p>' for reward.kind=coin (correct with probability p, by a hash of the "
                                  "response), a stand-in verifier with the task's difficulty profile for random-weight "
                                  "benchmarks. Empty: the real answers. Held-out evaluation always uses them.")


@dataclass
class DataConfig:
    train_files: list[str] = doc([], "Training data: DAPO-Math-17K parquet, or jsonl/parquet with prompt/answer "
                                     "columns. Empty with format=synthetic.")
    format: Literal["dapo", "generic", "synthetic"] = doc(
        "dapo", "Reader for train_files: DAPO-Math-17K's parquet schema, a generic jsonl/parquet with prompt/answer "
                "columns, or the built-in synthetic task (no files).")
    prompt_key: str = doc("prompt", "Column holding the prompt (jsonl/parquet).")
    answer_key: str = doc("answer", "Column holding the reference answer (jsonl/parquet).")
    template: Literal["none", "dapo", "boxed"] = doc("dapo", "Prompt template applied to raw problems of generic "
                                                             "files (DAPO-Math-17K prompts already carry theirs).")
    apply_chat_template: bool = doc(True, "Wrap prompts in the tokenizer's chat template.")
    train_batch_size: int = doc(512, "Prompts per RL step (paper: 512), i.e. groups after dynamic sampling.")
    shuffle: bool = doc(True, "Shuffle by (seed, epoch).")
    dedup: bool = doc(False, "Drop repeated (prompt, answer) rows of each train file (count in data_stats.json). "
                             "DAPO-Math-17K's parquet has ~1.79M rows of ~17.9K problems: with dedup, epochs and the "
                             "data position count unique problems (docs/data_and_rewards.md).")
    on_bad_row: Literal["error", "skip"] = doc("error", "Malformed rows: stop with file/row/field, or skip and count.")
    synthetic: SyntheticTaskConfig = field(default_factory=SyntheticTaskConfig)


@dataclass
class RewardConfig:
    kind: Literal["math", "synthetic", "coin"] = doc("math", "Verifier: math-verify (boxed / 'Answer:'), the synthetic "
                                                             "task, or 'coin' (the benchmark's keep-rate task).")
    num_workers: int = doc(4, "Reward processes (math-verify needs its own main thread per process).")
    timeout_s: float = doc(10.0, "Per-item time limit; a timed-out answer scores -1 and is counted.")


@dataclass
class EvalConfig:
    every: int = doc(0, "Evaluate every this many steps (0 = never during training).")
    benchmarks: list[str] = doc([], "Benchmark names (aime24, aime25, aime26, amc, minerva, olympiadbench, math500, "
                                    "synthetic).")
    k: int | None = doc(None, "Samples per problem; None = the paper's protocol per benchmark (32 or 8).")
    temperature: float = doc(1.0, "Paper: 1.0.")
    top_p: float = doc(0.95, "Paper: 0.95.")
    limit: int | None = doc(None, "Evaluate only the first N problems of each benchmark.")
    data_dir: str = doc("", "Benchmark directory (see docs/evaluation.md); empty = $DA3PO_DATA/benchmarks.")
    template: Literal["boxed", "dapo", "none"] = doc("boxed", "Prompt template of math benchmarks (the verifier reads "
                                                              "the last \\boxed{} or 'Answer:' line either way).")


@dataclass
class RayConfig:
    address: str = doc("local", "'local' starts a private Ray instance; 'auto' joins the cluster (Slurm).")
    num_cpus_per_policy_rank: float = doc(1, "Ray CPUs per policy actor.")
    device: Literal["auto", "gpu", "cpu"] = doc(
        "auto", "What the actors compute on: 'auto' = GPUs when the Ray cluster has any, else CPU; 'gpu' refuses a "
                "cluster without GPUs; 'cpu' gives every actor 0 GPUs (the only way to run on CPU on a cluster with "
                "GPUs: a 0-GPU actor there would see every GPU of its node). trainer/placement.py.")
    num_gpus_per_policy_rank: float | None = doc(None, "Ray GPUs per policy actor. None = 1 when the actors use GPUs "
                                                       "(ray.device), 0 on CPU; 0 on a GPU cluster is refused.")
    num_gpus_per_engine: float | None = doc(None, "Ray GPUs per vLLM engine. None = rollout.tensor_parallel_size when "
                                                  "the actors use GPUs, 0 on CPU; colocated: half of its rank's GPU.")
    spread_policy_nodes: bool = doc(False, "Each policy TP group (MoE: each block of lcm(TP, EP x ETP) ranks) on a "
                                           "node of its own (else they fill nodes in order) -- for the local "
                                           "multi-node tests.")
    expert_groups_across_nodes: bool = doc(False, "MoE: let an expert-parallel group straddle nodes. Default "
                                                  "false: the policy is placed in blocks of lcm(TP, EP x ETP) "
                                                  "consecutive ranks per node, so the dispatcher's all-to-alls stay "
                                                  "inside a node, and a layout whose block does not fit a node is "
                                                  "refused; true: blocks of TP ranks only (trainer/placement.py, "
                                                  "docs/moe.md).")
    placement_timeout_s: float = doc(300.0, "Seconds to wait for the placement groups (resources reserved on their "
                                            "nodes) before failing with what is pending where.")
    start_timeout_s: float = doc(1800.0, "Seconds to wait for the policy ranks' and engines' start-up (process "
                                         "groups, model build, vLLM load) before failing with the ranks/engines "
                                         "still pending and their nodes.")
    engine_cpus: str = doc("", "Cores the engine actors are pinned to, e.g. '0' or '0-3' ('' = no pinning).")
    policy_cpus: str = doc("", "Cores the policy actors are pinned to; disjoint from engine_cpus for real overlap.")

@dataclass
class ProfileConfig:
    steps: list[int] = doc([], "RL steps to profile (e.g. [5]); [] = off, and then profiling costs nothing. Traces go "
                               "to run_dir/profile/step_N/ (chrome-trace JSON: open in Perfetto, ui.perfetto.dev).")
    ranks: list[int] = doc([0], "Policy ranks (global torch.distributed ranks) traced with the torch profiler in a "
                                "profiled step: CPU activities, and CUDA activities on GPU.")
    engines: list[int] = doc([], "Rollout engines traced with vLLM's own profiler (LLM.start_profile / stop_profile; "
                                 "the engines are then built with a torch profiler_config); [] = none.")
    driver: bool = doc(True, "Also trace the driver (the RL loop: its phase ranges generate, reward, filter, "
                             "old_logprobs, train, weight_sync, checkpoint).")
    memory: bool = doc(False, "Record memory: the torch profiler's memory events, and on CUDA a memory snapshot "
                              "(torch.cuda.memory._dump_snapshot, open in pytorch.org/memory_viz) of each traced rank.")
    with_stack: bool = doc(False, "Python stacks in the traces (larger files, slower).")
    record_shapes: bool = doc(False, "Tensor shapes of the recorded ops.")
    nvtx: bool = doc(False, "NVTX ranges for the phases on EVERY step (for an nsys run of the whole job); profiled "
                            "steps get them anyway. No effect without CUDA.")


@dataclass
class TrainerConfig:
    total_steps: int = doc(200, "RL steps (paper: 200).")
    seed: int = doc(42, "Seed of data order, sampling and initialisation.")
    run_dir: str = doc("runs/da3po", "Where logs, checkpoints and plots go.")
    save_every: int = doc(20, "Checkpoint every N steps (0 = only at the end).")
    async_save: bool = doc(False, "Write checkpoints asynchronously (megatron-core's async dist_checkpointing save): "
                                  "the next step starts while the policy's shards are written; 'latest' moves only "
                                  "once the write is complete and verified; at most one save in flight "
                                  "(docs/operations.md).")
    save_hf_every: int = doc(0, "Also write Hugging Face weights (safetensors + config + tokenizer) into the "
                                "checkpoint of every N-th step, as step_N/hf/, from the weight sync's export stream "
                                "(a checkpoint is saved at those steps); 0 = off. `da3po eval --checkpoint step_N` "
                                "reads them.")
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    keep_last: int = doc(3, "Checkpoints kept (older ones deleted after a newer one is complete).")
    keep_best_metric: str = doc("", "Also keep the best checkpoint by this eval metric key (eval/avg/avg@k), never "
                                    "pruned, in checkpoints/best.json (paper: best of 200 steps). '' = off.")
    keep_best_mode: Literal["max", "min"] = doc("max", "Whether a larger or a smaller keep_best_metric is better.")
    resume: bool = doc(True, "Resume from run_dir/checkpoints/latest when it exists.")
    max_consecutive_skipped_updates: int = doc(
        3, "Optimizer updates in a row that may be refused -- a non-finite loss or gradient on any rank, or an update "
           "larger than max_update_ratio (megatron/update_guard.py) -- before the run stops with an error, ahead of "
           "the weight sync and any checkpoint.")
    max_update_ratio: float = doc(
        0.1, "Refuse an optimizer update whose relative size ||delta theta|| / ||theta|| (L2 over all weights, "
             "computed before it is applied; unitless, logged as train/update_ratio) exceeds this; 0 = measure only. "
             "Default: far above healthy RL steps and far below a blown-up update (measured: docs/reliability.md).")
    lock_lease_s: float = doc(
        120.0, "Seconds without a heartbeat after which another trainer may take run_dir/LOCK over (trainer/lock.py; "
               "a dead trainer on the same host is taken over at once). Heartbeat every lease/6.")
    tensorboard: bool = doc(True, "Write TensorBoard events to run_dir/tb (JSONL metrics are always written).")
    wandb_project: str = doc("", "Weights & Biases project ('' = off).")
    experiment_name: str = doc("", "Run name in logs ('' = basename of run_dir).")


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


# ----------------------------------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """YAML file (with ``defaults``) + dotted overrides -> validated :class:`Config`."""
    data: dict[str, Any] = read_yaml(Path(path)) if path else {}
    for item in overrides or []:
        keys, value = parse_override(item)
        try:  # a wrong key or value on the command line is reported as the command line's, not the YAML file's
            build(Config, nest(keys, value))
        except ConfigError as e:
            if "unknown config key" in str(e) or "is not a section" in str(e) or "expected a mapping" in str(e) \
                    or str(e).startswith(".".join(keys)):  # the value's own error, e.g. daa.lambda_=abc
                raise ConfigError(f"command line override {item!r}: {e}") from None
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: '{k}' is not a section")
        node[keys[-1]] = value
    try:
        cfg = build(Config, data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path else str(e)) from None
    resolve(cfg)
    validate(cfg)
    for line in preset_overrides(cfg):
        log.info("%s", line)
    return cfg


def resolve(cfg: Config) -> Config:
    """Fill, in place, every field the algorithm's preset decides and that is unset (None) -- the ONE place presets
    reach the config (``algorithms/registry.py``) -- and check custom functions given by import path (imported and
    signature-checked; a relative ``file.py`` path is made absolute so that workers with another working directory
    find it). Called by :func:`load_config`; call it on a :class:`Config` built in code. Returns ``cfg``."""
    resolve_presets(cfg)
    a = cfg.algorithm
    for name, args in (("policy_loss_fn", POLICY_LOSS_FN_ARGS), ("advantage_fn", ADVANTAGE_FN_ARGS)):
        spec = getattr(a, name)
        if not spec:
            continue
        try:
            load_function(spec, args, where=f"algorithm.{name}")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        module, _, fn = spec.partition(":")
        if module.endswith(".py"):
            setattr(a, name, f"{Path(module).resolve()}:{fn}")
    return cfg


def algorithm_config(name: str, **explicit: Any) -> AlgorithmConfig:
    """A resolved ``algorithm`` section for ``name``, explicit fields winning over the preset: for code that switches
    a live policy between algorithms (ablations, tests) without loading a whole run config."""
    cfg = Config(algorithm=AlgorithmConfig(name=name, **explicit))
    resolve(cfg)
    return cfg.algorithm


def standalone_policy_config(model_path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """A resolved, validated run config for a policy used without the RL loop (torchrun jobs, tests, benchmarks,
    self-checks): the synthetic data format (no files) and rollout lengths of a few tokens so that any micro-batch
    budget validates, then ``overrides`` as on the command line (e.g. ``parallel.tensor_model_parallel_size=2``,
    ``actor.loss_backend=torch``). Every other value is the run config's own default."""
    base = [f"model.path={model_path}", "data.format=synthetic", "rollout.max_prompt_length=1",
            "rollout.max_response_length=2", "algorithm.overlong.buffer_length=1"]
    return load_config(None, [*base, *overrides])


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain data (for logs, checkpoints and ``--print-config``)."""
    return dataclasses.asdict(cfg)


def describe(cls: type = Config, prefix: str = "") -> list[str]:
    """One line per field: dotted name, default, documentation."""
    lines = []
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            lines += describe(tp, name + ".")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        lines.append(f"{name} = {default!r}: {f.metadata.get('help', '')}")
    return lines
