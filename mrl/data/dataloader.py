"""Batches of prompts with a saveable position, for exact resume.

Each epoch visits every item once in an order shuffled by (seed, epoch) alone, so the order does not depend on
how many epochs ran in this process: a loader restored from `state_dict()` yields exactly the batches the
original would have yielded next.
"""

from __future__ import annotations

import random
from typing import Any, Generic, Iterator, Sequence, TypeVar

T = TypeVar("T")


class PromptDataLoader(Generic[T]):
    """Endless iterator of batches (lists of items); `epoch` counts completed passes, so the driver stops at its
    max_num_epochs. drop_last=True: every batch has exactly `batch_size` items (the tail of an epoch is skipped)."""

    def __init__(
        self, items: Sequence[T], batch_size: int, *, seed: int = 0, shuffle: bool = True, drop_last: bool = True
    ):
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        if drop_last and len(items) < batch_size:
            raise ValueError(
                f"{len(items)} items cannot fill one batch of {batch_size}: lower the batch or add data "
                "(the commands say which key, before any worker starts: preflight.check_fills_a_batch)"
            )
        if not items:
            raise ValueError("the dataset is empty")
        self.items = items
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # index into this epoch's order of the next item to yield
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    @property
    def batches_per_epoch(self) -> int:
        n = len(self.items)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def passes_done(self, max_epochs: int) -> bool:
        """Whether the next batch would start pass number `max_epochs + 1` (the loader's epoch counts passes started,
        and moves on only when the next batch is drawn)."""
        batches_served = self.epoch * self.batches_per_epoch + self.position // self.batch_size
        return batches_served >= max_epochs * self.batches_per_epoch

    def __iter__(self) -> Iterator[list[T]]:
        return self

    def __next__(self) -> list[T]:
        remaining = len(self.items) - self.position
        if remaining == 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch += 1
            self.position = 0
            self._order = self._epoch_order(self.epoch)
        stop = min(self.position + self.batch_size, len(self.items))
        batch = [self.items[i] for i in self._order[self.position : stop]]
        self.position = stop
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_items": len(self.items),
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, mine in (("num_items", len(self.items)), ("seed", self.seed)):
            if state[key] != mine:
                raise ValueError(
                    f"cannot resume the data loader: the checkpoint has {key}={state[key]}, this run "
                    f"{mine}; resume with the same data and seed (run.seed) or start a new run"
                )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)
