"""Which config fields define a run, and the diff of two resolved configs field by field with each change's kind --
pure facts of the config tree, read by the resume check (``trainer/resume/config_drift.py``: what a resume says,
records or refuses) and by replay (``trainer/generation/replay.py``: a dump that does not match the run). Split from
``config_drift.py`` (issue 56) so that generation need not import resume.

Kinds of a change (dotted keys, matched by prefix):

- ``defining`` (:data:`DEFINING` but :data:`DEFINING_EXCEPT`): the model and its tokenizer, every ``algorithm`` field,
  ``daa.*``, the data, the verifier, ``trainer.seed``, the sampling that defines the groups and Eq. 8, and the
  parallel layout a checkpoint cannot reshard -- refused on resume without ``--allow-config-change``;
- ``harmless`` (:data:`HARMLESS`): cannot change what a step computes (cadence, placement, resources, budgets) -- a
  one-line notice; a field one side does not know (an older version's config) counts as harmless;
- ``changed``: everything else -- the run goes on, training differently from then on (a warning).
"""

from __future__ import annotations

from typing import Any

# what defines the run: a change is refused without --allow-config-change (prefixes of dotted keys)
DEFINING = ("model.path", "model.params_dtype", "model.make_vocab_size_divisible_by", "algorithm.", "daa.", "data.",
            "reward.kind", "trainer.seed", "rollout.n", "rollout.temperature", "rollout.top_p",
            "rollout.max_prompt_length", "rollout.max_response_length", "parallel.tensor_model_parallel_size",
            "parallel.pipeline_model_parallel_size", "parallel.context_parallel_size")
DEFINING_EXCEPT = ("algorithm.max_generation_rounds", "data.on_bad_row")
# cannot change what a step computes: a one-line notice
HARMLESS = ("trainer.total_steps", "trainer.run_dir", "trainer.resume", "trainer.save_every", "trainer.keep_last",
            "trainer.keep_best_metric", "trainer.keep_best_mode", "trainer.async_save",
            "trainer.save_hf_every", "trainer.profile.", "trainer.tensorboard", "trainer.wandb_project",
            "trainer.experiment_name", "trainer.lock_lease_s", "trainer.max_consecutive_skipped_updates",
            "trainer.max_update_ratio", "eval.", "ray.", "rollout.num_engines", "rollout.gpu_memory_utilization",
            "rollout.kv_cache_memory_bytes", "rollout.weight_sync_bucket_mb", "rollout.weight_transfer",
            "rollout.weight_sync_timeout_s", "rollout.num_cpus_per_engine", "rollout.restart_on_failure",
            "rollout.logprob_drift_factor", "rollout.engine_placement", "rollout.colocate",
            "actor.max_tokens_per_microbatch", "actor.logprob_max_tokens_per_microbatch", "actor.memory_check",
            "actor.entropy", "model.recompute_", "reward.num_workers", "reward.timeout_s", "rollout.dump_",
            "rollout.replay_match_threshold",
            "algorithm.max_generation_rounds", "data.on_bad_row")


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def kind_of(key: str) -> str:
    """'defining', 'harmless' or 'changed' (see the module docstring)."""
    if key.startswith(DEFINING) and not key.startswith(DEFINING_EXCEPT):
        return "defining"
    if key.startswith(HARMLESS):
        return "harmless"
    return "changed"


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[dict[str, Any]]:
    """Every field whose value differs between the checkpoint's config ``old`` and the new one, with its kind. A field
    the checkpoint does not know (written by an older version) counts as harmless."""
    a, b = _flat(old), _flat(new)
    changes = []
    for key in sorted(set(a) | set(b)):
        if key in a and key in b and a[key] == b[key]:
            continue
        if key not in a or key not in b:
            kind = "harmless"
        else:
            kind = kind_of(key)
        changes.append({"key": key, "old": a.get(key, "<absent>"), "new": b.get(key, "<absent>"), "kind": kind})
    return changes
