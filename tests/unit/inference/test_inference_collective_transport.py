"""The collective refit transport's wire protocol: one broadcast per bucket once the bucket plan is known (headers
cross the wire once per plan), two alternating buffers, a changed plan recovered without a hang, several senders
(pipeline stages) each in a sub-group of its own. Threads stand in for the senders and the engines (gloo)."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from mrl.distributed.env import find_free_port
from mrl.inference.transports import collective


def _plan(seed: int, layers: int = 3) -> list[list[tuple[str, torch.Tensor]]]:
    """A refit's buckets (one layer each), mixed dtypes and odd byte sizes; new values for every `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return [[(f"model.layers.{i}.a", torch.randn(3, 5 + i, generator=gen)),
             (f"model.layers.{i}.b", torch.randn(7, generator=gen).to(torch.bfloat16)),
             (f"model.layers.{i}.c", torch.randint(0, 100, (2, 3), generator=gen))] for i in range(layers)]


@pytest.fixture
def broadcasts(monkeypatch) -> Counter:
    """Broadcasts per group (counted once per group: the sender's calls)."""
    counts: Counter = Counter()
    real = collective.collectives.broadcast

    def counting(tensor, group_src, group):
        if group.rank() == group_src:
            counts[id(group)] += 1
        real(tensor, group_src, group)

    monkeypatch.setattr(collective.collectives, "broadcast", counting)
    return counts


def _run(members: list[Callable[[], None]]) -> None:
    errors: list[BaseException] = []

    def guarded(member: Callable[[], None]) -> None:
        try:
            member()
        except BaseException as error:  # noqa: BLE001 -- reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(m,)) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


def _assert_same(received, sent) -> None:
    assert [n for n, _ in received] == [n for n, _ in sent]
    for (_, a), (_, b) in zip(received, sent):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_one_broadcast_per_bucket_once_the_plan_is_known(broadcasts):
    """Refit 1 sends every header (3 broadcasts a bucket), refit 2 all but its first bucket's (its predecessor is
    refit 1's last bucket, whose successor nobody knew), refit 3 on: one broadcast per bucket. Every bucket arrives
    bit-exact at both engines, the values changing refit after refit while the layout stays."""
    name, port, size, refits = f"t-{uuid.uuid4().hex}", find_free_port(), 3, 4
    plans = [_plan(seed) for seed in range(refits)]
    got: dict[int, list] = {1: [], 2: []}
    per_refit: list[int] = [0]  # the sender's broadcasts so far, after each refit

    def sender() -> None:
        collective.join_group(f"{name}-0", "127.0.0.1", port, 0, size, timeout_s=30)
        group = collective._MEMBERS[f"{name}-0"].group
        for plan in plans:
            for bucket in plan:
                collective.send_bucket(f"{name}-0", bucket)
            per_refit.append(broadcasts[id(group)])

    def receiver(rank: int) -> Callable[[], None]:
        def run() -> None:
            collective.join_group(f"{name}-{rank}", "127.0.0.1", port, rank, size, timeout_s=30)
            for plan in plans:
                for _ in plan:
                    # a copy: the views are only valid until the bucket after next arrives
                    got[rank].append([(n, t.clone()) for n, t in collective.receive_bucket(f"{name}-{rank}")])
        return run

    try:
        _run([sender, receiver(1), receiver(2)])
    finally:
        for rank in range(size):
            collective.leave_group(f"{name}-{rank}")
    assert [b - a for a, b in zip(per_refit, per_refit[1:])] == [9, 5, 3, 3]
    sent = [bucket for plan in plans for bucket in plan]
    for rank in (1, 2):
        assert len(got[rank]) == len(sent)
        for received, bucket in zip(got[rank], sent):
            _assert_same(received, bucket)


def test_two_buffers_alternate_and_a_changed_plan_is_recovered(broadcasts):
    """Bucket i's views survive bucket i + 1 (they live in the other slot); a layout the receivers did not predict
    (a new bucket size: two layers in one bucket, then an unseen shape) costs the 3-broadcast path once, not a hang
    or wrong bytes."""
    name, port = f"t-{uuid.uuid4().hex}", find_free_port()
    plan = _plan(0, layers=2)
    merged = [plan[0] + plan[1]]
    odd = [[("model.layers.0.a", torch.arange(11, dtype=torch.float64))]]
    order = [plan, plan, merged, merged, plan, odd, plan]  # refits, each a list of buckets
    sent = [bucket for refit in order for bucket in refit]
    received: list = []
    survived: list[bool] = []

    def sender() -> None:
        collective.join_group(f"{name}-0", "127.0.0.1", port, 0, 2, timeout_s=30)
        for bucket in sent:
            collective.send_bucket(f"{name}-0", bucket)

    def receiver() -> None:
        collective.join_group(f"{name}-1", "127.0.0.1", port, 1, 2, timeout_s=30)
        previous = None
        for index, bucket in enumerate(sent):
            views = collective.receive_bucket(f"{name}-1")
            if previous is not None:  # the previous bucket's views, after this one arrived
                survived.append(all(torch.equal(v, t) for (_, v), (_, t) in zip(previous, sent[index - 1])))
            received.append([(n, t.clone()) for n, t in views])
            previous = views

    try:
        _run([sender, receiver])
    finally:
        collective.leave_group(f"{name}-0")
        collective.leave_group(f"{name}-1")
    assert survived == [True] * (len(sent) - 1)
    for got, bucket in zip(received, sent):
        _assert_same(got, bucket)
    # predicted right (one broadcast): the 4th, 8th and 11th buckets (B after A); every other one is new or follows
    # a bucket whose successor changed (a wrong prediction: its size of garbage, then header and data)
    assert sum(broadcasts.values()) == 3 * len(sent) - 2 * 3


def test_pipeline_stages_send_their_own_buckets_in_sub_groups():
    """Two senders (stage 0: layer 0, stage 1: layer 1) with a sub-group each; the engine receives from both in the
    plan's order, each sub-group with its own header chain."""
    name, ports = f"t-{uuid.uuid4().hex}", [find_free_port(), find_free_port()]
    refits = [_plan(seed, layers=2) for seed in range(3)]
    received: list = []

    def sender(stage: int) -> Callable[[], None]:
        def run() -> None:
            collective.join_group(f"{name}-s{stage}", "127.0.0.1", ports[stage], 0, 2, timeout_s=30)
            for plan in refits:
                collective.send_bucket(f"{name}-s{stage}", plan[stage])
        return run

    def engine() -> None:
        for stage in (0, 1):  # every sub-group, in order (CollectiveTransport.join)
            collective.join_group(f"{name}-e{stage}", "127.0.0.1", ports[stage], 1, 2, timeout_s=30)
        for plan in refits:
            for stage in (0, 1):
                received.append([(n, t.clone()) for n, t in collective.receive_bucket(f"{name}-e{stage}")])

    try:
        _run([sender(0), sender(1), engine])
    finally:
        for key in ("s0", "s1", "e0", "e1"):
            collective.leave_group(f"{name}-{key}")
    for got, bucket in zip(received, [bucket for plan in refits for bucket in plan]):
        _assert_same(got, bucket)


def test_the_transport_routes_senders_and_engines_to_their_sub_groups(monkeypatch):
    joined: list[tuple] = []
    monkeypatch.setattr(collective, "join_group",
                        lambda name, address, port, member, size, timeout_s=600.0, *, backend="gloo":
                        joined.append((name, address, port, member, size)))
    transport = collective.CollectiveTransport("g", "a0", 1, 3, stages=(("a1", 2),))
    assert transport.senders == 2 and transport.in_flight == 2 and transport.meets
    transport.join(0)
    transport.join_sender(1)
    transport.join(2)  # engine 1: every sub-group
    assert joined == [("g", "a0", 1, 0, 3), ("g/s1", "a1", 2, 0, 3), ("g", "a0", 1, 2, 3), ("g/s1", "a1", 2, 2, 3)]
    assert transport.receiver_payload(1) == {"kind": "collective", "group": "g/s1"}
    assert transport.receiver_payload() == {"kind": "collective", "group": "g"}


def test_a_receiver_out_of_step_with_its_sender_fails_loudly():
    """A receiver whose bucket count differs from its sender's (e.g. it joined late) gets an error, not a tensor of
    someone else's bytes. (The bucket is a predicted one, a single broadcast, so the sender is not left waiting.)"""
    name, port = f"t-{uuid.uuid4().hex}", find_free_port()
    bucket = _plan(0, layers=1)[0]
    errors: list[str] = []

    def sender() -> None:
        collective.join_group(f"{name}-0", "127.0.0.1", port, 0, 2, timeout_s=30)
        for _ in range(3):  # the third is predicted: its header followed the second's before
            collective.send_bucket(f"{name}-0", bucket)

    def receiver() -> None:
        collective.join_group(f"{name}-1", "127.0.0.1", port, 1, 2, timeout_s=30)
        for _ in range(2):
            collective.receive_bucket(f"{name}-1")
        collective._MEMBERS[f"{name}-1"].chain.sequence += 1
        try:
            collective.receive_bucket(f"{name}-1")
        except RuntimeError as error:
            errors.append(str(error))

    try:
        _run([sender, receiver])
    finally:
        collective.leave_group(f"{name}-0")
        collective.leave_group(f"{name}-1")
    assert errors and "out of step" in errors[0]


def test_the_header_chain_is_forgotten_on_every_member_alike(monkeypatch):
    monkeypatch.setattr(collective, "MAX_CHAIN", 2)
    chain = collective._Chain()
    headers = [collective._Header.of([[f"w{i}", "float32", [1], 0, 4]], 4) for i in range(4)]
    for header in headers:
        chain.advance(header)
    assert len(chain.after) <= 2 and chain.sequence == 4 and chain.previous == headers[-1].key
