"""In-process transport: the tensors themselves, by reference.

Data flow (engine in the sender's process: VLLM_ENABLE_V1_MULTIPROCESSING=0, tensor parallel size 1; or the
Megatron engine in the driver):
    sender bucket [(name, tensor)] --(python reference, no copy)--> collective_rpc --> the one vLLM worker
    --> Worker.reload_weights copies each tensor into its (prepacked) parameters.
No serialisation and no extra memory beyond the sender's own tensors. Under multiprocessing the same payload would
be msgpack-serialised with tensors as nested lists (slow, wrong dtypes), so the vLLM backend refuses that
combination.
"""

from __future__ import annotations

from mrl.inference.transports.base import NamedTensor, Payload, describe

KIND = "in_process"


class InProcessTransport:
    kind = KIND
    meets = False
    in_flight = 1

    def pack(self, bucket: list[NamedTensor]) -> Payload:
        return describe({"kind": KIND, "tensors": bucket}, bucket)

    def receiver_payload(self, sender: int = 0) -> Payload:
        raise TypeError("the in-process transport hands each bucket over after packing; it announces nothing")

    def release(self, payload: Payload) -> None:
        payload["tensors"] = []  # drop our references; the sender's tensors live on as long as the sender keeps them


def unpack(payload: Payload) -> list[NamedTensor]:
    return list(payload["tensors"])
