"""Shared-memory file transport: one safetensors file per bucket in a RAM-backed folder.

Data flow (engine workers in other processes: vLLM multiprocessing, tensor parallel > 1, or an engine in a Ray
actor on the same node):
    sender bucket --save_file--> <shm_dir>/mrl-refit-<pid>-<uuid>.safetensors   (/dev/shm: RAM, not disk)
    payload {"kind", "path"} --collective_rpc (msgpack, a few bytes)--> every vLLM worker
    worker: load_file(path) --> Worker.reload_weights (each TP rank takes its shard of the HF tensor)
    controller: file removed after all workers returned (also when loading failed).
Peak extra memory: one bucket in the file plus one bucket per worker while it loads. CPU stand-in for the CUDA IPC
handles a colocated GPU engine would use.

Packed in parts (`sending` "expert_parts": the sharded policy under expert parallelism, one pipeline stage): rank 0
writes the bucket's dense tensors and its own routed experts, every other expert-parallel rank's first rank its own
experts, each to its own file, side by side (nothing crosses the EP group); the controller joins the ranks'
payloads (`merge`) into one whose `paths` every worker loads in turn, and removes them all.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path
from typing import Optional

from mrl.inference.transports.base import (
    NamedTensor,
    Payload,
    SenderLayout,
    Sending,
    TransportDefaults,
    describe,
    one_sender,
)

KIND = "shm_file"
_LINUX_SHM = "/dev/shm"


def default_shm_dir() -> str:
    """RAM-backed /dev/shm where it exists and is writable, else the temp folder (e.g. macOS)."""
    if os.path.isdir(_LINUX_SHM) and os.access(_LINUX_SHM, os.W_OK):
        return _LINUX_SHM
    return tempfile.gettempdir()


class SharedMemoryFileTransport(TransportDefaults):
    kind = KIND
    meets = False
    in_flight = 2  # one file (or one set of parts) per bucket: two may exist at once

    def __init__(self, shm_dir: str | None = None) -> None:
        self.shm_dir = Path(shm_dir or default_shm_dir())
        if not self.shm_dir.is_dir():
            raise ValueError(f"refit shared-memory folder {self.shm_dir} does not exist; create it or pick another")

    def sending(self, layout: SenderLayout) -> Sending:
        """Under expert parallelism with one pipeline stage each EP rank packs its own experts
        (`ShardedExporter.bucket_part`), joined by `merge`; else rank 0 packs."""
        return "expert_parts" if layout.expert_parallel > 1 and layout.pipeline_stages == 1 else "rank0"

    def pack(self, bucket: list[NamedTensor], sender: int = 0) -> Payload:
        one_sender(sender, KIND)
        from safetensors.torch import save_file

        path = self.shm_dir / f"mrl-refit-{os.getpid()}-{uuid.uuid4().hex}.safetensors"
        # safetensors refuses views and shared storage: each tensor gets its own contiguous buffer.
        save_file({name: tensor.detach().contiguous() for name, tensor in bucket}, str(path))
        return describe({"kind": KIND, "paths": [str(path)]}, bucket)

    def merge(self, parts: list[Optional[Payload]]) -> Payload:
        """The ranks' parts of one bucket (rank order; None from a rank that packed nothing) as one payload."""
        return merge(parts)

    def release(self, payload: Payload) -> None:
        for path in payload["paths"]:
            Path(path).unlink(missing_ok=True)


def merge(parts: list[Optional[Payload]]) -> Payload:
    """One payload of the parts' files, names and bytes; a name packed twice is refused (the ranks' parts of a bucket
    must not overlap: the engine would load whichever came last)."""
    packed = [part for part in parts if part is not None]
    if not packed:
        raise ValueError("no rank packed a part of the bucket")
    names = [name for part in packed for name in part["names"]]
    if len(set(names)) != len(names):
        twice = sorted({name for name in names if names.count(name) > 1})
        raise ValueError(f"tensors packed by two ranks: {twice[:5]}; the ranks' parts of a bucket must not overlap")
    return {
        "kind": KIND,
        "paths": [path for part in packed for path in part["paths"]],
        "names": names,
        "bytes": sum(part["bytes"] for part in packed),
    }


def unpack(payload: Payload) -> list[NamedTensor]:
    from safetensors.torch import load_file

    return [item for path in payload["paths"] for item in load_file(path).items()]
