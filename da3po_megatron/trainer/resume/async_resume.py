"""A resume that changes the asynchronous settings (issue 47, point 1; docs/async.md "Resuming with other settings").

``rollout.staleness``, ``partial_rollouts``, ``late_policy``, ``release_order``, ``max_versions_per_response`` and
``max_inflight_prompts`` decide what a checkpoint's generation state means: the prefetched batch of staleness 1
(``pending``) or the producer's queue, decided groups and interrupted partials (``async_rollout``). A change is
migrated exactly or refused before Ray starts (``config_drift.refuse_async_changes``, with these rules), naming
the fields; nothing is dropped silently:

- staleness 1 -> the producer: **migrated**; the prefetched batch enters the producer's queue first and is trained
  at the version the prefetch meant (``AsyncRollout(prefetched=)``; staleness 1 <= k);
- staleness 1 -> 0: **refused** while a prefetched batch is saved (it would be trained one version late);
- the producer -> staleness 0 / 1: **refused** while its state holds groups (the loop would never train them);
- the producer with k raised, partial rollouts on or off, another late_policy or max_inflight_prompts: **migrated**
  as saved (bounds only loosen; a partial continues, and without partial rollouts is drained at the next sync);
- the producer with k lowered: **refused** when a saved group could be trained more than the new k versions after
  it started (the admission rule's worst case: every undecided group counted as kept, in the new release order),
  else migrated;
- ``release_order`` fifo -> oldest_decided (issue 58): **migrated** -- the saved state has one format for both
  orders, and a state within the bound in admission order is within it earliest deadline first (the order that
  meets every deadline if any does: ``generation/release.py``); oldest_decided -> fifo: **refused**, naming
  ``rollout.release_order``, when a saved group would be trained late in admission order (a group restarted from
  scratch after an engine failure has a later deadline than younger ones), else migrated;
- max_versions_per_response lowered: **refused** when a saved partial would span more versions once continued.
"""

from __future__ import annotations

from typing import Any

from da3po_megatron.trainer.generation.release import late

FIELDS = ("rollout.staleness", "rollout.partial_rollouts", "rollout.late_policy", "rollout.release_order",
          "rollout.max_versions_per_response", "rollout.max_inflight_prompts")


def _producer(r: dict[str, Any]) -> bool:
    return int(r["staleness"]) >= 2 or bool(r["partial_rollouts"])


def _keeps(g: dict[str, Any], filter_groups: bool) -> bool:
    acc = list(g["acc"])
    p = sum(float(a) > 0 for a in acc) / max(len(acc), 1)
    return not filter_groups or 0.0 < p < 1.0


def over_bound(state: dict[str, Any], k: int, batch_size: int, first_version: int, filter_groups: bool,
               order: str = "fifo") -> list[str]:
    """Groups of a producer state (``AsyncRollout.state_dict``) that could be trained more than ``k`` versions after
    they started, each as ``uid (started v, trained <= w)``; the next batch trains at ``first_version``; every
    undecided group counted as kept. ``order``: ``fifo`` (the released kept groups in order, then the decided and
    undecided ones by admission index), ``oldest_decided`` (all of them earliest deadline first: by start version,
    then admission order, :func:`~da3po_megatron.trainer.generation.release.oldest_first`) or ``discard``
    (late_policy discard*: only the released queue; a later group over the bound is discarded and counted, never
    trained)."""
    rel = state.get("released", [])
    seq = [(g["example"]["uid"], int(g["weight_step"]), i - len(rel)) for i, g in enumerate(rel)
           if _keeps(g, filter_groups)]
    if order != "discard":
        later = [(g["example"]["uid"], int(g["weight_step"]), int(j)) for j, g in state.get("decided", [])
                 if _keeps(g, filter_groups)]
        later += [(p["example"]["uid"], int(p["start_version"]), int(p["j"])) for p in state.get("partials", [])]
        if order == "fifo":
            seq += sorted(later, key=lambda t: t[2])
        else:
            seq = sorted(seq + later, key=lambda t: (t[1], t[2]))
    return [f"{uid} (started at version {start}, trained at version {trained})"
            for uid, start, trained in late([(u, s) for u, s, _ in seq], first_version, batch_size, k)]


def async_resume_problems(old: dict[str, Any], new: dict[str, Any], state: dict[str, Any]) -> list[str]:
    """Why a checkpoint written under config ``old`` (a resolved config dict) cannot resume under ``new``, given its
    trainer state ``state`` (empty: it can, migrated as the table in the module docstring says)."""
    o, n = old["rollout"], new["rollout"]
    pending, producer_state = state.get("pending") or [], state.get("async_rollout")
    held = producer_state and any(producer_state.get(x) for x in ("released", "decided", "partials"))
    problems = []
    if _producer(o) and not _producer(n) and held:
        s = producer_state
        problems.append(f"the checkpoint holds the asynchronous producer's {len(s['released'])} queued, "
                        f"{len(s['decided'])} decided and {len(s['partials'])} in-flight groups, which the loop "
                        f"without the producer (rollout.staleness={n['staleness']}, partial_rollouts="
                        f"{n['partial_rollouts']}) would never train")
    if not _producer(n) and int(n["staleness"]) == 0 and pending:
        problems.append("the checkpoint holds a prefetched batch (staleness 1); at rollout.staleness=0 it would be "
                        "trained one version after it was generated, over the new bound")
    if _producer(o) and _producer(n) and held:
        k, batch = int(n["staleness"]), int(new["data"]["train_batch_size"])
        first = int(producer_state.get("first_version", state.get("step", 0)))
        filt = bool(new["algorithm"]["filter_groups"])
        order = n.get("release_order", "fifo") if n["late_policy"] == "pace" else "discard"
        over = over_bound(producer_state, k, batch, first, filt, order)
        if over:
            was, now = o.get("release_order", "fifo"), n.get("release_order", "fifo")
            named = f" under rollout.release_order={now} (the checkpoint's run: {was})" if now != was else ""
            problems.append(f"{len(over)} admitted groups could be trained more than rollout.staleness={k} versions "
                            f"after they started{named}, e.g. {', '.join(over[:3])}")
        m = int(n["max_versions_per_response"])
        wide = [p["example"]["uid"] for p in producer_state.get("partials", []) if n["partial_rollouts"] and
                int(p["span"]) + 1 > m]
        if wide:
            problems.append(f"{len(wide)} interrupted groups would span more than rollout.max_versions_per_response="
                            f"{m} versions once continued, e.g. {', '.join(wide[:3])}")
    return problems
