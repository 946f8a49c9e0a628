"""Planning micro-batches by a token budget: sequence packing (first-fit-decreasing) and dynamic batching.

Both planners work on sequence lengths only and return a `MicroBatchPlan`: which original sequences go into
which micro-batch, in which order, and how to put per-sequence results back in the original order.

Packing (THD layout): sequences of one micro-batch are concatenated into one row of at most `budget` tokens,
each starting at a `cu_seqlens` boundary. Every length is first rounded up to `multiple`, the granularity the
parallel layout needs (`mrl.parallel.layout.length_multiple`). Bins are filled first-fit-decreasing (longest first,
into the
first bin with room), which uses at most 11/9 OPT + 6/9 bins (Dosa 2007).
    packing_efficiency = real tokens / (micro-batches * budget)
i.e. the fraction of the fixed-size buffers (what pipeline parallelism sends between stages) holding real tokens.

Dynamic batching (padded layout, packing off): sequences sorted by length are cut into micro-batches whose
padded size `rows * longest` stays within the budget, so short sequences share a micro-batch and long ones get
their own.
    efficiency = real tokens / sum over micro-batches of rows * longest (rounded)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, TypeVar

import torch

T = TypeVar("T")


def round_up(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


@dataclass(frozen=True)
class MicroBatchPlan:
    """bins[i] = original indices of the sequences in micro-batch i, in the order they are laid out;
    lengths[j] / padded_lengths[j] = real / rounded length of original sequence j."""

    bins: list[list[int]]
    lengths: list[int]
    padded_lengths: list[int]
    budget: int
    packed: bool

    @property
    def num_micro_batches(self) -> int:
        return len(self.bins)

    @property
    def order(self) -> list[int]:
        """Original indices in processing order (bins concatenated)."""
        return [j for b in self.bins for j in b]

    @property
    def inverse(self) -> torch.Tensor:
        """inverse[j] = position of original sequence j in `order`; `flat_results[inverse]` restores the order."""
        order = torch.tensor(self.order, dtype=torch.long)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(len(order))
        return inv

    def restore(self, per_sequence: Sequence[T]) -> list[T]:
        """Results listed in processing order -> the same results in the original order."""
        if len(per_sequence) != len(self.lengths):
            raise ValueError(f"got {len(per_sequence)} results for {len(self.lengths)} sequences")
        return [per_sequence[i] for i in self.inverse.tolist()]

    def cu_seqlens(self, bin_index: int) -> torch.Tensor:
        """[n + 1] int32 start offsets of the (rounded) sequences of one packed micro-batch (THD layout)."""
        sizes = [self.padded_lengths[j] for j in self.bins[bin_index]]
        return torch.tensor([0] + sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)

    def bin_tokens(self, bin_index: int) -> int:
        """Tokens the micro-batch occupies: the packed sum, or rows * longest when padded."""
        sizes = [self.padded_lengths[j] for j in self.bins[bin_index]]
        return sum(sizes) if self.packed else len(sizes) * max(sizes)

    @property
    def efficiency(self) -> float:
        """Real tokens / tokens computed (packed: whole budget-sized buffers; padded: rows * longest)."""
        if not self.bins:
            return 1.0
        computed = self.budget * len(self.bins) if self.packed else sum(map(self.bin_tokens, range(len(self.bins))))
        return sum(self.lengths) / computed


def _rounded(lengths: Sequence[int], budget: int, multiple: int, key: str) -> list[int]:
    if budget < 1 or multiple < 1:
        raise ValueError(f"need a token budget >= 1 and a multiple >= 1, got {budget} and {multiple}")
    padded = []
    for i, length in enumerate(lengths):
        if length < 1:
            raise ValueError(f"sequence {i} has length {length}; every sequence needs at least one token")
        rounded = round_up(int(length), multiple)
        if rounded > budget:
            raise ValueError(
                f"sequence {i} has {length} tokens ({rounded} rounded to a multiple of {multiple}), "
                f"more than the micro-batch budget of {budget}: raise {key} to at least {rounded} "
                "(or lower the maximum sequence length)"
            )
        padded.append(rounded)
    return padded


def _longest_first(padded: Sequence[int]) -> list[int]:
    # Stable: equal lengths keep their original order, so plans are deterministic.
    return sorted(range(len(padded)), key=lambda j: -padded[j])


def _groups(count: int, group_size: int) -> list[list[int]]:
    """Consecutive sequences that must share a micro-batch (a preference pair: group_size 2)."""
    if group_size < 1 or count % group_size:
        raise ValueError(f"{count} sequences do not split into groups of {group_size} (e.g. chosen/rejected pairs)")
    return [list(range(g, g + group_size)) for g in range(0, count, group_size)]


def _group_budget_error(group: list[int], tokens: int, budget: int, key: str) -> ValueError:
    return ValueError(
        f"sequences {group[0]}..{group[-1]} must share a micro-batch (one preference pair) and take "
        f"{tokens} tokens together, more than the budget of {budget}: raise {key} to at least {tokens}"
    )


def pack_sequences(
    lengths: Sequence[int],
    budget: int,
    *,
    multiple: int = 1,
    min_micro_batches: int = 1,
    group_size: int = 1,
    key: str = "policy.sequence_packing.tokens_per_microbatch",
) -> MicroBatchPlan:
    """First-fit-decreasing packing of sequence `lengths` into micro-batches of at most `budget` tokens each.
    `min_micro_batches` splits the work into at least that many bins (e.g. so every pipeline stage has work).
    Consecutive groups of `group_size` sequences are packed as one item (they stay in one micro-batch, in order).
    `key` names the budget in errors."""
    padded = _rounded(lengths, budget, multiple, key)
    groups = _groups(len(padded), group_size)
    sizes = [sum(padded[j] for j in g) for g in groups]
    if min_micro_batches > len(groups) > 0:
        raise ValueError(f"cannot make {min_micro_batches} micro-batches out of {len(groups)} sequences (or groups)")
    bins: list[list[int]] = [[] for _ in range(min_micro_batches if groups else 0)]
    room: list[int] = [budget] * len(bins)
    for g in _longest_first(sizes):
        if sizes[g] > budget:
            raise _group_budget_error(groups[g], sizes[g], budget, key)
        # Fill the forced-empty bins first so each of them gets a sequence; then plain first fit.
        target = next((b for b in range(len(bins)) if not bins[b]), None)
        if target is None:
            target = next((b for b in range(len(bins)) if room[b] >= sizes[g]), None)
        if target is None:
            bins.append([])
            room.append(budget)
            target = len(bins) - 1
        bins[target].extend(groups[g])
        room[target] -= sizes[g]
    return MicroBatchPlan(bins, [int(x) for x in lengths], padded, budget, packed=True)


def dynamic_batches(
    lengths: Sequence[int],
    budget: int,
    *,
    multiple: int = 1,
    group_size: int = 1,
    key: str = "policy.dynamic_batching.tokens_per_microbatch",
) -> MicroBatchPlan:
    """Padded micro-batches of similar lengths whose `rows * longest` (rounded) stays within `budget` tokens.
    Consecutive groups of `group_size` sequences stay in one micro-batch (ordered by their longest member); `key`
    names the budget in errors."""
    padded = _rounded(lengths, budget, multiple, key)
    groups = _groups(len(padded), group_size)
    longest_of = [max(padded[j] for j in g) for g in groups]
    bins: list[list[int]] = []
    longest = 0
    for g in _longest_first(longest_of):
        if group_size * longest_of[g] > budget:
            raise _group_budget_error(groups[g], group_size * longest_of[g], budget, key)
        # Longest first: the first group of a bin holds its longest sequence, so the padded size is rows * that.
        if bins and (len(bins[-1]) + group_size) * longest <= budget:
            bins[-1].extend(groups[g])
        else:
            bins.append(list(groups[g]))
            longest = longest_of[g]
    return MicroBatchPlan(bins, [int(x) for x in lengths], padded, budget, packed=False)


@dataclass(frozen=True)
class PackedMicroBatch:
    """One packed micro-batch in THD layout (a single row of concatenated sequences).

    input_ids     [1, L]   the sequences back to back, each padded to its rounded length with `pad_id`
    position_ids  [1, L]   restarting at 0 for every sequence (RoPE restarts per sequence)
    cu_seqlens    [n + 1]  int32 offsets of the rounded sequences (attention is block-diagonal over them)
    seq_lengths   [n]      real lengths; tokens past a sequence's real length are padding
    indices       [n]      original indices of the sequences
    L = the rounded sum, or the whole budget when `fixed_size` (pipeline parallelism sends fixed shapes)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_lengths: torch.Tensor
    indices: list[int]

    def unpack(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Per-token values [1, L] (or [L]) -> one [length] tensor per sequence, padding dropped."""
        flat = values.reshape(-1)
        starts = self.cu_seqlens[:-1].tolist()
        return [flat[s : s + n] for s, n in zip(starts, self.seq_lengths.tolist())]


def build_packed_micro_batch(
    plan: MicroBatchPlan,
    bin_index: int,
    sequences: Sequence[torch.Tensor],
    *,
    pad_id: int = 0,
    fixed_size: bool = False,
) -> PackedMicroBatch:
    """Lay out bin `bin_index` of a packing `plan`; `sequences[j]` = token ids [lengths[j]] of original sequence j."""
    if not plan.packed:
        raise ValueError("build_packed_micro_batch needs a plan from pack_sequences, not dynamic_batches")
    indices = plan.bins[bin_index]
    cu = plan.cu_seqlens(bin_index)
    total = plan.budget if fixed_size else int(cu[-1])
    input_ids = torch.full((1, total), pad_id, dtype=torch.long)
    position_ids = torch.zeros((1, total), dtype=torch.long)
    for start, j in zip(cu[:-1].tolist(), indices):
        tokens = sequences[j]
        if tokens.numel() != plan.lengths[j]:
            raise ValueError(f"sequence {j} has {tokens.numel()} tokens but the plan expects {plan.lengths[j]}")
        input_ids[0, start : start + tokens.numel()] = tokens
        position_ids[0, start : start + plan.padded_lengths[j]] = torch.arange(plan.padded_lengths[j])
    lengths = torch.tensor([plan.lengths[j] for j in indices], dtype=torch.int32)
    return PackedMicroBatch(input_ids, position_ids, cu, lengths, list(indices))


def context_parallel_chunks(length: int, cp_size: int, cp_rank: int) -> list[tuple[int, int]]:
    """The two [start, stop) token ranges of a sequence that CP rank `cp_rank` holds: the sequence is cut into
    2*cp equal chunks and rank r takes chunks r and 2*cp-1-r, so every rank gets the same causal-attention work."""
    if cp_size < 2:
        return [(0, length)]
    if length % (2 * cp_size):
        raise ValueError(
            f"a sequence of {length} tokens does not split into {2 * cp_size} chunks; round lengths "
            f"with mrl.parallel.layout.length_multiple"
        )
    chunk = length // (2 * cp_size)
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return [(first * chunk, (first + 1) * chunk), (second * chunk, (second + 1) * chunk)]


def local_token_positions(length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """[length / cp] positions (within its sequence) of the tokens CP rank `cp_rank` holds of a `length`-token
    sequence, in the order the rank lays them out: its first chunk, then its mirrored chunk."""
    return torch.cat([torch.arange(start, stop) for start, stop in context_parallel_chunks(length, cp_size, cp_rank)])
