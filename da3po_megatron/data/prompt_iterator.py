"""The resumable shuffled walk over a prompt dataset: :class:`PromptIterator`.

Epoch after epoch, in an order that depends only on (seed, epoch); ``state_dict()`` / ``load_state_dict()`` resume
exactly mid-epoch and refuse another dataset (its size and uid fingerprint are checked). The trainer over-samples
prompts for dynamic sampling, so it pulls a variable number per step with :meth:`PromptIterator.take`.

It walks anything shaped like :class:`~da3po_megatron.data.datasets.PromptDataset` (:class:`Prompts`), which makes
one with ``PromptDataset.iterator()``; it imports nothing of the readers.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class Prompts(Protocol):
    """What the iterator reads of a dataset: its length, items by index, ``name`` and uid ``fingerprint()``."""

    name: str

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> Any: ...

    def fingerprint(self) -> str: ...


class PromptIterator:
    """Examples epoch after epoch; the order of epoch e is a permutation that depends only on (seed, e).

    ``state_dict()`` after any number of items and ``load_state_dict()`` on a fresh iterator over the same dataset
    continue with exactly the same items. ``max_epochs`` (None = forever) ends iteration with StopIteration.
    """

    def __init__(self, dataset: Prompts, seed: int = 0, shuffle: bool = True,
                 max_epochs: int | None = None) -> None:
        if len(dataset) == 0:
            raise ValueError(f"cannot iterate over the empty dataset {dataset.name or '<unnamed>'}")
        self.dataset, self.seed, self.shuffle, self.max_epochs = dataset, int(seed), bool(shuffle), max_epochs
        self.epoch, self.position, self.consumed = 0, 0, 0
        self._order_epoch, self._order = -1, np.arange(0)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The index order of ``epoch`` (a pure function of seed and epoch)."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(n)

    def __iter__(self) -> PromptIterator:
        return self

    def __next__(self) -> Any:
        if self.position >= len(self.dataset):
            self.epoch, self.position = self.epoch + 1, 0
        if self.max_epochs is not None and self.epoch >= self.max_epochs:
            raise StopIteration
        if self._order_epoch != self.epoch:
            self._order, self._order_epoch = self.epoch_order(self.epoch), self.epoch
        ex = self.dataset[int(self._order[self.position])]
        self.position += 1
        self.consumed += 1
        return ex

    def take(self, k: int) -> list[Any]:
        """The next ``k`` examples (crossing epoch boundaries; fewer only when ``max_epochs`` runs out)."""
        out = []
        for _ in range(k):
            try:
                out.append(next(self))
            except StopIteration:
                break
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "shuffle": self.shuffle, "epoch": self.epoch, "position": self.position,
                "consumed": self.consumed, "num_examples": len(self.dataset),
                "fingerprint": self.dataset.fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, mine in (("num_examples", len(self.dataset)), ("fingerprint", self.dataset.fingerprint())):
            if state.get(key) != mine:
                raise ValueError(f"iterator state does not match this dataset: {key} is {state.get(key)!r} in the "
                                 f"checkpoint but {mine!r} here (a different or reordered data file?)")
        for key in ("seed", "shuffle", "epoch", "position", "consumed"):
            if key not in state:
                raise ValueError(f"iterator state is missing {key!r}")
        if not 0 <= int(state["position"]) <= len(self.dataset):
            raise ValueError(f"iterator state position {state['position']} outside [0, {len(self.dataset)}]")
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.epoch, self.position, self.consumed = int(state["epoch"]), int(state["position"]), int(state["consumed"])
        self._order_epoch = -1
