"""In-process transport: the tensors themselves, by reference.

Data flow (engine in the caller's process: VLLM_ENABLE_V1_MULTIPROCESSING=0, tensor parallel size 1):
    caller bucket [(name, tensor)] --(python reference, no copy)--> collective_rpc --> the one vLLM worker
    --> Worker.reload_weights copies each tensor into its (prepacked) parameters.
No serialisation and no extra memory beyond the caller's own tensors. Under multiprocessing the same payload would
be msgpack-serialised with tensors as nested lists (slow, wrong dtypes), so the backend refuses that combination.
"""

from __future__ import annotations

import torch

from mrl.inference.buckets import NamedTensor

KIND = "in_process"


class InProcessTransport:
    name = "in_process"

    def pack(self, bucket: list[NamedTensor]) -> dict:
        return {"kind": KIND, "tensors": bucket}

    def release(self, payload: dict) -> None:
        payload["tensors"] = []  # drop our references; the caller's tensors live on as long as the caller keeps them


def unpack(payload: dict) -> list[tuple[str, torch.Tensor]]:
    return list(payload["tensors"])
