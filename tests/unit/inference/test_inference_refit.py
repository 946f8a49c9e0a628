"""The refit loop against hand-checked expectations: buckets in order, each released after every receiver loaded
it, the sink told how the refit ended, incomplete refits refused, meeting transports only between collective ends."""

from __future__ import annotations

import pytest
import torch

from mrl.inference.refit import LocalWeights, RefitError, refit
from mrl.inference.transports import CollectiveTransport, SharedMemoryFileTransport, unpack_payload


class RecordingSink:
    """A sink that unpacks every payload as an engine's worker would and records what happened. It starts asleep
    (a colocated engine after generating) and refuses a payload before its weights were woken."""

    def __init__(self, expected_names=None, fail_on: int | None = None) -> None:
        self.expected_names = expected_names
        self.fail_on = fail_on
        self.loaded: list[list[str]] = []
        self.finished: list[bool] = []
        self.weights_awake = False

    def prepare_for_refit(self) -> None:
        self.weights_awake = True

    def load_payload(self, payload: dict) -> None:
        assert self.weights_awake, "a bucket arrived before the refit woke the engine's weights"
        if len(self.loaded) == self.fail_on:
            raise RuntimeError("engine worker died")
        self.loaded.append([name for name, _ in unpack_payload(payload)])

    def finish_refit(self, complete: bool = True) -> None:
        self.finished.append(complete)


def _state(layers: int = 3) -> dict[str, torch.Tensor]:
    state = {"model.embed_tokens.weight": torch.ones(4, 4)}  # 64 bytes
    for i in range(layers):
        state[f"model.layers.{i}.mlp.up_proj.weight"] = torch.ones(4, 4)
        state[f"model.layers.{i}.mlp.down_proj.weight"] = torch.ones(4, 4)  # a layer: 128 bytes
    return state


def test_buckets_of_whole_layers_arrive_in_order_and_are_released(tmp_path):
    state = _state()
    sink = RecordingSink(expected_names=frozenset(state))
    stats = refit(LocalWeights(state.items()), sink, SharedMemoryFileTransport(str(tmp_path)), bucket_bytes=150)
    # 64 + 128 > 150: the embedding alone, then one layer per bucket (a file lists its tensors sorted)
    assert sink.loaded == [["model.embed_tokens.weight"]] + [
        [f"model.layers.{i}.mlp.down_proj.weight", f"model.layers.{i}.mlp.up_proj.weight"] for i in range(3)]
    assert (stats.num_buckets, stats.num_tensors, stats.bytes, stats.max_bucket_bytes) == (4, 7, 448, 128)
    assert sink.finished == [True]
    assert list(tmp_path.iterdir()) == []  # every shared-memory file removed


def test_a_failed_load_releases_the_bucket_and_tells_the_sink(tmp_path):
    sink = RecordingSink(fail_on=1)
    with pytest.raises(RuntimeError, match="engine worker died"):
        refit(LocalWeights(_state()), sink, SharedMemoryFileTransport(str(tmp_path)), bucket_bytes=150)
    assert sink.finished == [False] and list(tmp_path.iterdir()) == []


class DeadSink(RecordingSink):
    """An engine that died while loading: every later call to it fails too, with its own error."""

    def finish_refit(self, complete: bool = True) -> None:
        raise ConnectionError("the engine is gone (this call)")


def test_a_sink_that_died_in_a_load_is_reported_by_that_load_not_by_the_clean_up(tmp_path):
    with pytest.raises(RuntimeError, match="engine worker died"):
        refit(LocalWeights(_state()), DeadSink(fail_on=1), SharedMemoryFileTransport(str(tmp_path)), bucket_bytes=150)
    assert list(tmp_path.iterdir()) == []


def test_a_refit_missing_tensors_of_the_engine_is_refused(tmp_path):
    state = _state()
    sink = RecordingSink(expected_names=frozenset([*state, "lm_head.weight"]))
    with pytest.raises(RefitError, match="lm_head.weight"):
        refit(LocalWeights(state), sink, SharedMemoryFileTransport(str(tmp_path)), bucket_bytes=1 << 20)
    assert sink.finished == [False]  # never counted as a whole refit (an engine asleep at level 2 stays unusable)


def test_a_broadcast_needs_collective_ends():
    transport = CollectiveTransport("g", "127.0.0.1", 1, 2)
    with pytest.raises(TypeError, match="CollectiveRefitSink"):
        refit(LocalWeights(_state()), RecordingSink(), transport, bucket_bytes=1 << 20)


class Loading:
    """A load under way: it runs when the refit loop waits for it (like a Ray call it does not block the caller)."""

    def __init__(self, sink: "AsyncSink", payload: dict) -> None:
        self.sink, self.payload = sink, payload

    def result(self, timeout_s=None) -> None:
        self.sink.events.append(f"loaded {len(self.sink.loaded)}")
        self.sink.load_payload(self.payload)


class AsyncSink(RecordingSink):
    def __init__(self, shm_dir, **kwargs) -> None:
        super().__init__(**kwargs)
        self.shm_dir, self.events, self.most_files = shm_dir, [], 0

    def load_payload_async(self, payload: dict) -> Loading:
        self.events.append(f"load {len(self.loaded)} started")
        return Loading(self, payload)


class CountingWeights(LocalWeights):
    def __init__(self, state, sink: AsyncSink) -> None:
        super().__init__(state)
        self.sink = sink

    def send_bucket(self, index, transport):
        self.sink.events.append(f"pack {index}")
        payload = super().send_bucket(index, transport)
        self.sink.most_files = max(self.sink.most_files, len(list(self.sink.shm_dir.iterdir())))
        return payload


def test_double_buffered_refit_packs_the_next_bucket_while_the_last_one_loads(tmp_path):
    state = _state()
    sink = AsyncSink(tmp_path, expected_names=frozenset(state))
    stats = refit(CountingWeights(state.items(), sink), sink, SharedMemoryFileTransport(str(tmp_path)),
                  bucket_bytes=150)
    assert sink.events == ["pack 0", "load 0 started", "pack 1", "loaded 0", "load 1 started", "pack 2", "loaded 1",
                           "load 2 started", "pack 3", "loaded 2", "load 3 started", "loaded 3"]
    assert sink.loaded[0] == ["model.embed_tokens.weight"] and len(sink.loaded) == stats.num_buckets == 4
    assert sink.most_files == 2 and list(tmp_path.iterdir()) == []  # two buckets alive at most, all removed
    assert sink.finished == [True]


def test_the_source_is_free_once_its_last_bucket_is_packed_while_that_bucket_loads(tmp_path):
    """`on_sent` (asynchronous GRPO trains from then on) comes after the last pack, before the last load ends."""
    state = _state()
    sink = AsyncSink(tmp_path, expected_names=frozenset(state))
    refit(CountingWeights(state.items(), sink), sink, SharedMemoryFileTransport(str(tmp_path)), bucket_bytes=150,
          on_sent=lambda: sink.events.append("sent"))
    assert sink.events[-5:] == ["pack 3", "loaded 2", "load 3 started", "sent", "loaded 3"]
    assert sink.events.count("sent") == 1 and sink.finished == [True]


def test_without_double_buffering_the_source_is_free_after_the_last_load(tmp_path):
    sink, events = RecordingSink(), []
    refit(LocalWeights(_state()), sink, SharedMemoryFileTransport(str(tmp_path)), bucket_bytes=150,
          on_sent=lambda: events.append(len(sink.loaded)))
    assert events == [4] and sink.finished == [True]


def test_a_failed_load_under_double_buffering_frees_both_buckets(tmp_path):
    sink = AsyncSink(tmp_path, fail_on=1)
    with pytest.raises(RuntimeError, match="engine worker died"):
        refit(LocalWeights(_state()), sink, SharedMemoryFileTransport(str(tmp_path)), bucket_bytes=150)
    assert sink.finished == [False] and list(tmp_path.iterdir()) == []


class Done:
    """A call that already finished (stands in for a GroupFuture)."""

    def __init__(self, value) -> None:
        self.value = value

    def result(self, timeout_s=None):
        return self.value


class StageSource:
    """A collective source whose buckets belong to pipeline stages 0, 1, 1 (`bucket_sender`)."""

    owners = [0, 1, 1]

    def plan_buckets(self, bucket_bytes):
        return range(len(self.owners))

    def bucket_sender(self, index):
        return self.owners[index]

    def send_bucket_async(self, index, transport):
        return Done({"names": [f"t{index}"], "bytes": 4})


class ReceivingSink(RecordingSink):
    def __init__(self) -> None:
        super().__init__()
        self.receiving: list[dict] = []

    def load_payload_async(self, payload):
        self.receiving.append(payload)
        return Done(None)


@pytest.mark.parametrize("stages", [(("127.0.0.1", 2),), ()], ids=["sender-per-stage", "one-sender"])
def test_receivers_meet_each_bucket_in_its_senders_sub_group(monkeypatch, stages):
    """With one sender per pipeline stage the engines receive each bucket in its owner stage's sub-group; with one
    sender (a transport without stages) every bucket in the group itself, whatever the source's stages."""
    import mrl.distributed

    monkeypatch.setattr(mrl.distributed, "wait_all", lambda futures: [f.result() for f in futures])
    sink = ReceivingSink()
    transport = CollectiveTransport("g", "127.0.0.1", 1, 2, stages=stages)
    stats = refit(StageSource(), sink, transport, bucket_bytes=1 << 20)
    groups = ["g", "g/s1", "g/s1"] if stages else ["g", "g", "g"]
    assert [p["group"] for p in sink.receiving] == groups and stats.num_buckets == 3
