"""Tensors travel as numpy between driver and workers and come back as equal, writable torch tensors."""

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from mrl.distributed.transport import TensorPayload, decode, encode


@dataclass(frozen=True)
class Sample:
    ids: torch.Tensor
    name: str

    def __post_init__(self):
        if not isinstance(self.ids, torch.Tensor):
            raise TypeError("ids must be a tensor")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16])
def test_round_trip_keeps_dtype_shape_and_values(dtype):
    tensor = (torch.arange(12).reshape(3, 4) % 3).to(dtype)
    payload = encode(tensor)
    assert isinstance(payload, TensorPayload) and isinstance(payload.array, np.ndarray)
    back = decode(payload)
    assert back.dtype == dtype and back.shape == (3, 4) and torch.equal(back, tensor)


def test_containers_non_contiguous_and_grad_tensors():
    weight = torch.randn(4, 3, requires_grad=True)
    value = {"t": weight.t(), "items": [torch.ones(2), 3, "x"], "pair": (torch.zeros(1), None),
             "sample": Sample(torch.arange(3), "s")}
    encoded = encode(value)
    assert isinstance(encoded["sample"].ids, TensorPayload) and encoded["items"][1:] == [3, "x"]
    back = decode(encoded)
    assert torch.equal(back["t"], weight.detach().t()) and not back["t"].requires_grad
    assert torch.equal(back["items"][0], torch.ones(2)) and back["pair"][1] is None
    assert type(back["sample"]) is Sample and torch.equal(back["sample"].ids, torch.arange(3))


def test_decoded_tensor_from_read_only_array_is_writable_copy():
    array = np.arange(4, dtype=np.float32)
    array.flags.writeable = False  # what a zero-copy get from Ray's object store returns
    tensor = decode(TensorPayload(array))
    tensor += 1
    assert tensor.tolist() == [1.0, 2.0, 3.0, 4.0] and array.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_numpy_and_python_values_pass_unchanged():
    array = np.ones(3)
    assert encode(array) is array and decode(array) is array
    assert encode({"a": 1}) == {"a": 1}
