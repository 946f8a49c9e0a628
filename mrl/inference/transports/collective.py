"""Collective transport: a broadcast group between the policy's rank 0 and every engine (non-colocated refit).

Data flow (engines on devices or nodes of their own, where a shared-memory file is not an option):
    set-up   the controller picks an address and a free port on the policy's rank 0; rank 0 joins as member 0,
             engine e (its Ray actor) as member 1 + e, of a process group of their own: a TCPStore and a gloo group
             (NCCL on GPU clusters would take the same three broadcasts), apart from the policy's and vLLM's worlds
    bucket   rank 0: [(name, tensor)] -> one flat byte buffer + a JSON header (names, dtypes, shapes, offsets)
             broadcast(header size) -> broadcast(header) -> broadcast(buffer)         every member takes part
             engine: tensors are views of its received buffer -> the engine's own refit path (in-process reload,
             or a shared-memory file for an engine whose vLLM workers run in other processes)
Peak extra memory: one bucket on each side. The controller starts rank 0's send and the engines' receive together
(they meet in the broadcasts), so a bucket costs one transfer, not a round trip through the controller.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import torch
import torch.distributed as dist

from mrl.inference.buckets import NamedTensor

KIND = "collective"
_ALIGN = 16
#: Groups this process belongs to, by name (a process may serve several engines / runs in tests).
_GROUPS: dict[str, Any] = {}
_BUFFERS: dict[str, torch.Tensor] = {}


def join_group(name: str, address: str, port: int, member: int, size: int, timeout_s: float = 600.0) -> None:
    """Join refit group `name` as `member` of `size` (member 0 hosts the store). Blocks until all joined."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, size, is_master=member == 0, timeout=timeout)
    _GROUPS[name] = dist.ProcessGroupGloo(store, member, size, timeout)


def leave_group(name: str) -> None:
    _GROUPS.pop(name, None)
    _BUFFERS.pop(name, None)


def _broadcast(name: str, tensor: torch.Tensor) -> torch.Tensor:
    group = _GROUPS.get(name)
    if group is None:
        raise RuntimeError(f"this process is not in refit group {name!r}: call join_group first")
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()
    return tensor


def send_bucket(name: str, bucket: list[NamedTensor]) -> int:
    """Member 0: broadcast one bucket; returns the bytes sent."""
    header, offset = [], 0
    for tensor_name, tensor in bucket:
        offset = -(-offset // _ALIGN) * _ALIGN  # every tensor starts aligned, so the receiver can view it in place
        size = tensor.numel() * tensor.element_size()
        header.append([tensor_name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, size])
        offset += size
    buffer = _BUFFERS.get(name)  # reused from bucket to bucket, as on the receiving side
    if buffer is None or buffer.numel() < offset:
        buffer = _BUFFERS[name] = torch.empty(offset, dtype=torch.uint8)
    buffer = buffer[:offset]
    for (_, tensor), (_, _, _, start, size) in zip(bucket, header):
        buffer[start:start + size] = tensor.detach().contiguous().view(-1).view(torch.uint8)
    encoded = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
    _broadcast(name, torch.tensor([len(encoded), offset], dtype=torch.long))
    _broadcast(name, encoded)
    _broadcast(name, buffer)
    return offset


def receive_bucket(name: str) -> list[NamedTensor]:
    """Members 1..: receive one bucket as (name, tensor) views of the received buffer."""
    sizes = _broadcast(name, torch.zeros(2, dtype=torch.long))
    encoded = _broadcast(name, torch.empty(int(sizes[0]), dtype=torch.uint8))
    # One receive buffer per group, grown to the largest bucket and reused: a fresh allocation per bucket left the
    # engine's memory growing refit after refit (allocator fragmentation). Safe because the engine copies the
    # tensors into its parameters before the next bucket is received.
    buffer = _BUFFERS.get(name)
    if buffer is None or buffer.numel() < int(sizes[1]):
        buffer = _BUFFERS[name] = torch.empty(int(sizes[1]), dtype=torch.uint8)
    buffer = _broadcast(name, buffer[: int(sizes[1])])
    out = []
    for tensor_name, dtype, shape, start, size in json.loads(bytes(encoded.tolist()).decode()):
        flat = buffer[start:start + size].view(getattr(torch, dtype))
        out.append((tensor_name, flat.view(shape)))
    return out


def payload(name: str) -> dict:
    """What the controller hands each engine for one bucket: only the group's name (the data comes by broadcast)."""
    return {"kind": KIND, "group": name}
