"""CUDA IPC transport: each bucket packed into one device buffer that the engine's workers map, no copy through host.

Data flow (a colocated GPU engine: the policy's rank and the engine's worker on the same device, other processes):
    sender   bucket --pack_flat--> device buffer of slot i % 2 (aligned offsets; grown, then reused)
             the buffer's IPC handle is made once per buffer (cached until the buffer grows)
    payload  {"kind", "slot", "handle": the handle's fields as plain bytes/ints, "header": names, dtypes, shapes,
             offsets}  --collective_rpc (msgpack, a few hundred bytes)--> every vLLM worker on the device
    receiver the handle is opened once per buffer (cached per sender and slot; a grown buffer replaces the old
             mapping) -> views at the header's offsets -> the engine's own reload copies them into its parameters
    release  nothing: the slots stay for the next bucket and the next refit.
Two slots alternate, so the refit loop can pack bucket i + 1 while the workers still read bucket i (`in_flight = 2`,
mrl/inference/refit.py); bucket i + 2 reuses slot i's buffer only after bucket i was loaded. The sender synchronises
its stream before the payload leaves, so a receiver never reads a half-copied buffer.

Not run on the project's CPU machines: `tests/gpu` (make test-gpu) checks it between two processes on one device.
The packing itself (layout, offsets, views) is `mrl.inference.buckets` and is tested on CPU.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from mrl.inference.buckets import flat_layout, flat_views, pack_flat
from mrl.inference.transports.base import NamedTensor, Payload, describe

KIND = "cuda_ipc"
SLOTS = 2
#: Sender side, per transport (it travels to the sender by pickle with every bucket, so it holds its name only):
#: the slots' buffers with their handles, and the slot of the next bucket.
_SENT: dict[str, dict[int, tuple[torch.Tensor, dict[str, Any]]]] = {}
_NEXT: dict[str, int] = {}
#: Receiver side: the buffer each (sender, slot) last sent, opened from its handle once; a grown buffer (a new
#: handle) replaces the old mapping, which is then closed.
_OPENED: dict[tuple[str, int], tuple[bytes, torch.Tensor]] = {}


@dataclass(frozen=True)
class CudaIpcTransport:
    """Settings only (see the module docstring); `name` keys the sender's buffers."""

    name: str = field(default_factory=lambda: f"mrl-ipc-{uuid.uuid4().hex[:12]}")

    kind = KIND
    meets = False
    in_flight = SLOTS

    def pack(self, bucket: list[NamedTensor]) -> Payload:
        header, size = flat_layout(bucket)
        slot = _NEXT.get(self.name, 0)
        _NEXT[self.name] = (slot + 1) % SLOTS
        buffer, handle = _slot_buffer(self.name, slot, size, bucket[0][1].device)
        pack_flat(bucket, header, buffer)
        torch.cuda.current_stream(buffer.device).synchronize()  # the bytes are there before anyone is told
        return describe({"kind": KIND, "sender": self.name, "slot": slot, "handle": handle, "header": header}, bucket)

    def receiver_payload(self) -> Payload:
        raise TypeError("the CUDA IPC transport hands each bucket over after packing; it announces nothing")

    def release(self, payload: Payload) -> None:
        """Nothing to free: the slot's buffer is reused two buckets later."""


def _slot_buffer(name: str, slot: int, size: int, device: torch.device) -> tuple[torch.Tensor, dict[str, Any]]:
    """Slot `slot`'s buffer (at least `size` bytes on `device`; made or grown here) and its handle."""
    if device.type != "cuda":
        raise ValueError(f"the cuda_ipc transport sends device tensors; this bucket is on {device} (use shm_file)")
    slots = _SENT.setdefault(name, {})
    current = slots.get(slot)
    if current is None or current[0].numel() < size or current[0].device != device:
        buffer = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
        slots[slot] = current = (buffer, share(buffer))
    return current[0][:size], current[1]


def share(buffer: torch.Tensor) -> dict[str, Any]:
    """The IPC handle of a device buffer as msgpack-safe fields (torch's own reduction, types spelled as names)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    (_cls, size, stride, offset, _storage_cls, dtype, device, handle, storage_bytes, storage_offset, _grad,
     ref_handle, ref_offset, event_handle, event_sync) = args
    return {"size": list(size), "stride": list(stride), "offset": int(offset), "dtype": str(dtype).split(".")[-1],
            "device": int(device), "handle": bytes(handle), "storage_bytes": int(storage_bytes),
            "storage_offset": int(storage_offset), "ref_handle": bytes(ref_handle), "ref_offset": int(ref_offset),
            "event_handle": bytes(event_handle), "event_sync": bool(event_sync)}


def open_handle(shared: dict[str, Any]) -> torch.Tensor:
    """The buffer a `share` handle names, mapped into this process."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor, tuple(shared["size"]), tuple(shared["stride"]), shared["offset"], torch.storage.TypedStorage,
        getattr(torch, shared["dtype"]), shared["device"], bytes(shared["handle"]), shared["storage_bytes"],
        shared["storage_offset"], False, bytes(shared["ref_handle"]), shared["ref_offset"],
        bytes(shared["event_handle"]), shared["event_sync"])


def unpack(payload: Payload) -> list[NamedTensor]:
    key, handle = (payload["sender"], payload["slot"]), bytes(payload["handle"]["handle"])
    opened = _OPENED.get(key)
    if opened is None or opened[0] != handle:
        _OPENED[key] = opened = (handle, open_handle(payload["handle"]))
    return flat_views(opened[1], payload["header"])
