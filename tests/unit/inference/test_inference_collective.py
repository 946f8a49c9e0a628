"""The collective refit transport: a bucket of mixed dtypes and shapes broadcast from member 0 arrives bit-exact at
every other member (threads stand in for the policy's rank 0 and two engines)."""

from __future__ import annotations

import threading
import uuid

import torch

from mrl.distributed.env import find_free_port
from mrl.inference.transports import collective


def test_bucket_arrives_bit_exact_at_every_member():
    gen = torch.Generator().manual_seed(0)
    bucket = [("model.layers.0.a", torch.randn(3, 5, generator=gen)),
              ("model.layers.0.b", torch.randn(7, generator=gen).to(torch.bfloat16)),  # odd byte size: alignment
              ("model.layers.0.c", torch.arange(6, dtype=torch.int64).view(2, 3)),
              ("model.norm.weight", torch.randn(4, generator=gen, dtype=torch.float64))]
    name, port, size = f"test-{uuid.uuid4().hex}", find_free_port(), 3
    got: dict[int, list] = {}
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            collective.join_group(f"{name}-{rank}", "127.0.0.1", port, rank, size, timeout_s=60)
            # every member joins under its own registry key: the threads share this module's registry
            if rank == 0:
                got[0] = [collective.send_bucket(f"{name}-0", bucket)]
            else:
                got[rank] = collective.receive_bucket(f"{name}-{rank}")
        except BaseException as error:  # noqa: BLE001 -- reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert got[0][0] >= sum(t.numel() * t.element_size() for _, t in bucket)
    for rank in (1, 2):
        assert [n for n, _ in got[rank]] == [n for n, _ in bucket]
        for (_, sent), (_, received) in zip(bucket, got[rank]):
            assert received.dtype == sent.dtype and torch.equal(received, sent)
    for rank in range(size):
        collective.leave_group(f"{name}-{rank}")


def test_transport_announces_the_group_only_and_meets():
    transport = collective.CollectiveTransport("g", "127.0.0.1", 1234, 3)
    assert transport.receiver_payload() == {"kind": "collective", "group": "g"}
    assert transport.meets and transport.kind == "collective"
    transport.release(transport.receiver_payload())  # nothing to free: buffers stay for the next bucket
