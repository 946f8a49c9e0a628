"""The parallel layout of the policy and every rule it must obey, each written once.

Pure Python (no torch): the config check (`mrl.config.checks`) reads these rules before anything starts, and the
runtime (process groups, packing, the policy worker) applies the same functions, so a layout the check accepts is
a layout the workers run. A rule returns `Violation`s naming the config key to change; the config turns them into
`ConfigError`s, the runtime raises them.

Megatron-Core orders ranks tp -> cp -> dp -> pp (tensor parallel innermost). With world size W:
    dp = W / (tp * pp * cp)
Experts are laid out separately over the same ranks with expert-tensor-parallel = tp (Megatron's default):
    expert_dp = W / (tp * ep * pp), which needs ep to divide dp * cp.
Sequence lengths: with sequence parallelism each sequence is split over the tp ranks, with context parallelism
into 2 * cp chunks (rank i takes chunks i and 2cp-1-i, which balances causal attention), so every sequence (and,
packed, every sequence of a pack) is a multiple of `length_multiple` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Violation:
    """One broken rule: the config key to change, what is wrong, and what would be right."""

    key: str
    message: str
    given: Any = None
    allowed: Optional[str] = None
    fix: Optional[str] = None

    def __str__(self) -> str:
        extra = [
            f"given {self.given!r}" if self.given is not None else "",
            f"allowed: {self.allowed}" if self.allowed else "",
            f"fix: {self.fix}" if self.fix else "",
        ]
        return f"{self.key}: {self.message}" + "".join(f"; {part}" for part in extra if part)


class ParallelLayoutError(ValueError):
    """The requested TP/PP/CP/EP/SP combination cannot be laid out on the given world size."""


def length_multiple(tp: int = 1, cp: int = 1, *, sequence_parallel: bool = False) -> int:
    """Every sequence's length (padded) is a multiple of this: tp with sequence parallelism, times 2 * cp with
    context parallelism (see the module docstring)."""
    if tp < 1 or cp < 1:
        raise ValueError(f"parallel sizes must be >= 1, got tp={tp}, cp={cp}")
    return (tp if sequence_parallel else 1) * (2 * cp if cp > 1 else 1)


def layout_violations(
    *, tp: int, pp: int, cp: int, ep: int, sequence_parallel: bool, world_size: int
) -> list[Violation]:
    """Every rule of Megatron's layout that the sizes break."""
    out: list[Violation] = []
    sizes = {
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "context_parallel_size": cp,
        "expert_parallel_size": ep,
    }
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            out.append(Violation(f"policy.parallel.{name}", "must be a positive integer", value))
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        out.append(
            Violation("cluster.devices_per_node", "the policy's world size must be a positive integer", world_size)
        )
    if out:
        return out
    if world_size % (tp * pp * cp):
        out.append(
            Violation(
                "policy.parallel",
                f"policy world size {world_size} is not divisible by tp*pp*cp = "
                f"{tp * pp * cp} (tp={tp}, pp={pp}, cp={cp})",
                fix="change the parallel sizes, or the devices (cluster.devices_per_node)",
            )
        )
    elif (world_size // (tp * pp)) % ep:
        out.append(
            Violation(
                "policy.parallel.expert_parallel_size",
                f"expert parallel size {ep} must divide dp*cp = {world_size // (tp * pp)} (experts are "
                "spread over the data- and context-parallel ranks of each tp*pp shard)",
                ep,
                allowed=f"a divisor of {world_size // (tp * pp)}",
            )
        )
    if sequence_parallel and tp == 1:
        out.append(
            Violation(
                "policy.parallel.sequence_parallel",
                "sequence parallelism needs tensor parallelism "
                "(it splits each sequence over the tensor-parallel ranks)",
                True,
                fix="set policy.parallel.tensor_parallel_size > 1 or sequence_parallel=false",
            )
        )
    return out


def micro_batching_violations(
    *,
    packing: bool,
    dynamic_batching: bool,
    tokens_per_microbatch: int,
    pp: int,
    multiple: int,
    budget_key: str = "policy.sequence_packing.tokens_per_microbatch",
) -> list[Violation]:
    """Rules of token-budget micro-batches (`policy.sequence_packing` / `policy.dynamic_batching`): `multiple` is
    `length_multiple` of the layout, `tokens_per_microbatch` the budget of whichever is enabled (named by
    `budget_key`: the training budget or a logprob pass's)."""
    out: list[Violation] = []
    if packing and dynamic_batching:
        out.append(
            Violation(
                "policy.dynamic_batching.enabled",
                "sequence packing and dynamic batching are alternatives; enable one",
                True,
                fix="set policy.dynamic_batching.enabled or policy.sequence_packing.enabled to false",
            )
        )
    elif dynamic_batching and pp > 1:
        out.append(
            Violation(
                "policy.dynamic_batching.enabled",
                "dynamic batching makes micro-batches of different "
                "shapes, which pipeline parallelism cannot send between stages",
                True,
                fix="use policy.sequence_packing (packs are padded to a fixed size) with pipeline parallelism",
            )
        )
    elif packing and pp > 1 and tokens_per_microbatch % multiple:
        out.append(
            Violation(
                budget_key,
                "with pipeline parallelism every pack "
                "is padded to the budget, which must split over the sequence-splitting ranks "
                "(tp with sequence parallel x 2*cp)",
                tokens_per_microbatch,
                allowed=f"a multiple of {multiple}",
            )
        )
    return out


def pipeline_split_violations(*, layers: int, pp: int, first: Optional[int], last: Optional[int]) -> list[Violation]:
    """Decoder layers over pipeline stages: the first and last stage may hold a given number, the stages between
    them an equal share of the rest (Megatron's num_layers_in_{first,last}_pipeline_stage)."""
    if pp == 1:
        given = [k for k, v in (("first_stage_layers", first), ("last_stage_layers", last)) if v is not None]
        return [
            Violation(
                f"policy.parallel.{k}",
                "needs pipeline parallelism",
                fix="remove it or set policy.parallel.pipeline_parallel_size > 1",
            )
            for k in given
        ]
    middle_layers = layers - (first or 0) - (last or 0)
    middle_stages = pp - (first is not None) - (last is not None)
    if middle_layers < 0 or (middle_stages == 0 and middle_layers) or (middle_stages and middle_layers % middle_stages):
        split = f"first {first}, last {last}" if first or last else "an even split"
        return [
            Violation(
                "policy.parallel.pipeline_parallel_size",
                f"{layers} decoder layers do not split over {pp} pipeline stages ({split})",
                pp,
                fix="choose a size whose stages hold equal numbers of layers, or set "
                "policy.parallel.first_stage_layers / last_stage_layers",
            )
        ]
    return []


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of each parallel dimension; `dp` is derived. Construction validates the combination.

    Fields mirror `policy.parallel` in the config (tensor/pipeline/context/expert parallel sizes,
    sequence_parallel) plus the number of ranks the policy runs on.
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    world_size: int = 1

    def __post_init__(self) -> None:
        problems = layout_violations(
            tp=self.tp,
            pp=self.pp,
            cp=self.cp,
            ep=self.ep,
            sequence_parallel=self.sequence_parallel,
            world_size=self.world_size,
        )
        if problems:
            raise ParallelLayoutError(
                "invalid parallel layout " + self.describe() + ":\n- " + "\n- ".join(str(p) for p in problems)
            )

    @property
    def dp(self) -> int:
        """Data-parallel size: the ranks that hold the same model shard and see different data."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of the expert weights (expert tensor parallel = tp, Megatron's default)."""
        return self.world_size // (self.tp * self.ep * self.pp)

    @property
    def length_multiple(self) -> int:
        """What every sequence's padded length is a multiple of under this layout (`length_multiple`)."""
        return length_multiple(self.tp, self.cp, sequence_parallel=self.sequence_parallel)

    def describe(self) -> str:
        return (
            f"(world_size={self.world_size}, tp={self.tp}, pp={self.pp}, cp={self.cp}, ep={self.ep}, "
            f"sequence_parallel={self.sequence_parallel})"
        )
