"""The CUDA IPC transport's logic that needs no GPU: each receiver routes to its own GPU's handle by UUID and refuses
a GPU the payload does not name, the mapping cache is keyed by what identifies the bytes (a grown slot carved from
the same segment is opened again, and the old mapping dropped first), the ranks' parts merge into one handle per
GPU, and a vLLM worker answers a bucket only after its stream was synchronised (a recording stream stand-in).
The GPU side (handles opened between processes, the race with a delay on the receiver's stream): tests/gpu."""

from __future__ import annotations

import pytest
import torch

from mrl.inference.transports import cuda_ipc
from mrl.inference.transports.in_process import InProcessTransport
from mrl.inference.vllm_extension import load_bucket

pytestmark = pytest.mark.unit


def _share(handle: bytes, offset: int, size: int, gpu: str = "GPU-aaaa") -> dict:
    return {"uuid": gpu, "handle": handle, "storage_offset": offset, "storage_bytes": size}


def _payload(*gpus: str, slot: int = 0) -> dict:
    return {"kind": "cuda_ipc", "sender": "s", "slot": slot, "header": [],
            "handles": {g: _share(b"h-" + g.encode(), 0, 64, g) for g in gpus}}


def test_a_receiver_opens_the_handle_of_its_own_gpu():
    payload = _payload("GPU-aaaa", "GPU-bbbb")
    assert cuda_ipc.route(payload, "GPU-bbbb")["handle"] == b"h-GPU-bbbb"
    assert cuda_ipc.route(payload, "GPU-aaaa")["handle"] == b"h-GPU-aaaa"


def test_a_gpu_the_payload_does_not_name_is_refused_with_a_named_error():
    with pytest.raises(cuda_ipc.IpcDeviceError, match=r"GPU-cccc.*GPU-aaaa.*GPU-bbbb"):
        cuda_ipc.route(_payload("GPU-aaaa", "GPU-bbbb"), "GPU-cccc")


def test_the_cache_reopens_a_grown_slot_in_the_same_segment_and_drops_the_old_mapping_first(monkeypatch):
    monkeypatch.setattr(cuda_ipc, "_OPENED", {})
    opened = []

    def open_for(key):
        def opener(shared):
            assert key not in cuda_ipc._OPENED, "the old mapping must be dropped before the new one is opened"
            opened.append(cuda_ipc.identity(shared))
            return torch.zeros(1)
        return opener

    first = cuda_ipc.mapped(("s", 0), _share(b"seg", 0, 100), open_for(("s", 0)))
    assert cuda_ipc.mapped(("s", 0), _share(b"seg", 0, 100), open_for(("s", 0))) is first  # same bytes, same map
    cuda_ipc.mapped(("s", 0), _share(b"seg", 512, 300), open_for(("s", 0)))  # grown: same segment, another block
    cuda_ipc.mapped(("s", 0), _share(b"seg", 512, 600), open_for(("s", 0)))  # grown in place: same offset, larger
    cuda_ipc.mapped(("s", 1), _share(b"seg", 512, 600), open_for(("s", 1)))  # the other slot has its own mapping
    assert cuda_ipc._OPENED[("s", 0)][0] == (b"seg", 512, 600)
    assert opened == [(b"seg", 0, 100), (b"seg", 512, 300), (b"seg", 512, 600), (b"seg", 512, 600)]


def _part(gpu: str, *, first: bool = False, slot: int = 0) -> dict:
    part = {"kind": "cuda_ipc", "sender": "s", "slot": slot, "handles": {gpu: _share(b"h", 0, 8, gpu)}}
    return {**part, "header": [["w", "float32", [2], 0, 8]], "names": ["w"], "bytes": 8} if first else part


def test_the_ranks_parts_merge_into_one_handle_per_gpu():
    merged = cuda_ipc.merge([_part("GPU-0", first=True), _part("GPU-1"), None, _part("GPU-3")])
    assert sorted(merged["handles"]) == ["GPU-0", "GPU-1", "GPU-3"]
    assert merged["header"] == [["w", "float32", [2], 0, 8]] and merged["names"] == ["w"]


def test_two_ranks_on_one_gpu_or_buckets_out_of_step_are_refused():
    with pytest.raises(ValueError, match="two policy ranks export from GPU GPU-0"):
        cuda_ipc.merge([_part("GPU-0", first=True), _part("GPU-0")])
    with pytest.raises(ValueError, match="out of step"):
        cuda_ipc.merge([_part("GPU-0", first=True), _part("GPU-1", slot=1)])


def test_a_bucket_on_the_host_is_refused():
    with pytest.raises(ValueError, match="use shm_file"):
        cuda_ipc.CudaIpcTransport().pack([("w", torch.zeros(2))])


class _RecordingStream:
    """Stands in for torch.cuda.Stream (its documented contract: work queued on it runs in order, asynchronously to
    the host; `synchronize()` returns once all of it ran). It records what was queued and when the host waited."""

    def __init__(self, log: list) -> None:
        self.log = log

    def synchronize(self) -> None:
        self.log.append("synchronize")


class _Worker:
    """A vLLM worker's surface that `load_bucket` uses: reload_weights queues one copy per tensor on the stream."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.model_runner = self

    def get_model(self) -> torch.nn.Module:
        return torch.nn.Module()

    def reload_weights(self, weights_iterator, is_checkpoint_format: bool) -> None:
        self.log.extend(f"copy {name}" for name, _ in weights_iterator)


def test_a_worker_answers_only_after_its_copies_ran():
    log: list = []
    bucket = [("a", torch.ones(2)), ("b", torch.zeros(3))]
    count = load_bucket(_Worker(log), InProcessTransport().pack(bucket), stream=_RecordingStream(log))
    log.append("answer")
    assert count == 2
    assert log == ["copy a", "copy b", "synchronize", "answer"]


def test_without_the_fence_the_answer_would_overtake_the_copies(monkeypatch):
    """The check above can fail: with the fence gone, nothing waits for the queued copies."""
    from mrl.inference import vllm_extension

    monkeypatch.setattr(vllm_extension, "fence", lambda stream=None: None)
    log: list = []
    load_bucket(_Worker(log), InProcessTransport().pack([("a", torch.ones(2))]), stream=_RecordingStream(log))
    assert "synchronize" not in log


def test_every_rank_holds_rank_0s_bucket_and_shares_its_own_gpus_copy(monkeypatch):
    """`pack_on_ranks` on two ranks, one after the other in this process (each with its own sender state), the
    broadcast recorded on rank 0 and replayed on rank 1; device buffers and shares stood in by host ones."""
    gpu_of, buffers = {}, []
    monkeypatch.setattr(cuda_ipc, "_this_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _RecordingStream([]))

    def slot_buffer(name, slot, size, device):
        buffer = torch.zeros(max(size, 1), dtype=torch.uint8)
        buffers.append(buffer[:size])
        return buffer[:size], {"uuid": gpu_of["rank"], "handle": b"h", "storage_offset": 0, "storage_bytes": size}

    monkeypatch.setattr(cuda_ipc, "_slot_buffer", slot_buffer)
    sent: list[torch.Tensor] = []

    def record(tensor, into=None):
        sent.append((into if into is not None else tensor).clone())
        return into if into is not None else tensor

    replay = iter(())

    def play(tensor, into=None):
        value = next(replay)
        if into is None:
            return value
        into.copy_(value)
        return into

    bucket = [("w", torch.arange(6.0)), ("b", torch.tensor([1, 2, 3], dtype=torch.int64))]
    transport = cuda_ipc.CudaIpcTransport(name="t")
    parts = []
    for rank, gpu in enumerate(("GPU-0", "GPU-1")):
        gpu_of["rank"] = gpu
        monkeypatch.setattr(cuda_ipc, "_SENT", {})
        monkeypatch.setattr(cuda_ipc, "_NEXT", {})
        if rank == 1:
            replay = iter(sent)
        parts.append(transport.pack_on_ranks(bucket if rank == 0 else None, group_size=2,
                                             broadcast=record if rank == 0 else play))
    payload = transport.merge(parts)
    assert sorted(payload["handles"]) == ["GPU-0", "GPU-1"] and payload["names"] == ["w", "b"]
    assert "header" not in parts[1] and parts[1]["slot"] == parts[0]["slot"] == 0
    # what rank 1 received is rank 0's packed bucket: its views are the bucket's tensors
    from mrl.inference.buckets import flat_views

    assert len(buffers) == 2 and buffers[1].data_ptr() != buffers[0].data_ptr()
    views = dict(flat_views(buffers[1], payload["header"]))
    assert torch.equal(views["w"], bucket[0][1]) and torch.equal(views["b"], bucket[1][1])


class _SessionModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.kept: list = []

    def load_weights(self, weights) -> set:
        self.kept.extend(weights)  # vLLM keeps a module's tensors until the module is whole
        return {name for name, _ in self.kept}


def test_in_a_refit_session_the_bucket_is_copied_before_vllm_keeps_it():
    """In one reload session per refit vLLM may hold a bucket's tensors past the call; the sender's buffer is then
    reused (the next-but-one bucket), so what vLLM keeps must be the worker's own copy, not a view of it."""
    log: list = []
    worker = _Worker(log)
    model = _SessionModel()
    worker.get_model = lambda: model
    worker._mrl_refit_names = []  # an open session (vllm_extension.begin_refit)
    bucket = [("a", torch.ones(4)), ("b", torch.arange(3.0))]
    assert load_bucket(worker, InProcessTransport().pack(bucket), stream=_RecordingStream(log)) == 2
    assert worker._mrl_refit_names == ["a", "b"] and log == ["synchronize"]
    for (name, kept), (_, sent) in zip(model.kept, bucket):
        assert torch.equal(kept, sent) and kept.untyped_storage().data_ptr() != sent.untyped_storage().data_ptr()
