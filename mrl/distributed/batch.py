"""Splitting a batch over data-parallel ranks and merging per-rank results: the sharding contract of
`WorkerGroup.shard_and_run`, kept pure (no Ray) so it is tested on its own.

Contract
--------
A batch is a mapping (`dict[str, ...]`) or a dataclass instance; containers nest (a dict value may be a dict or a
dataclass). Its leaves are classified as:

- **sharded along axis 0**: `torch.Tensor` and `numpy.ndarray` with at least one dimension, and `list`s
  (per-sample Python data such as texts or message logs). Every sharded leaf must have the same length B on axis 0.
- **replicated** (every shard gets the same object): everything else -- scalars, strings, `None`, tuples,
  0-dim arrays -- and dataclass fields declared with `replicated_field()` even when they hold arrays.

Shard `d` of `D` holds rows `[start_d, end_d)` of every sharded leaf, with contiguous blocks in rank order, so
concatenating the shards in order gives the batch back. `B % D != 0` is an error unless `allow_uneven=True`; then
the first `B % D` shards hold one extra row (numpy.array_split sizes). `B < D` is always an error: a rank with an
empty shard would desynchronise the collectives of data-parallel training.

Merging (results of the data-parallel leaders, in data-parallel order) is the inverse: sharded leaves are
concatenated along axis 0, lists are concatenated, and any other leaf becomes the common value when all shards hold
an equal value, else a list with one entry per shard.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

REPLICATED = "mrl_replicated"


def replicated_field(**kwargs: Any) -> Any:
    """A dataclass field that every data-parallel rank receives whole, even if it holds an array."""
    metadata = dict(kwargs.pop("metadata", {}) or {})
    metadata[REPLICATED] = True
    return dataclasses.field(metadata=metadata, **kwargs)


def _is_tensor(value: Any) -> bool:
    # Checked by module name so this file does not import torch (worker processes that never use torch stay light).
    return type(value).__module__.startswith("torch") and hasattr(value, "shape") and hasattr(value, "dim")


def _is_sharded_leaf(value: Any) -> bool:
    if isinstance(value, list):
        return True
    if isinstance(value, np.ndarray) or _is_tensor(value):
        return len(value.shape) >= 1
    return False


def _is_container(value: Any) -> bool:
    return isinstance(value, dict) or (dataclasses.is_dataclass(value) and not isinstance(value, type))


def _children(container: Any) -> list[tuple[str, Any, bool]]:
    """(name, value, replicated) of each child of a dict or dataclass."""
    if isinstance(container, dict):
        return [(key, value, False) for key, value in container.items()]
    return [
        (field.name, getattr(container, field.name), bool(field.metadata.get(REPLICATED, False)))
        for field in dataclasses.fields(container)
    ]


def _rebuild(container: Any, values: dict[str, Any]) -> Any:
    """A container of the same type with new child values. Dataclasses are copied field by field without calling
    __init__/__post_init__, which may validate types that a half-built shard does not have yet."""
    if isinstance(container, dict):
        return type(container)(values) if type(container) is not dict else dict(values)
    clone = object.__new__(type(container))
    for field in dataclasses.fields(container):
        object.__setattr__(clone, field.name, values[field.name])
    return clone


def _sharded_lengths(batch: Any, path: str = "") -> dict[str, int]:
    """Leading length of every sharded leaf, keyed by its dotted path."""
    lengths: dict[str, int] = {}
    for name, value, replicated in _children(batch):
        child = f"{path}{name}"
        if replicated:
            continue
        if _is_container(value):
            lengths.update(_sharded_lengths(value, child + "."))
        elif _is_sharded_leaf(value):
            lengths[child] = len(value)
    return lengths


def batch_size(batch: Any) -> int:
    """The common axis-0 length B of the sharded leaves; errors name the leaves that disagree."""
    if not _is_container(batch):
        raise TypeError(
            f"a batch to shard must be a dict or a dataclass instance, got {type(batch).__name__}; wrap it, e.g. "
            "{'input_ids': tensor}"
        )
    lengths = _sharded_lengths(batch)
    if not lengths:
        raise ValueError(
            "the batch has no tensor, array or list to shard along axis 0 (replicated values go in the method's "
            "other arguments)"
        )
    sizes = set(lengths.values())
    if len(sizes) > 1:
        listing = ", ".join(f"{name}: {size}" for name, size in sorted(lengths.items()))
        raise ValueError(f"sharded batch fields disagree on their axis-0 size ({listing}); they must all be equal")
    return sizes.pop()


def shard_bounds(size: int, num_shards: int, allow_uneven: bool = False) -> list[tuple[int, int]]:
    """[start, end) of each shard's rows; contiguous, in order, covering 0..size."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if size < num_shards:
        raise ValueError(
            f"a batch of {size} rows cannot feed {num_shards} data-parallel ranks (each needs at least one row); "
            f"use a batch of at least {num_shards} rows"
        )
    if size % num_shards and not allow_uneven:
        raise ValueError(
            f"a batch of {size} rows does not split evenly over {num_shards} data-parallel ranks; pad it to a "
            f"multiple of {num_shards} or pass allow_uneven=True (the first {size % num_shards} ranks then get one "
            "row more)"
        )
    base, extra = divmod(size, num_shards)
    bounds, start = [], 0
    for shard in range(num_shards):
        end = start + base + (1 if shard < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _slice(batch: Any, start: int, end: int) -> Any:
    values = {}
    for name, value, replicated in _children(batch):
        if replicated:
            values[name] = value
        elif _is_container(value):
            values[name] = _slice(value, start, end)
        elif _is_sharded_leaf(value):
            values[name] = value[start:end]
        else:
            values[name] = value
    return _rebuild(batch, values)


def split_batch(batch: Any, num_shards: int, allow_uneven: bool = False) -> list[Any]:
    """Split `batch` into `num_shards` shards along axis 0 (see the module docstring for the contract).

    Slices of tensors and arrays are views; nothing is copied until the shards are serialised for the workers.
    """
    bounds = shard_bounds(batch_size(batch), num_shards, allow_uneven)
    return [_slice(batch, start, end) for start, end in bounds]


def _concat(values: Sequence[Any]) -> Any:
    first = values[0]
    if isinstance(first, list):
        return [item for value in values for item in value]
    if isinstance(first, np.ndarray):
        return np.concatenate(values, axis=0)
    import torch

    return torch.cat(list(values), dim=0)


def _all_equal(values: Sequence[Any]) -> bool:
    first = values[0]
    for value in values[1:]:
        try:
            same = value is first or bool(value == first)
        except (TypeError, ValueError, RuntimeError):  # arrays without a single truth value, odd __eq__
            return False
        if not same:
            return False
    return True


def _merge_leaves(values: Sequence[Any]) -> Any:
    if all(_is_sharded_leaf(value) for value in values) and len({type(value) for value in values}) == 1:
        return _concat(values)
    return values[0] if _all_equal(values) else list(values)


def merge_shards(shards: Sequence[Any]) -> Any:
    """Inverse of `split_batch` for results gathered in data-parallel order (see the module docstring)."""
    if not shards:
        raise ValueError("no shard results to merge")
    first = shards[0]
    if not _is_container(first):
        return _merge_leaves(shards)
    if any(type(shard) is not type(first) for shard in shards):
        kinds = sorted({type(shard).__name__ for shard in shards})
        raise TypeError(f"cannot merge results of different types across data-parallel ranks: {kinds}")
    values = {}
    for name, _, replicated in _children(first):
        try:
            column = [shard[name] if isinstance(shard, dict) else getattr(shard, name) for shard in shards]
        except KeyError as missing:
            raise KeyError(f"result key {missing} is missing on some data-parallel ranks") from None
        values[name] = column[0] if replicated else merge_shards(column)
    return _rebuild(first, values)
