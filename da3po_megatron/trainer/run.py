"""Everything a training run holds, built from the config: Ray, policy ranks, engines, data, rewards, logs, checkpoints.

:class:`Run` is what ``trainer/loop.py`` drives. It owns the state an exact resume needs (step, data position,
dynamic-sampling buffer, driver RNG, cumulative counters, the policy's checkpoint) and the placement:

- the policy: ``world = TP x PP x CP x DP`` Ray actors (``megatron.actor_group.PolicyGroup``), one per rank;
- the engines: ``rollout.num_engines`` vLLM Ray actors (``rollout.RolloutClient.ray``); on GPU ``ray.
  num_gpus_per_policy_rank`` / ``num_gpus_per_engine`` decide whether they share GPUs (``rollout.colocate``);
- the reward pool: processes of the driver.

Preemption: SIGUSR1 / SIGTERM, or a file ``run_dir/PREEMPT`` (what ``slurm/train.sbatch`` creates before the job is
killed), makes the loop checkpoint after the current step and exit; the requeued job resumes from ``latest``.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from da3po_megatron.algorithms import DynamicSamplingBuffer, tis_weights
from da3po_megatron.config import Config, to_dict
from da3po_megatron.data.datasets import Example, PromptDataset, ReadStats, load_prompts
from da3po_megatron.data.templates import render_prompt
from da3po_megatron.megatron.batching import PolicyBatch
from da3po_megatron.rollout.types import EngineConfig
from da3po_megatron.trainer import batch as B
from da3po_megatron.trainer.best import BestCheckpoint, save_checkpoint
from da3po_megatron.trainer.checkpoint import CheckpointManager
from da3po_megatron.trainer.console import ray_init_kwargs
from da3po_megatron.trainer.metrics import MetricsLogger


def _pin(_worker: Any, spec: str) -> list[int]:
    from da3po_megatron.affinity import pin_process

    return pin_process(spec)


def _hostname(_worker: Any = None) -> str:
    import socket

    return socket.gethostname()


def init_ray(cfg: Config) -> None:
    import ray

    if ray.is_initialized():
        return
    if cfg.ray.address == "local":
        tmp = Path(os.environ.get("DA3PO_RAY_TMP", "/tmp/da3po_ray"))
        tmp.mkdir(parents=True, exist_ok=True)
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, _temp_dir=str(tmp),
                 num_cpus=max(os.cpu_count() or 1, cfg.policy_world_size + cfg.rollout.num_engines + 1),
                 **ray_init_kwargs())
    else:
        ray.init(address=cfg.ray.address, include_dashboard=False, **ray_init_kwargs())


def engine_config(cfg: Config) -> EngineConfig:
    """The training engines' :class:`~da3po_megatron.rollout.EngineConfig`. They return the log-probs of the
    distribution they sample from (vLLM ``processed_logprobs``: after ``rollout.temperature``, and after the nucleus
    renormalisation when ``rollout.top_p`` < 1), which the policy scores with the same temperature (see
    ``megatron.policy.loss_setup``)."""
    r = cfg.rollout
    return EngineConfig(
        model_path=cfg.model.path, tensor_parallel_size=r.tensor_parallel_size,
        dtype=cfg.model.params_dtype if r.dtype == "auto" else r.dtype,
        max_model_len=r.max_prompt_length + r.max_response_length,
        kv_cache_memory_bytes=None if torch.cuda.is_available() else r.kv_cache_memory_bytes,
        gpu_memory_utilization=r.gpu_memory_utilization, seed=cfg.trainer.seed, enable_sleep_mode=r.colocate,
        logprobs_mode="processed_logprobs")


def load_train_data(cfg: Config) -> PromptDataset:
    d = cfg.data
    if d.format == "synthetic":
        from da3po_megatron.data.synthetic import make_synthetic_dataset

        s = d.synthetic
        return make_synthetic_dataset(s.train_per_bucket, "train", cfg.trainer.seed,
                                      buckets=range(s.min_digits, s.max_digits + 1))
    missing = [f for f in d.train_files if not Path(f).exists()]
    if missing:
        hint = ""
        if any(Path(f).name.lower() == "dapo-math-17k.parquet" for f in missing):
            hint = ("; no downloads happen at run time: fetch it first on a machine with internet, e.g. "
                    "`huggingface-cli download --repo-type dataset BytedTsinghua-SIA/DAPO-Math-17k --local-dir .` "
                    "(writes data/dapo-math-17k.parquet), or set data.train_files")
        raise FileNotFoundError(f"data.train_files: not found: {', '.join(missing)}{hint}")
    if d.format == "dapo":
        parts = [load_prompts(f, format="dapo", on_bad_row=d.on_bad_row, dedup=d.dedup) for f in d.train_files]
    else:
        parts = [load_prompts(f, format="generic", prompt_key=d.prompt_key, answer_key=d.answer_key,
                              on_bad_row=d.on_bad_row, template=d.template, default_source=Path(f).stem,
                              dedup=d.dedup)
                 for f in d.train_files]
    for f, part in zip(d.train_files, parts):
        s = part.stats
        print(f"data: {f}: {s.rows} rows, {s.kept} prompts"
              + (f", {s.duplicates} repeated rows dropped (data.dedup)" if s.duplicates else "")
              + (f", {s.skipped} malformed rows skipped (data.on_bad_row=skip)" if s.skipped else ""), flush=True)
    if len(parts) == 1:
        return parts[0]
    stats = ReadStats(path="+".join(d.train_files), rows=sum(p.stats.rows for p in parts),
                      kept=sum(p.stats.kept for p in parts), skipped=sum(p.stats.skipped for p in parts),
                      duplicates=sum(p.stats.duplicates for p in parts))
    return PromptDataset([ex for p in parts for ex in p], stats, name="+".join(p.name for p in parts))


def preflight(cfg: Config) -> None:
    """Checks that need the model's config.json, before the run writes or starts anything: the parallel sizes divide
    the model (heads, KV heads, MLP, layers), and the policy's estimated peak memory per rank fits the device
    (``actor.memory_check``; "fit" lowers ``actor.max_tokens_per_microbatch`` in ``cfg``)."""
    from da3po_megatron.megatron.memory import check_policy_memory
    from da3po_megatron.megatron.model import check_parallel_sizes, load_hf_config

    if not (Path(cfg.model.path) / "config.json").exists():
        return  # reported with its fix by Run below
    hf = load_hf_config(cfg.model.path)
    p = cfg.parallel
    try:
        check_parallel_sizes(hf, p.tensor_model_parallel_size, p.pipeline_model_parallel_size)
    except ValueError as e:
        raise ValueError(f"parallel: {e} ({cfg.model.path}/config.json)") from None
    cfg.actor.max_tokens_per_microbatch = check_policy_memory(cfg, hf, log=lambda m: print(m, flush=True))


class Run:
    def __init__(self, cfg: Config) -> None:
        from da3po_megatron.bridge.export import load_policy_hf
        from da3po_megatron.megatron.actor_group import PolicyGroup
        from da3po_megatron.rewards import RewardPool
        from da3po_megatron.rollout import RolloutClient

        self.cfg = cfg
        preflight(cfg)  # parallel sizes and memory: fail before anything is written or started
        self.run_dir = Path(cfg.trainer.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.step = 0
        self.engine_weight_step = 0  # the policy step whose weights the engines hold (tags every generated group)
        self.pending: list[Any] = []  # staleness 1: the next step's batch, generated during this step (checkpointed)
        self.totals = {"samples": 0, "tokens": 0, "groups": 0, "kept_groups": 0, "reward_timeouts": 0,
                       "reward_errors": 0}
        self._preempt = False
        from da3po_megatron.rollout.consistency import DRIFT_FLOOR, DriftMonitor

        self.drift = DriftMonitor(cfg.rollout.logprob_drift_factor, DRIFT_FLOOR.get(cfg.model.params_dtype, 1e-2))
        (self.run_dir / "PREEMPT").unlink(missing_ok=True)  # a request of the previous (requeued) job
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

        random.seed(cfg.trainer.seed)
        np.random.seed(cfg.trainer.seed)
        torch.manual_seed(cfg.trainer.seed)
        from transformers import AutoTokenizer

        self.dataset = load_train_data(cfg)  # first: bad data fails before anything heavy starts
        if not (Path(cfg.model.path) / "config.json").exists():
            raise FileNotFoundError(
                f"model.path={cfg.model.path!r} is not a Hugging Face checkpoint directory (no config.json); no "
                "downloads happen at run time: fetch it first, e.g. `huggingface-cli download Qwen/Qwen3-4B-Base "
                "--local-dir checkpoints/Qwen3-4B-Base`, and point model.path there")
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.data_skipped_rows = self.dataset.stats.skipped if self.dataset.stats is not None else 0
        self.prompts = self.dataset.iterator(seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
        self.buffer = DynamicSamplingBuffer(cfg.data.train_batch_size, cfg.algorithm.surplus, cfg.rollout.n)
        self.rewards = RewardPool(num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s)
        if self.dataset.stats is not None:  # what the reader kept, dropped and skipped (docs/data_and_rewards.md)
            (self.run_dir / "data_stats.json").write_text(json.dumps(self.dataset.stats.as_dict(), indent=1) + "\n")
        t = cfg.trainer
        self.ckpt = CheckpointManager(self.run_dir, t.keep_last)
        self.best = BestCheckpoint(self.ckpt.root, t.keep_best_metric, t.keep_best_mode) if t.keep_best_metric else None
        self.ckpt.protect = self.best.protected if self.best else self.ckpt.protect

        init_ray(cfg)
        t0 = time.perf_counter()
        self.policy = PolicyGroup.from_config(cfg)
        if not all(self.policy.run_on_all(load_policy_hf, cfg.model.path)):  # HF weights in, through the bridge
            print(f"warning: no *.safetensors in {cfg.model.path}: the policy keeps its random initialisation",
                  flush=True)
        self.rollout = RolloutClient.ray(engine_config(cfg), num_engines=cfg.rollout.num_engines,
                                         num_cpus_per_engine=cfg.rollout.num_cpus_per_engine,
                                         num_gpus_per_engine=cfg.ray.num_gpus_per_engine,
                                         restart_on_failure=cfg.rollout.restart_on_failure)
        print(f"policy ({cfg.policy_world_size} ranks) and {cfg.rollout.num_engines} engine(s) ready in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        self.pin_cpus()
        policy_hosts = self.policy.run_on_all(_hostname)
        engine_hosts = [h.get("host", "?") for h in self.rollout.health()]
        print("placement: " + ", ".join(f"policy rank {i} on {h}" for i, h in enumerate(policy_hosts)) + "; "
              + ", ".join(f"engine {i} on {h}" for i, h in enumerate(engine_hosts)), flush=True)
        print(f"policy loss: {self.policy.info()[0]['loss_backend']} (actor.loss_backend={cfg.actor.loss_backend})",
              flush=True)
        from da3po_megatron.rollout.weight_sync import choose_transport

        self.weight_transfer = choose_transport(cfg.rollout.weight_transfer, has_cuda=torch.cuda.is_available(),
                                                colocate=cfg.rollout.colocate, policy_hosts=policy_hosts,
                                                engine_hosts=engine_hosts)
        self.rollout.check_transport(self.weight_transfer)  # the installed vLLM has what it needs (names version)
        self._transport: Any = None
        self.rollout.resync = self.sync_weights  # an engine restarted after a sync gets the weights again
        print(f"weight transfer: {self.weight_transfer} (rollout.weight_transfer={cfg.rollout.weight_transfer})",
              flush=True)

        latest = self.ckpt.latest() if cfg.trainer.resume else None
        if latest is not None:
            self._restore(latest)
        self.logger = MetricsLogger(self.run_dir, cfg.trainer.total_steps, start_step=self.step,
                                    tensorboard=cfg.trainer.tensorboard, wandb_project=cfg.trainer.wandb_project,
                                    run_name=cfg.trainer.experiment_name, config=to_dict(cfg))

    # ------------------------------------------------------------------------------------------------ generation
    def next_prompts(self, k: int) -> list[Example]:
        return self.prompts.take(k)

    def prompts_for_round(self, need: int) -> int:
        """Prompts to generate for ``need`` missing groups: over-sampled by the inverse of the keep rate observed so
        far in this run (at most 4x; exactly ``need`` without filtering or on the first round of a run)."""
        if not self.cfg.algorithm.filter_groups or self.totals["groups"] == 0:
            return need
        keep_rate = max(self.totals["kept_groups"] / self.totals["groups"], 0.25)
        return max(need, math.ceil(need / keep_rate))

    def sampling_seed(self, step: int, round_: int) -> int:
        """Engine sampling seed of one generation round: a function of (seed, step, round) so a resumed run samples
        exactly what an uninterrupted one would."""
        return (self.cfg.trainer.seed * 1_000_003 + step * 1_009 + round_) % (2**31 - 1)

    def sampling_config(self, seed: int) -> Any:
        from da3po_megatron.rollout import SamplingConfig

        r = self.cfg.rollout
        return SamplingConfig(n=r.n, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_response_length,
                              seed=seed, apply_chat_template=False, ignore_eos=r.ignore_eos)

    def render_prompts(self, examples: list[Example]) -> list[Any]:
        return [render_prompt(self.tokenizer, ex.prompt, self.cfg.data.apply_chat_template) for ex in examples]

    def generate(self, examples: list[Example], seed: int) -> list[list[Any]]:
        """G responses per prompt in one round (an example's ``meta["max_tokens"]`` caps its own responses)."""
        lengths = [ex.meta.get("max_tokens") for ex in examples]
        out = self.rollout.generate(self.render_prompts(examples), self.sampling_config(seed),
                                    max_tokens=lengths if any(x is not None for x in lengths) else None)
        return out

    def score(self, examples: list[Example], completions: list[list[Any]]) -> list[B.Group]:
        r = self.cfg.rollout
        for ex, comps in zip(examples, completions, strict=True):
            if len(comps[0].prompt_token_ids) > r.max_prompt_length:
                raise ValueError(f"prompt {ex.uid} has {len(comps[0].prompt_token_ids)} tokens, more than "
                                 f"rollout.max_prompt_length={r.max_prompt_length}")
        texts = [c.text for cs in completions for c in cs]
        answers = [ex.answer for ex, cs in zip(examples, completions) for _ in cs]
        scored = self.rewards.score_batch(texts, answers, kind=self.cfg.reward.kind)
        ov = self.cfg.algorithm.overlong
        groups = B.make_groups(examples, completions, scored.rewards, self.cfg.rollout.max_response_length,
                               ov.buffer_length if ov.enable else None)
        n_tok = sum(len(c.token_ids) for cs in completions for c in cs)
        self.totals["samples"] += len(texts)
        self.totals["tokens"] += n_tok
        self.totals["groups"] += len(groups)
        self.totals["reward_timeouts"] += scored.timeouts
        self.totals["reward_errors"] += scored.errors
        return groups

    # ------------------------------------------------------------------------------------------------ training
    def old_logprobs(self, batch: PolicyBatch, fresh: bool = True) -> tuple[PolicyBatch, dict[str, float]]:
        """pi_old for the ratio, and the rollout-vs-policy log-prob mismatch of the sampled tokens (logged every step:
        the trainer/engine mismatch problem). With ``actor.use_rollout_logprobs`` only a ``rollout.
        logprob_check_fraction`` sample of responses is recomputed, for the mismatch metric alone. With
        ``algorithm.rollout_correction=tis`` the batch also gets the per-token TIS weights
        min(pi_old / pi_rollout, tis_cap) that correct for the mismatch, and their ``tis/*`` statistics. ``fresh``:
        the batch was generated by the policy's current weights (not one step off, ``rollout.staleness=1``); only
        then does the mismatch measure the sync, and feed the drift alert."""
        import random as _random

        from da3po_megatron.rollout.consistency import logprob_diff_metrics

        rollout_lp = batch.old_logprobs
        if self.cfg.actor.use_rollout_logprobs:
            n = len(batch)
            k = min(n, math.ceil(self.cfg.rollout.logprob_check_fraction * n))
            idx = sorted(_random.Random(self.step).sample(range(n), k))
            if not idx:
                return batch, {}
            sub = PolicyBatch([batch.prompt_ids[i] for i in idx], [batch.response_ids[i] for i in idx])
            mismatch = logprob_diff_metrics([rollout_lp[i] for i in idx], self.policy.compute_logprobs(sub))
            return batch, {**mismatch, **(self.drift.update(self.step + 1, mismatch) if fresh else {})}
        policy_lp = self.policy.compute_logprobs(batch)
        mismatch = logprob_diff_metrics(rollout_lp, policy_lp)
        mismatch.update(self.drift.update(self.step + 1, mismatch) if fresh else {})
        weights = None
        if self.cfg.algorithm.rollout_correction == "tis":
            def flat(rows: list[list[float]]) -> torch.Tensor:
                return torch.tensor([v for row in rows for v in row], dtype=torch.float64)

            w, stats = tis_weights(flat(policy_lp), flat(rollout_lp), self.cfg.algorithm.tis_cap)
            weights = [part.tolist() for part in w.split([len(row) for row in policy_lp])]
            mismatch.update(stats)
        return replace(batch, old_logprobs=[list(x) for x in policy_lp], token_weights=weights), mismatch

    def sync_weights(self) -> dict[str, float]:
        """Policy -> every engine through the transport chosen at start-up (``rollout.weight_transfer``)."""
        from da3po_megatron.rollout.weight_sync import sync_policy_group_to_engines

        r = self.cfg.rollout
        if self.weight_transfer == "collective":
            from da3po_megatron.rollout.collective_transport import CollectiveTransport

            if self._transport is None:
                self._transport = CollectiveTransport(self.policy.run_on_all,
                                                      self.cfg.parallel.pipeline_model_parallel_size,
                                                      timeout_s=r.weight_sync_timeout_s)
            return self._transport.sync(self.rollout, bucket_mb=r.weight_sync_bucket_mb)
        if self.weight_transfer == "ipc":
            from da3po_megatron.rollout.ipc import ipc_sync

            return ipc_sync(self.policy, self.rollout, bucket_mb=r.weight_sync_bucket_mb)
        return sync_policy_group_to_engines(self.policy, self.rollout, bucket_mb=r.weight_sync_bucket_mb)

    def engines_idle(self) -> None:
        """The step's generation is over. Colocated on CUDA ("ipc"), the engines sleep (level 2: KV cache and weights
        freed; the next sync rewrites every weight) so the policy has the GPU memory; ``ipc_sync`` wakes them."""
        if self.weight_transfer == "ipc":
            self.rollout.sleep(level=2)

    def pin_cpus(self) -> None:
        """Placement for overlap: engines on ``ray.engine_cpus``, policy ranks on ``ray.policy_cpus`` (disjoint cores:
        generation and training never compete for one). Prints the resulting affinity."""
        r = self.cfg.ray
        for name, spec in (("policy_cpus", r.policy_cpus), ("engine_cpus", r.engine_cpus)):
            try:
                if name == "policy_cpus":
                    cores = self.policy.run_on_all(_pin, spec) if spec else []
                else:
                    cores = self.rollout.call_all("pin_cpus", spec) if spec else []
            except Exception as e:  # noqa: BLE001 - name the field
                raise ValueError(f"ray.{name}={spec!r}: {e}") from e
            if spec:
                print(f"placement: {name.split('_')[0]} processes pinned to cores {cores}", flush=True)

    # ------------------------------------------------------------------------------------------------ metrics
    def step_metrics(self, rollout, daa, mismatch, train_metrics, sync, phase_seconds, step_seconds
                     ) -> dict[str, float]:
        cfg = self.cfg
        groups, generated = rollout.groups, rollout.generated
        m: dict[str, float] = {}
        m.update(B.group_stats(generated, cfg.rollout.max_response_length, "gen"))
        m.update(B.group_stats(groups, cfg.rollout.max_response_length, "batch"))
        m["acc/mean"] = m.get("gen/acc", 0.0)
        m["reward/mean"] = m.get("gen/reward", 0.0)
        s = rollout.stats
        m.update(s)
        versions = [g.weight_step for g in groups]
        m["rollout/weight_step_min"], m["rollout/weight_step_max"] = float(min(versions)), float(max(versions))
        m["rollout/staleness"] = float(self.step - 1 - min(versions))  # policy step trained from - generating step
        m["gen/rounds"] = s["dynamic_sampling/rounds"]
        m["gen/groups"] = s["dynamic_sampling/generated_groups"]
        m["filter/kept_groups"] = s["dynamic_sampling/kept_groups"]
        gen = max(s["dynamic_sampling/generated_groups"], 1.0)
        m["filter/frac_filtered"] = (s["dynamic_sampling/discarded_all_correct_groups"]
                                     + s["dynamic_sampling/discarded_all_wrong_groups"]) / gen
        m["gen/cumulative_samples"] = float(self.totals["samples"])
        m["gen/cumulative_tokens"] = float(self.totals["tokens"])
        m["gen/cumulative_groups"] = float(self.totals["groups"])
        m["reward/timeouts_total"] = float(self.totals["reward_timeouts"])
        m["reward/errors_total"] = float(self.totals["reward_errors"])
        m["data/skipped_rows"] = float(self.data_skipped_rows)
        m.update(daa)
        m.update(B.theory_stats(generated, groups, cfg.algorithm.advantage_eps))
        m.update({k: float(v) for k, v in mismatch.items()})
        m.update({f"train/{k}": float(v) for k, v in train_metrics.items() if isinstance(v, int | float)})
        m.update({f"sync/{k}": float(v) for k, v in sync.items() if isinstance(v, int | float)})
        m.update({f"time/{k}": v for k, v in phase_seconds.items()})
        m["time/step"] = step_seconds
        n_tok = sum(len(r) for g in generated for r in g.response_ids)
        m["perf/rollout_tokens_per_s"] = n_tok / max(phase_seconds.get("generate", 0.0), 1e-9)
        return m

    # ------------------------------------------------------------------------------------------------ evaluation
    def should_evaluate(self, step: int) -> bool:
        e = self.cfg.eval
        return bool(e.every) and bool(e.benchmarks) and (step % e.every == 0 or step == self.cfg.trainer.total_steps)

    def evaluate(self) -> dict[str, float]:
        from da3po_megatron.trainer.evaluation import evaluate_during_training

        return evaluate_during_training(self)

    # ------------------------------------------------------------------------------------------------ checkpoints
    def should_checkpoint(self, step: int) -> bool:
        every = self.cfg.trainer.save_every
        return step == self.cfg.trainer.total_steps or (every > 0 and step % every == 0)

    def trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "prompts": self.prompts.state_dict(),
            "buffer": self.buffer.state_dict(),
            "totals": dict(self.totals),
            "engine_weight_step": self.engine_weight_step,
            "pending": list(self.pending),
            "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
            "config": to_dict(self.cfg),
        }

    def best_candidate(self, metrics: dict[str, Any]) -> float | None:
        """The value of trainer.keep_best_metric when this step's evaluation beats the best so far (else None)."""
        return self.best.candidate(self.step, metrics) if self.best else None

    def save_checkpoint(self, best_value: float | None = None) -> Path:
        """Checkpoint this step; with ``best_value`` also record it as the best checkpoint (trainer/best.py)."""
        t0 = time.perf_counter()
        path = save_checkpoint(self.ckpt, self.best, self.step, lambda p: self.policy.save(str(p)),
                               self.trainer_state(), best_value)
        note = f"; best {self.best.metric} = {best_value:.4f}" if self.best and best_value is not None else ""
        print(f"checkpoint step {self.step} -> {path} ({time.perf_counter() - t0:.1f} s){note}", flush=True)
        return path

    def _restore(self, path: Path) -> None:
        t0 = time.perf_counter()
        state = self.ckpt.load_trainer_state(path)
        self.policy.load(str(path / "policy"))
        self.step = int(state["step"])
        self.prompts.load_state_dict(state["prompts"])
        self.buffer.load_state_dict(state["buffer"])
        self.totals = dict(state["totals"])
        # staleness 1: the next step's batch was complete when this checkpoint was written (the loop joins the
        # prefetch before the weight sync and the checkpoint); it is saved and trained on as is after a resume
        self.pending = list(state.get("pending", []))
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        torch.set_rng_state(state["rng"]["torch"])
        self.sync_weights()  # the engines start from the HF weights; give them the checkpoint's
        self.engine_weight_step = self.step
        print(f"resumed from {path} at step {self.step} ({time.perf_counter() - t0:.1f} s)", flush=True)

    # ------------------------------------------------------------------------------------------------ preemption
    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
        print(f"received signal {signum}: will checkpoint after this step and exit", flush=True)
        self._preempt = True

    def preempted(self) -> bool:
        return self._preempt or (self.run_dir / "PREEMPT").exists()

    def close(self) -> None:
        if getattr(self, "_transport", None) is not None:
            try:
                self._transport.teardown(self.rollout)
            except Exception as e:  # noqa: BLE001 - closing must not hide the real error
                print(f"warning: closing the weight-transfer group failed: {e}", flush=True)
            self._transport = None
        for part in ("rollout", "policy", "rewards"):
            obj = getattr(self, part, None)
            if obj is not None:
                try:
                    (obj.shutdown if hasattr(obj, "shutdown") else obj.close)()
                except Exception as e:  # closing must not hide the real error of a failed run
                    print(f"warning: closing {part} failed: {e}", flush=True)
        if getattr(self, "logger", None) is not None:
            self.logger.close()
        if (self.run_dir / "PREEMPT").exists():
            (self.run_dir / "PREEMPT").unlink()
