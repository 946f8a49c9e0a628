"""Collective transport: a broadcast group between the policy's rank 0 and every engine (non-colocated refit).

Data flow (engines on devices or nodes of their own, where a shared-memory file is not an option):
    set-up   `connect(source, sink)`: the source names an address and a free port on its sending rank (the policy's
             rank 0); the sender joins as member 0, engine e (its Ray actor) as member 1 + e, of a process group
             of their own: a TCPStore and a gloo group (an NCCL group where CUDA is present: the same three
             broadcasts, of device buffers), apart from the policy's and vLLM's worlds. Once per (source, sink) pair.
    bucket   sender: [(name, tensor)] -> one flat byte buffer + a JSON header (names, dtypes, shapes, offsets)
             broadcast(header size) -> broadcast(header) -> broadcast(buffer)         every member takes part
             receiver: tensors are views of its received buffer -> the engine's own refit path (in-process reload,
             or a shared-memory file for an engine whose vLLM workers run in other processes)
The sender's `pack` and the receivers' `unpack` meet in the broadcasts (`meets = True`): the refit loop starts the
receivers on `receiver_payload()` and the sender together, so a bucket costs one transfer, not a round trip
through the controller. Peak extra memory: one bucket on each side (buffers reused from bucket to bucket).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Optional

import torch

from mrl.inference.buckets import flat_layout, flat_views, pack_flat
from mrl.inference.transports.base import NamedTensor, Payload, describe
from mrl.parallel import collectives
from mrl.parallel.groups import standalone_group

if TYPE_CHECKING:
    from mrl.inference.refit import CollectiveRefitSink, CollectiveWeightSource

KIND = "collective"
#: Groups this process belongs to, by name (a process may serve several engines / runs in tests).
_GROUPS: dict[str, Any] = {}
_DEVICES: dict[str, torch.device] = {}
_BUFFERS: dict[str, torch.Tensor] = {}
Backend = Literal["gloo", "nccl"]


@dataclass(frozen=True)
class CollectiveTransport:
    """One refit broadcast group: `size` members, member 0 (the sender) hosting the store at address:port."""

    group: str
    address: str
    port: int
    size: int
    backend: Backend = "gloo"
    """nccl: members broadcast device buffers (each member on its current CUDA device); not run on CPU machines."""

    kind = KIND
    meets = True
    in_flight = 1

    def join(self, member: int, timeout_s: float = 600.0) -> None:
        """Join the group as `member` (run in the member's own process). Blocks until every member joined."""
        join_group(self.group, self.address, self.port, member, self.size, timeout_s, backend=self.backend)

    def pack(self, bucket: list[NamedTensor]) -> Payload:
        send_bucket(self.group, bucket)
        return describe(self.receiver_payload(), bucket)

    def receiver_payload(self) -> Payload:
        return {"kind": KIND, "group": self.group}

    def release(self, payload: Payload) -> None:
        """Nothing to free: the buffers stay for the next bucket."""


def unpack(payload: Payload) -> list[NamedTensor]:
    return receive_bucket(payload["group"])


def connect(source: "CollectiveWeightSource", sink: "CollectiveRefitSink",
            backend: Optional[Backend] = None) -> CollectiveTransport:
    """Make the broadcast group of `source`'s sender and `sink`'s receivers (both join at once: they meet in the
    store's rendezvous). `backend` defaults to nccl where this process sees CUDA (a GPU cluster), else gloo."""
    from mrl.distributed import wait_all

    address, port = source.refit_address()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    transport = CollectiveTransport(f"mrl-refit-{uuid.uuid4().hex[:12]}", address, port, 1 + sink.num_receivers,
                                    backend)
    wait_all([source.join_refit_group_async(transport), sink.join_refit_group_async(transport)])
    return transport


def join_group(name: str, address: str, port: int, member: int, size: int, timeout_s: float = 600.0, *,
               backend: Backend = "gloo") -> None:
    """Join refit group `name` as `member` of `size` (member 0 hosts the store). Blocks until all joined."""
    _GROUPS[name] = standalone_group(address, port, member, size, backend, timeout_s)
    _DEVICES[name] = collectives.group_device(_GROUPS[name])  # NCCL: this member's current CUDA device


def leave_group(name: str) -> None:
    _GROUPS.pop(name, None)
    _DEVICES.pop(name, None)
    _BUFFERS.pop(name, None)


def _broadcast(name: str, tensor: torch.Tensor) -> torch.Tensor:
    group = _GROUPS.get(name)
    if group is None:
        raise RuntimeError(f"this process is not in refit group {name!r}: join it first (CollectiveTransport.join)")
    collectives.broadcast(tensor, 0, group)  # from member 0; the buffers are on the group's device already
    return tensor


def _buffer(name: str, size: int) -> torch.Tensor:
    """The group's byte buffer, grown to the largest bucket and reused: a fresh allocation per bucket left the
    engine's memory growing refit after refit (allocator fragmentation). Safe because the engine copies the
    tensors into its parameters before the next bucket is received."""
    buffer = _BUFFERS.get(name)
    if buffer is None or buffer.numel() < size:
        buffer = _BUFFERS[name] = torch.empty(size, dtype=torch.uint8, device=_DEVICES[name])
    return buffer[:size]


def send_bucket(name: str, bucket: list[NamedTensor]) -> int:
    """Member 0: broadcast one bucket; returns the bytes sent."""
    header, size = flat_layout(bucket)
    buffer = _buffer(name, size)
    pack_flat(bucket, header, buffer)
    device = _DEVICES[name]
    encoded = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8).to(device)
    _broadcast(name, torch.tensor([len(encoded), size], dtype=torch.long, device=device))
    _broadcast(name, encoded)
    _broadcast(name, buffer)
    return size


def receive_bucket(name: str) -> list[NamedTensor]:
    """Members 1..: receive one bucket as (name, tensor) views of the received buffer."""
    device = _DEVICES[name]
    sizes = _broadcast(name, torch.zeros(2, dtype=torch.long, device=device)).tolist()
    encoded = _broadcast(name, torch.empty(sizes[0], dtype=torch.uint8, device=device))
    buffer = _broadcast(name, _buffer(name, sizes[1]))
    return flat_views(buffer, json.loads(bytes(encoded.tolist()).decode()))
