"""The transport interface (the receiver-side dispatcher, `unpack_payload`, is the package's).

A transport moves one refit bucket, a list of (HF name, tensor), from the process that holds it (the sender: the
policy's rank 0, or the caller of `update_weights`) to the engine's workers (the receivers):
    sender       payload = transport.pack(bucket)        a small plain dict tagged with `kind`
    controller   hands the payload to every receiver, then transport.release(payload)
    receiver     unpack_payload(payload) -> [(name, tensor)]   dispatched on `kind` to the module that made it
                                                           (mrl.inference.transports.unpack_payload)
The payload is a plain dict because under vLLM multiprocessing it is serialised with msgpack (tensors inside it
would arrive as nested lists). A transport object travels to the sender (a Ray actor) by pickle, so it holds
settings only, never open handles.

Transports whose sender and receivers meet in a collective (`meets = True`: the broadcast group of
collective.py) cannot hand a payload over after packing: the receivers must already be receiving while the sender
packs. They announce the payload receivers get (`receiver_payload(sender)`) and the refit loop starts both sides at
once.

A transport is the run's weight-sync mode, chosen once (`make_transport` from the engine's config, or
`collective.connect`), and it owns the sender strategy: which policy ranks pack a bucket (`sending`, `pack`,
`pack_on_ranks`), how the controller joins their return values (`merge`), the pipeline depth (`in_flight`), whether
sender and receivers meet (`meets`, `senders`, `receiver_payload`) and freeing (`release`). The refit loop and the
policy ask it these and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Protocol

from mrl.inference.buckets import NamedTensor

Payload = dict[str, Any]

Sending = Literal["rank0", "every_rank", "expert_parts", "stages"]
"""Which policy ranks pack a bucket (`WeightTransport.sending`); in every case the controller joins the ranks' return
values with `WeightTransport.merge`:
    rank0         every rank takes part in gathering the bucket; global rank 0 alone packs it (`pack`), the others
                  return None
    every_rank    as rank0, then every rank packs: rank 0's bucket reaches each rank inside `pack_on_ranks` (CUDA
                  IPC: each GPU's engine worker opens its own rank's buffer)
    expert_parts  each rank gathers and packs its own part (`ShardedExporter.bucket_part`: rank 0 the dense tensors
                  and its experts, each other expert-parallel rank's first rank its experts); None from a rank with
                  no part
    stages        only the bucket's owner stage gathers it (no pipeline broadcast); the stage's first rank packs it
                  as sender `owner` (`pack(bucket, sender=owner)`), the others return None"""


@dataclass(frozen=True)
class SenderLayout:
    """What a transport's sender strategy depends on: the policy's parallel layout."""

    pipeline_stages: int
    expert_parallel: int


class WeightTransport(Protocol):
    """How one bucket travels from its sender(s) to the receivers (one implementation per file of this package).
    Everything the refit loop, the policy's controller (mrl/policy/group.py) and its ranks (mrl/policy/worker.py)
    ask of a transport is declared here; `TransportDefaults` holds what a transport with nothing to do answers."""

    kind: str
    """The payload tag `unpack_payload` dispatches on."""
    meets: bool
    """Sender and receivers meet in a collective: the receivers must be receiving while the sender packs."""
    in_flight: int
    """Pipeline depth: payloads that may be alive at once (2 lets the refit loop pack bucket i + 1 while bucket i
    is loaded)."""

    @property
    def senders(self) -> int:
        """How many senders the receivers may hear from (one per pipeline stage of a collective transport made with
        `refit_addresses`, else 1): the refit loop asks the source for each bucket's sender when more than 1."""
        ...

    def sending(self, layout: SenderLayout) -> Sending:
        """Which ranks of a policy laid out as `layout` pack a bucket (see `Sending`)."""
        ...

    def pack(self, bucket: list[NamedTensor], sender: int = 0) -> Payload:
        """Sender side: the payload of one bucket (for a meeting transport: send it as sender `sender`, then return
        the announcement)."""
        ...

    def pack_on_ranks(self, bucket: Optional[list[NamedTensor]]) -> Payload:
        """`every_rank` transports, collective over the policy's ranks: rank 0 holds `bucket` (None elsewhere); every
        rank returns its part of the payload. Others raise."""
        ...

    def merge(self, parts: list[Optional[Payload]]) -> Payload:
        """Controller side: the policy ranks' return values of one bucket (rank order, None from a rank that packed
        nothing) as the one payload the receivers get."""
        ...

    def receiver_payload(self, sender: int = 0) -> Payload:
        """Meeting transports: what every receiver gets before sender `sender` packs (0 unless the transport has
        several senders: one per pipeline stage). Others raise."""
        ...

    def release(self, payload: Payload) -> None:
        """Controller side: free what `pack` created, once every receiver has loaded it (also after a failure)."""
        ...


class TransportDefaults:
    """The answers of a transport that hands over a whole bucket packed by rank 0 after packing."""

    kind: str

    @property
    def senders(self) -> int:
        return 1

    def sending(self, layout: SenderLayout) -> Sending:
        return "rank0"

    def pack_on_ranks(self, bucket: Optional[list[NamedTensor]]) -> Payload:
        raise TypeError(f"the {self.kind} transport is packed by one rank (`pack`), not on every rank")

    def merge(self, parts: list[Optional[Payload]]) -> Payload:
        """The one rank's payload (rank0 and stages: exactly one rank packs)."""
        return only_part(parts)

    def receiver_payload(self, sender: int = 0) -> Payload:
        raise TypeError(f"the {self.kind} transport hands each bucket over after packing; it announces nothing")


def only_part(parts: list[Optional[Payload]]) -> Payload:
    """The one payload among the ranks' return values (the others None)."""
    packed = [part for part in parts if part is not None]
    if len(packed) != 1:
        raise ValueError(f"{len(packed)} policy ranks packed a bucket that exactly one rank packs")
    return packed[0]


def one_sender(sender: int, kind: str) -> None:
    if sender != 0:
        raise ValueError(f"the {kind} transport has one sender (0), not {sender}")


def describe(payload: Payload, bucket: list[NamedTensor]) -> Payload:
    """The payload with what the refit loop counts: the bucket's tensor names and bytes (sender side)."""
    return {
        **payload,
        "names": [name for name, _ in bucket],
        "bytes": sum(t.numel() * t.element_size() for _, t in bucket),
    }
