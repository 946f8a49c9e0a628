"""Weight transports round-trip exactly and clean up after themselves."""

import os
import pickle

import pytest
import torch

from mrl.inference.transports import make_transport, unpack_payload


def _bucket():
    gen = torch.Generator().manual_seed(0)
    return [
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 4, generator=gen)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(8, generator=gen)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(4, 6, generator=gen).t()),  # a non-contiguous view
    ]


def test_shm_file_round_trip_and_removal(tmp_path):
    transport = make_transport("shm_file", shm_dir=str(tmp_path))
    bucket = _bucket()
    payload = transport.pack(bucket)
    [path] = payload["paths"]
    assert path.startswith(str(tmp_path)) and os.path.exists(path)
    received = dict(unpack_payload(payload))
    assert set(received) == {name for name, _ in bucket}
    for name, tensor in bucket:
        assert torch.equal(received[name], tensor)
    transport.release(payload)
    assert list(tmp_path.iterdir()) == []


def test_shm_file_parts_of_ranks_join_into_one_bucket(tmp_path):
    """Two ranks each pack part of a bucket (each expert-parallel rank its own experts): the merged payload carries
    both files, every tensor, the names and bytes of both; releasing it removes both files; overlapping parts and a
    bucket nobody packed are refused."""
    transport = make_transport("shm_file", shm_dir=str(tmp_path))
    bucket = _bucket()
    first, second = transport.pack(bucket[:1]), transport.pack(bucket[1:])
    payload = transport.merge([first, None, second])
    assert len(payload["paths"]) == 2 and payload["names"] == [name for name, _ in bucket]
    assert payload["bytes"] == sum(t.numel() * t.element_size() for _, t in bucket)
    received = dict(unpack_payload(payload))
    assert set(received) == {name for name, _ in bucket}
    for name, tensor in bucket:
        assert torch.equal(received[name], tensor)
    with pytest.raises(ValueError, match="packed by two ranks"):
        transport.merge([first, first])
    with pytest.raises(ValueError, match="no rank packed"):
        transport.merge([None, None])
    transport.release(payload)
    assert list(tmp_path.iterdir()) == []


def test_in_process_passes_the_same_tensors():
    transport = make_transport("in_process")
    bucket = _bucket()
    payload = transport.pack(bucket)
    received = unpack_payload(payload)
    assert all(a[1] is b[1] for a, b in zip(received, bucket))
    transport.release(payload)
    assert payload["tensors"] == []


def test_unknown_payload_and_transport_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown kind"):
        unpack_payload({"kind": "carrier-pigeon"})
    with pytest.raises(ValueError, match="'in_process', 'shm_file' or 'cuda_ipc'"):
        make_transport("nccl")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not exist"):
        make_transport("shm_file", shm_dir=str(tmp_path / "missing"))


def test_cuda_ipc_is_refused_clearly_without_cuda():
    """The CUDA IPC transport runs in make test-gpu; on CPU its misuse says what to use instead."""
    from mrl.inference.transports import CudaIpcTransport, make_transport
    from mrl.inference.vllm_backend import VllmEngineConfig

    if torch.cuda.is_available():
        pytest.skip("CUDA is here: tests/gpu exercises the transport")
    transport = make_transport("cuda_ipc")
    assert isinstance(transport, CudaIpcTransport) and transport.in_flight == 2 and not transport.meets
    with pytest.raises(ValueError, match="sends device tensors.*shm_file"):
        transport.pack([("w", torch.ones(2))])
    from mrl.inference.vllm_backend import VllmBackend

    config = VllmEngineConfig(model_path="m", refit_transport="cuda_ipc")  # a driver without CUDA may plan it
    with pytest.raises(ValueError, match="needs CUDA.*shm_file"):
        VllmBackend(config)  # the engine, where the device is known, refuses it before building anything
    assert pickle.loads(pickle.dumps(transport)) == transport  # settings only: it travels to the sender by pickle
