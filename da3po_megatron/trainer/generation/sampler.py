"""The generation side of a run, one object: the prompt stream (with ``data.selection``), the sampling settings, the
engines' calls, the reward pool and the dynamic-sampling buffer, with the counters they keep -- and its own saved
state (slime's ``RolloutManager`` and ``RolloutDataSource.save/load`` in small).

Who uses it: ``generation/collect.py`` (one step's batch, rounds or streaming), the prefetch and the asynchronous
producer (``generation/async_rollout.py``), dump / replay (``generation/replay.py``) and the re-scoring diagnostic
(``generation/rescore.py``); ``trainer/run.py`` builds it, the checkpoint (``resume/run_state.py``) asks it for
:meth:`Sampler.state_dict`. None of them reaches into its fields to save or restore it.

What it leaves to others: the policy, the weight sync (a restarted engine is re-synced through the engines' client's
``resync``, which the run sets to its weight sync) and the update counters (``trainer/updates.py``).
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from da3po_megatron.algorithms import DynamicSamplingBuffer
from da3po_megatron.config import Config
from da3po_megatron.data.datasets import Example, PromptDataset
from da3po_megatron.data.selection import selecting
from da3po_megatron.data.templates import render_prompt
from da3po_megatron.trainer import batch as B

GENERATION_TOTALS = ("samples", "tokens", "groups", "kept_groups", "reward_timeouts", "reward_errors")


class Sampler:
    """Prompts -> engines -> rewards for one run (see the module docstring). ``rewards``: the reward pool (None: a
    :class:`~da3po_megatron.rewards.RewardPool` of ``reward.num_workers`` processes is started); ``rollout``, the
    engines' client, is set once the engines have started (bring-up); ``replay``: the run's dump / replay switch."""

    def __init__(self, cfg: Config, tokenizer: Any, dataset: PromptDataset, rewards: Any = None) -> None:
        self.cfg, self.tokenizer, self.dataset = cfg, tokenizer, dataset
        self.data_skipped_rows = dataset.stats.skipped if dataset.stats is not None else 0
        # data.selection: skips by each prompt's history (data/selection.py); the posterior rule needs G and DAA's tau
        self.prompts = selecting(dataset.iterator(seed=cfg.trainer.seed, shuffle=cfg.data.shuffle), cfg.data,
                                 cfg.trainer.seed, group_size=cfg.rollout.n, tau=cfg.daa.tau)
        self.selection_metrics: dict[str, float] = {}  # drained when a step completes (resume/run_state.py)
        self.buffer = DynamicSamplingBuffer(cfg.data.train_batch_size, cfg.algorithm.surplus, cfg.rollout.n)
        if rewards is None:
            from da3po_megatron.rewards import RewardPool

            rewards = RewardPool(num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s)
        self.rewards = rewards
        self.rollout: Any = None  # the engines' client (RolloutClient, or bring-up's NoEngines)
        self.replay: Any = None  # rollout.dump_dir / replay_dir (generation/replay.py)
        self.totals = dict.fromkeys(GENERATION_TOTALS, 0)
        self.engine_weight_step = 0  # the policy step whose weights the engines hold (tags every generated group)

    # ------------------------------------------------------------------------------------------------ prompts
    def next_prompts(self, k: int) -> list[Example]:
        return self.prompts.take(k)

    def prompts_for_round(self, need: int) -> int:
        """Prompts to generate for ``need`` missing groups: over-sampled by the inverse of the keep rate observed so
        far in this run (at most 4x; exactly ``need`` without filtering or on the first round of a run)."""
        if not self.cfg.algorithm.filter_groups or self.totals["groups"] == 0:
            return need
        if hasattr(self.prompts, "round_size"):  # data.selection: the keep rate of the recent windows
            return self.prompts.round_size(need)
        keep_rate = max(self.totals["kept_groups"] / self.totals["groups"], 0.25)
        return max(need, math.ceil(need / keep_rate))

    def drain_selection(self) -> None:
        """A step completed: take data.selection's counters of it (logged with the step's metrics)."""
        if hasattr(self.prompts, "drain"):
            self.selection_metrics = self.prompts.drain()

    # ------------------------------------------------------------------------------------------------ sampling
    def sampling_seed(self, step: int, round_: int) -> int:
        """Engine sampling seed of one generation round: a function of (seed, step, round) so a resumed run samples
        exactly what an uninterrupted one would."""
        return (self.cfg.trainer.seed * 1_000_003 + step * 1_009 + round_) % (2**31 - 1)

    def sampling_config(self, seed: int) -> Any:
        from da3po_megatron.megatron.memory_host import route_fraction
        from da3po_megatron.rollout import SamplingConfig

        r = self.cfg.rollout
        return SamplingConfig(n=r.n, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_response_length,
                              seed=seed, apply_chat_template=False, ignore_eos=r.ignore_eos,
                              routes_fraction=route_fraction(self.cfg.moe))

    def render_prompts(self, examples: list[Example]) -> list[Any]:
        return [render_prompt(self.tokenizer, ex.prompt, self.cfg.data.apply_chat_template) for ex in examples]

    def generate(self, examples: list[Example], seed: int) -> list[list[Any]]:
        """G responses per prompt in one round (an example's ``meta["max_tokens"]`` caps its own responses). An engine
        that died is restarted by the client; its weights come back through ``rollout.resync`` (the run's sync)."""
        from da3po_megatron.rollout.types import EngineDeadError

        r = self.cfg.rollout
        lengths = [ex.meta.get("max_tokens") for ex in examples]
        prompts, sampling = self.render_prompts(examples), self.sampling_config(seed)
        max_tokens = lengths if any(x is not None for x in lengths) else None
        try:
            out = self.rollout.generate(prompts, sampling, max_tokens=max_tokens)
        except EngineDeadError as e:  # the client restarted the engine but cannot replay weights the policy pushed
            if not r.restart_on_failure:
                raise
            print(f"warning: {e}; syncing the policy's weights into the restarted engine and generating again",
                  flush=True)
            self.rollout.resync()
            out = self.rollout.generate(prompts, sampling, max_tokens=max_tokens)
        self._check_prompt_lengths(examples, out)
        return out

    def _check_prompt_lengths(self, examples: list[Example], completions: list[list[Any]]) -> None:
        limit = self.cfg.rollout.max_prompt_length
        for ex, comps in zip(examples, completions, strict=True):
            if len(comps[0].prompt_token_ids) > limit:
                raise ValueError(f"prompt {ex.uid} has {len(comps[0].prompt_token_ids)} tokens, more than "
                                 f"rollout.max_prompt_length={limit}")

    # ------------------------------------------------------------------------------------------------ rewards
    def score(self, examples: list[Example], completions: list[list[Any]]) -> list[B.Group]:
        """Rewards (R_acc + the overlong shaping of Eq. 8) of each group; counted, and fed to data.selection."""
        self._check_prompt_lengths(examples, completions)
        texts = [c.text for cs in completions for c in cs]
        answers = [ex.answer for ex, cs in zip(examples, completions) for _ in cs]
        scored = self.rewards.score_batch(texts, answers, kind=self.cfg.reward.kind)
        ov = self.cfg.algorithm.overlong
        groups = B.make_groups(examples, completions, scored.rewards, self.cfg.rollout.max_response_length,
                               ov.buffer_length if ov.enable else None)
        self.totals["samples"] += len(texts)
        self.totals["tokens"] += sum(len(c.token_ids) for cs in completions for c in cs)
        self.totals["groups"] += len(groups)
        self.totals["reward_timeouts"] += scored.timeouts
        self.totals["reward_errors"] += scored.errors
        if observe := getattr(self.prompts, "observe", None):  # data.selection: the history
            observe([(g.example.uid, g.p_hat) for g in groups])
        return groups

    # ------------------------------------------------------------------------------------------------ saved state
    def state_dict(self) -> dict[str, Any]:
        """The generation side's state, plain data (``torch.load(weights_only=True)``): the data position and
        data.selection's history, the dynamic-sampling buffer (groups carried to the next step), the generation
        counters and the driver's RNG. The one capture: checkpoints (``resume/run_state.py``) and dumps
        (``generation/replay.py``) both store it."""
        from da3po_megatron.megatron.runtime import numpy_rng_state

        buffer = self.buffer.state_dict()
        return {"prompts": self.prompts.state_dict(),
                "selection": self.prompts.selection_state() if hasattr(self.prompts, "selection_state") else None,
                "buffer": {**buffer, "groups": [B.group_to_dict(g) for g in buffer["groups"]]},
                "totals": dict(self.totals),
                "rng": {"python": random.getstate(), "numpy": numpy_rng_state(), "torch": torch.get_rng_state()}}

    def load_state_dict(self, state: dict[str, Any]) -> str | None:
        """Restore :meth:`state_dict` (or the same keys of a checkpoint's trainer state, of any layout since f5d1453:
        its ``totals`` may hold the update counters too, ignored here; its buffer may hold pickled ``Group``
        objects). Returns data.selection's line to print (None without selection)."""
        from da3po_megatron.megatron.runtime import set_numpy_rng_state

        self.prompts.load_state_dict(state["prompts"])
        note = None
        if hasattr(self.prompts, "load_selection_state"):  # another dataset / none saved: a new history
            note = self.prompts.load_selection_state(state.get("selection"))
        groups = state["buffer"]["groups"]
        self.buffer.load_state_dict({**state["buffer"], "groups": [
            B.group_from_dict(g) if isinstance(g, dict) else g for g in groups]})
        self.totals.update({k: v for k, v in state["totals"].items() if k in self.totals})
        random.setstate(tuple(state["rng"]["python"]))
        set_numpy_rng_state(state["rng"]["numpy"])
        torch.set_rng_state(state["rng"]["torch"])
        return note
