"""Config changes on resume: said, recorded, or refused.

Which fields define a run, and the field-by-field diff, are pure config facts: ``config/diff.py`` (this module reads
checkpoints and run records and decides what to say or refuse). Every checkpoint holds the resolved config it was
trained with (``trainer_state.pt["config"]``, every preset value
filled in). On resume the trainer compares it with the config of the new command, field by field, and

- **refuses** (exit 2, every such field listed with its old and new value) changes to what defines the run: the
  model and its tokenizer (``model.path``, dtype, vocabulary padding), every ``algorithm`` field (the preset's and
  the custom functions; ``max_generation_rounds`` excepted), ``daa.*``, the data (``data.*`` but ``on_bad_row``),
  the verifier (``reward.kind``), ``trainer.seed``, the sampling that defines the groups and Eq. 8 (``rollout.n``,
  ``temperature``, ``top_p``, ``max_prompt_length``, ``max_response_length``) and the parallel layout the checkpoint
  cannot reshard (TP, PP, CP, EP, ETP: the optimizer state loads at the same layout only, DP aside; the checkpoint's
  own ``policy/meta.json`` layout is compared too, :func:`check_checkpoint_layout`) -- unless
  ``--allow-config-change``;
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

Where the run's config is recorded, so that a damaged checkpoint cannot hide it (issue 35):

- ``run_dir/config.yaml``, the **run record**: the resolved config the run trains with, written atomically
  (write-then-``os.replace``) at the first launch and rewritten by a resume that changes something (after the check
  passed, so it names what the next checkpoint will hold); loadable with ``--config``. A run directory of an older
  version gets it from its newest readable checkpoint on its first resume.
- every checkpoint's ``trainer_state.pt["config"]``, the config that checkpoint was trained with.

A resume is checked twice: before anything starts (:func:`check_resume_config`, against the run record: a damaged
``latest`` no longer skips the check), and once the checkpoint to load is known (:func:`check_checkpoint_config`,
called by ``trainer/run.py`` after the verification that may fall back to an older checkpoint): against that
checkpoint's own record whenever it defines the run differently from the run record (a fallback across an allowed
change) or there is no run record. Either refuses the same way.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from da3po_megatron.config import Config, to_dict
from da3po_megatron.config.diff import config_changes
from da3po_megatron.trainer.resume.async_resume import FIELDS, async_resume_problems

CHANGES_FILE = "config_changes.jsonl"
RECORD_FILE = "config.yaml"

# the LR schedule: megatron-core restores it from the checkpoint (see the module docstring)
SCHEDULE = ("optim.lr", "optim.min_lr", "optim.lr_warmup_steps", "optim.lr_schedule", "optim.weight_decay")


class ConfigDriftError(RuntimeError):
    """A resume would change what defines the run (the message lists the fields)."""


def _line(c: dict[str, Any]) -> str:
    return f"{c['key']}: {c['old']!r} -> {c['new']!r}"


def _latest_name(run_dir: str | Path) -> str | None:
    pointer = Path(run_dir) / "checkpoints" / "latest"
    try:
        return pointer.read_text().strip() or None
    except OSError:
        return None


def _step_of(name: str) -> int:
    try:
        return int(name.rsplit("_", 1)[1])
    except (IndexError, ValueError):
        return 0


def checkpoint_config(run_dir: str | Path, path: Path | None = None, quiet: bool = False
                      ) -> tuple[Path, int, dict[str, Any]] | None:
    """(checkpoint, step, resolved config) of the checkpoint ``path`` (default: the one ``latest`` names), read
    without verifying it (the trainer verifies before loading); None when there is none or it has no config."""
    from da3po_megatron.megatron.checkpoint import safe_load

    if path is None:
        name = _latest_name(run_dir)
        if name is None:
            return None
        path = Path(run_dir) / "checkpoints" / name
    try:
        state = safe_load(path / "trainer_state.pt")
    except Exception as e:  # noqa: BLE001 - a damaged checkpoint is the resume's business (verified, fallen back)
        if not quiet:
            print(f"note: could not read the config recorded in {path} ({type(e).__name__}); the run record "
                  f"{Path(run_dir) / RECORD_FILE} and the checkpoint the resume falls back to are checked instead",
                  flush=True)
        return None
    if not isinstance(state, dict) or not isinstance(state.get("config"), dict):
        return None
    return path, int(state.get("step", 0)), state["config"]


# ---------------------------------------------------------------------------------------------------- run record
def read_run_record(run_dir: str | Path) -> dict[str, Any] | None:
    """The run record ``run_dir/config.yaml`` (None when the run has none yet). An unreadable record raises
    :class:`ConfigDriftError`: it is what a resume is checked against, so it is never silently skipped."""
    import yaml

    path = Path(run_dir) / RECORD_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        data = e
    if not isinstance(data, dict):
        raise ConfigDriftError(
            f"{path}: the run record is unreadable ({data if isinstance(data, Exception) else 'not a mapping'}); "
            "every checkpoint holds a copy of the config it was trained with (trainer_state.pt['config']): restore the "
            "file, or pass --allow-config-change to resume and rewrite it")
    return data


def write_run_record(cfg: Config) -> Path | None:
    """Write ``run_dir/config.yaml`` atomically (a private file, fsync, ``os.replace``) when it is missing or differs
    from ``cfg``; returns its path when written."""
    import yaml

    run_dir = Path(cfg.trainer.run_dir)
    path = run_dir / RECORD_FILE
    data = to_dict(cfg)
    try:
        if read_run_record(run_dir) == data:
            return None
    except ConfigDriftError:
        pass  # unreadable: replaced (a resume past it needed --allow-config-change)
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{RECORD_FILE}.{os.getpid()}.tmp")
    head = (f"# The run record of {run_dir}: the resolved config this run trains with (da3po train, "
            f"{time.strftime('%Y-%m-%dT%H:%M:%S')}). A resume is checked against it; changes are listed in "
            f"{CHANGES_FILE}.\n")
    with open(tmp, "w") as f:
        f.write(head + yaml.safe_dump(data, sort_keys=False))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def adopt_checkpoint_record(run_dir: str | Path) -> bool:
    """A run directory of an older version (checkpoints, no run record): write the record from the newest readable
    checkpoint's config (``latest``'s, or the newest step before it). True when written."""
    import yaml

    run_dir = Path(run_dir)
    if (run_dir / RECORD_FILE).exists() or _latest_name(run_dir) is None:
        return False
    found = checkpoint_config(run_dir, quiet=True)
    if found is None:
        return False
    path = run_dir / RECORD_FILE
    tmp = path.with_name(f".{RECORD_FILE}.{os.getpid()}.tmp")
    tmp.write_text(f"# The run record of {run_dir}, taken from {found[0].name}'s trainer_state.pt (a run of an older "
                   "version)\n" + yaml.safe_dump(found[2], sort_keys=False))
    os.replace(tmp, path)
    return True


def refuse_async_changes(new: dict[str, Any], old: dict[str, Any], changes: list[dict[str, Any]], path: Path,
                         log=print) -> None:
    """Before Ray starts: when ``changes`` touch the asynchronous settings (``async_resume.FIELDS``), read the
    checkpoint ``path``'s trainer state and raise :class:`ConfigDriftError` naming the fields if
    ``async_resume_problems`` finds any (``--allow-config-change`` does not override it: the state would be dropped);
    else say what is migrated. (Moved here from ``async_resume.py``, which keeps the pure rules: issue 56.)"""
    from da3po_megatron.megatron.checkpoint import safe_load

    touched = [c for c in changes if c["key"] in FIELDS]
    if not touched:
        return
    try:
        state = safe_load(Path(path) / "trainer_state.pt")
    except Exception:  # noqa: BLE001 - unreadable: the verification falls back; AsyncRollout re-checks the bound
        return
    names = "; ".join(f"{c['key']}: {c['old']!r} -> {c['new']!r}" for c in touched)
    problems = async_resume_problems(old, new, state if isinstance(state, dict) else {})
    if problems:
        raise ConfigDriftError(
            f"resuming from {Path(path).name} with {names} would drop or break saved generation state: "
            + "; ".join(problems) + ". Resume with the checkpoint's values of these fields (docs/async.md "
            "'Resuming with other settings'), or start another trainer.run_dir.")
    if state.get("pending") or state.get("async_rollout"):
        log(f"note: resume changes {names}: the saved generation state is migrated (docs/async.md 'Resuming with "
            "other settings')")


# ---------------------------------------------------------------------------------------------------- the checks
def _check(cfg: Config, old: dict[str, Any], name: str, step: int, allow: bool, log, against: str
           ) -> list[dict[str, Any]]:
    """Compare ``cfg`` with ``old`` (``against``: what it is, for the record), print, record, refuse."""
    changes = config_changes(old, to_dict(cfg))
    if not changes:
        return []
    refuse_async_changes(to_dict(cfg), old, changes, Path(cfg.trainer.run_dir) / "checkpoints" / name, log)
    defining = [c for c in changes if c["kind"] == "defining"]
    if defining and not allow:
        notes = [c for c in changes if c["kind"] != "defining"]
        raise ConfigDriftError(
            f"resuming {cfg.trainer.run_dir} from {name} (step {step}) would change what defines the run:\n  "
            + "\n  ".join(_line(c) for c in defining)
            + ("\n(also changed, allowed: " + "; ".join(_line(c) for c in notes) + ")" if notes else "")
            + f"\n(compared with {against})"
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
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "resumed_from": str(Path(cfg.trainer.run_dir) /
                                                                             "checkpoints" / name),
              "step": step, "compared_with": against, "allow_config_change": allow, "changes": changes}
    with open(Path(cfg.trainer.run_dir) / CHANGES_FILE, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")
    return changes


def check_resume_config(cfg: Config, allow: bool = False, log=print) -> list[dict[str, Any]]:
    """Before anything of a resume starts: compare ``cfg`` with the run record ``run_dir/config.yaml`` (a run of an
    older version: with the newest readable checkpoint's config, adopted as its record); print every change, record
    them in ``run_dir/config_changes.jsonl``, and raise :class:`ConfigDriftError` for changes to what defines the run
    unless ``allow``. Returns the changes (empty when nothing changed or there is nothing to resume)."""
    if not cfg.trainer.resume:
        return []
    run_dir = Path(cfg.trainer.run_dir)
    name = _latest_name(run_dir)
    if name is None:
        return []  # no checkpoint: nothing is resumed (the run starts at step 0; its record is rewritten)
    adopt_checkpoint_record(run_dir)
    try:
        old = read_run_record(run_dir)
    except ConfigDriftError:
        if not allow:
            raise
        old = None
    if old is None:  # no record and latest unreadable: the checkpoint actually loaded is checked (trainer/run.py)
        checkpoint_config(run_dir)
        return []
    return _check(cfg, old, name, _step_of(name), allow, log, f"the run record {run_dir / RECORD_FILE}")


def planned_layout(cfg: Config) -> dict[str, Any]:
    """The parallel layout ``cfg`` will run the policy at, in ``meta.json``'s terms (ETP None = TP)."""
    p = cfg.parallel
    return {"tensor_model_parallel_size": p.tensor_model_parallel_size,
            "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
            "context_parallel_size": p.context_parallel_size,
            "expert_model_parallel_size": p.expert_model_parallel_size,
            "expert_tensor_parallel_size": p.expert_tensor_parallel_size or p.tensor_model_parallel_size,
            "params_dtype": cfg.model.params_dtype, "distributed_optimizer": cfg.optim.use_distributed_optimizer}


def check_checkpoint_layout(cfg: Config, path: Path, allow: bool = False, log=print) -> list[str]:
    """Before Ray starts: the policy layout recorded in the checkpoint ``path`` (``policy/meta.json``) against the
    one ``cfg`` will run at. The optimizer state (Adam moments) loads only at the same TP, PP, CP, EP, ETP, dtype and
    optimizer kind (``megatron/checkpoint.OPTIMIZER_LAYOUT``; DP may change); any other change raises
    :class:`ConfigDriftError` naming the fields, or with ``allow`` (``--allow-config-change``) prints that the
    policy will load the model only. The layer spec (TE or local), known only on the ranks, is checked there
    (``load_policy``: model only, with a warning). Returns the changes."""
    from da3po_megatron.megatron.checkpoint import optimizer_layout_changes

    meta_file = next((f for f in (Path(path) / "policy" / "meta.json", Path(path) / "meta.json") if f.exists()), None)
    if meta_file is None:
        return []
    try:
        saved = json.loads(meta_file.read_text()).get("layout") or {}
    except (OSError, ValueError):
        return []  # a damaged checkpoint is the verification's business
    changes = optimizer_layout_changes(saved, planned_layout(cfg))
    if changes and not allow:
        raise ConfigDriftError(
            f"resuming {cfg.trainer.run_dir} from {Path(path).name} would change the policy's layout: "
            + "; ".join(changes) + f"\n(saved in {meta_file}). Its optimizer state loads only at the same layout "
            "(megatron's dp_reshardable buckets; DP may change). Resume with the saved layout, or pass "
            "--allow-config-change to load the model only (Adam moments start fresh).")
    if changes:
        log(f"warning: resume changes the policy's layout ({'; '.join(changes)}): the policy loads the MODEL ONLY "
            f"from {Path(path).name}; its optimizer state starts fresh (allowed by --allow-config-change)")
    return changes


def check_checkpoint_config(cfg: Config, path: Path, allow: bool = False, log=print) -> list[dict[str, Any]]:
    """The checkpoint ``path`` a resume loads (after verification and any fallback) against its own recorded config,
    when that defines the run differently from the run record (which :func:`check_resume_config` compared with) or
    there is no run record. Refuses like :func:`check_resume_config`. First its policy layout
    (:func:`check_checkpoint_layout`)."""
    check_checkpoint_layout(cfg, path, allow, log)
    run_dir = Path(cfg.trainer.run_dir)
    found = checkpoint_config(run_dir, path)
    if found is None:
        return []
    _, step, old = found
    try:
        record = read_run_record(run_dir)
    except ConfigDriftError:
        record = None
    if record is not None and not any(c["kind"] == "defining" for c in config_changes(record, old)):
        return []  # what defines the run is the record's, already compared
    return _check(cfg, old, path.name, step, allow, log, f"the config recorded in {path / 'trainer_state.pt'}")
