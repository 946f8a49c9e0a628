"""CUDA IPC transport: each bucket packed into one device buffer per GPU that the engine's workers on that GPU map.

Data flow (colocated GPU engines: every GPU holds one policy rank and one vLLM worker of one engine, other processes):
    policy rank 0   bucket --pack_flat--> its device buffer of slot i % 2 (aligned offsets; grown, then reused)
    every rank      the layout (a small header) and the buffer's bytes are broadcast from rank 0 to every policy rank
                    (one broadcast of the packed bytes over the policy's group: NVLink inside a node), so each GPU
                    holds the bucket in its own rank's slot buffer; each rank's stream is synchronised (the bytes are
                    there before anyone is told) and the rank shares its buffer: {its GPU's UUID: IPC handle}
    controller      the ranks' payloads merged (`merge`): {"kind", "sender", "slot", "header", "handles": {UUID:
                    handle}}  --collective_rpc (msgpack, a few hundred bytes a GPU)--> every vLLM worker
    receiver        picks the handle of its own GPU by UUID (a GPU the payload does not name: `IpcDeviceError`),
                    opens it on its OWN device index (the sender's index means nothing here: CUDA_VISIBLE_DEVICES
                    differs between processes), keeps the mapping per (sender, slot) keyed by what identifies the
                    bytes (segment handle, offset in the segment, size), views it at the header's offsets; the
                    engine copies the views into its parameters and SYNCHRONISES its stream before it answers
                    (vllm_extension.fence: the sender repacks this slot two buckets later)
    release         nothing: the slots stay for the next bucket and the next refit.

Why one export per GPU (and not rank 0's for everyone): a handle opens only in a process that can see the GPU it was
made on, by that process's index for it; an engine on GPU 3 sees that GPU as device 0 and cannot see GPU 0 at all.
vLLM 0.32's own IPC weight transfer does the same (vllm/distributed/weight_transfer/ipc_engine.py: handles keyed by
GPU UUID, opened on the receiver's index).

Reference counts (torch's contract: torch/multiprocessing/cuda_multiprocessing.md): each share of a buffer gives the
producer a counter of 1, and each mapping a consumer drops takes 1 off; the producer frees a dropped buffer once its
counter is 0 (`torch.cuda.ipc_collect`). So each share is opened by exactly one receiver: on GPUs one engine worker
sits on each GPU (mrl.inference.factory.engine_seats), and the sender shares each buffer once when it is made. A
receiver drops its mapping of a slot when the slot grows (a new identity) and all of them before it ends
(`drop_mappings`: an engine's shutdown), and the sender collects the grown-out buffers after each growth.

Not run on the project's CPU machines: `tests/gpu` (make test-gpu) checks it between processes on one device; the
routing, the cache keys and the merge are tested on CPU (tests/unit/inference/test_inference_cuda_ipc.py).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch

from mrl.inference.buckets import flat_layout, flat_views, pack_flat
from mrl.inference.transports.base import (
    NamedTensor,
    Payload,
    SenderLayout,
    Sending,
    TransportDefaults,
    describe,
    one_sender,
)

KIND = "cuda_ipc"
SLOTS = 2
#: Sender side, per transport (it travels to the sender by pickle with every bucket, so it holds its name only):
#: the slots' buffers with their handles, and the slot of the next bucket.
_SENT: dict[str, dict[int, tuple[torch.Tensor, dict[str, Any]]]] = {}
_NEXT: dict[str, int] = {}
#: Receiver side: per (sender, slot), the identity of the bytes last opened and their mapping.
_OPENED: dict[tuple[str, int], tuple[tuple, torch.Tensor]] = {}


class Broadcast(Protocol):
    """Rank 0's `tensor` (None on the other ranks) on every rank of the policy's group: into `into` when given (the
    same size everywhere), else a new tensor (`_broadcast_from_rank0`; tests record and replay it)."""

    def __call__(self, tensor: Optional[torch.Tensor], into: Optional[torch.Tensor] = None, /) -> torch.Tensor: ...


class IpcDeviceError(RuntimeError):
    """A receiver's GPU is not among those the payload's handles were made on."""


@dataclass(frozen=True)
class CudaIpcTransport(TransportDefaults):
    """Settings only (see the module docstring); `name` keys the sender's buffers."""

    name: str = field(default_factory=lambda: f"mrl-ipc-{uuid.uuid4().hex[:12]}")

    kind = KIND
    meets = False
    in_flight = SLOTS

    def sending(self, layout: SenderLayout) -> Sending:
        """Every policy rank packs (`pack_on_ranks`): each GPU's engine worker opens its own rank's buffer."""
        return "every_rank"

    def pack(self, bucket: list[NamedTensor], sender: int = 0) -> Payload:
        """One process holds the bucket and is the only sender (`update_weights` of an engine, tests)."""
        one_sender(sender, KIND)
        return self.pack_on_ranks(bucket, group_size=1)

    def pack_on_ranks(
        self,
        bucket: Optional[list[NamedTensor]],
        *,
        group_size: Optional[int] = None,
        broadcast: Optional[Broadcast] = None,
    ) -> Payload:
        """Collective over the policy's ranks: rank 0 holds `bucket` (None elsewhere); every rank returns its part
        of the payload (rank 0's carries the header, names and bytes), which `merge` joins."""
        from mrl.parallel import collectives

        size_of_group = collectives.world_size() if group_size is None else group_size
        slot = _NEXT.get(self.name, 0)
        _NEXT[self.name] = (slot + 1) % SLOTS
        if bucket is not None:
            header, size = flat_layout(bucket)
            buffer, handle = _slot_buffer(self.name, slot, size, bucket[0][1].device)
            pack_flat(bucket, header, buffer)
        if size_of_group > 1:
            send = broadcast or _broadcast_from_rank0
            header = json.loads(bytes(send(_header_bytes(header) if bucket is not None else None).tolist()))
            if bucket is None:
                size = header[-1][3] + header[-1][4] if header else 0
                buffer, handle = _slot_buffer(self.name, slot, size, _this_device())
            send(buffer if bucket is not None else None, buffer)
        torch.cuda.current_stream(buffer.device).synchronize()  # the bytes are there before anyone is told
        part: Payload = {"kind": KIND, "sender": self.name, "slot": slot, "handles": {handle["uuid"]: handle}}
        if bucket is None:
            return part
        return describe({**part, "header": header}, bucket)

    def merge(self, parts: list[Optional[Payload]]) -> Payload:
        """The ranks' parts (rank order; None from a rank that exported nothing) joined into one payload."""
        return merge(parts)

    def release(self, payload: Payload) -> None:
        """Nothing to free: the slot's buffer is reused two buckets later."""

    def close(self) -> None:
        """Sender side, once no refit will follow: drop this transport's buffers (freed once the receivers dropped
        their mappings: torch.cuda.ipc_collect)."""
        _SENT.pop(self.name, None)
        _NEXT.pop(self.name, None)
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()


def merge(parts: list[Optional[Payload]]) -> Payload:
    """Rank 0's payload with every rank's handles: one per GPU (two ranks on one GPU share nothing: refused)."""
    first = parts[0]
    if first is None or "header" not in first:
        raise ValueError("the first rank's part of a CUDA IPC payload must carry the bucket's header")
    handles: dict[str, dict[str, Any]] = {}
    for rank, part in enumerate(parts):
        if part is None:
            continue
        if (part["sender"], part["slot"]) != (first["sender"], first["slot"]):
            raise ValueError(
                f"rank {rank} packed slot {part['slot']} of {part['sender']}, rank 0 slot "
                f"{first['slot']} of {first['sender']}: the ranks' buckets are out of step"
            )
        for gpu, handle in part["handles"].items():
            if gpu in handles:
                raise ValueError(
                    f"two policy ranks export from GPU {gpu}: one engine worker per GPU opens one "
                    "rank's share (torch's reference count); place one policy rank per GPU"
                )
            handles[gpu] = handle
    return {**first, "handles": handles}


def _header_bytes(header: list) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)


def _this_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _broadcast_from_rank0(tensor: Optional[torch.Tensor], into: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rank 0's `tensor` on every rank of the default group: into `into` when given (the same size everywhere),
    else a new tensor (its shape and dtype sent first). On the group's device (NCCL: the GPU)."""
    from mrl.parallel import collectives

    if into is not None:
        collectives.broadcast(into, 0)
        return into
    return collectives.broadcast_tensor(tensor, 0)


def _slot_buffer(name: str, slot: int, size: int, device: torch.device) -> tuple[torch.Tensor, dict[str, Any]]:
    """Slot `slot`'s buffer (at least `size` bytes on `device`; made or grown here) and its one share."""
    if device.type != "cuda":
        raise ValueError(f"the cuda_ipc transport sends device tensors; this bucket is on {device} (use shm_file)")
    slots = _SENT.setdefault(name, {})
    current = slots.get(slot)
    if current is None or current[0].numel() < size or current[0].device != device:
        grown = current is not None
        slots.pop(slot, None)
        buffer = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
        slots[slot] = current = (buffer, share(buffer))
        if grown:
            torch.cuda.ipc_collect()  # free buffers whose receivers dropped their mapping (the grown-out ones)
    return current[0][:size], current[1]


def device_uuid(index: int) -> str:
    """The GPU's UUID as CUDA names it ("GPU-..."): the same in every process, whatever its CUDA_VISIBLE_DEVICES."""
    raw = str(torch.cuda.get_device_properties(index).uuid)
    return raw if raw.startswith("GPU-") else f"GPU-{raw}"


def share(buffer: torch.Tensor) -> dict[str, Any]:
    """The IPC handle of a device buffer as msgpack-safe fields (torch's own reduction), with its GPU's UUID."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    (
        _cls,
        size,
        stride,
        offset,
        _storage_cls,
        dtype,
        device,
        handle,
        storage_bytes,
        storage_offset,
        _grad,
        ref_handle,
        ref_offset,
        event_handle,
        event_sync,
    ) = args
    return {
        "uuid": device_uuid(int(device)),
        "size": list(size),
        "stride": list(stride),
        "offset": int(offset),
        "dtype": str(dtype).split(".")[-1],
        "handle": bytes(handle),
        "storage_bytes": int(storage_bytes),
        "storage_offset": int(storage_offset),
        "ref_handle": bytes(ref_handle),
        "ref_offset": int(ref_offset),
        "event_handle": bytes(event_handle),
        "event_sync": bool(event_sync),
    }


def route(payload: Payload, own_uuid: str) -> dict[str, Any]:
    """The handle this receiver opens: the one made on its own GPU."""
    handles = payload["handles"]
    if own_uuid not in handles:
        raise IpcDeviceError(
            f"this engine worker's GPU {own_uuid} is not among the GPUs the bucket was shared from "
            f"({sorted(handles)}): every GPU that holds an engine worker needs a policy rank on it (colocated "
            "placement), or use the collective transport for engines on GPUs of their own"
        )
    return handles[own_uuid]


def identity(shared: dict[str, Any]) -> tuple:
    """What names the bytes of a share: a handle names a whole allocator segment, the offset the block in it."""
    return bytes(shared["handle"]), int(shared["storage_offset"]), int(shared["storage_bytes"])


def open_handle(shared: dict[str, Any], device_index: int) -> torch.Tensor:
    """The buffer a `share` names, mapped into this process on ITS device `device_index` (torch's own cache,
    keyed by handle and offset alone, is bypassed: a grown block may start where the old one did)."""
    storage = torch.UntypedStorage._new_shared_cuda(
        device_index,
        bytes(shared["handle"]),
        shared["storage_bytes"],
        shared["storage_offset"],
        bytes(shared["ref_handle"]),
        shared["ref_offset"],
        bytes(shared["event_handle"]),
        shared["event_sync"],
    )
    tensor = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", device_index))
    tensor.set_(storage, shared["offset"], tuple(shared["size"]), tuple(shared["stride"]))
    return tensor.view(getattr(torch, shared["dtype"]))


def mapped(
    key: tuple[str, int], shared: dict[str, Any], opener: Callable[[dict[str, Any]], torch.Tensor]
) -> torch.Tensor:
    """The mapping of `shared` for (sender, slot) `key`: reused while its identity holds; a new identity (a grown
    slot) drops the old mapping first (its reference goes back to the sender), then opens the new one."""
    ident = identity(shared)
    opened = _OPENED.get(key)
    if opened is None or opened[0] != ident:
        _OPENED.pop(key, None)
        opened = _OPENED[key] = (ident, opener(shared))
    return opened[1]


def drop_mappings() -> int:
    """Receiver side, before the process ends: drop every mapping, so each share's reference goes back to its
    sender (a receiver that exits holding them leaves the sender's buffers in torch's limbo for good, and with them
    the allocator segments they sit in). Returns how many were dropped."""
    count = len(_OPENED)
    _OPENED.clear()
    return count


def unpack(payload: Payload) -> list[NamedTensor]:
    index = torch.cuda.current_device()
    shared = route(payload, device_uuid(index))
    buffer = mapped((payload["sender"], payload["slot"]), shared, lambda s: open_handle(s, index))
    return flat_views(buffer, payload["header"])
