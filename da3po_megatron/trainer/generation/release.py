"""Which decided groups the asynchronous producer releases into a batch, and when admission waits (issue 58; the
producer is ``async_rollout.py``, docs/async.md "Release order"). Pure functions over plain tuples: no lock, no
engine, no Ray; the producer calls them under its lock and ``tests/test_async_release.py`` drives them alone.

**The deadline invariant.** A group that starts generating under policy version v has the deadline v + k
(k = ``rollout.staleness``): it must be trained at a version <= v + k. The batch the loop takes next trains at
``first_version`` = f, the one after it at f + 1, and so on, B = ``data.train_batch_size`` kept groups each. Count
every group admitted and not yet trained or filtered -- decided and kept, or still undecided (running, interrupted,
or with the scorer: counted as kept, since its p_hat is unknown). The invariant is

    for every version w >= f:   #{such groups with deadline <= w}  <=  (w - f + 1) * B            (I)

i.e. taken earliest deadline first, the group at position i (0-based) is trained at f + i // B <= its deadline
(:func:`fits`). Nothing is ever dropped: the three steps that change the counts each keep (I):

- **admission** (:func:`admissible`): a new group under the engines' version v has the latest deadline v + k of all
  (no group started under a later version), so it only adds to the count at w >= v + k, and it is admitted only if
  the count it joins fits: f + p_max // B <= v + k, p_max = the groups counted above. Otherwise admission waits for
  the next weight update (pacing). It waits for nothing else, under either order;
- **a decision**: a filtered group (p_hat 0 or 1) leaves the count; a kept one stays;
- **release** (:func:`pick`, the loop's ``take``): B kept decided groups leave the count and f becomes f + 1.
  ``fifo`` (the default until issue 58's study): the first B kept groups in admission order, once every group
  before the B-th is decided (a running group at the head holds back every later one). ``oldest_decided`` (the
  default): the B oldest *decided* kept groups,
  out of order -- a decided group never waits behind an older running one -- unless the rest would break (I) at
  f + 1 (an older undecided group needs the slot: most plainly, one at its deadline, start + k <= f, which no
  batch after this one may train); then the take waits for decisions. Oldest = the version the group started
  under, then its admission index: earliest deadline first. So a running group never loses its place to the bound;
  it loses places only to groups that can spare them.

Nothing else is needed, and nothing waits for liveness either: the undecided groups finish without new admissions,
and once every counted group is decided the B earliest-deadline ones can always leave -- the rest keep their
positions less B, each trained one version later than before it, i.e. at f + i // B as (I) had it. Issue 58 asked
for a wait on top (admission also stops while an in-flight group is at its deadline, as verl's fully asynchronous
trainer's ``wait`` strategy stops sampling while an in-flight prompt sits at the staleness threshold). It is not
needed for (I): a group at its deadline is first in earliest-deadline order, so :func:`pick` cannot release a batch
without it, and admission only adds groups that fit behind it. It only idled the other engines while the long group
finished (15.3 % against FIFO's 5.6 % at 4 stand-in engines, docs/async.md "What was measured"), so it was removed
(issue 58 point 3); ``tests/test_async_release.py`` checks (I) at every engine step of its random runs with
admission going on past such groups. ``rollout/async/deadline_waits`` counts the takes that waited, with B kept
groups decided, for an older group still in flight.

A picture, k = 2, B = 2: a .. f admitted in this order under version 0 (deadline 2), b long, the others short.
``=`` generating, ``|`` decided, ``~`` a sync (the producer paused: drained, or interrupted with its tokens kept and
continued under the new version -- its start version, so its deadline, unchanged); ``[x y]@w``: the batch a take
returns, trained at version w. Between two takes the loop trains, pauses the producer, syncs and resumes it::

    fifo             engines at v0 .................................. v1 ........ v2 ........
      b              ==================================|
      a c d e f      =|  =|  =|  =|  =|     c..f wait decided behind b; admission held (a 7th would break (I))
      takes                                            [a b]@0        [c d]@1     [e f]@2
    oldest_decided   engines at v0 ........ v1 ............... v2 ..............
      b              ================== ~ ================= ~ =====|
      a c d e f      =|  =|  =|  =|  =|
      g h (v1, dl 3)                        =|  =|
      i j (v2, dl 4)                                                =|  =|
      takes                  [a c]@0           [d e]@1               [b f]@2    at take@2 b is at its deadline:
                                                                                the take waits for it, admission
                                                                                does not (i, j fit behind b)

FIFO trains b fresh and idles the engines; out of order, the long (hard) group is the stalest one trained, still
within k (``rollout/staleness_bucket/*`` shows it per difficulty; TIS corrects it per token). A group resubmitted
from scratch after an engine failure starts again under the current version (a later deadline: only looser).
A checkpoint saves each group's start version; a resume recomputes the deadlines.
The same rule without a hard bound -- train the oldest finished groups first, nothing discarded -- is
tinker-cookbook's ``AsyncConfig`` (its docs: a slow rollout "is trained when it finishes, however many steps
stale"); AReaL sorts finished work by start time. Here (I) adds the bound: a group is never trained late, and
admission, not discard, pays for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal, NamedTuple

ORDERS = ("fifo", "oldest_decided")
ReleaseOrder = Literal["fifo", "oldest_decided"]
KEPT, FILTERED, UNDECIDED = "kept", "filtered", "undecided"


class Entry(NamedTuple):
    """One admitted group not yet trained: ``key`` (the caller's handle, returned by :func:`pick`), ``start`` (the
    version it started under: ``Group.weight_step`` / ``Partial.start_version``), ``order`` (admission order,
    smaller = older) and ``state`` (:data:`KEPT`, :data:`FILTERED` or :data:`UNDECIDED`)."""

    key: Any
    start: int
    order: int
    state: str


def admissible(p_max: int, version: int, first_version: int, batch_size: int, k: int) -> bool:
    """Admission bound of rollout.staleness = k: a group admitted now, under engine weights ``version``, has the
    latest deadline ``version + k``; ``p_max`` groups are counted before it (kept or undecided), so taken earliest
    deadline first it is trained at version <= first_version + p_max // batch_size; admit only if that is
    <= version + k."""
    return first_version + p_max // batch_size <= version + k


def fits(deadlines: Iterable[int], first_version: int, batch_size: int) -> bool:
    """Invariant (I): groups with these deadlines, trained earliest deadline first in batches of ``batch_size``
    from ``first_version`` on, are each trained by their deadline."""
    return all(first_version + i // batch_size <= d for i, d in enumerate(sorted(deadlines)))


def late(ordered: Sequence[tuple[Any, int]], first_version: int, batch_size: int, k: int) -> list[tuple[Any, int, int]]:
    """Of groups given as (tag, start version) in the order they would be trained (kept or undecided only), those
    trained more than k versions after they started, as (tag, start, trained version)."""
    out = []
    for i, (tag, start) in enumerate(ordered):
        trained = first_version + i // batch_size
        if trained - start > k:
            out.append((tag, start, trained))
    return out


def oldest_first(entries: Iterable[Entry]) -> list[Entry]:
    """Earliest deadline first: by start version, then admission order (= admission order, except a group
    restarted from scratch after an engine failure, which started again under a later version)."""
    return sorted(entries, key=lambda e: (e.start, e.order))


def pick(order: str, entries: Sequence[Entry], first_version: int, batch_size: int, k: int) -> list[Any] | None:
    """The keys of the groups that leave with the batch trained at ``first_version`` (its B kept groups and the
    filtered groups reported with it, in admission order), or None: the take must wait for more decisions.

    ``fifo``: admission order, up to and including the B-th kept group; None while a group before it is undecided.
    ``oldest_decided``: the B oldest decided kept groups (:func:`oldest_first`) and every decided filtered one;
    None while fewer than B are decided, or while the rest (kept or undecided) would not :func:`fits` from
    ``first_version + 1`` on -- an older undecided group needs one of the slots."""
    if order == "fifo":
        out, kept = [], 0
        for e in sorted(entries, key=lambda e: e.order):
            if e.state == UNDECIDED:
                return None
            out.append(e.key)
            kept += e.state == KEPT
            if kept == batch_size:
                return out
        return None
    if order != "oldest_decided":
        raise ValueError(f"rollout.release_order = {order!r}: one of {ORDERS}")
    ready = oldest_first(e for e in entries if e.state == KEPT)
    if len(ready) < batch_size:
        return None
    rest = [e.start + k for e in entries if e.state == UNDECIDED] + [e.start + k for e in ready[batch_size:]]
    if not fits(rest, first_version + 1, batch_size):
        return None
    leaving = ready[:batch_size] + [e for e in entries if e.state == FILTERED]
    return [e.key for e in sorted(leaving, key=lambda e: e.order)]
