"""The policy as the loops see it (`TrainablePolicy`), what it trains on (`RankBatch`) and with (`PolicyLoss`).

Layout of a `RankBatch` (rows = sequences, right-padded):

    input_ids   [N, T] token ids
    loss_mask   [N, T] 1 on the tokens whose logprob enters the loss (the response tokens)
    token_data  name -> [N, T] tensors aligned with the tokens (advantages, old/ref/engine logprobs)
    seq_data    name -> [N] tensors (one value per sequence)
    lengths     [N] real tokens (prompt + response); None = up to the last loss token
    group_size  rows come in consecutive groups of this size that one loss term couples (2: a DPO or reward-model
                pair, chosen then rejected); a group never straddles a micro-batch or a data-parallel shard
    routing     [N, T, layers, k] uint8 / int16 (`routing_dtype`) or None: the engine's experts per token and MoE
                layer, aligned with input_ids (not shifted), `no_route` where none was reported
                (mrl/model/router_replay.py)

Light on purpose (torch only): the loops build batches without importing Megatron. The implementation is
`mrl.policy.group.Policy` (one Ray actor per rank, mrl/policy/worker.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from mrl.model.router_replay import no_route


class PolicyLoss(Protocol):
    """A loss evaluated per micro-batch and normalised by the global count of the step."""

    @property
    def level(self) -> Literal["token", "sequence"]:
        """What `global_count` counts: valid tokens or sequences. Read only: the losses are frozen dataclasses."""
        ...

    def __call__(
        self, logprobs: torch.Tensor, batch: dict[str, torch.Tensor], global_count: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """logprobs [b, T'] of the target tokens; `batch` holds `loss_mask` [b, T'], the token data [b, T'], the
        sequence data [b] and `seq_num_tokens` [b] (valid tokens per whole sequence, also under CP).
        Returns (scalar loss = sum over this micro-batch / global_count, additive metrics)."""


@runtime_checkable
class WholeSequenceLoss(PolicyLoss, Protocol):
    """A loss of each whole sequence's sum over its tokens (DPO's logprob sums, a reward model's score): under
    context parallelism the train step adds the ranks' `row_sums` before `from_row_sums`
    (mrl/policy/train_step.py, "Whole-sequence losses under context parallelism")."""

    def row_sums(self, logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[b] each row's part of its sequence's sum, additive over the sequence's tokens (a CP rank's chunks)."""
        ...

    def from_row_sums(
        self, sums: torch.Tensor, batch: dict[str, torch.Tensor], global_count: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """What `__call__` returns, from the whole sequences' sums [b]."""
        ...


@dataclass
class RankBatch:
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    token_data: dict[str, torch.Tensor] = field(default_factory=dict)
    seq_data: dict[str, torch.Tensor] = field(default_factory=dict)
    lengths: torch.Tensor | None = None  # [N] real tokens (prompt + response); None = up to the last loss token
    group_size: int = 1  # consecutive rows kept in one micro-batch and one data-parallel shard (a preference pair)
    routing: torch.Tensor | None = None  # [N, T, layers, k] the engine's experts (router replay), no_route = none

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device) -> "RankBatch":
        """Every tensor on `device` (the rank's CUDA device on GPUs; batches travel between processes on the host)."""
        move = lambda x: x.to(device, non_blocking=True)  # noqa: E731
        return RankBatch(
            move(self.input_ids),
            move(self.loss_mask),
            {k: move(v) for k, v in self.token_data.items()},
            {k: move(v) for k, v in self.seq_data.items()},
            None if self.lengths is None else move(self.lengths),
            self.group_size,
            None if self.routing is None else move(self.routing),
        )

    def slice(self, start: int, stop: int) -> "RankBatch":
        return RankBatch(
            self.input_ids[start:stop],
            self.loss_mask[start:stop],
            {k: v[start:stop] for k, v in self.token_data.items()},
            {k: v[start:stop] for k, v in self.seq_data.items()},
            None if self.lengths is None else self.lengths[start:stop],
            self.group_size,
            None if self.routing is None else self.routing[start:stop],
        )

    def select(self, rows: list[int], width: int) -> "RankBatch":
        """Rows `rows` (in that order) with every [N, T] tensor cut or right-padded (zeros) to `width` columns."""
        t = self.input_ids.shape[1]

        def cols(x: torch.Tensor) -> torch.Tensor:  # [N, T] -> [len(rows), width]
            return x[rows, :width] if width <= t else torch.nn.functional.pad(x[rows], (0, width - t))

        return RankBatch(
            cols(self.input_ids),
            cols(self.loss_mask),
            {k: cols(v) for k, v in self.token_data.items()},
            {k: v[rows] for k, v in self.seq_data.items()},
            None if self.lengths is None else self.lengths[rows],
            self.group_size,
            None if self.routing is None else pad_routing(self.routing[rows], width),
        )

    def micro_batches(self, size: int) -> list["RankBatch"]:
        if size % self.group_size:
            raise ValueError(
                f"micro-batches of {size} rows would split the groups of {self.group_size} rows "
                "(preference pairs); use an even micro-batch size"
            )
        if len(self) % size:
            # Pipeline schedules send fixed-shape activations between stages: every micro-batch has `size` rows.
            raise ValueError(f"{len(self)} sequences on this rank do not split into micro-batches of {size}")
        return [self.slice(i, i + size) for i in range(0, len(self), size)]


def pad_routing(routing: torch.Tensor, width: int) -> torch.Tensor:
    """[N, T, L, k] routing cut or right-padded to `width` tokens; padding tokens carry `no_route` (no engine
    routing)."""
    t = routing.shape[1]
    if width <= t:
        return routing[:, :width]
    return torch.nn.functional.pad(routing, (0, 0, 0, 0, 0, width - t), value=no_route(routing.dtype))


def global_count(loss_mask: torch.Tensor, level: str) -> float:
    """Valid tokens (token level) or sequences with at least one valid token (sequence level) in a whole step."""
    if level == "token":
        return float(loss_mask[:, 1:].sum())
    return float((loss_mask[:, 1:].sum(dim=1) > 0).sum())


class TrainablePolicy(Protocol):
    """A sharded policy driven by the controller: every call covers all of its ranks."""

    @property
    def data_parallel_size(self) -> int:
        """Batches passed in need a multiple of this many rows (each data-parallel rank takes a share)."""
        ...

    def logprobs(self, batch: RankBatch, *, temperature: float = 1.0, reference: bool = False) -> torch.Tensor:
        """[B, T] log-probabilities of `batch.input_ids` (position 0 is 0) under the policy or its reference."""
        ...

    def train(self, batch: RankBatch, loss_fn: PolicyLoss, *, temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step on the whole batch; the step's metrics."""
        ...

    def save(self, path: str, *, weights_only: bool = False) -> None: ...

    def load(self, path: str, *, load_optimizer: bool = True) -> list[Any]: ...

    def export_state(self) -> dict[str, torch.Tensor]:
        """The whole model as HF-named full tensors."""
        ...

    def shutdown(self) -> None: ...


class ReleasesMemory(Protocol):
    """A policy that shares its devices with a rollout engine (colocated): it hands memory over around generation."""

    def release_memory(self) -> dict[str, float]:
        """Move optimizer states, gradients (and the weights when configured) off the devices and empty the CUDA
        caches, before the engine wakes; the policy's next call that needs them takes them back itself. Returns the
        GB moved per part and the CUDA memory reserved before and after."""
        ...

    def reclaim_memory(self) -> None:
        """Take back everything `release_memory` moved."""
        ...
