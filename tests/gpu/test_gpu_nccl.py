"""The collective refit transport over NCCL: a bucket broadcast from the sender's GPU arrives bit-exact on another
GPU. Needs two devices (sender and receiver on one device is not what NCCL broadcasts are for)."""

from __future__ import annotations

import uuid

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                reason="the NCCL refit transport needs two GPUs (a sender and a receiver)")


def _member(rank: int, name: str, port: int, out) -> None:
    from mrl.inference.transports import collective

    torch.cuda.set_device(rank)
    collective.join_group(name, "127.0.0.1", port, rank, 2, timeout_s=120, backend="nccl")
    g = torch.Generator(device="cuda").manual_seed(0)
    bucket = [("model.layers.0.a", torch.randn(1000, 7, device="cuda", generator=g)),
              ("model.layers.0.b", torch.randn(33, device="cuda", generator=g).to(torch.bfloat16))]
    if rank == 0:
        collective.send_bucket(name, bucket)
        out.put(("sent", None))
    else:
        got = collective.receive_bucket(name)
        out.put(("received", all(torch.equal(a[1], b[1]) and a[0] == b[0] for a, b in zip(got, bucket))))


def test_a_bucket_arrives_bit_exact_over_nccl():
    from mrl.distributed.env import find_free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    name, port = f"nccl-{uuid.uuid4().hex[:8]}", find_free_port()
    procs = [ctx.Process(target=_member, args=(rank, name, port, out)) for rank in (0, 1)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert results == {"sent": None, "received": True}
