"""`da3po train --config X.yaml [section.key=value ...]`: run (or resume) DA3PO / DAPO / GRPO / GSPO training.

Restarting the same command resumes from ``run_dir/checkpoints/latest`` (exactly, on CPU). ``--describe`` lists every
config field with its documentation; ``--print-config`` shows the effective config (every value the algorithm's preset
decides filled in) and exits. Explicit values that override the preset are reported on stderr, e.g.
``note: algorithm.clip_ratio_high=0.3 overrides the gspo preset (0.0004)``. The console shows our progress lines;
third-party logs (Transformer-Engine/Apex fallbacks, vLLM start-up, Ray workers) go to ``run_dir/logs/`` unless
``--verbose`` (``trainer/observability/console.py``).

Run integrity (docs/reliability.md): the trainer holds ``run_dir/LOCK`` while it runs (``trainer/resume/lock.py``; a
second trainer on the same directory exits with status 2 naming the holder; ``--force-unlock`` takes a lock whose holder
you know is gone), and a resume compares the config with the run record ``run_dir/config.yaml`` and with the checkpoint
it loads (``trainer/resume/config_drift.py``; changes to what defines the run are refused with status 2 unless
``--allow-config-change``, recorded in ``run_dir/config_changes.jsonl``). ``trainer.resume=false`` in a directory
that holds a run moves that run aside to ``run_dir/previous-<time>/`` (``trainer/resume/history.py``): no launch deletes
a run's checkpoints or metrics.

``main`` returns the exit status and never exits the process: a failed start-up closes what it opened (actors,
placement groups, reward pool; the lock here), so an in-process caller ends promptly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from da3po_megatron.algorithms.registry import preset_overrides
from da3po_megatron.config import ConfigError, describe, load_config, to_dict


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="da3po train", description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="YAML recipe (see examples/)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=10 daa.lambda_=2.5")
    ap.add_argument("--print-config", action="store_true", help="print the effective config and exit")
    ap.add_argument("--describe", action="store_true", help="list every config field with its documentation")
    ap.add_argument("--verbose", action="store_true", help="also show third-party logs (megatron-core, vLLM, Ray "
                                                           "workers) on the console; they always go to run_dir/logs/")
    ap.add_argument("--force-unlock", action="store_true", help="take run_dir/LOCK over whatever its holder (only "
                                                                 "when you know that trainer is gone)")
    ap.add_argument("--allow-config-change", action="store_true", help="resume although the config changes what "
                    "defines the run (model, algorithm, DAA, data, seed, layout); recorded in "
                    "run_dir/config_changes.jsonl")
    args = ap.parse_args(argv)
    if args.describe:
        print("\n".join(describe()))
        return 0
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    for line in preset_overrides(cfg):
        print(f"note: {line}", file=sys.stderr, flush=True)
    if args.print_config:
        print(json.dumps(to_dict(cfg), indent=2))
        return 0
    from da3po_megatron.trainer.inputs import InputError, check_output_dirs
    from da3po_megatron.trainer.resume.config_drift import ConfigDriftError, check_resume_config
    from da3po_megatron.trainer.resume.history import move_previous_run_aside
    from da3po_megatron.trainer.resume.lock import RunDirLock, RunDirLocked

    try:  # nothing is written yet: a run or dump directory that cannot be made is one line, exit 2
        check_output_dirs(cfg)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    lock = RunDirLock(cfg.trainer.run_dir, lease_s=cfg.trainer.lock_lease_s)
    try:  # before anything of the run is read or written
        lock.acquire(force=args.force_unlock)
    except RunDirLocked as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        try:
            if not cfg.trainer.resume:  # a fresh start: a previous run in this directory is kept, aside
                move_previous_run_aside(cfg.trainer.run_dir)
            check_resume_config(cfg, allow=args.allow_config_change)
        except ConfigDriftError as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
        except OSError as e:  # the run directory cannot be read or written (permissions, a full disk)
            print(f"error: {cfg.trainer.run_dir}: {e}", file=sys.stderr)
            return 2
        return _train(cfg, args)
    finally:
        lock.release()


def _train(cfg, args: argparse.Namespace) -> int:
    """The run itself, under the lock: logs, ``train``, and one line + exit status per kind of failure."""
    from da3po_megatron.data.datasets import BadRowError
    from da3po_megatron.megatron.memory import MemoryBudgetError
    from da3po_megatron.rewards import RewardPoolError
    from da3po_megatron.trainer.cluster.placement import PlacementError
    from da3po_megatron.trainer.generation.async_engines import EngineFailure
    from da3po_megatron.trainer.generation.async_rollout import ProducerStalled
    from da3po_megatron.trainer.generation.collect import DynamicSamplingError
    from da3po_megatron.trainer.inputs import InputError
    from da3po_megatron.trainer.loop import train
    from da3po_megatron.trainer.observability.console import configure
    from da3po_megatron.trainer.resume.checkpoint import CheckpointWriteError, NoIntactCheckpointError
    from da3po_megatron.trainer.resume.config_drift import ConfigDriftError
    from da3po_megatron.trainer.updates import UpdateSizeError

    log_dir = configure(cfg.trainer.run_dir, verbose=args.verbose or os.environ.get("DA3PO_VERBOSE") == "1")
    print(f"logs: third-party output in {log_dir}/" + ("" if args.verbose else " (--verbose to see it here)"),
          flush=True)

    try:
        run = train(cfg, allow_config_change=args.allow_config_change)
    except ConfigDriftError as e:  # the checkpoint a resume fell back to defines the run otherwise: nothing started
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except BadRowError as e:  # names file, row and field; data.on_bad_row=skip skips and counts instead
        print(f"data error: {e}\n(set data.on_bad_row=skip to skip and count malformed rows)", file=sys.stderr)
        return 2
    except (FileNotFoundError, NoIntactCheckpointError, InputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except UpdateSizeError as e:  # updates refused for their size (trainer.max_update_ratio): before a sync or save
        print(f"update error: {e}", file=sys.stderr)
        return 1
    except FloatingPointError as e:  # non-finite updates / rewards / weights: stopped before a sync or save
        print(f"non-finite error: {e}", file=sys.stderr)
        return 1
    except CheckpointWriteError as e:  # e.g. disk full: the previous checkpoint and `latest` are intact
        print(f"checkpoint error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C: exit now (actors and reward workers were shut down)
        print("interrupted: exited without a checkpoint", file=sys.stderr)
        return 130
    except DynamicSamplingError as e:  # one line; the filter's counts of the failed step are in metrics.jsonl
        print(f"dynamic sampling error: {e}", file=sys.stderr)
        return 2
    except RewardPoolError as e:
        print(f"reward error: {e}", file=sys.stderr)
        return 2
    except (EngineFailure, ProducerStalled) as e:  # the async producer's engine died / hung (no restart): the last
        print(f"rollout error: {e}; the last completed step is checkpointed (rollout.restart_on_failure=true "
              "restarts the engine instead)", file=sys.stderr)  # completed step is checkpointed (trainer/loop.py)
        return 1
    except MemoryBudgetError as e:  # before anything started; the message says what to change
        print(f"memory error: {e}", file=sys.stderr)
        return 2
    except PlacementError as e:  # the Ray cluster cannot hold the run (checked before any actor starts)
        print(f"placement error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        if not str(e).startswith("parallel: "):
            raise
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(f"done: step {run.state.step}; logs in {run.run_dir}/metrics.jsonl", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
