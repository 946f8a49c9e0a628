"""The CUDA IPC refit transport between two processes on one device: a bucket of mixed dtypes arrives bit-exact, the
two slots alternate and are reused, and the throughput of moving a ~1 GB model through it (GB/s) is printed."""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp

BUCKET_MB = 256
MODEL_MB = 1024


def _bucket(seed: int, mb: float) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = int(mb * 2**20 / 4 / 4)
    return [(f"model.layers.{seed}.a", torch.randn(n, device="cuda", generator=g)),
            (f"model.layers.{seed}.b", torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)),
            (f"model.layers.{seed}.c", torch.randint(-9, 9, (n // 2,), device="cuda", generator=g)),
            (f"model.layers.{seed}.d", torch.randn(n + 3, device="cuda", generator=g).to(torch.float16))]


def _checksums(named) -> dict:
    """Per tensor: dtype, shape, the sum of its bytes and the sum of its values."""
    return {name: (t.dtype, t.shape, t.contiguous().view(torch.uint8).sum().item(), t.float().sum().item())
            for name, t in named}


def _receiver(payloads, answers) -> None:
    """Unpack each payload as an engine worker would, copy it into 'parameters', answer with their checksums."""
    from mrl.inference.transports import unpack_payload

    params: dict[str, torch.Tensor] = {}
    while (payload := payloads.get()) is not None:
        for name, view in unpack_payload(payload):
            params.setdefault(name, torch.empty_like(view)).copy_(view)
        torch.cuda.synchronize()
        answers.put(_checksums((name, params[name]) for name in payload["names"]))


@pytest.fixture
def receiver():
    ctx = mp.get_context("spawn")
    payloads, answers = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(payloads, answers))
    proc.start()
    yield payloads, answers
    payloads.put(None)
    proc.join(timeout=60)


def test_buckets_arrive_bit_exact_through_two_alternating_slots(receiver):
    from mrl.inference.transports import CudaIpcTransport

    payloads, answers = receiver
    transport = CudaIpcTransport()
    seen = []
    for seed in range(4):
        bucket = _bucket(seed, 8)
        payload = transport.pack(bucket)
        seen.append((payload["slot"], payload["handle"]["handle"]))
        payloads.put(payload)
        assert answers.get(timeout=120) == _checksums(bucket)
        transport.release(payload)
    assert [slot for slot, _ in seen] == [0, 1, 0, 1]
    assert seen[0][1] == seen[2][1] and seen[1][1] == seen[3][1] and seen[0][1] != seen[1][1]  # handles reused


def test_refit_throughput_of_a_1gb_model(receiver, figure):
    from mrl.inference.transports import CudaIpcTransport

    payloads, answers = receiver
    transport = CudaIpcTransport()
    buckets = [_bucket(seed, BUCKET_MB) for seed in range(MODEL_MB // BUCKET_MB)]
    total = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
    payloads.put(transport.pack(buckets[0]))  # warm-up: buffers made, handles opened
    answers.get(timeout=300)
    start = time.perf_counter()
    for bucket in buckets:
        payloads.put(transport.pack(bucket))
        answers.get(timeout=300)
    seconds = time.perf_counter() - start
    figure("cuda_ipc.refit_gib_s", total / 2**30 / seconds, "GiB/s", gib=total / 2**30, seconds=seconds,
           bucket_mib=BUCKET_MB, what="pack + map + copy into the receiver's tensors")
    assert seconds > 0
