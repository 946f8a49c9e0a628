"""Collective transport: a broadcast group between the policy's sender(s) and every engine (non-colocated refit).

Data flow (engines on devices or nodes of their own, where a shared-memory file is not an option):
    set-up   `connect(source, sink)`: the source names an address and a free port on its sending rank (the policy's
             rank 0); the sender joins as member 0, engine e (its Ray actor) as member 1 + e, of a process group
             of their own: a TCPStore and a gloo group (an NCCL group where CUDA is present: the same broadcasts, of
             device buffers), apart from the policy's and vLLM's worlds. Once per (source, sink) pair.
    bucket   sender: [(name, tensor)] -> slot i % 2's flat byte buffer: a 64-byte control block, then the tensors
             at the layout's offsets (names, dtypes, shapes, offsets: the bucket's header)
             ONE broadcast of [control block | tensors]                        every member takes part
             receiver: checks the control block, tensors are views of its slot's buffer -> the engine's own refit
             path (in-process reload, or a shared-memory file / CUDA IPC for an engine whose vLLM workers run in
             other processes)

Headers cross the wire once per bucket plan, not once per bucket. A broadcast needs its size on every member before
it starts, so each member predicts the next bucket's header: the one that followed the previous bucket's header last
time (`_Chain`, kept identically on every member: every member sees every bucket of its group). The refit loop
gives the transport neither the plan nor refit boundaries (`WeightTransport.pack` sees one bucket), and the policy
exports the same plan every refit, so the successor chain is the plan: after the first refit (plus the first bucket
of the second, whose predecessor is the previous refit's last bucket) every prediction holds.
    hit      (steady state) 1 broadcast: the control block says "as predicted" and names the header's key
    miss     (first refit, a new bucket size or model) 3 broadcasts: [control block | predicted size of garbage]
             with the real header's and data's sizes, then the header (JSON), then [data]
The sender never waits on the host for a bucket on the hit path (no `.tolist()`/`.item()` of device memory: the
control block is written from host values with a non-blocking copy; on NCCL the broadcast is only enqueued). Each
receiver reads its bucket's 64-byte control block back: it has to know that the bytes are the predicted layout
before it hands views of them on, and the hand-on (a reload, a shared-memory file, a CUDA IPC buffer) waits for the
data anyway.

Two buffers alternate per member (slot = bucket sequence number % 2): bucket i + 1 never overwrites the buffer that
bucket i's receivers may still be reading, so a refit loop that starts bucket i + 1 before bucket i is loaded
(`in_flight = 2`; mrl/inference/refit.py's `_met` waits for both today) needs no change here. A receiver's views
are valid until the bucket after next arrives: a receiver that keeps them longer (a layerwise reload session that
buffers the tensors of a layer cut across buckets until the layer completes) must copy them. Peak extra memory: two
buckets on each member (buffers grown to the largest bucket and reused).

Several senders (each pipeline stage's first rank sending its own layers, docs/weight-transfer.md): a transport with
`stages` has one sub-group per sender: sender k is member 0 of sub-group k and the engines join every sub-group as
members 1 + e; `pack(bucket, sender=k)` / `receiver_payload(sender=k)` name the sub-group of a bucket. Every
sub-group keeps its own chain and buffers. The default (no `stages`) is a single sender. The policy
(mrl/policy/group.py) gives one address per pipeline stage (`refit_addresses`): its buckets never span two stages,
the owner stage's first rank packs each one as sender `bucket_sender(index)` with no pipeline broadcast
(mrl/policy/worker.py `export_bucket`), and the refit loop points the engines at that sender's sub-group
(mrl/inference/refit.py `_met`).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Optional

import torch

from mrl.inference.buckets import FLAT_ALIGN, FlatEntry, flat_layout, flat_views, pack_flat
from mrl.inference.transports.base import NamedTensor, Payload, SenderLayout, Sending, TransportDefaults, describe
from mrl.parallel import collectives
from mrl.parallel.groups import standalone_group

if TYPE_CHECKING:
    from mrl.inference.refit import CollectiveRefitSink, CollectiveWeightSource

KIND = "collective"
Backend = Literal["gloo", "nccl"]
SLOTS = 2
#: Bytes before a bucket's data in its broadcast: the control block (`_CONTROL_FIELDS` int64, then padding).
CONTROL_BYTES = 64
_CONTROL_FIELDS = ("magic", "status", "sequence", "key", "header_bytes", "data_bytes")
_MAGIC = 0x6D726C2D72656674  # "mrl-reft"
_HIT, _MISS = 1, 2
#: A chain longer than this (bucket plans changing refit after refit) is forgotten and starts again, on every member
#: at the same bucket, so the members' chains stay identical.
MAX_CHAIN = 1 << 14
assert CONTROL_BYTES % FLAT_ALIGN == 0 and CONTROL_BYTES >= 8 * len(_CONTROL_FIELDS)


@dataclass(frozen=True)
class _Header:
    """One bucket's layout as both ends hold it: entries (name, dtype, shape, offset, bytes), data size, key."""

    entries: list[FlatEntry]
    data_bytes: int
    key: int
    encoded: bytes

    @classmethod
    def of(cls, entries: list[FlatEntry], data_bytes: int) -> "_Header":
        encoded = json.dumps([entries, data_bytes], separators=(",", ":")).encode()
        key = int.from_bytes(hashlib.blake2b(encoded, digest_size=8).digest(), "little", signed=True)
        return cls(entries, data_bytes, key, encoded)

    @classmethod
    def decode(cls, encoded: bytes) -> "_Header":
        entries, data_bytes = json.loads(encoded.decode())
        return cls.of(entries, data_bytes)


class _Chain:
    """Which header followed which: every member of a group updates it with every bucket, in the same order."""

    def __init__(self) -> None:
        self.after: dict[Optional[int], _Header] = {}
        self.previous: Optional[int] = None  # the key of the group's last bucket (None: none yet)
        self.sequence = 0

    def predicted(self) -> Optional[_Header]:
        return self.after.get(self.previous)

    def advance(self, header: _Header) -> None:
        if len(self.after) >= MAX_CHAIN and self.previous not in self.after:
            self.after.clear()
        self.after[self.previous] = header
        self.previous = header.key
        self.sequence += 1


@dataclass
class _Member:
    """This process's part of one group: the group, its device, the slots' buffers and the header chain."""

    group: Any
    device: torch.device
    chain: _Chain
    buffers: list[Optional[torch.Tensor]]


#: Groups this process belongs to, by name (a process may serve several engines / runs in tests).
_MEMBERS: dict[str, _Member] = {}


def sub_group(group: str, sender: int) -> str:
    """The name of sender `sender`'s sub-group of transport group `group` (sender 0's is the group's own name)."""
    return group if sender == 0 else f"{group}/s{sender}"


@dataclass(frozen=True)
class CollectiveTransport(TransportDefaults):
    """One refit broadcast group: `size` members, member 0 (the sender) hosting the store at address:port; with
    `stages`, one more sender (and sub-group of `size` members) per (address, port) there."""

    group: str
    address: str
    port: int
    size: int
    backend: Backend = "gloo"
    """nccl: members broadcast device buffers (each member on its current CUDA device); not run on CPU machines."""
    stages: tuple[tuple[str, int], ...] = ()
    """Senders 1, 2, ...: the store address and port of each one's sub-group (pipeline stages 1, 2, ...)."""

    kind = KIND
    meets = True
    in_flight = SLOTS

    @property
    def senders(self) -> int:
        return 1 + len(self.stages)

    def sending(self, layout: SenderLayout) -> Sending:
        """One sender per pipeline stage (made with the policy's `refit_addresses`): each stage's first rank packs
        its own buckets; else (a transport whose senders do not match the stages) rank 0 packs them all as sender 0."""
        return "stages" if self.senders == layout.pipeline_stages else "rank0"

    def _endpoint(self, sender: int) -> tuple[str, int]:
        return (self.address, self.port) if sender == 0 else self.stages[sender - 1]

    def join(self, member: int, timeout_s: float = 600.0) -> None:
        """Join as `member` (run in the member's own process): 0 is sender 0 (`join_sender` names the others),
        1 + e is engine e, which joins every sender's sub-group. Blocks until every member of them joined."""
        if member == 0:
            self.join_sender(0, timeout_s)
            return
        for sender in range(self.senders):
            address, port = self._endpoint(sender)
            join_group(sub_group(self.group, sender), address, port, member, self.size, timeout_s, backend=self.backend)

    def join_sender(self, sender: int, timeout_s: float = 600.0) -> None:
        """Join sender `sender`'s sub-group as its member 0 (the pipeline stage's first rank)."""
        address, port = self._endpoint(sender)
        join_group(sub_group(self.group, sender), address, port, 0, self.size, timeout_s, backend=self.backend)

    def pack(self, bucket: list[NamedTensor], sender: int = 0) -> Payload:
        send_bucket(sub_group(self.group, sender), bucket)
        return describe(self.receiver_payload(sender), bucket)

    def receiver_payload(self, sender: int = 0) -> Payload:
        return {"kind": KIND, "group": sub_group(self.group, sender)}

    def release(self, payload: Payload) -> None:
        """Nothing to free: the buffers stay for the next bucket."""


def unpack(payload: Payload) -> list[NamedTensor]:
    return receive_bucket(payload["group"])


def connect(
    source: "CollectiveWeightSource", sink: "CollectiveRefitSink", backend: Optional[Backend] = None
) -> CollectiveTransport:
    """Make the broadcast group of `source`'s sender(s) and `sink`'s receivers (both join at once: they meet in the
    stores' rendezvous). `backend` defaults to nccl where this process sees CUDA (a GPU cluster), else gloo. The
    source's `refit_addresses()` name one (address, port) per sender (pipeline stages): a sub-group per sender."""
    from mrl.distributed import wait_all

    addresses = source.refit_addresses()
    (address, port), stages = addresses[0], tuple((a, p) for a, p in addresses[1:])
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    transport = CollectiveTransport(
        f"mrl-refit-{uuid.uuid4().hex[:12]}", address, port, 1 + sink.num_receivers, backend, stages
    )
    wait_all([source.join_refit_group_async(transport), sink.join_refit_group_async(transport)])
    return transport


def join_group(
    name: str, address: str, port: int, member: int, size: int, timeout_s: float = 600.0, *, backend: Backend = "gloo"
) -> None:
    """Join refit group `name` as `member` of `size` (member 0 hosts the store and sends). Blocks until all joined."""
    group = standalone_group(address, port, member, size, backend, timeout_s)
    # NCCL: this member's current CUDA device
    _MEMBERS[name] = _Member(group, collectives.group_device(group), _Chain(), [None] * SLOTS)


def leave_group(name: str) -> None:
    _MEMBERS.pop(name, None)


def _member(name: str) -> _Member:
    member = _MEMBERS.get(name)
    if member is None:
        raise RuntimeError(f"this process is not in refit group {name!r}: join it first (CollectiveTransport.join)")
    return member


def _broadcast(member: _Member, tensor: torch.Tensor) -> torch.Tensor:
    collectives.broadcast(tensor, 0, member.group)  # from member 0; the buffers are on the group's device already
    return tensor


def _slot(member: _Member, data_bytes: int) -> torch.Tensor:
    """This bucket's slot buffer, [control block | data_bytes], grown to the largest bucket and reused: a fresh
    allocation per bucket left the engine's memory growing refit after refit (allocator fragmentation). Slots
    alternate, so the previous bucket's buffer is left alone while this one is filled."""
    index = member.chain.sequence % SLOTS
    buffer = member.buffers[index]
    if buffer is None or buffer.numel() < CONTROL_BYTES + data_bytes:
        buffer = member.buffers[index] = torch.empty(
            CONTROL_BYTES + data_bytes, dtype=torch.uint8, device=member.device
        )
    return buffer


def _control(buffer: torch.Tensor) -> torch.Tensor:
    return buffer[: 8 * len(_CONTROL_FIELDS)].view(torch.int64)


def send_bucket(name: str, bucket: list[NamedTensor]) -> int:
    """Member 0: broadcast one bucket; returns the bytes sent (its data, not the control block or a header)."""
    member = _member(name)
    entries, data_bytes = flat_layout(bucket)
    header = _Header.of(entries, data_bytes)
    predicted = member.chain.predicted()
    hit = predicted is not None and predicted.key == header.key
    first_bytes = CONTROL_BYTES + (predicted.data_bytes if predicted is not None else 0)
    buffer = _slot(member, max(data_bytes, first_bytes - CONTROL_BYTES))
    pack_flat(bucket, entries, buffer[CONTROL_BYTES:])
    control = torch.tensor(
        [_MAGIC, _HIT if hit else _MISS, member.chain.sequence, header.key, len(header.encoded), data_bytes],
        dtype=torch.int64,
    )
    _control(buffer).copy_(control, non_blocking=True)  # from host values: no read of device memory
    _broadcast(member, buffer[:first_bytes])
    if not hit:
        _broadcast(member, torch.frombuffer(bytearray(header.encoded), dtype=torch.uint8).to(member.device))
        _broadcast(member, buffer[CONTROL_BYTES : CONTROL_BYTES + data_bytes])
    member.chain.advance(header)
    return data_bytes


def receive_bucket(name: str) -> list[NamedTensor]:
    """Members 1..: receive one bucket as (name, tensor) views of this bucket's slot buffer (valid until the bucket
    after next arrives)."""
    member = _member(name)
    predicted = member.chain.predicted()
    first_bytes = CONTROL_BYTES + (predicted.data_bytes if predicted is not None else 0)
    buffer = _broadcast(member, _slot(member, first_bytes - CONTROL_BYTES)[:first_bytes])
    control = dict(zip(_CONTROL_FIELDS, _control(buffer).tolist()))  # the one read back: see the module docstring
    if control["magic"] != _MAGIC or control["sequence"] != member.chain.sequence:
        raise RuntimeError(
            f"refit group {name!r}: bucket {member.chain.sequence} arrived out of step with its "
            f"sender ({control}); the group is unusable, restart its members"
        )
    if control["status"] == _HIT:
        if predicted is None or predicted.key != control["key"]:
            raise RuntimeError(f"refit group {name!r}: the sender's header chain differs from this member's")
        header = predicted
    else:
        encoded = torch.empty(control["header_bytes"], dtype=torch.uint8, device=member.device)
        header = _Header.decode(bytes(_broadcast(member, encoded).cpu().numpy()))
        if header.key != control["key"] or header.data_bytes != control["data_bytes"]:
            raise RuntimeError(f"refit group {name!r}: header of bucket {member.chain.sequence} is corrupt")
        buffer = _slot(member, header.data_bytes)
        _broadcast(member, buffer[CONTROL_BYTES : CONTROL_BYTES + header.data_bytes])
    member.chain.advance(header)
    return flat_views(buffer[CONTROL_BYTES : CONTROL_BYTES + header.data_bytes], header.entries)
