"""The ``rollout`` config section: generation engines, sampling, weight sync, staleness (exported by
``config/__init__.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from da3po_megatron.config.io import doc


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
                                "engine i and policy rank i take half of one GPU each (trainer/cluster/placement.py).")
    engine_placement: Literal["any", "same_nodes", "other_nodes"] = doc(
        "any", "Nodes the engines may use: 'other_nodes' = only nodes without policy ranks (the paper's layout: "
               "policy on one 8-GPU node, engines on the second), 'same_nodes' = only nodes with policy ranks, 'any'. "
               "Enforced by node-pinned placement-group bundles (trainer/cluster/placement.py).")
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
                            "discarded for being late; trainer/generation/async_rollout.py, docs/async.md).")
    partial_rollouts: bool = doc(False, "At a weight update, interrupt the running requests (tokens kept) and continue "
                                        "them under the new weights from prompt + tokens so far, instead of letting "
                                        "them finish before the sync. Every token records the version that sampled it "
                                        "(TIS and the drift check use it). Needs mode=streaming, staleness >= 1.")
    late_policy: Literal["pace", "discard", "discard_unpaced"] = doc(
        "pace", "The asynchronous producer's staleness bound: 'pace' (admission waits, nothing is discarded) or "
                "'discard' (for comparison only: groups released in completion order, and a kept group that would be "
                "trained more than staleness versions after it started is thrown away, counted per difficulty "
                "bucket in rollout/async/discarded_late/*; hard prompts, the long ones, are the ones it starves). "
                "'discard_unpaced' (comparison only, issue 47): as 'discard' but admission is not paced -- the "
                "engines generate ahead freely (only rollout.max_inflight_prompts bounds them) and the bound is "
                "enforced by discarding alone.")
    release_order: Literal["fifo", "oldest_decided"] = doc(
        "oldest_decided", "The asynchronous producer (staleness >= 2 or partial_rollouts, late_policy 'pace'): which "
                "decided groups a batch takes; elsewhere it has no effect (the loop trains batches as generated; "
                "late_policy 'discard*' releases in completion order). 'oldest_decided' (the default since issue 58: "
                "AReaL / tinker-cookbook release the oldest finished work first): the oldest decided kept groups, out "
                "of order, unless an older running group needs the slot to meet its deadline (the take then waits "
                "for it; admission does not). 'fifo': the first data.train_batch_size kept groups in admission order "
                "(a running long group holds back the later ones; the default before). Either way a group started "
                "under version v is trained at <= v + staleness (unit: versions). trainer/generation/release.py; "
                "docs/async.md 'Release order and hard prompts' for the study behind the default.")
    max_versions_per_response: int = doc(4, "Partial rollouts: a response may span at most this many policy versions; "
                                            "a group that reached it is finished under its weights at the next update "
                                            "(the sync waits for it) instead of being interrupted again.")
    producer_timeout_s: float = doc(600.0, "The asynchronous producer: seconds an engine's stream call may take "
                                           "before the engine counts as hung (restarted with restart_on_failure, "
                                           "else the run checkpoints its last completed step and stops, naming it); "
                                           "the loop waits at most twice this for a producer that shows no progress.")
    allow_uncorrected: bool = doc(False, "Opt-out (comparisons only): let the asynchronous producer (staleness >= 2 "
                                         "or partial_rollouts) train with algorithm.rollout_correction=none, or with "
                                         "GSPO's sequence ratio (which has no per-token TIS), i.e. ignore that tokens "
                                         "were sampled by up to k older policies. docs/async.md 'Correction'.")
    ignore_eos: bool = doc(False, "Generate exactly max_response_length tokens, ignoring EOS (benchmarks only).")
    # Debugging at scale: dump a run's rollouts, replay them without (or against) the engines
    # (trainer/generation/replay.py)
    dump_dir: str = doc("", "Write each step's rollout (kept and generated groups, rewards, seeds; under the "
                            "asynchronous producer the batch it gave, with per-token versions and behaviour "
                            "log-probs), its policy batch after advantages and the driver state, atomically, to "
                            "dump_dir/step_NNNNNN.pt, with dump_dir/manifest.json (config, model, tokenizer and data "
                            "identity); '' = off. A launch removes the step files after the step it starts from. "
                            "docs/operations.md 'Rollout dump and replay'.")
    dump_every: int = doc(1, "Dump every k-th step only (bounds the disk: a step holds its token ids, log-probs, "
                             "versions and MoE routes).")
    dump_keep: int = doc(0, "Keep only the newest k step files in dump_dir (0 = all).")
    replay_dir: str = doc("", "Train on the rollouts dumped in this directory instead of generating them (the "
                              "manifest must match the run: refused before Ray starts otherwise; a dump of the "
                              "asynchronous producer replays without it); '' = off.")
    replay_mode: Literal["train_only", "compare"] = doc(
        "train_only", "train_only: no engine is planned or started, weight sync and evaluation are skipped; "
                      "compare: the engines regenerate each recorded group with its recorded seeds and the "
                      "token match ratio and log-prob difference are logged (replay/*), training consumes the "
                      "recording (a weight-sync check on real hardware).")
    replay_match_threshold: float = doc(0.9, "compare: a step whose token match ratio is below this is reported "
                                             "(warning, replay/match_below_threshold=1): the engines do not hold the "
                                             "policy's weights (Miles' threshold: 0.9).")
