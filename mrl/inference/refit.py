"""The one refit loop: weights move from a source to a sink, bucket by bucket, through a transport.

    sink.prepare_for_refit()                            a sleeping engine wakes its weights (lifecycle.py)
    for each bucket i of source.plan_buckets(bucket_bytes):
        payload = source.send_bucket(i, transport)      the sender gathers bucket i and packs it
        sink.load_payload(payload)                      every worker of every engine loads it
        transport.release(payload)                      before bucket i + 1 is gathered
    every tensor of the engine's checkpoint carried?    else sink.finish_refit(complete=False), RefitError
    sink.finish_refit(complete=True)                    e.g. drop prefix caches computed with the old weights
`on_sent` (optional) is called as soon as the source has handed over its last bucket, possibly while the sink still
loads it: asynchronous GRPO lets the policy train from then on.
Double-buffered transports (`in_flight` >= 2: shared-memory files, CUDA IPC buffers) with a sink that loads without
waiting overlap the two halves: bucket i + 1 is gathered while the sink loads bucket i (`_pipelined`).
With a meeting transport (collective broadcast), the sink starts receiving `transport.receiver_payload(sender)` and
the source sends bucket i at the same time, and both are awaited together; `sender` is the bucket's sender when the
transport has several (one per pipeline stage: `source.bucket_sender(i)`), else 0.

Sources: the sharded policy (mrl.policy.group.Policy: rank 0 gathers each bucket from the TP/PP shards, or with a
collective transport of one sender per pipeline stage each stage's first rank its own buckets) or
`LocalWeights` (a stream or state dict in this process: `update_weights` of every engine). Sinks: the vLLM engine
group (Ray actors), one vLLM engine, the Megatron engine. Peak extra memory is one bucket (one layer if a layer
exceeds the bucket) on each side (two on the sender's when double-buffered), unless the sink needs a whole state at
once (the Megatron engine validates a complete state before loading anything).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol, TypeGuard

import torch

from mrl.inference.buckets import iter_buckets
from mrl.inference.transports.base import NamedTensor, Payload, WeightTransport

if TYPE_CHECKING:
    from mrl.distributed import GroupFuture

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RefitStats:
    """What one weight update moved."""

    num_tensors: int
    num_buckets: int
    bytes: int
    max_bucket_bytes: int
    seconds: float

    def as_metrics(self) -> dict[str, float]:
        """The step-log entries of a refit (`timing/refit` in seconds, bytes moved, buckets)."""
        return {
            "timing/refit": self.seconds,
            "refit/bytes": float(self.bytes),
            "refit/buckets": float(self.num_buckets),
            "refit/max_bucket_bytes": float(self.max_bucket_bytes),
        }


class RefitError(RuntimeError):
    """A weight update that would leave an engine with a mix of old and new weights."""


class Pending(Protocol):
    """A call under way on a group of workers (`mrl.distributed.GroupFuture`)."""

    def result(self, timeout_s: Optional[float] = None) -> Any: ...


class WeightSource(Protocol):
    """Where the weights come from: HF-named full tensors, in buckets of whole layers."""

    def plan_buckets(self, bucket_bytes: int) -> Iterable[int]:
        """The bucket indices, in order; a stream source moves to bucket i when index i is produced."""
        ...

    def send_bucket(self, index: int, transport: WeightTransport) -> Payload:
        """Gather bucket `index` and pack it with `transport` (`transports.base.describe`d: names and bytes)."""
        ...


class RefitSink(Protocol):
    """An engine that loads refit payloads."""

    @property
    def expected_names(self) -> Optional[frozenset[str]]:
        """The HF tensor names a complete refit carries (None: not checked). Read only: engines compute it from
        their config (a plain attribute satisfies it as well)."""
        ...

    def prepare_for_refit(self) -> None:
        """Before the first bucket: the engine's weights resident (a sleeping engine wakes them)."""
        ...

    def load_payload(self, payload: Payload) -> None:
        """Every worker of the engine loads one bucket; returns once all did."""
        ...

    def finish_refit(self, complete: bool = True) -> None:
        """After the last bucket (complete) or a failed refit (not complete)."""
        ...


class AsyncRefitSink(RefitSink, Protocol):
    """A sink that loads without waiting: the refit loop pipelines bucket i + 1's gathering with its load."""

    def load_payload_async(self, payload: Payload) -> Pending: ...


class CollectiveWeightSource(WeightSource, Protocol):
    """A source whose sender can join a broadcast group (collective transport). Its calls under way are worker
    groups' futures: sender and receivers are awaited together (`mrl.distributed.wait_all`)."""

    def join_refit_group_async(self, transport: Any) -> GroupFuture: ...

    def send_bucket_async(self, index: int, transport: WeightTransport) -> GroupFuture: ...

    def refit_addresses(self) -> list[tuple[str, int]]:
        """One (address, port) per sender (pipeline stages: each stage's first rank; else the sender's alone)."""
        ...

    def bucket_sender(self, index: int) -> int:
        """The sender of bucket `index` (asked only of a transport with several senders, `WeightTransport.senders`)."""
        ...


class CollectiveRefitSink(AsyncRefitSink, Protocol):
    """A sink whose receivers can join a broadcast group (collective transport); futures as the source's."""

    @property
    def num_receivers(self) -> int:
        """The group's members besides the sender (one per engine)."""
        ...

    def join_refit_group_async(self, transport: Any) -> GroupFuture: ...

    def load_payload_async(self, payload: Payload) -> GroupFuture: ...


class LocalWeights:
    """`WeightSource` over HF-named tensors in this process: a stream yielding each layer's tensors together (an
    exporter; consumed lazily, one bucket at a time) or an in-memory state dict / `.items()` in any order."""

    def __init__(self, named_tensors: Iterable[NamedTensor] | Mapping[str, torch.Tensor]) -> None:
        self.named_tensors = named_tensors
        self._bucket: list[NamedTensor] = []

    def plan_buckets(self, bucket_bytes: int) -> Iterator[int]:
        for index, bucket in enumerate(iter_buckets(self.named_tensors, bucket_bytes)):
            self._bucket = bucket
            yield index
        self._bucket = []

    def send_bucket(self, index: int, transport: WeightTransport) -> Payload:
        return transport.pack(self._bucket)


def refit(
    source: WeightSource,
    sink: RefitSink,
    transport: WeightTransport,
    *,
    bucket_bytes: int,
    on_sent: Optional[Callable[[], None]] = None,
) -> RefitStats:
    """Move every bucket of `source` into `sink` through `transport` (see the module docstring). `on_sent` is called
    once the source has handed over its last bucket: its weights may change from then on, while the sink may still
    be loading that bucket (asynchronous GRPO trains the policy's next step meanwhile)."""
    start = time.perf_counter()
    names: set[str] = set()
    sizes: list[int] = []
    sink.prepare_for_refit()
    try:
        plan = source.plan_buckets(bucket_bytes)
        if transport.meets:
            moved = _met(source, sink, transport, plan, on_sent)
        elif _pipelines(sink, transport):
            moved = _pipelined(source, sink, transport, plan, on_sent)
        else:
            moved = _moved(source, sink, transport, plan, on_sent)
        for payload in moved:
            names.update(payload["names"])
            sizes.append(payload["bytes"])
    except BaseException:
        # Hazard: after a failed broadcast the receivers may still be blocked in it, and a call queued behind that
        # would never run; the caller shuts those engines down instead.
        if not transport.meets:
            _close_after_failure(sink)
        raise
    try:
        check_complete(sink.expected_names, names)
    except RefitError:
        sink.finish_refit(complete=False)  # not every weight came: the sink must not count it as a whole refit
        raise
    sink.finish_refit(complete=True)
    return RefitStats(len(names), len(sizes), sum(sizes), max(sizes, default=0), time.perf_counter() - start)


def _close_after_failure(sink: RefitSink) -> None:
    """`finish_refit(complete=False)` after a failed refit; its own failure (a sink that died fails this call too)
    is logged, so that the refit's first failure, the cause, is the one raised."""
    try:
        sink.finish_refit(complete=False)
    except Exception as error:  # noqa: BLE001 -- the failure being raised is the refit's
        log.warning("closing the failed refit: %s", error)


def _moved(
    source: WeightSource,
    sink: RefitSink,
    transport: WeightTransport,
    plan: Iterable[int],
    on_sent: Optional[Callable[[], None]],
) -> Iterator[Payload]:
    """One bucket at a time from the source into every worker of the sink (`on_sent` after the last is loaded)."""
    for index in plan:
        payload = source.send_bucket(index, transport)
        try:
            sink.load_payload(payload)
        finally:
            transport.release(payload)
        yield payload
    if on_sent is not None:
        on_sent()


def _met(
    source: WeightSource,
    sink: RefitSink,
    transport: WeightTransport,
    plan: Iterable[int],
    on_sent: Optional[Callable[[], None]],
) -> Iterator[Payload]:
    """Sender and receivers meet in one broadcast per bucket: both start, and both end before the next bucket (a
    sender blocked in a broadcast whose receiver died would never return). Only the last bucket's receivers may
    still be loading when `on_sent` is called: its sender is done, and a receiver that fails before then is
    raised at once (`result_watching`)."""
    from mrl.distributed import result_watching, wait_all

    if not (_is_collective_source(source) and _is_collective_sink(sink)):
        raise TypeError(
            f"a {transport.kind} transport needs a CollectiveWeightSource and a CollectiveRefitSink, "
            f"got {type(source).__name__} and {type(sink).__name__}"
        )
    indices = list(plan)  # a collective source plans from its config alone (`Policy.plan_buckets`: a range)
    several = transport.senders > 1  # one sender per pipeline stage: the engines meet each bucket's own
    for position, index in enumerate(indices):
        sent = source.send_bucket_async(index, transport)
        sender = source.bucket_sender(index) if several else 0
        received = sink.load_payload_async(transport.receiver_payload(sender))
        if position < len(indices) - 1 or on_sent is None:
            payload = wait_all([sent, received])[0]
        else:
            payload = result_watching(sent, [received])
            on_sent()
            received.result()
        transport.release(payload)  # as every path does once the receivers have the bucket (a broadcast: no-op)
        yield payload
    if not indices and on_sent is not None:
        on_sent()


def _pipelines(sink: RefitSink, transport: WeightTransport) -> TypeGuard[AsyncRefitSink]:
    """Whether bucket i + 1 may be gathered while the sink loads bucket i: the transport keeps two payloads apart
    (`in_flight` >= 2: two files, two device buffers) and the sink can load without waiting."""
    return not transport.meets and transport.in_flight >= 2 and hasattr(sink, "load_payload_async")


# Optional capabilities have protocols of their own (AsyncRefitSink, CollectiveWeightSource, CollectiveRefitSink),
# which sources and sinks satisfy structurally, without inheriting them: the loop tests for the capability's member.
def _is_collective_source(source: WeightSource) -> TypeGuard[CollectiveWeightSource]:
    return hasattr(source, "send_bucket_async")


def _is_collective_sink(sink: RefitSink) -> TypeGuard[CollectiveRefitSink]:
    return hasattr(sink, "load_payload_async")


def _pipelined(
    source: WeightSource,
    sink: AsyncRefitSink,
    transport: WeightTransport,
    plan: Iterable[int],
    on_sent: Optional[Callable[[], None]],
) -> Iterator[Payload]:
    """Double-buffered: the source gathers and packs bucket i + 1 while every worker of the sink loads bucket i;
    bucket i is released once loaded, before bucket i + 2 is packed (at most two payloads alive). `on_sent` comes
    after the last bucket is packed, while the sink loads it."""
    loading: Optional[tuple[Payload, Pending]] = None
    try:
        for index in plan:
            payload = source.send_bucket(index, transport)
            previous, loading = loading, None
            try:
                if previous is not None:
                    _finish_loading(transport, *previous)
            except BaseException:
                transport.release(payload)  # packed, never handed to the sink
                raise
            loading = (payload, sink.load_payload_async(payload))
            yield payload
        if on_sent is not None:
            on_sent()
        previous, loading = loading, None
        if previous is not None:
            _finish_loading(transport, *previous)
    finally:
        if loading is not None:  # a failure while a load was under way: let it end, then free its payload
            try:
                loading[1].result()
            except BaseException:  # noqa: BLE001 -- the first failure is the one raised
                pass
            transport.release(loading[0])


def _finish_loading(transport: WeightTransport, payload: Payload, pending: Pending) -> None:
    try:
        pending.result()
    finally:
        transport.release(payload)


def check_complete(expected_names: Optional[frozenset[str]], seen: set[str]) -> None:
    """Raise `RefitError` when a refit did not carry every tensor of the engine's checkpoint (None: not checked)."""
    missing = sorted(expected_names - seen) if expected_names is not None else []
    if missing:
        raise RefitError(
            f"refit carried {len(seen)} tensors, missing {len(missing)} of the engine's checkpoint "
            f"(first: {missing[:5]}); the policy export must yield every HF tensor of the model"
        )
