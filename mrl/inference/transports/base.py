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
"""

from __future__ import annotations

from typing import Any, Protocol

from mrl.inference.buckets import NamedTensor

Payload = dict[str, Any]


class WeightTransport(Protocol):
    """How one bucket travels from its sender to the receivers (one implementation per file of this package)."""

    kind: str
    """The payload tag `unpack_payload` dispatches on."""
    meets: bool
    """Sender and receivers meet in a collective: the receivers must be receiving while the sender packs."""
    in_flight: int
    """Payloads that may be alive at once: 2 lets the refit loop pack bucket i + 1 while bucket i is loaded."""

    def pack(self, bucket: list[NamedTensor]) -> Payload:
        """Sender side: the payload of one bucket (for a meeting transport: send it, then return the announcement)."""
        ...

    def receiver_payload(self, sender: int = 0) -> Payload:
        """Meeting transports: what every receiver gets before sender `sender` packs (0 unless the transport has
        several senders: one per pipeline stage). Others raise."""
        ...

    def release(self, payload: Payload) -> None:
        """Controller side: free what `pack` created, once every receiver has loaded it (also after a failure)."""
        ...


def describe(payload: Payload, bucket: list[NamedTensor]) -> Payload:
    """The payload with what the refit loop counts: the bucket's tensor names and bytes (sender side)."""
    return {
        **payload,
        "names": [name for name, _ in bucket],
        "bytes": sum(t.numel() * t.element_size() for _, t in bucket),
    }
