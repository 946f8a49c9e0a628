"""The transport interface and the worker-side dispatcher.

A transport turns a bucket of (HF name, tensor) into a payload that vLLM's `collective_rpc` can carry to every
worker, and cleans up after the workers loaded it. The payload is a plain dict tagged with `kind`, because under
vLLM multiprocessing it is serialised with msgpack (tensors inside it would arrive as nested lists). The worker
extension calls `unpack_payload`, which dispatches on `kind` to the transport module that made it.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import torch

from mrl.inference.buckets import NamedTensor

TransportName = Literal["in_process", "shm_file"]
Payload = dict[str, Any]


class WeightTransport(Protocol):
    """Caller side of a transport."""

    name: TransportName

    def pack(self, bucket: list[NamedTensor]) -> Payload:
        """Make the payload for one bucket."""
        ...

    def release(self, payload: Payload) -> None:
        """Free what `pack` created, once every worker has loaded the payload (also after a failed load)."""
        ...


def make_transport(name: TransportName, *, shm_dir: str | None = None) -> WeightTransport:
    """The transport called `name`."""
    from mrl.inference.transports.in_process import InProcessTransport
    from mrl.inference.transports.shared_memory import SharedMemoryFileTransport

    if name == "in_process":
        return InProcessTransport()
    if name == "shm_file":
        return SharedMemoryFileTransport(shm_dir)
    raise ValueError(f"unknown refit transport {name!r}; choose 'in_process' or 'shm_file'")


def unpack_payload(payload: Payload) -> list[tuple[str, torch.Tensor]]:
    """Worker side: the (HF name, tensor) list a payload carries."""
    from mrl.inference.transports import in_process, shared_memory

    kind = payload.get("kind") if isinstance(payload, dict) else None
    if kind == in_process.KIND:
        return in_process.unpack(payload)
    if kind == shared_memory.KIND:
        return shared_memory.unpack(payload)
    raise ValueError(f"refit payload of unknown kind {kind!r}: caller and engine run different mrl versions?")
