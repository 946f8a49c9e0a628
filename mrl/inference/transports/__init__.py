"""Weight transports: how one refit bucket travels from its sender to the engine's workers (one file each).

in_process.py: tensors by reference (engine in the sender's process); shared_memory.py: a safetensors file in
/dev/shm (engines on the sender's node); collective.py: a broadcast group (engines anywhere). base.py: the
interface they share and the receiver-side dispatcher.
"""

from typing import Literal, Optional

from mrl.inference.buckets import NamedTensor
from mrl.inference.transports import collective, in_process, shared_memory
from mrl.inference.transports.base import Payload, WeightTransport
from mrl.inference.transports.collective import CollectiveTransport
from mrl.inference.transports.in_process import InProcessTransport
from mrl.inference.transports.shared_memory import SharedMemoryFileTransport

#: Transports an engine can use to reach its own workers (a collective one is made by `collective.connect`).
LocalTransportName = Literal["in_process", "shm_file"]


def make_transport(name: LocalTransportName, *, shm_dir: Optional[str] = None) -> WeightTransport:
    """The local transport called `name`."""
    if name == "in_process":
        return InProcessTransport()
    if name == "shm_file":
        return SharedMemoryFileTransport(shm_dir)
    raise ValueError(f"unknown refit transport {name!r}; choose 'in_process' or 'shm_file'")


def unpack_payload(payload: Payload) -> list[NamedTensor]:
    """Receiver side: the (HF name, tensor) list a payload carries, by the module that made it."""
    kind = payload.get("kind") if isinstance(payload, dict) else None
    for module in (in_process, shared_memory, collective):
        if kind == module.KIND:
            return module.unpack(payload)
    raise ValueError(f"refit payload of unknown kind {kind!r}: caller and engine run different mrl versions?")


__all__ = ["CollectiveTransport", "InProcessTransport", "LocalTransportName", "Payload", "SharedMemoryFileTransport",
           "WeightTransport", "make_transport", "unpack_payload"]
