"""Config sections of the algorithm and the run: algorithm presets, DAA, data, rewards, evaluation, Ray, trainer
(exported by ``config/__init__.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from da3po_megatron.algorithms.registry import ALGORITHMS
from da3po_megatron.config.io import doc


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
                                         "math RL (benchmarks, da3po bench async). Each training prompt's responses "
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
    # Pre-rollout selection (data/selection.py; docs/algorithms.md "Selective rollout"; GRESO, arXiv 2506.02177)
    selection: Literal["none", "skip_zero_variance", "posterior"] = doc(
        "none", "Skip prompts before generation with a probability growing with their zero-variance streak "
                "(P(keep) = p^z), all-correct and all-wrong streaks by separate rules; posterior: skip with the "
                "probability that the next group of rollout.n is zero-variance under a per-prompt Beta posterior "
                "of the pass rate (data/selection_posterior.py, MoPPS arXiv 2507.04632; issue 59); none = the "
                "paper's sampling.")
    selection_tails: Literal["separate", "shared"] = doc(
        "separate", "separate: own rate (<= 1/2) and back-off re-admission for all-wrong streaks (hard prompts stay "
                    "in play); "
                    "shared: one rate for both tails (naive GRESO, for comparison).")
    selection_target_all_correct: float = doc(0.10, "Target fraction of generated groups that are all correct; p_c "
                                                    "steps down when a window exceeds it, up otherwise.")
    selection_target_all_wrong: float = doc(0.20, "Target fraction of all-wrong generated groups (adapts p_w).")
    selection_explore_init: float = doc(0.5, "Initial exploration rates p_c, p_w (P(keep) of a streak of 1).")
    selection_explore_step: float = doc(0.05, "Additive step eta of the rates per window of train_batch_size "
                                              "generated groups.")
    selection_explore_min: float = doc(0.05, "Floor of p_c (and of the shared rate).")
    selection_explore_min_all_wrong: float = doc(0.05, "Floor of p_w (p_w <= 1/2, the back-off's rate; hard "
                                                 "prompts stay in play by the back-off re-admission).")
    selection_max_skips_all_wrong: int = doc(1, "Back-off base b: an all-wrong prompt with a streak of z, skipped "
                                                "b * 2^(z-1) times in a row, is generated the next time it comes up "
                                                "(0 = never skip all-wrong streaks).")
    selection_prior_strength: float = doc(2.0, "posterior: n0, the prior's weight in pseudo-samples (responses) at "
                                               "its bucket's running pass rate (MoPPS's Beta(1, 1) prior has 2).")
    selection_decay: float = doc(0.9, "posterior: lambda, the evidence's weight kept per training step (decayed "
                                      "toward the prior, MoPPS's temporal discount); 0.9 = half-life ~6.6 steps, "
                                      "about an epoch of the 128-prompt comparison (our choice).")
    selection_sharpness: float = doc(3.0, "posterior: s, P(keep) = (1 - P(zero-variance group))^s above the floors "
                                          "(data/selection_posterior.py Eq. P5); 1 = the chance the group is "
                                          "informative, larger skips likely-zero-variance prompts harder; 3 saved "
                                          "most in the issue 59 study (docs/results_selection.md).")


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
    rescore_groups: int = doc(0, "Diagnostic (issue 47), 0 = off: every step after the weight sync, generate G fresh "
                                 "responses for up to this many kept and this many dropped groups of the step and "
                                 "log how often the filter's (0 < p_hat < 1) and DAA's (p_hat < daa.tau) decisions "
                                 "made with the old p_hat differ under the new weights (rescore/*, per bucket; "
                                 "trainer/generation/rescore.py). Not trained on, not counted in "
                                 "gen/cumulative_samples.")


@dataclass
class RayConfig:
    address: str = doc("local", "'local' starts a private Ray instance; 'auto' joins the cluster (Slurm).")
    num_cpus_per_policy_rank: float = doc(1, "Ray CPUs per policy actor.")
    device: Literal["auto", "gpu", "cpu"] = doc(
        "auto", "What the actors compute on: 'auto' = GPUs when the Ray cluster has any, else CPU; 'gpu' refuses a "
                "cluster without GPUs; 'cpu' gives every actor 0 GPUs (the only way to run on CPU on a cluster with "
                "GPUs: a 0-GPU actor there would see every GPU of its node). trainer/cluster/placement.py.")
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
                                                  "refused; true: blocks of TP ranks only "
                                                  "(trainer/cluster/placement.py, docs/moe.md).")
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
    nvtx: bool = doc(False, "NVTX ranges for the phases on EVERY step, in the driver and on every policy rank (for "
                            "an nsys run of the whole job); profiled steps get them anyway and return to this state. "
                            "No effect without CUDA.")


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
        120.0, "Seconds without a heartbeat after which another trainer may take run_dir/LOCK over "
               "(trainer/resume/lock.py; a dead trainer on the same host is taken over at once). Heartbeat every "
               "lease/6.")
    tensorboard: bool = doc(True, "Write TensorBoard events to run_dir/tb (JSONL metrics are always written).")
    wandb_project: str = doc("", "Weights & Biases project ('' = off).")
    experiment_name: str = doc("", "Run name in logs ('' = basename of run_dir).")

