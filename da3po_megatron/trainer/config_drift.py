"""Config changes on resume: said, recorded, or refused.

Every checkpoint holds the resolved config it was trained with (``trainer_state.pt["config"]``, every preset value
filled in). On resume the trainer compares it with the config of the new command, field by field, and

- **refuses** (exit 2, every such field listed with its old and new value) changes to what defines the run: the
  model and its tokenizer (``model.path``, dtype, vocabulary padding), every ``algorithm`` field (the preset's and
  the custom functions; ``max_generation_rounds`` excepted), ``daa.*``, the data (``data.*`` but ``on_bad_row``),
  the verifier (``reward.kind``), ``trainer.seed``, the sampling that defines the groups and Eq. 8 (``rollout.n``,
  ``temperature``, ``top_p``, ``max_prompt_length``, ``max_response_length``) and the parallel layout the checkpoint
  cannot reshard (TP, PP, CP: the optimizer state loads at the same TP x PP only) -- unless ``--allow-config-change``;
- passes with a one-line **notice** changes that cannot change what a step computes: ``trainer.total_steps``, eval,
  checkpoint and logging cadence, placement and resources (``ray.*``, engine counts and memory, weight-sync
  transport), micro-batch token budgets, recomputation, reward workers and time limits;
- passes with a **warning** (the run goes on, but from this step on it trains differently) everything else, e.g.
  ``actor.ppo_mini_batch_size``, ``actor.loss_backend``, ``rollout.staleness``, ``optim.clip_grad``.

``optim.lr`` and the rest of the LR schedule are a case of their own: megatron-core restores the schedule from the
checkpoint (``OptimizerParamScheduler.load_state_dict`` with ``use_checkpoint_opt_param_scheduler=True``, 0.16.1
``optimizer_param_scheduler.py`` ~312-378: lr, min_lr, warm-up, decay steps and style come from the checkpoint), so a
changed value has no effect, and the warning says so.

Every resume with a change appends one line to ``run_dir/config_changes.jsonl`` (time, step, checkpoint, whether
``--allow-config-change`` was given, each change with its kind), so a run's history says what changed when.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from da3po_megatron.config import Config, to_dict

CHANGES_FILE = "config_changes.jsonl"

# what defines the run: a change is refused without --allow-config-change (prefixes of dotted keys)
DEFINING = ("model.path", "model.params_dtype", "model.make_vocab_size_divisible_by", "algorithm.", "daa.", "data.",
            "reward.kind", "trainer.seed", "rollout.n", "rollout.temperature", "rollout.top_p",
            "rollout.max_prompt_length", "rollout.max_response_length", "parallel.tensor_model_parallel_size",
            "parallel.pipeline_model_parallel_size", "parallel.context_parallel_size")
DEFINING_EXCEPT = ("algorithm.max_generation_rounds", "data.on_bad_row")
# cannot change what a step computes: a one-line notice
HARMLESS = ("trainer.total_steps", "trainer.run_dir", "trainer.resume", "trainer.save_every", "trainer.keep_last",
            "trainer.keep_best_metric", "trainer.keep_best_mode", "trainer.tensorboard", "trainer.wandb_project",
            "trainer.experiment_name", "trainer.lock_lease_s", "trainer.max_consecutive_skipped_updates",
            "trainer.max_update_ratio", "eval.", "ray.", "rollout.num_engines", "rollout.gpu_memory_utilization",
            "rollout.kv_cache_memory_bytes", "rollout.weight_sync_bucket_mb", "rollout.weight_transfer",
            "rollout.weight_sync_timeout_s", "rollout.num_cpus_per_engine", "rollout.restart_on_failure",
            "rollout.logprob_drift_factor", "rollout.engine_placement", "rollout.colocate",
            "actor.max_tokens_per_microbatch", "actor.logprob_max_tokens_per_microbatch", "actor.memory_check",
            "actor.entropy", "model.recompute_", "reward.num_workers", "reward.timeout_s",
            "algorithm.max_generation_rounds", "data.on_bad_row")
SCHEDULE = ("optim.lr", "optim.min_lr", "optim.lr_warmup_steps", "optim.lr_schedule", "optim.weight_decay")


class ConfigDriftError(RuntimeError):
    """A resume would change what defines the run (the message lists the fields)."""


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


def _line(c: dict[str, Any]) -> str:
    return f"{c['key']}: {c['old']!r} -> {c['new']!r}"


def checkpoint_config(run_dir: str | Path) -> tuple[Path, int, dict[str, Any]] | None:
    """(checkpoint, step, resolved config) of the checkpoint a resume of ``run_dir`` would start from (``latest``),
    read without verifying it (the trainer verifies before loading); None when there is none or it has no config."""
    from da3po_megatron.megatron.checkpoint import safe_load

    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    path = pointer.parent / pointer.read_text().strip()
    try:
        state = safe_load(path / "trainer_state.pt")
    except Exception as e:  # noqa: BLE001 - a damaged checkpoint is the resume's business (verified, fallen back)
        print(f"note: could not read the config recorded in {path} ({type(e).__name__}); config changes are not "
              "checked for this resume", flush=True)
        return None
    if not isinstance(state, dict) or not isinstance(state.get("config"), dict):
        return None
    return path, int(state.get("step", 0)), state["config"]


def check_resume_config(cfg: Config, allow: bool = False, log=print) -> list[dict[str, Any]]:
    """Compare ``cfg`` with the config of the checkpoint a resume would load; print every change, record them in
    ``run_dir/config_changes.jsonl``, and raise :class:`ConfigDriftError` for changes to what defines the run unless
    ``allow``. Returns the changes (empty when nothing changed or there is nothing to resume)."""
    if not cfg.trainer.resume:
        return []
    found = checkpoint_config(cfg.trainer.run_dir)
    if found is None:
        return []
    path, step, old = found
    changes = config_changes(old, to_dict(cfg))
    if not changes:
        return []
    defining = [c for c in changes if c["kind"] == "defining"]
    if defining and not allow:
        notes = [c for c in changes if c["kind"] != "defining"]
        raise ConfigDriftError(
            f"resuming {cfg.trainer.run_dir} from {path.name} (step {step}) would change what defines the run:\n  "
            + "\n  ".join(_line(c) for c in defining)
            + ("\n(also changed, allowed: " + "; ".join(_line(c) for c in notes) + ")" if notes else "")
            + "\nResume with the checkpoint's values, start another trainer.run_dir, or pass --allow-config-change "
              f"to continue anyway (recorded in {Path(cfg.trainer.run_dir) / CHANGES_FILE}).")
    for c in changes:
        if c["kind"] == "harmless":
            extra = " (the LR schedule keeps the checkpoint's horizon)" if c["key"] == "trainer.total_steps" and \
                cfg.optim.lr_schedule != "constant" else ""
            log(f"note: resume changes {_line(c)}{extra}")
        elif c["key"] in SCHEDULE:
            log(f"warning: resume changes {_line(c)}, which has no effect: megatron-core restores the LR schedule "
                "from the checkpoint")
        else:
            log(f"warning: resume changes {_line(c)}" + (" (allowed by --allow-config-change)"
                                                          if c["kind"] == "defining" else "")
                + f": steps after {step} train differently from those before")
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "resumed_from": str(path), "step": step,
              "allow_config_change": allow, "changes": changes}
    with open(Path(cfg.trainer.run_dir) / CHANGES_FILE, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")
    return changes
