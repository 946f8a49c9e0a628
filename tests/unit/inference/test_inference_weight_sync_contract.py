"""The weight-sync contract every transport keeps (mrl/inference/transports/base.py `WeightTransport`), one test run
per mode that runs on CPU: in-process, shared-memory files, a collective broadcast (gloo, sender and engine in two
threads of this process), and CUDA IPC with its device calls stood in by host ones (the routing and the slots are
the real code; tests/gpu runs it between processes on a GPU).

    pack -> merge -> unpack      the receiver gets the sender's tensors: names, dtypes, values
    in_flight                    the last `in_flight` buckets stay readable while later ones are packed, and the refit
                                 loop never has more than `in_flight` payloads packed and not released
    release                      frees what pack made (shared-memory files gone), also after a failed refit
    completeness                 a refit that misses a tensor the engine expects is refused (`RefitError`), the sink
                                 told the refit did not complete
    declared members only        the refit loop reads nothing a transport does not declare (a proxy with exactly the
                                 protocol's members stands in for it), and every transport has every member
The sender here is one policy rank that packs as the transport's `sending` says (rank0 / every_rank / stages), the
controller joining its return value with `merge`, as mrl/policy/worker.py and group.py do."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

import mrl.distributed
from mrl.distributed.env import find_free_port
from mrl.inference.buckets import iter_buckets
from mrl.inference.refit import RefitError, refit
from mrl.inference.transports import (
    CollectiveTransport,
    CudaIpcTransport,
    InProcessTransport,
    SharedMemoryFileTransport,
    WeightTransport,
    collective,
    cuda_ipc,
    unpack_payload,
)
from mrl.inference.transports.base import SenderLayout, describe
from mrl.parallel import collectives

pytestmark = pytest.mark.unit

MODES = ["in_process", "shm_file", "collective", "cuda_ipc"]
ONE_RANK = SenderLayout(pipeline_stages=1, expert_parallel=1)
#: Every member the protocol declares: what the refit loop and the policy may ask of a transport.
DECLARED = ("kind", "meets", "in_flight", "senders", "sending", "pack", "pack_on_ranks", "merge", "receiver_payload",
            "release")


def _bucket(seed: int) -> list[tuple[str, torch.Tensor]]:
    """One layer's tensors in three dtypes and odd sizes; new values for every `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return [(f"model.layers.{seed}.a", torch.randn(3, 5, generator=gen)),
            (f"model.layers.{seed}.b", torch.randn(7, generator=gen).to(torch.bfloat16)),
            (f"model.layers.{seed}.c", torch.randint(0, 100, (2, 3), generator=gen))]


def _assert_same(received: list, sent: list) -> None:
    assert sorted(n for n, _ in received) == sorted(n for n, _ in sent)
    got = dict(received)
    for name, tensor in sent:
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def _rank_pack(transport: WeightTransport, bucket: list) -> dict:
    """A one-rank policy's export: the rank packs as `sending` says, the controller merges (mrl/policy)."""
    sending = transport.sending(ONE_RANK)
    if sending == "every_rank":
        part = transport.pack_on_ranks(bucket)
    else:
        assert sending in ("rank0", "stages"), sending  # one stage: its first rank is rank 0, sender 0
        part = transport.pack(bucket, sender=0)
    return transport.merge([part])


class _Thread:
    """A call under way in a thread (stands in for a worker group's future)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, args=(fn,))
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.value = fn()
        except BaseException as error:  # noqa: BLE001 -- raised by result()
            self.error = error

    def result(self, timeout_s: Optional[float] = None) -> Any:
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "a member of the refit group hung"
        if self.error is not None:
            raise self.error
        return self.value


class Mode:
    """One transport and how its two ends are reached from this process."""

    def __init__(self, name: str, transport: WeightTransport, files: Optional[Path] = None) -> None:
        self.name, self.transport, self.files = name, transport, files
        self.alias: Optional[str] = None  # collective: the engine's name for the group (both ends in one process)

    def receiver_view(self, payload: dict) -> dict:
        return {**payload, "group": self.alias} if self.alias is not None else payload

    def deliver(self, buckets: list[list]) -> tuple[list[dict], list[list]]:
        """Each bucket packed by the sender and unpacked by the receiver, in order, nothing released: the payloads
        and the receiver's tensors (as the receiver holds them: views, where the transport gives views)."""
        payloads: list[dict] = []
        received: list[list] = []
        for bucket in buckets:
            if self.transport.meets:
                announced = self.receiver_view(self.transport.receiver_payload(0))
                receiving = _Thread(lambda: unpack_payload(announced))
                payloads.append(_rank_pack(self.transport, bucket))
                received.append(receiving.result())
            else:
                payloads.append(_rank_pack(self.transport, bucket))
                received.append(unpack_payload(payloads[-1]))
        return payloads, received

    def leftovers(self) -> list[Path]:
        """What `pack` made that is still there (shared-memory files)."""
        return sorted(self.files.iterdir()) if self.files is not None else []


@pytest.fixture
def fake_cuda(monkeypatch) -> None:
    """CUDA IPC's device calls on host memory: a slot's buffer is a host tensor made or grown per (transport, slot)
    and reused (as on a GPU), its share names it, and opening a share gives that very buffer (as a mapping would)."""
    blocks: dict[bytes, torch.Tensor] = {}

    class Stream:
        def synchronize(self) -> None:
            pass

    def slot_buffer(name: str, slot: int, size: int, device: torch.device) -> tuple[torch.Tensor, dict]:
        key = f"{name}/{slot}".encode()
        if key not in blocks or blocks[key].numel() < size:
            blocks[key] = torch.empty(max(size, 1), dtype=torch.uint8)
        block = blocks[key]
        return block[:size], {"uuid": "GPU-0", "handle": key, "storage_offset": 0, "storage_bytes": block.numel()}

    monkeypatch.setattr(cuda_ipc, "_slot_buffer", slot_buffer)
    monkeypatch.setattr(cuda_ipc, "device_uuid", lambda index: "GPU-0")
    monkeypatch.setattr(cuda_ipc, "open_handle", lambda shared, index: blocks[shared["handle"]])
    monkeypatch.setattr(cuda_ipc, "_SENT", {})
    monkeypatch.setattr(cuda_ipc, "_NEXT", {})
    monkeypatch.setattr(cuda_ipc, "_OPENED", {})
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(collectives, "world_size", lambda group=None: 1)  # one policy rank


@pytest.fixture(params=MODES)
def mode(request, tmp_path) -> Iterator[Mode]:
    name = request.param
    if name == "in_process":
        yield Mode(name, InProcessTransport())
    elif name == "shm_file":
        yield Mode(name, SharedMemoryFileTransport(str(tmp_path)), files=tmp_path)
    elif name == "cuda_ipc":
        request.getfixturevalue("fake_cuda")
        yield Mode(name, CudaIpcTransport())
    else:
        group, port = f"contract-{uuid.uuid4().hex[:8]}", find_free_port()
        transport = CollectiveTransport(group, "127.0.0.1", port, size=2)
        engine = _Thread(lambda: collective.join_group(f"{group}-engine", "127.0.0.1", port, 1, 2, timeout_s=30))
        transport.join(0, timeout_s=30)
        engine.result()
        found = Mode(name, transport)
        found.alias = f"{group}-engine"
        try:
            yield found
        finally:
            collective.leave_group(group)
            collective.leave_group(f"{group}-engine")


# ------------------------------------------------------------------------------------------------ the transport
def test_every_transport_declares_every_member_and_its_sender_strategy(mode):
    transport = mode.transport
    assert all(hasattr(transport, member) for member in DECLARED)
    assert transport.in_flight >= 1 and transport.senders == 1
    expected = {"in_process": "rank0", "shm_file": "rank0", "collective": "stages", "cuda_ipc": "every_rank"}
    assert transport.sending(ONE_RANK) == expected[mode.name]
    moe = SenderLayout(pipeline_stages=1, expert_parallel=2)  # the EP ranks pack their own experts: files only
    assert transport.sending(moe) == ("expert_parts" if mode.name == "shm_file" else expected[mode.name])
    staged = SenderLayout(pipeline_stages=2, expert_parallel=2)  # one sender: rank 0 packs everything
    assert transport.sending(staged) == ("rank0" if mode.name == "collective" else expected[mode.name])
    if not transport.meets:
        with pytest.raises(TypeError, match="announces nothing"):
            transport.receiver_payload(0)


def test_pack_send_unpack_gives_the_senders_tensors(mode):
    buckets = [_bucket(0), _bucket(1)]
    payloads, received = mode.deliver(buckets)
    for payload, got, sent in zip(payloads, received, buckets):
        _assert_same(got, sent)
        assert payload["kind"] == mode.transport.kind and sorted(payload["names"]) == sorted(n for n, _ in sent)
        assert payload["bytes"] == sum(t.numel() * t.element_size() for _, t in sent)
    for payload in payloads:
        mode.transport.release(payload)


def test_the_last_in_flight_buckets_stay_readable_while_later_ones_are_packed(mode):
    """What `in_flight` promises the refit loop: payload i is still good after buckets i + 1 .. i + in_flight - 1
    were packed (two files, two device slots, two broadcast buffers)."""
    buckets = [_bucket(seed) for seed in range(mode.transport.in_flight)]
    payloads, received = mode.deliver(buckets)
    for got, sent in zip(received, buckets):
        _assert_same(got, sent)
    for payload in payloads:
        mode.transport.release(payload)


def test_release_frees_what_pack_made(mode):
    bucket = _bucket(0)
    payloads, _ = mode.deliver([bucket])
    if mode.files is not None:
        assert len(mode.leftovers()) == 1
    mode.transport.release(payloads[0])
    assert mode.leftovers() == []
    if mode.name == "in_process":
        assert payloads[0]["tensors"] == []  # the transport's references dropped


def test_merge_takes_the_one_packers_payload_and_refuses_a_bucket_packed_twice_or_never(mode):
    """`merge`: where one rank packs (rank0, stages) the controller gets its payload whatever the others returned;
    a bucket that no rank packed is refused, and so is one packed by two ranks, unless the transport joins parts
    (the files of EP ranks, the handles of GPUs: their own tests)."""
    transport = mode.transport
    with pytest.raises(ValueError):
        transport.merge([None, None])
    if transport.sending(ONE_RANK) == "every_rank":
        return
    if transport.meets:  # what the sender's pack returns, without the broadcast
        part = describe(transport.receiver_payload(0), _bucket(0))
    else:
        part = transport.pack(_bucket(0))
    assert transport.merge([None, part, None])["names"] == part["names"]
    if mode.name != "shm_file":  # files: the parts' names must differ (test_inference_transports)
        with pytest.raises(ValueError, match="exactly one rank"):
            transport.merge([part, part])
    transport.release(part)


# ------------------------------------------------------------------------------------------------ the refit loop
class Counting:
    """Exactly the protocol's members, delegated: the refit loop reading anything else fails here. Counts the
    payloads packed and not yet released."""

    def __init__(self, inner: WeightTransport) -> None:
        self.inner = inner
        self.kind, self.meets, self.in_flight = inner.kind, inner.meets, inner.in_flight
        self.alive = self.most = self.released = 0
        self.lock = threading.Lock()

    @property
    def senders(self) -> int:
        return self.inner.senders

    def _packed(self) -> None:
        with self.lock:
            self.alive += 1
            self.most = max(self.most, self.alive)

    def sending(self, layout: SenderLayout):
        return self.inner.sending(layout)

    def pack(self, bucket, sender=0):
        payload = self.inner.pack(bucket, sender)
        self._packed()
        return payload

    def pack_on_ranks(self, bucket):
        payload = self.inner.pack_on_ranks(bucket)
        self._packed()
        return payload

    def merge(self, parts):
        return self.inner.merge(parts)

    def receiver_payload(self, sender=0):
        return self.inner.receiver_payload(sender)

    def release(self, payload) -> None:
        self.inner.release(payload)
        with self.lock:
            self.alive -= 1
            self.released += 1


class OneRankPolicy:
    """A source whose one rank packs as `sending` says (mrl/policy/worker.py), merged as the controller does; with a
    collective transport it sends from a thread while the engine receives (`send_bucket_async`). Its plan is made
    up front, as the policy's is (from the config alone)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state
        self.buckets: list[list] = []

    def plan_buckets(self, bucket_bytes: int) -> range:
        self.buckets = list(iter_buckets(self.state.items(), bucket_bytes))
        return range(len(self.buckets))

    def send_bucket(self, index: int, transport: Any) -> dict:
        return _rank_pack(transport, self.buckets[index])

    def send_bucket_async(self, index: int, transport: Any) -> _Thread:
        return _Thread(lambda: _rank_pack(transport, self.buckets[index]))

    def bucket_sender(self, index: int) -> int:
        return 0


class Engine:
    """A sink that loads without waiting (the load runs when awaited; a collective one receives in a thread at
    once) and keeps a copy of every tensor it got."""

    def __init__(self, mode: Mode, expected_names: Optional[frozenset[str]]) -> None:
        self.mode, self.expected_names = mode, expected_names
        self.got: dict[str, torch.Tensor] = {}
        self.finished: list[bool] = []

    def prepare_for_refit(self) -> None:
        pass

    def _load(self, payload: dict) -> None:
        for name, tensor in unpack_payload(self.mode.receiver_view(payload)):
            self.got[name] = tensor.clone()

    def load_payload(self, payload: dict) -> None:
        self._load(payload)

    def load_payload_async(self, payload: dict) -> Any:
        if self.mode.transport.meets:
            return _Thread(lambda: self._load(payload))
        engine = self

        class Later:
            def result(self, timeout_s: Optional[float] = None) -> None:
                engine._load(payload)

        return Later()

    def finish_refit(self, complete: bool = True) -> None:
        self.finished.append(complete)


@pytest.fixture
def sequential_waits(monkeypatch) -> None:
    """`wait_all` over thread futures (the refit loop's meeting path awaits sender and receivers together)."""
    monkeypatch.setattr(mrl.distributed, "wait_all", lambda futures, timeout_s=None: [f.result() for f in futures])


def _state(layers: int = 4) -> dict[str, torch.Tensor]:
    return {name: tensor for seed in range(layers) for name, tensor in _bucket(seed)}


@pytest.mark.usefixtures("sequential_waits")
def test_a_refit_moves_every_tensor_with_at_most_in_flight_payloads_alive(mode):
    state = _state()
    transport = Counting(mode.transport)
    engine = Engine(mode, expected_names=frozenset(state))
    bucket_bytes = sum(t.numel() * t.element_size() for _, t in _bucket(0))  # one layer a bucket
    stats = refit(OneRankPolicy(state), engine, transport, bucket_bytes=bucket_bytes)  # type: ignore[arg-type]
    assert stats.num_buckets == 4 and stats.num_tensors == len(state) and engine.finished == [True]
    _assert_same(list(engine.got.items()), list(state.items()))
    assert 1 <= transport.most <= mode.transport.in_flight
    assert transport.alive == 0 and transport.released == 4 and mode.leftovers() == []


@pytest.mark.usefixtures("sequential_waits")
def test_a_refit_missing_a_tensor_the_engine_expects_is_refused(mode):
    state = _state(layers=2)
    transport = Counting(mode.transport)
    engine = Engine(mode, expected_names=frozenset(state) | {"lm_head.weight"})
    with pytest.raises(RefitError, match="missing 1"):
        refit(OneRankPolicy(state), engine, transport, bucket_bytes=1 << 20)  # type: ignore[arg-type]
    assert engine.finished == [False]  # the engine does not count it as a whole refit
    assert transport.alive == 0 and mode.leftovers() == []
