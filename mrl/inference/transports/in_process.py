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

from mrl.inference.transports.base import NamedTensor, Payload, TransportDefaults, describe, one_sender

KIND = "in_process"


class InProcessTransport(TransportDefaults):
    """Rank 0 packs (`sending` "rank0", the default); one payload alive at a time."""

    kind = KIND
    meets = False
    in_flight = 1

    def pack(self, bucket: list[NamedTensor], sender: int = 0) -> Payload:
        one_sender(sender, KIND)
        return describe({"kind": KIND, "tensors": bucket}, bucket)

    def release(self, payload: Payload) -> None:
        payload["tensors"] = []  # drop our references; the sender's tensors live on as long as the sender keeps them


def unpack(payload: Payload) -> list[NamedTensor]:
    return list(payload["tensors"])
