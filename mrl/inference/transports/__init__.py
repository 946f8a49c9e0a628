"""Weight transports: how one refit bucket travels from its sender to the engine's workers (one file each).

in_process.py: tensors by reference (engine in the sender's process); shared_memory.py: a safetensors file in
/dev/shm (engines on the sender's node); cuda_ipc.py: device buffers mapped by the engine (a colocated GPU engine);
collective.py: a broadcast group (engines anywhere; gloo, or NCCL on GPUs). base.py: the
interface they share and the receiver-side dispatcher.
"""

from typing import Literal, Optional

from mrl.inference.buckets import NamedTensor
from mrl.inference.transports import collective, cuda_ipc, in_process, shared_memory
from mrl.inference.transports.base import Payload, WeightTransport
from mrl.inference.transports.collective import CollectiveTransport
from mrl.inference.transports.cuda_ipc import CudaIpcTransport
from mrl.inference.transports.in_process import InProcessTransport
from mrl.inference.transports.shared_memory import SharedMemoryFileTransport

#: Transports an engine can use to reach its own workers (a collective one is made by `collective.connect`).
LocalTransportName = Literal["in_process", "shm_file", "cuda_ipc"]


def make_transport(name: LocalTransportName, *, shm_dir: Optional[str] = None) -> WeightTransport:
    """The local transport called `name`."""
    if name == "in_process":
        return InProcessTransport()
    if name == "shm_file":
        return SharedMemoryFileTransport(shm_dir)
    if name == "cuda_ipc":
        return CudaIpcTransport()
    raise ValueError(f"unknown refit transport {name!r}; choose 'in_process', 'shm_file' or 'cuda_ipc'")


def unpack_payload(payload: Payload) -> list[NamedTensor]:
    """Receiver side: the (HF name, tensor) list a payload carries, by the module that made it."""
    kind = payload.get("kind") if isinstance(payload, dict) else None
    for module in (in_process, shared_memory, cuda_ipc, collective):
        if kind == module.KIND:
            return module.unpack(payload)
    raise ValueError(f"refit payload of unknown kind {kind!r}: caller and engine run different mrl versions?")


__all__ = [
    "CollectiveTransport",
    "CudaIpcTransport",
    "InProcessTransport",
    "LocalTransportName",
    "Payload",
    "SharedMemoryFileTransport",
    "WeightTransport",
    "make_transport",
    "unpack_payload",
]
