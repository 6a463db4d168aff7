"""The run config's range and consistency checks (:func:`validate`), kept apart from the tree they check
(:mod:`da3po_megatron.config.tree`; :mod:`da3po_megatron.config.load` calls them from ``load_config``). Each error
names the field and its allowed range.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from da3po_megatron.config.io import ConfigError, check_finite

if TYPE_CHECKING:
    from da3po_megatron.config.tree import Config


def _check(cond: bool, name: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"{name} = {value!r} is out of range: allowed {allowed}")


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
    return obj


def validate(cfg: Config) -> None:
    """Range and consistency checks; each error names the field and its allowed range."""
    check_finite(cfg)
    p = cfg.parallel
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "data_parallel_size"):
        _check(getattr(p, name) >= 1, f"parallel.{name}", getattr(p, name), ">= 1")
    if p.context_parallel_size > 1:
        raise ConfigError(f"parallel.context_parallel_size = {p.context_parallel_size}: context parallelism is not "
                          "supported yet (sequences are not split across CP ranks, so pi_old would come out multiplied "
                          "by the CP size); use parallel.context_parallel_size=1")
    _check(p.expert_model_parallel_size >= 1, "parallel.expert_model_parallel_size", p.expert_model_parallel_size,
           ">= 1")
    if p.expert_tensor_parallel_size is not None:
        _check(p.expert_tensor_parallel_size >= 1, "parallel.expert_tensor_parallel_size",
               p.expert_tensor_parallel_size, ">= 1 or null (= tensor_model_parallel_size)")
    if p.sequence_parallel and p.tensor_model_parallel_size == 1:
        raise ConfigError("parallel.sequence_parallel = True needs parallel.tensor_model_parallel_size > 1 (it splits "
                          "the sequence over the TP ranks); use parallel.sequence_parallel=null or false at TP 1")
    _check(cfg.eval.rescore_groups >= 0, "eval.rescore_groups", cfg.eval.rescore_groups, ">= 0 (0 = off)")
    _check(cfg.moe.aux_loss_coeff >= 0, "moe.aux_loss_coeff", cfg.moe.aux_loss_coeff, ">= 0")
    _check(0 <= cfg.moe.router_agreement_fraction <= 1, "moe.router_agreement_fraction",
           cfg.moe.router_agreement_fraction, "[0, 1]")
    if cfg.moe.routing_replay != "none":  # what R3 cannot work with (a dense model is refused by preflight)
        # (the streaming engines return routes too since issue 60: rollout/stream.py, _stream_routes)
        why = {"model.recompute_granularity": "recomputed MoE layers would route again in the backward pass "
               "(megatron's REPLAY_BACKWARD is not wired)" if cfg.model.recompute_granularity == "full" else ""}
        for field_name, reason in why.items():
            if reason:
                raise ConfigError(f"moe.routing_replay = {cfg.moe.routing_replay!r} with {field_name} = "
                                  f"{_get(cfg, field_name)!r}: {reason}; use moe.routing_replay=none or change "
                                  f"{field_name}")
    d = cfg.daa
    _check(d.lambda_ > 0, "daa.lambda_", d.lambda_, "> 0 (1 = no amplification)")
    _check(0 < d.tau < 1, "daa.tau", d.tau, "the open interval (0, 1)")
    _check(0 < d.lambda_min <= d.lambda_max, "daa.lambda_min", d.lambda_min, f"(0, daa.lambda_max={d.lambda_max}]")
    a = cfg.algorithm
    unresolved = [n for n, v in (("algorithm.clip_ratio_low", a.clip_ratio_low),
                                 ("algorithm.clip_ratio_high", a.clip_ratio_high),
                                 ("algorithm.ratio_level", a.ratio_level), ("algorithm.loss_agg_mode", a.loss_agg_mode),
                                 ("algorithm.filter_groups", a.filter_groups),
                                 ("algorithm.overlong.enable", a.overlong.enable), ("daa.enable", d.enable))
                  if v is None]
    if unresolved:
        raise ConfigError(f"{', '.join(unresolved)} unset: call config.resolve(cfg) before validate(cfg)")
    _check(0 <= a.clip_ratio_low < 1, "algorithm.clip_ratio_low", a.clip_ratio_low, "[0, 1)")
    _check(a.clip_ratio_high >= 0, "algorithm.clip_ratio_high", a.clip_ratio_high, ">= 0")
    _check(a.max_generation_rounds >= 1, "algorithm.max_generation_rounds", a.max_generation_rounds, ">= 1")
    _check(a.advantage_eps >= 0, "algorithm.advantage_eps", a.advantage_eps, ">= 0")
    _check(a.tis_cap > 0, "algorithm.tis_cap", a.tis_cap, "> 0")
    if a.rollout_correction == "tis" and cfg.actor.use_rollout_logprobs:
        raise ConfigError("algorithm.rollout_correction='tis' with actor.use_rollout_logprobs=true: pi_old would BE "
                          "pi_rollout, so every weight pi_old / pi_rollout is 1; recompute pi_old "
                          "(actor.use_rollout_logprobs=false) or set algorithm.rollout_correction=none")
    if a.rollout_correction == "tis" and a.ratio_level != "token":
        raise ConfigError(f"algorithm.rollout_correction='tis' with algorithm.name={a.name!r}: its ratio is per "
                          "sequence, and per-token TIS weights do not apply to it; use a token-ratio algorithm "
                          "(grpo, dapo, da3po) or algorithm.rollout_correction=none")
    r = cfg.rollout
    _check(r.n >= 2, "rollout.n", r.n, ">= 2 (group advantages need at least two responses)")
    _check(r.temperature > 0, "rollout.temperature", r.temperature, "> 0")
    _check(0 < r.top_p <= 1, "rollout.top_p", r.top_p, "(0, 1]")
    _check(r.max_response_length >= 1, "rollout.max_response_length", r.max_response_length, ">= 1")
    _check(r.staleness >= 0, "rollout.staleness", r.staleness, ">= 0")
    _check(r.max_versions_per_response >= 1, "rollout.max_versions_per_response", r.max_versions_per_response, ">= 1")
    if r.staleness >= 2 or r.partial_rollouts:  # the asynchronous producer (trainer/generation/async_rollout.py)
        what = "rollout.partial_rollouts=true" if r.partial_rollouts else f"rollout.staleness={r.staleness}"
        _check(r.mode == "streaming", "rollout.mode", r.mode, f"'streaming' with {what} (the producer streams)")
        _check(r.stream_order == "submission", "rollout.stream_order", r.stream_order,
               f"'submission' with {what} (batches are filled in FIFO order)")
        _check(r.staleness >= 1, "rollout.staleness", r.staleness, f">= 1 with {what} (0 is the synchronous loop)")
        _check(not r.colocate, "rollout.colocate", r.colocate, f"false with {what} (the engines generate while the "
               "policy trains)")
        # behaviour-policy correction cannot be forgotten (issue 47, point 2; docs/async.md "Correction")
        _check(not cfg.actor.use_rollout_logprobs, "actor.use_rollout_logprobs", True, f"false with {what}: pi_old "
               "must be one policy (recomputed), not the engines' per-token log-probs of up to k versions stitched")
        _check(r.allow_uncorrected or a.ratio_level == "token", "algorithm.name", a.name, f"a token-ratio algorithm "
               f"(grpo, dapo, da3po) with {what}: GSPO's sequence ratio has no behaviour correction here (per-token "
               "TIS does not apply to it); rollout.allow_uncorrected=true runs it uncorrected")
        _check(r.allow_uncorrected or a.rollout_correction != "none", "algorithm.rollout_correction",
               a.rollout_correction, f"'tis' with {what} (tokens sampled by up to k older policies need the "
               "behaviour correction); rollout.allow_uncorrected=true opts out")
    _check(r.late_policy == "pace" or r.staleness >= 2 or r.partial_rollouts, "rollout.late_policy", r.late_policy,
           "'pace' unless the asynchronous producer runs (rollout.staleness >= 2 or rollout.partial_rollouts)")
    _check(r.release_order in ("fifo", "oldest_decided"), "rollout.release_order", r.release_order,
           "'fifo' or 'oldest_decided'")
    _check(r.stream_steps_per_call >= 1, "rollout.stream_steps_per_call", r.stream_steps_per_call, ">= 1")
    _check(r.mode == "rounds" or a.surplus == "drop", "algorithm.surplus", a.surplus, "'drop' with rollout.mode="
           "streaming (it aborts the surplus instead of generating it)")
    _check(r.logprob_drift_factor >= 0, "rollout.logprob_drift_factor", r.logprob_drift_factor, ">= 0 (0 = off)")
    _check(0 <= r.logprob_check_fraction <= 1, "rollout.logprob_check_fraction", r.logprob_check_fraction, "[0, 1]")
    _check(r.weight_transfer in ("auto", "bytes", "collective", "ipc"), "rollout.weight_transfer", r.weight_transfer,
           "auto, bytes, collective or ipc")
    _check(r.weight_transfer != "ipc" or r.colocate, "rollout.weight_transfer", r.weight_transfer,
           "'ipc' only with rollout.colocate=true (CUDA IPC shares one GPU's memory)")
    _check(r.weight_transfer != "ipc" or p.expert_model_parallel_size == 1 or p.expert_tensor_parallel_size in
           (None, 1), "rollout.weight_transfer", r.weight_transfer,
           f"not 'ipc' with parallel.expert_tensor_parallel_size = {p.expert_tensor_parallel_size} (with EP > 1 the "
           "IPC transport passes each EP rank's whole experts round its EP group; an expert split over GPUs is not "
           "gathered: use 'bytes' or 'collective', docs/moe.md)")
    # the colocated IPC layout (engine GPUs without a policy rank) is a placement rule: trainer/cluster/placement.py
    # check_colocated_ipc, before Ray starts (issue 56: config validation imports nothing above config)
    _check(r.weight_sync_timeout_s > 0, "rollout.weight_sync_timeout_s", r.weight_sync_timeout_s, "> 0")
    _check(cfg.actor.offload == "none" or r.staleness == 0, "actor.offload", cfg.actor.offload,
           f"'none' with rollout.staleness={r.staleness} (the engines generate while the policy trains: its memory "
           "is never free to hand over; megatron/offload.py)")
    _check(r.dump_every >= 1, "rollout.dump_every", r.dump_every, ">= 1")
    _check(r.dump_keep >= 0, "rollout.dump_keep", r.dump_keep, ">= 0 (0 = keep all)")
    _check(0 <= r.replay_match_threshold <= 1, "rollout.replay_match_threshold", r.replay_match_threshold, "[0, 1]")
    # rollout.dump_dir is written under every pipeline, the asynchronous producer's too (issue 58: the batch each take
    # gave, with its versions and behaviour log-probs); its replay runs without the producer (generation/replay.py)
    if r.replay_dir:  # trainer/generation/replay.py: recorded batches, consumed in order
        _check(not (r.dump_dir and Path(r.dump_dir).resolve() == Path(r.replay_dir).resolve()), "rollout.dump_dir",
               r.dump_dir, "a directory other than rollout.replay_dir")
        _check(r.replay_mode == "train_only" or r.mode == "rounds", "rollout.mode", r.mode, "'rounds' with "
               "rollout.replay_mode=compare (the recorded request seeds are the generation rounds'; a dump of the "
               "asynchronous producer, which streams, replays with train_only)")
    ov = a.overlong
    _check(0 <= ov.buffer_length < r.max_response_length, "algorithm.overlong.buffer_length", ov.buffer_length,
           f"[0, rollout.max_response_length={r.max_response_length})")
    o = cfg.optim
    _check(o.lr > 0, "optim.lr", o.lr, "> 0")
    _check(0 <= o.min_lr <= o.lr, "optim.min_lr", o.min_lr, f"[0, optim.lr={o.lr}]")
    _check(o.clip_grad >= 0, "optim.clip_grad", o.clip_grad, ">= 0 (0 = off)")
    _check(o.weight_decay >= 0, "optim.weight_decay", o.weight_decay, ">= 0")
    _check(o.adam_eps > 0, "optim.adam_eps", o.adam_eps, "> 0")
    for name in ("adam_beta1", "adam_beta2"):
        _check(0 <= getattr(o, name) < 1, f"optim.{name}", getattr(o, name), "[0, 1)")
    _check(o.lr_warmup_steps >= 0, "optim.lr_warmup_steps", o.lr_warmup_steps, ">= 0")
    _check(cfg.reward.timeout_s > 0, "reward.timeout_s", cfg.reward.timeout_s, "> 0")
    _check(cfg.trainer.max_consecutive_skipped_updates >= 1, "trainer.max_consecutive_skipped_updates",
           cfg.trainer.max_consecutive_skipped_updates, ">= 1")
    _check(cfg.trainer.max_update_ratio >= 0, "trainer.max_update_ratio", cfg.trainer.max_update_ratio,
           ">= 0 (0 = measure only)")
    _check(cfg.trainer.lock_lease_s > 0, "trainer.lock_lease_s", cfg.trainer.lock_lease_s, "> 0")
    dc = cfg.data
    _check(dc.train_batch_size >= 1, "data.train_batch_size", dc.train_batch_size, ">= 1")
    for name in ("target_all_correct", "target_all_wrong", "explore_init", "explore_step", "explore_min",
                 "explore_min_all_wrong"):
        v = getattr(dc, f"selection_{name}")
        _check(0.0 <= v <= 1.0, f"data.selection_{name}", v, "in [0, 1]")
    _check(dc.selection_max_skips_all_wrong >= 0, "data.selection_max_skips_all_wrong",
           dc.selection_max_skips_all_wrong, ">= 0")
    _check(dc.selection_prior_strength > 0, "data.selection_prior_strength", dc.selection_prior_strength, "> 0")
    _check(0.0 <= dc.selection_decay <= 1.0, "data.selection_decay", dc.selection_decay, "in [0, 1]")
    _check(dc.selection_sharpness > 0, "data.selection_sharpness", dc.selection_sharpness, "> 0")
    ac = cfg.actor
    _check(ac.ppo_mini_batch_size >= 1, "actor.ppo_mini_batch_size", ac.ppo_mini_batch_size, ">= 1")
    _check(dc.train_batch_size % ac.ppo_mini_batch_size == 0, "actor.ppo_mini_batch_size", ac.ppo_mini_batch_size,
           f"a divisor of data.train_batch_size={dc.train_batch_size}")
    _check(ac.ppo_epochs >= 1, "actor.ppo_epochs", ac.ppo_epochs, ">= 1")
    _check(ac.logprob_max_tokens_per_microbatch >= 0, "actor.logprob_max_tokens_per_microbatch",
           ac.logprob_max_tokens_per_microbatch, ">= 0 (0 = 2 x actor.max_tokens_per_microbatch)")
    _check(cfg.model.make_vocab_size_divisible_by >= 1, "model.make_vocab_size_divisible_by",
           cfg.model.make_vocab_size_divisible_by, ">= 1")
    _check(ac.max_tokens_per_microbatch >= r.max_prompt_length + r.max_response_length,
           "actor.max_tokens_per_microbatch", ac.max_tokens_per_microbatch,
           f">= rollout.max_prompt_length + rollout.max_response_length = {r.max_prompt_length + r.max_response_length}"
           " (one whole sequence must fit)")
    sy = dc.synthetic
    _check(not sy.response_tokens or (len(sy.response_tokens) == 2 and 1 <= sy.response_tokens[0] <=
                                      sy.response_tokens[1]), "data.synthetic.response_tokens", sy.response_tokens,
           "[] or [easy, hard] with 1 <= easy <= hard")
    _check(not sy.coin_p or (len(sy.coin_p) == sy.max_digits - sy.min_digits + 1 and all(0 <= p <= 1 for p in
                                                                                          sy.coin_p)),
           "data.synthetic.coin_p", sy.coin_p, f"[] or {sy.max_digits - sy.min_digits + 1} probabilities in [0, 1] "
           "(one per bucket min_digits..max_digits)")
    if dc.format != "synthetic" and not dc.train_files:
        raise ConfigError(f"data.train_files is empty; give at least one file for data.format={dc.format!r}")
    _check(cfg.trainer.total_steps >= 1, "trainer.total_steps", cfg.trainer.total_steps, ">= 1")
    _check(o.lr_warmup_steps < cfg.optimizer_steps, "optim.lr_warmup_steps", o.lr_warmup_steps,
           f"< the run's {cfg.optimizer_steps} optimizer steps (trainer.total_steps x mini-batches x ppo_epochs)")
    _check(cfg.trainer.keep_last >= 1, "trainer.keep_last", cfg.trainer.keep_last, ">= 1")
    _check(cfg.trainer.save_every >= 0, "trainer.save_every", cfg.trainer.save_every,
           ">= 0 (0 = only at the end and on a stop request)")
    _check(cfg.trainer.save_hf_every >= 0, "trainer.save_hf_every", cfg.trainer.save_hf_every, ">= 0 (0 = off)")
    prof = cfg.trainer.profile
    _check(all(1 <= s <= cfg.trainer.total_steps for s in prof.steps), "trainer.profile.steps", prof.steps,
           f"steps within 1..trainer.total_steps={cfg.trainer.total_steps}")
    _check(all(0 <= r < cfg.policy_world_size for r in prof.ranks), "trainer.profile.ranks", prof.ranks,
           f"policy ranks within 0..{cfg.policy_world_size - 1} (the policy world's size is {cfg.policy_world_size})")
    _check(all(0 <= e < cfg.rollout.num_engines for e in prof.engines), "trainer.profile.engines", prof.engines,
           f"engine indices within 0..{cfg.rollout.num_engines - 1} (rollout.num_engines={cfg.rollout.num_engines})")
    best, ev = cfg.trainer.keep_best_metric, cfg.eval
    _check(not best or (best.startswith("eval/") and ev.every > 0 and bool(ev.benchmarks)), "trainer.keep_best_metric",
           best, f"'' or an eval/... metric key with evaluations on (eval.every={ev.every}, eval.benchmarks="
           f"{ev.benchmarks})")
    if not cfg.model.path:
        raise ConfigError("model.path is empty: give a Hugging Face checkpoint directory")
