"""MoE routes by reference (issue 60): the engines' routes go to the policy ranks through Ray's object store and
never through the driver process.

Routes are large (Qwen3-30B-A3B: 48 MoE layers x top-8 = 384 B per position, ~51x the token ids and log-probs of a
step together), so the driver -- the one process that cannot grow -- carries references only:

* **engine side** (:func:`by_reference`, called by ``VLLMEngine.generate`` inside its Ray actor, and by the bench's
  stand-in engine the same way): the routes of one prompt's completions are packed into one :class:`GroupRoutes`
  (expert ids in ``rollout/types.route_dtype``: uint8 up to 254 experts, else int16; the prompt's rows stored once
  when every sample's prompt rows are equal, i.e. where the engine computed the prompt once and the others reused it
  from the prefix cache) and ``ray.put`` once; each :class:`~da3po_megatron.rollout.types.Completion` carries a
  :class:`RouteRef` (the group's ObjectRef, its sample number and its row count). Outside a Ray actor (in-process
  engines: the engine *is* the driver's process) the arrays stay as they are.
* **driver**: groups, the batch (:class:`RouteRefs`, one per policy batch, sliced per data-parallel share like the
  other per-token arrays) and the checkpoint's in-flight state hold refs. A group dynamic sampling drops releases its
  refs with it, and Ray frees the object once nothing refers to it.
* **policy rank**: ``actor_group._on_share`` calls :meth:`RouteRefs.fetch` inside the rank: it gets the groups of its
  share from the object store (zero-copy on the engine's node) and builds the ``Ragged`` share the schedule reads.
* **checkpoint**: refs do not survive a restart. :func:`write_routes` (``CheckpointManager.start``) hands the refs of
  the in-flight state to a Ray actor (:class:`RouteFiles`, one per driver) that writes their groups to ``routes.npz``
  beside ``trainer_state.pt`` (covered by the manifest's CRC), and puts small placeholders into the state;
  :func:`read_routes` (``load_trainer_state``) has it read the file back and return each group as one result of its
  call -- owned by the driver, stored in the object store -- and turns the placeholders into refs again. The resumed
  groups replay exactly the routes they were generated with (the bytes are the same), so resumes stay exact. Results
  under Ray's inline threshold (``max_direct_call_object_size``, 100 KiB: only toy sizes) are kept in the driver's
  in-process store, as bytes.

Ownership: an engine owns the objects it put. A dead engine takes the routes of its groups not yet trained with it
(Ray's ``OwnerDiedError`` when a rank fetches them): the step fails, and the run resumes from its last checkpoint,
whose routes are in its file. Dumps (``rollout.dump_dir``, a debugging tool) fetch the routes into the driver.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROUTES_FILE = "routes.npz"


@dataclass(eq=False)
class GroupRoutes:
    """The routes of one prompt's n completions, as one object: ``values`` = the shared prompt rows (``prompt``
    rows; 0 when none is shared) then each sample's own rows (``starts`` / ``lengths``); a sample with ``shared``
    set reads ``values[:prompt]`` first. Sample i's routes are ``[P + R_i - 1, MoE layers, top_k]``."""

    values: np.ndarray
    prompt: int
    starts: np.ndarray
    lengths: np.ndarray
    shared: np.ndarray

    @classmethod
    def pack(cls, rows: list[np.ndarray | None], prompt_len: int) -> GroupRoutes:
        """One group's per-sample routes (None: the sample carries none) into one object."""
        base = next((r for r in rows if r is not None and len(r) >= prompt_len), None)
        head = base[:prompt_len] if base is not None else None
        parts = [head] if head is not None else []
        starts, lengths, shared, at = [], [], [], len(head) if head is not None else 0
        for r in rows:
            share = r is not None and head is not None and len(r) >= prompt_len and np.array_equal(r[:prompt_len],
                                                                                                  head)
            own = np.zeros((0,), np.uint8) if r is None else (r[prompt_len:] if share else r)
            parts.append(own)
            starts.append(at)
            lengths.append(len(own))
            shared.append(share)
            at += len(own)
        arrays = [p for p in parts if p.ndim == 3]
        dtype = arrays[0].dtype if arrays else np.uint8
        values = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros((0, 1, 1), dtype)
        return cls(values, len(head) if head is not None else 0, np.asarray(starts, np.int64),
                   np.asarray(lengths, np.int64), np.asarray(shared, bool))

    def sample(self, i: int) -> np.ndarray:
        """Sample ``i``'s routes (a view when it has its own prompt rows, else one copy)."""
        own = self.values[self.starts[i]:self.starts[i] + self.lengths[i]]
        return np.concatenate([self.values[:self.prompt], own]) if self.shared[i] else own

    def to_arrays(self, key: str) -> dict[str, np.ndarray]:
        return {f"{key}_values": self.values, f"{key}_meta": np.stack([self.starts, self.lengths,
                                                                       self.shared.astype(np.int64)]),
                f"{key}_prompt": np.asarray([self.prompt], np.int64)}

    @classmethod
    def from_arrays(cls, f: Any, key: str) -> GroupRoutes:
        meta = np.asarray(f[f"{key}_meta"])
        return cls(np.asarray(f[f"{key}_values"]), int(f[f"{key}_prompt"][0]), meta[0], meta[1], meta[2] != 0)


class RouteRef:
    """One completion's routes by reference: ``ref`` (an ObjectRef of a :class:`GroupRoutes`, or, where no Ray
    object exists, the routes array itself), ``sample`` (its index in the group) and ``rows`` (P + R - 1)."""

    __slots__ = ("ref", "sample", "rows")

    def __init__(self, ref: Any, sample: int, rows: int) -> None:
        self.ref, self.sample, self.rows = ref, int(sample), int(rows)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RouteRef) and _key(self.ref) == _key(other.ref) and self.sample == other.sample

    def __hash__(self) -> int:
        return hash((_key(self.ref), self.sample))

    def __getstate__(self) -> tuple:
        return self.ref, self.sample, self.rows

    def __setstate__(self, state: tuple) -> None:
        self.ref, self.sample, self.rows = state

    def __repr__(self) -> str:
        return f"RouteRef({self.ref!r}, sample={self.sample}, rows={self.rows})"


def _key(ref: Any) -> Any:
    """What identifies a route object: an ObjectRef's id (two deserialised copies of one ref are one object), else
    the Python object (an array or group held inline)."""
    return ref.binary() if hasattr(ref, "binary") else id(ref)


def in_ray_actor() -> bool:
    """Whether this process is a Ray actor (an engine put there: its routes go into the object store)."""
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # noqa: BLE001 - no Ray: an in-process engine
        return False


def by_reference(groups: list[list[np.ndarray | None]], prompt_lens: list[int]) -> list[list[Any]]:
    """Engine side: each group's per-sample routes packed into one :class:`GroupRoutes`, ``ray.put`` once, and a
    :class:`RouteRef` per sample (None stays None). Outside a Ray actor: the arrays as they are."""
    if not in_ray_actor():
        return groups
    import ray

    out = []
    for rows, p in zip(groups, prompt_lens):
        if all(r is None for r in rows):
            out.append(list(rows))
            continue
        ref = ray.put(GroupRoutes.pack(rows, p))
        out.append([None if r is None else RouteRef(ref, i, len(r)) for i, r in enumerate(rows)])
    return out


def is_ref(r: Any) -> bool:
    return isinstance(r, RouteRef)


@dataclass(eq=False)
class RouteRefs:
    """A policy batch's routes by reference, one :class:`RouteRef` per held row; a share (``rows`` set, as in
    ``batching.Ragged``) holds only its rows. :meth:`fetch` (inside a policy rank) resolves them into a
    ``Ragged``."""

    items: list[RouteRef]
    rows: np.ndarray | None = None
    size: int | None = None

    @classmethod
    def from_rows(cls, rows: list[Any]) -> RouteRefs:
        return cls([r if isinstance(r, RouteRef) else RouteRef(np.asarray(r), -1, len(r)) for r in rows])

    def __len__(self) -> int:
        return int(self.size) if self.rows is not None else len(self.items)

    def lengths(self) -> np.ndarray:
        return np.asarray([r.rows for r in self.items], dtype=np.int64)

    def _local(self, indices: Any) -> list[int]:
        idx = [int(i) for i in np.asarray(indices).reshape(-1)]
        if self.rows is None:
            return idx
        where = {int(r): k for k, r in enumerate(self.rows)}
        return [where[i] for i in idx]

    def take(self, indices: Any) -> RouteRefs:
        return RouteRefs([self.items[k] for k in self._local(indices)])

    def share(self, indices: Any, size: int) -> RouteRefs:
        idx = np.asarray(indices, dtype=np.int64)
        return RouteRefs(self.take(idx).items, idx, int(size))

    @property
    def nbytes(self) -> int:
        """What the refs themselves weigh in a pickle (~ an ObjectRef's id and owner address each)."""
        return 96 * len(self.items)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RouteRefs) and self.items == other.items

    def fetch(self) -> Any:
        """The routes of the held rows as a ``batching.Ragged`` (a share when this is one): the referenced groups
        from the object store, each once."""
        from da3po_megatron.megatron.batching import Ragged

        groups = _resolve([r.ref for r in self.items])
        rows = [_rows(groups, r) for r in self.items]
        if any(len(a) != r.rows for a, r in zip(rows, self.items)):
            raise ValueError("routes fetched from the object store do not have the rows their refs name")
        dtype = rows[0].dtype if rows else np.uint8
        out = Ragged.from_rows(rows, dtype)
        return Ragged(out.values, out.offsets, self.rows, self.size) if self.rows is not None else out


def _rows(groups: dict[Any, Any], r: RouteRef) -> np.ndarray:
    """One completion's routes from the resolved objects (:func:`_resolve`)."""
    obj = groups.get(_key(r.ref), r.ref)
    return obj.sample(r.sample) if isinstance(obj, GroupRoutes) else np.asarray(obj)


def _resolve(refs: list[Any]) -> dict[Any, Any]:
    """{key: GroupRoutes} of the ObjectRefs among ``refs`` (one ``ray.get`` of the distinct ones)."""
    unique = {_key(r): r for r in refs if not isinstance(r, np.ndarray | GroupRoutes)}
    out: dict[Any, Any] = {_key(r): r for r in refs if isinstance(r, GroupRoutes)}
    if unique:
        import ray

        out.update(zip(unique, ray.get(list(unique.values()))))
    return out


# ------------------------------------------------------------------------------------------------ checkpoints
def _walk(obj: Any, fn: Any) -> Any:
    """``obj`` with every leaf ``fn`` answers for replaced (dicts, lists and tuples rebuilt; other values kept)."""
    got = fn(obj)
    if got is not None:
        return got
    if isinstance(obj, dict):
        return {k: _walk(v, fn) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_walk(v, fn) for v in obj)
    return obj


def _write_task(path: str, keys: list[str], *groups: Any) -> int:
    """In :class:`RouteFiles` (the refs resolved there): the groups into one uncompressed ``.npz``."""
    arrays: dict[str, np.ndarray] = {}
    for k, g in zip(keys, groups):
        arrays.update(g.to_arrays(k) if isinstance(g, GroupRoutes) else {f"{k}_array": np.asarray(g)})
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return sum(a.nbytes for a in arrays.values())


def _read_task(path: str, keys: list[str]) -> Any:
    """In :class:`RouteFiles`: each group of the file, one result each (owned by the caller)."""
    with np.load(path) as f:
        out = [GroupRoutes.from_arrays(f, k) if f"{k}_values" in f.files else np.asarray(f[f"{k}_array"])
               for k in keys]
    return out[0] if len(out) == 1 else tuple(out)


class RouteFiles:
    """The process that writes and reads checkpoint route files (a Ray actor, one per driver, started at the first
    use or by :func:`route_files`): the refs it is given are resolved there, never in the driver, and what it reads
    back is returned as its method's results, owned by the caller (the driver) and stored in the object store."""

    def write(self, path: str, keys: list[str], *groups: Any) -> int:
        return _write_task(path, keys, *groups)

    def read(self, path: str, keys: list[str]) -> Any:
        return _read_task(path, keys)


_FILES: dict[str, Any] = {}


def route_files() -> Any:
    """This driver's :class:`RouteFiles` actor (started once; a long run's later checkpoints find it warm)."""
    import ray

    ctx = ray.get_runtime_context()
    session = (ctx.get_node_id(), ctx.get_job_id())  # a new Ray (tests start several) needs its own actor
    if _FILES.get("session") != session:
        _FILES.update(actor=ray.remote(num_cpus=0)(RouteFiles).remote(), session=session)
    return _FILES["actor"]


def write_routes(state: Any, directory: Path) -> Any:
    """The checkpoint's trainer state with its :class:`RouteRef` s replaced by placeholders
    (``{"routes_file", "group", "sample", "rows"}``), their groups written to ``directory / routes.npz`` by a Ray
    task (never through this process). A state without refs is returned unchanged."""
    keys: dict[Any, str] = {}
    refs: list[Any] = []

    def place(r: Any) -> Any:
        if not isinstance(r, RouteRef):
            return None
        k = keys.get(_key(r.ref))
        if k is None:
            k = keys[_key(r.ref)] = f"g{len(refs)}"
            refs.append(r.ref)
        return {"routes_file": ROUTES_FILE, "group": k, "sample": r.sample, "rows": r.rows}

    out = _walk(state, place)
    if refs:
        path = str(Path(directory) / ROUTES_FILE)
        if all(isinstance(r, np.ndarray | GroupRoutes) for r in refs):  # no Ray objects (in-process engines)
            _write_task(path, list(keys.values()), *refs)
        else:
            import ray

            ray.get(route_files().write.remote(path, list(keys.values()), *refs))
    return out


def read_routes(state: Any, directory: Path) -> Any:
    """The inverse of :func:`write_routes`: placeholders back to :class:`RouteRef` s, the groups put into the
    object store by :class:`RouteFiles` (as its results; with Ray not initialised: read here, as arrays)."""
    found: dict[str, None] = {}

    def note(x: Any) -> Any:
        if isinstance(x, dict) and "routes_file" in x:
            found[x["group"]] = None
            return x
        return None

    _walk(state, note)
    if not found:
        return state
    keys, path = list(found), str(Path(directory) / ROUTES_FILE)
    try:
        import ray

        remote = ray.is_initialized()
    except ImportError:
        remote = False
    if remote:
        got = route_files().read.options(num_returns=len(keys)).remote(path, keys)
        objs = dict(zip(keys, [got] if len(keys) == 1 else got))
    else:
        res = _read_task(path, keys)
        objs = dict(zip(keys, [res] if len(keys) == 1 else res))

    def back(x: Any) -> Any:
        if isinstance(x, dict) and "routes_file" in x:
            ref = objs[x["group"]]
            if isinstance(ref, GroupRoutes | np.ndarray):  # read here: the array itself
                return _rows({}, RouteRef(ref, int(x["sample"]), int(x["rows"])))
            return RouteRef(ref, int(x["sample"]), int(x["rows"]))
        return None

    return _walk(state, back)


def inline_routes(state: Any) -> Any:
    """``state`` with every :class:`RouteRef` replaced by its routes as a tensor, fetched into this process (dumps:
    ``rollout.dump_dir``, a debugging tool; never the training path)."""
    import torch

    refs: list[RouteRef] = []
    _walk(state, lambda x: refs.append(x) if isinstance(x, RouteRef) else None)
    if not refs:
        return state
    groups = _resolve([r.ref for r in refs])

    def inline(x: Any) -> Any:
        if not isinstance(x, RouteRef):
            return None
        return torch.from_numpy(np.array(_rows(groups, x), copy=True, order="C"))

    return _walk(state, inline)
