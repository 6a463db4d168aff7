"""Rollout dump and replay: debug the update without the engines that produced its data (issue 48).

**Dump** (``rollout.dump_dir``). After each step's collection (generation + rewards + dynamic sampling) and its
advantages, the step is written atomically (a private file, fsync, ``os.replace``) to ``dump_dir/step_NNNNNN.pt``:

- ``rollout``: the step's :class:`~da3po_megatron.trainer.batch.StepRollout` as ``rollout_to_dict`` holds
it -- the
  kept and every generated group with token ids, rollout log-probs, per-token versions, MoE routes, rewards, the
  request seed of each group (``Group.seed``) and the dynamic-sampling counters;
- ``batch``: the policy batch after advantages (Eq. 3 + DAA, Eq. 14), as the policy received it;
- ``driver``: what the collection changed in the driver, taken when it ended: the sampler's
  :meth:`~da3po_megatron.trainer.generation.sampler.Sampler.state_dict` (the data iterator's position and
  ``data.selection``'s history, the dynamic-sampling buffer, the generation counters, the driver's RNG states) -- the
  same capture a checkpoint stores. Dumps written before it (issue 56) hold the update counters in ``totals`` too;
  they are ignored on replay.

``dump_dir/manifest.json`` says what produced the dump: the resolved config, the config identity (the run record's
defining fields, ``config/diff.py``), the model's and the tokenizer's identity (sha256 of
``config.json`` and of each tokenizer file; each weight file's name, size and safetensors header -- names, dtypes,
shapes, offsets; the values themselves are not hashed, which would read the whole model), the data (the iterator's
fingerprint of the prompts in order, their number, seed and shuffle), the seeds and the format version.
``rollout.dump_every`` writes every k-th step only; ``rollout.dump_keep`` keeps the newest k step files (0 = all).

**Replay** (``rollout.replay_dir``), checked before Ray starts (:func:`check_replay`; a manifest that does not match
the run is refused with exit 2, naming each difference; the parallel layout, micro-batching and paths may differ, so
a cluster's dump replays on CPU and at another TP). Each step then takes the recorded rollout instead of
collecting one, and restores the recorded driver state, so everything after it -- advantages, pi_old, the updates,
the checkpoint, the metrics -- is the original step's:

- ``train_only``: no engine is planned, reserved or started (``NoEngines`` of ``trainer/cluster/bringup.py`` stands
  in; placement is planned with none); weight sync and engine idling do nothing; periodic evaluation is skipped.
- ``compare``: the engines start as usual and, every step, regenerate the recorded groups with the recorded seeds
  (the same prompts in the same calls, so the same requests) under the weights the policy synced to them. Their
  tokens and log-probs are compared with the recording (:func:`compare_completions`: ``replay/token_match_ratio``,
  ``replay/logprob_diff_mean|max``, logged every step); a ratio below ``rollout.replay_match_threshold`` is a
  warning and ``replay/match_below_threshold=1`` -- the engines do not hold the policy's weights (Miles' check; 0.9
  its threshold). Training consumes the recording. Needs ``rollout.mode=rounds`` (the recorded seeds are the rounds').

**Under the asynchronous producer** (``rollout.staleness >= 2`` / partial rollouts, issue 58): the step file holds
the batch ``AsyncRollout.take`` gave (kept and released groups, each with its start version, per-token versions
and behaviour log-probs; the producer's per-take counters in ``stats``) and the policy batch, as above; its ``driver``
state is taken when the step completes (:meth:`completed`, from ``RunState.step_completed``: the producer paused, the
groups the engines finished scored, before data.selection's counters are drained) -- the producer generates beside
the loop, so that is the moment the step's metrics read the sampler's counters. The file is written then, atomically,
before the step's checkpoint. A replay of such a dump runs without the producer (``uses_producer`` is false with
``rollout.replay_dir``; ``train_only`` only: ``compare`` needs rounds) and trains bit-identically. A launch that
starts after step s (a resume from its checkpoint, or s = 0) removes the dump's files of steps > s and the temporaries
a SIGKILL left (:meth:`start`): they are an interrupted launch's, which the resumed run does not continue (an
asynchronous run is not reproducible), so the dump stays the history of the run that the checkpoints continue.

Left out: ``compare`` of a producer's dump (streamed groups carry no round seeds), and evaluation in ``train_only``
(it needs engines).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from da3po_megatron.config import Config, to_dict
from da3po_megatron.rollout.route_refs import inline_routes
from da3po_megatron.trainer import batch as B
from da3po_megatron.trainer.batch import StepRollout, rollout_from_dict, rollout_to_dict
from da3po_megatron.trainer.inputs import InputError

if TYPE_CHECKING:
    from da3po_megatron.trainer.generation.sampler import Sampler

FORMAT = 1
MANIFEST = "manifest.json"
_STEP = re.compile(r"^step_(\d{6,})\.pt$")
# fields that may differ between the dumping run and the replay: where things are, and the layout (replay across
# layouts is a use of it: tools/studies/replay_layouts.py); checked against config/diff.py's defining fields otherwise
FREE = ("model.path", "data.train_files", "trainer.run_dir", "parallel.", "rollout.dump_", "rollout.replay_")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja")


class ReplayManifestError(InputError):
    """A replay that does not match its dump (refused before Ray starts; exit 2)."""


# ------------------------------------------------------------------------------------------------ files


def step_file(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}.pt"


def dumped_steps(root: str | Path) -> list[int]:
    root = Path(root)
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _STEP.match(p.name))) if root.is_dir() else []


def _atomic(path: Path, write: Callable[[Any], None], mode: str = "wb") -> None:
    """Write ``path`` as a whole or not at all: a private temporary file, fsync, ``os.replace`` (as checkpoints)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _sha256(path: Path, limit: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read() if limit is None else f.read(limit))
    return h.hexdigest()


def _safetensors_header(path: Path) -> str:
    """sha256 of a safetensors file's JSON header (tensor names, dtypes, shapes, offsets; not the values)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return hashlib.sha256(f.read(min(n, 2**28))).hexdigest()


def model_identity(model_path: str | Path) -> dict[str, Any]:
    """What identifies the model directory without reading its weights (see the module docstring)."""
    p = Path(model_path)
    weights = {f.name: {"bytes": f.stat().st_size, "header_sha256": _safetensors_header(f)}
               for f in sorted(p.glob("*.safetensors"))}
    return {"config.json": _sha256(p / "config.json"), "weights": weights}


def tokenizer_identity(model_path: str | Path) -> dict[str, str]:
    p = Path(model_path)
    return {name: _sha256(p / name) for name in TOKENIZER_FILES if (p / name).is_file()}


def make_manifest(cfg: Config, prompts_state: dict[str, Any]) -> dict[str, Any]:
    from da3po_megatron import __version__

    return {"format": FORMAT, "da3po_version": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "config": to_dict(cfg), "model": model_identity(cfg.model.path),
            "tokenizer": tokenizer_identity(cfg.model.path),
            "data": {k: prompts_state.get(k) for k in ("fingerprint", "num_examples", "seed", "shuffle")},
            "seeds": {"trainer.seed": cfg.trainer.seed,
                      "rounds": "engine request seed = (seed * 1000003 + step * 1009 + round) % (2**31 - 1) + i * n "
                                "for prompt i of the round (Sampler.sampling_seed; Group.seed records it)"},
            "dump_every": cfg.rollout.dump_every, "dump_keep": cfg.rollout.dump_keep}


def manifest_differences(dumped: dict[str, Any], here: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(refused, warned): what differs between the dump's manifest and this run's, one line each. Refused: the
    format, the model and tokenizer identity, the data, and the config's defining fields (``config/diff.py: DEFINING``)
    but for :data:`FREE`; warned: other config fields that change what a step computes (``kind == 'changed'``)."""
    from da3po_megatron.config.diff import config_changes

    refused: list[str] = []
    if dumped.get("format") != here["format"]:
        refused.append(f"dump format {dumped.get('format')!r} (this version reads {here['format']})")
    for part in ("model", "tokenizer", "data"):
        a, b = dumped.get(part) or {}, here[part]
        if part == "model":
            a, b = {"config.json": a.get("config.json"), **(a.get("weights") or {})}, \
                {"config.json": b["config.json"], **b["weights"]}
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                refused.append(f"{part} {key}: {a.get(key, '<absent>')!r} in the dump, {b.get(key, '<absent>')!r} "
                               "here")
    warned = []
    for c in config_changes(dumped.get("config") or {}, here["config"]):
        if c["key"].startswith(FREE):
            continue
        line = f"config {c['key']}: {c['old']!r} in the dump, {c['new']!r} here"
        if c["kind"] == "defining":
            refused.append(line)
        elif c["kind"] == "changed":
            warned.append(line)
    return refused, warned


def check_replay(cfg: Config, prompts_state: dict[str, Any], first_step: int = 1, allow: bool = False,
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """Before Ray starts: the dump in ``rollout.replay_dir`` matches this run (model, tokenizer, data, config
    identity) and holds every step from ``first_step`` to ``trainer.total_steps``. Raises
    :class:`ReplayManifestError` naming each difference (``allow``: ``--allow-config-change`` turns the config's
    differences into warnings; the model, tokenizer and data never pass). Returns the dump's manifest."""
    root = Path(cfg.rollout.replay_dir)
    path = root / MANIFEST
    if not path.is_file():
        raise ReplayManifestError(f"rollout.replay_dir={str(root)!r}: no {MANIFEST} (not a dump written with "
                                  "rollout.dump_dir)")
    try:
        dumped = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ReplayManifestError(f"{path}: unreadable ({e})") from None
    refused, warned = manifest_differences(dumped, make_manifest(cfg, prompts_state))
    if allow:
        warned += [r for r in refused if r.startswith("config ")]
        refused = [r for r in refused if not r.startswith("config ")]
    if refused:
        raise ReplayManifestError(f"rollout.replay_dir={str(root)!r} does not match this run (refused before "
                                  "anything starts):\n  " + "\n  ".join(refused)
                                  + "\n(config differences pass with --allow-config-change; model, tokenizer and "
                                  "data must be the dump's)")
    for line in warned:
        log(f"warning: replay: {line}: the replayed steps train differently from the dumped ones")
    have = set(dumped_steps(root))
    missing = [s for s in range(first_step, cfg.trainer.total_steps + 1) if s not in have]
    if missing:
        raise ReplayManifestError(
            f"rollout.replay_dir={str(root)!r} lacks steps {_ranges(missing)} of the {first_step}.."
            f"{cfg.trainer.total_steps} this run would train (it holds {_ranges(sorted(have)) or 'none'}; "
            f"written with rollout.dump_every={dumped.get('dump_every')}, dump_keep={dumped.get('dump_keep')}): "
            "lower trainer.total_steps or resume from a checkpoint of the step before the first dumped one")
    return dumped


def _ranges(steps: list[int]) -> str:
    out: list[str] = []
    for s in steps:
        if out and int(out[-1].split("-")[-1]) == s - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{s}"
        else:
            out.append(str(s))
    return ", ".join(out)


# ------------------------------------------------------------------------------------------------ batches


def batch_to_dict(batch: Any) -> dict[str, Any]:
    """The policy batch as plain tensors (``Ragged``: values + offsets)."""
    out: dict[str, Any] = {}
    for name in ("prompt_ids", "response_ids", "old_logprobs", "advantages", "token_weights", "routed_experts"):
        v = getattr(batch, name, None)
        if v is None:
            continue
        if hasattr(v, "fetch"):  # routes by reference (rollout/route_refs.py): a dump fetches them into the driver
            v = v.fetch()
        if hasattr(v, "offsets"):
            out[name] = {"values": torch.from_numpy(np.ascontiguousarray(v.values)),
                         "offsets": torch.from_numpy(np.ascontiguousarray(v.offsets))}
        else:
            out[name] = torch.from_numpy(np.ascontiguousarray(v))
    return out


# ------------------------------------------------------------------------------------------------ compare


def compare_completions(recorded: list[B.Group], regenerated: list[list[Any]]) -> dict[str, float]:
    """How well regenerated responses reproduce the recorded ones. Per response pair, the agreeing prefix (tokens
    equal up to the first difference); ``replay/token_match_ratio`` = sum of agreeing prefixes / sum of the longer
    lengths (1.0: every token reproduced; a token that differs ends the agreement, as everything after it is
    conditioned differently). Log-prob differences are over the agreeing prefixes (same context, same token)."""
    matched = total = 0
    diffs: list[np.ndarray] = []
    for g, comps in zip(recorded, regenerated, strict=True):
        for r, lp, c in zip(g.response_ids, g.rollout_logprobs, comps, strict=True):
            q = np.asarray(c.token_ids)
            n = min(len(r), len(q))
            neq = np.flatnonzero(r[:n] != q[:n])
            k = int(neq[0]) if len(neq) else n
            matched += k
            total += max(len(r), len(q))
            if k and c.logprobs is not None:
                diffs.append(np.abs(np.asarray(lp[:k], np.float64) - np.asarray(c.logprobs[:k], np.float64)))
    d = np.concatenate(diffs) if diffs else np.zeros(0)
    return {"replay/token_match_ratio": matched / total if total else 1.0,
            "replay/logprob_diff_mean": float(d.mean()) if len(d) else 0.0,
            "replay/logprob_diff_max": float(d.max()) if len(d) else 0.0,
            "replay/compared_tokens": float(total)}


def seed_runs(groups: list[B.Group], n: int) -> list[tuple[int, list[B.Group]]]:
    """The recorded groups as the generation calls that produced them: consecutive groups whose request seeds are
    ``seed, seed + n, ...`` (one round of ``Sampler.generate``: prompt i of a call gets ``seed + i * n``)."""
    runs: list[tuple[int, list[B.Group]]] = []
    for g in groups:
        if g.seed is None:
            raise ValueError(f"group {g.example.uid} of the dump has no request seed (rollout.replay_mode=compare "
                             "needs a dump of rollout.mode=rounds)")
        if runs and g.seed == runs[-1][0] + len(runs[-1][1]) * n:
            runs[-1][1].append(g)
        else:
            runs.append((int(g.seed), [g]))
    return runs


# ------------------------------------------------------------------------------------------------ the run's side


class Replay:
    """The run's dump / replay switch (``sampler.replay``); every method is a no-op when neither is configured."""

    def __init__(self, cfg: Config) -> None:
        r = cfg.rollout
        self.cfg = cfg
        self.dump_root = Path(r.dump_dir) if r.dump_dir else None
        self.root = Path(r.replay_dir) if r.replay_dir else None
        self.mode = r.replay_mode
        self._snapshots: dict[int, dict[str, Any]] = {}
        self._recorded: dict[int, dict[str, Any]] = {}
        self._held: dict[int, dict[str, Any]] = {}  # the producer's steps, written when they complete

    @property
    def replaying(self) -> bool:
        return self.root is not None

    def start(self, run: Sampler, latest: Path | None, allow: bool) -> Replay:
        """Before Ray starts: check the dump replayed (:func:`check_replay`; from the step after the checkpoint
        ``latest`` resumed from), write the dump's manifest. Returns self."""
        first_step = int(latest.name.rsplit("_", 1)[1]) + 1 if latest is not None else 1
        if self.root is not None:
            check_replay(self.cfg, run.prompts.state_dict(), first_step, allow)
            print(f"replay: steps {first_step}..{self.cfg.trainer.total_steps} from {self.root} "
                  f"(rollout.replay_mode={self.mode}" + ("; no engines, no evaluation" if self.mode == "train_only"
                                                         else "") + ")", flush=True)
        if self.dump_root is not None:
            self._drop_after(first_step - 1)
            manifest = make_manifest(self.cfg, run.prompts.state_dict())
            _atomic(self.dump_root / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1) + "\n"), "w")
        return self

    def _drop_after(self, step: int) -> None:
        """This launch starts after ``step``: the dump's step files beyond it and a killed write's temporaries are
        an interrupted launch's (see the module docstring); removed, and said."""
        assert self.dump_root is not None
        if not self.dump_root.is_dir():
            return
        stale = [s for s in dumped_steps(self.dump_root) if s > step]
        for s in stale:
            step_file(self.dump_root, s).unlink(missing_ok=True)
        for tmp in self.dump_root.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)
        if stale:
            print(f"dump: removed steps {_ranges(stale)} from {self.dump_root}: written after step {step}, where this "
                  "launch starts, by an earlier launch whose steps it does not continue", flush=True)

    def due(self, step: int) -> bool:
        return self.dump_root is not None and step % self.cfg.rollout.dump_every == 0

    def collect(self, run: Sampler, step: int, live: Callable[[], StepRollout]) -> StepRollout:
        """The batch of ``step``: the recorded one when replaying (its driver state restored; ``compare``: the
        engines regenerate it first), else ``live()`` (its driver state kept for the dump)."""
        if self.root is None:
            rollout = live()
            if self.due(step):
                self._snapshots[step] = run.state_dict()
            return rollout
        t0 = time.perf_counter()
        rec = torch.load(step_file(self.root, step), weights_only=True)
        rollout = rollout_from_dict(rec["rollout"])
        self._recorded[step] = rec["batch"]
        stats = dict(rollout.stats)
        if self.mode == "compare":
            stats.update(self.compare(run, step, rollout))
        run.load_state_dict(rec["driver"])
        if self.due(step):
            self._snapshots[step] = rec["driver"]
        return StepRollout(rollout.groups, rollout.generated, stats, rollout.weight_step,
                           {"replay_load": time.perf_counter() - t0})

    def compare(self, run: Sampler, step: int, rollout: StepRollout) -> dict[str, float]:
        """``compare``: the engines regenerate the recorded groups with their recorded seeds (see the docstring)."""
        regenerated: dict[int, list[Any]] = {}
        for seed, groups in seed_runs(rollout.generated, self.cfg.rollout.n):
            out = run.generate([g.example for g in groups], seed=seed)
            regenerated.update({id(g): comps for g, comps in zip(groups, out, strict=True)})
        m = compare_completions(rollout.generated, [regenerated[id(g)] for g in rollout.generated])
        threshold = self.cfg.rollout.replay_match_threshold
        below = m["replay/token_match_ratio"] < threshold
        m["replay/match_below_threshold"] = float(below)
        line = (f"replay compare step {step}: token match ratio {m['replay/token_match_ratio']:.4f} over "
                f"{m['replay/compared_tokens']:.0f} tokens, log-prob diff mean {m['replay/logprob_diff_mean']:.2e} "
                f"max {m['replay/logprob_diff_max']:.2e}")
        if below:
            line = (f"warning: {line}: BELOW rollout.replay_match_threshold={threshold:g} -- the engines do not "
                    "generate what the recording's weights did (a weight sync that did not arrive?)")
        print(line, flush=True)
        return m

    def record(self, step: int, rollout: StepRollout, batch: Any) -> None:
        """After the advantages: dump the step (when due), and when replaying check that this code computed the
        recorded batch's advantages (a difference is a warning: the replay then trains on other numbers)."""
        recorded = self._recorded.pop(step, None)
        if recorded is None and not self.due(step):
            return
        mine = batch_to_dict(batch)
        if recorded is not None and "advantages" in recorded and "advantages" in mine and not torch.equal(
                recorded["advantages"], mine["advantages"]):
            diff = (recorded["advantages"] - mine["advantages"]).abs().max().item()
            print(f"warning: replay step {step}: advantages differ from the recording by up to {diff:.3g} (the "
                  "advantage code or config differs from the dumping run's)", flush=True)
        if not self.due(step):
            return
        out = {"format": FORMAT, "step": step, "rollout": rollout_to_dict(rollout), "batch": mine,
               "driver": self._snapshots.pop(step, None)}
        if out["driver"] is None:  # the producer's batch: no collection left a driver state; taken at completion
            self._held[step] = out
            return
        self._write(step, out)

    def completed(self, step: int, driver: Callable[[], dict[str, Any]]) -> None:
        """Step ``step`` completed (``RunState.step_completed``): a step :meth:`record` held (the producer's) is
        written now, with ``driver()`` -- the sampler's state at this moment -- as its driver state."""
        out = self._held.pop(step, None)
        if out is not None:
            out["driver"] = driver()
            self._write(step, out)

    def _write(self, step: int, out: dict[str, Any]) -> None:
        assert self.dump_root is not None
        out = inline_routes(out)  # MoE routes by reference: their arrays, fetched here (a dump is for debugging)
        _atomic(step_file(self.dump_root, step), lambda f: torch.save(out, f))
        keep = self.cfg.rollout.dump_keep
        if keep > 0:
            for old in dumped_steps(self.dump_root)[:-keep]:
                step_file(self.dump_root, old).unlink(missing_ok=True)
