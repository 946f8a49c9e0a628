"""The refit loop shared by every vLLM-fed backend: bucket, pack, load everywhere, release, check completeness.

    named HF tensors --iter_buckets(bucket_bytes)--> bucket --transport.pack--> payload
    --load(payload) (every worker of every engine)--> transport.release(payload) --> next bucket

Peak extra memory is one bucket (one layer if a layer exceeds the bucket). The caller resets the engines' prefix
caches afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Optional

import torch

from mrl.inference.buckets import NamedTensor, iter_buckets, tensor_bytes
from mrl.inference.interface import RefitStats
from mrl.inference.transports.base import Payload, WeightTransport


class RefitError(RuntimeError):
    """A weight update that would leave an engine with a mix of old and new weights."""


def stream_weights(
    named_tensors: Iterable[NamedTensor] | Mapping[str, torch.Tensor],
    *,
    bucket_bytes: int,
    transport: WeightTransport,
    load: Callable[[Payload], None],
    expected_names: Optional[frozenset[str]],
) -> RefitStats:
    """Send `named_tensors` bucket by bucket through `transport`; `load(payload)` returns once every worker loaded it.

    `named_tensors`: a stream of (HF name, tensor) yielding each layer's tensors together (an exporter), or an
    in-memory state dict / `.items()` in any order.

    Raises `RefitError` when `expected_names` (the engine checkpoint's tensor names; None = unknown, not checked)
    holds names the stream did not carry: a partial refit would silently generate from mixed weights.
    """
    start = time.perf_counter()
    seen: set[str] = set()
    num_tensors = num_buckets = total = largest = 0
    for bucket in iter_buckets(named_tensors, bucket_bytes):
        seen.update(name for name, _ in bucket)
        payload = transport.pack(bucket)
        try:
            load(payload)
        finally:
            transport.release(payload)
        size = sum(tensor_bytes(t) for _, t in bucket)
        num_tensors += len(bucket)
        num_buckets += 1
        total += size
        largest = max(largest, size)
    check_complete(expected_names, seen)
    return RefitStats(num_tensors, num_buckets, total, largest, time.perf_counter() - start)


def check_complete(expected_names: Optional[frozenset[str]], seen: set[str]) -> None:
    """Raise `RefitError` when a refit did not carry every tensor of the engine's checkpoint (None: not checked)."""
    missing = sorted(expected_names - seen) if expected_names is not None else []
    if missing:
        raise RefitError(
            f"refit carried {len(seen)} tensors but not {len(missing)} of the engine's checkpoint "
            f"(first: {missing[:5]}); the policy export must yield every HF tensor of the model"
        )
