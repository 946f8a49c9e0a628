"""Refit buckets: whole layers, bounded size, input order, lazy consumption."""

import pytest
import torch

from mrl.inference.buckets import iter_buckets, layer_key


def _model(num_layers: int = 3, width: int = 4) -> list[tuple[str, torch.Tensor]]:
    """HF-like names; every tensor is width x width fp32 = 64 bytes for width 4."""
    names = ["model.embed_tokens.weight"]
    for i in range(num_layers):
        names += [f"model.layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"]
        names += [f"model.layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    names += ["model.norm.weight", "lm_head.weight"]
    return [(name, torch.zeros(width, width)) for name in names]


def test_layer_key_groups_each_transformer_layer_and_top_level_module():
    assert layer_key("model.layers.12.self_attn.q_proj.bias") == "model.layers.12"
    assert layer_key("model.layers.1.mlp.experts.7.up_proj.weight") == "model.layers.1"
    assert layer_key("model.embed_tokens.weight") == "model.embed_tokens"
    assert layer_key("lm_head.weight") == "lm_head"


def test_buckets_hold_whole_layers_within_the_bound():
    tensors = _model()
    layer_bytes = 7 * 64  # 7 matrices per layer
    buckets = list(iter_buckets(tensors, bucket_bytes=2 * layer_bytes))
    # Every tensor exactly once, in input order.
    assert [n for b in buckets for n, _ in b] == [n for n, _ in tensors]
    for bucket in buckets:
        assert sum(t.numel() * 4 for _, t in bucket) <= 2 * layer_bytes
    # No layer is split across buckets.
    owner = {}
    for index, bucket in enumerate(buckets):
        for name, _ in bucket:
            assert owner.setdefault(layer_key(name), index) == index
    # embed (64) + layer 0 (448) = 512; + layer 1 would be 960 > 896 -> new bucket; layers 1 + 2 = 896 fit exactly;
    # + norm would be 960 -> norm and lm_head form the last bucket.
    assert [len(b) for b in buckets] == [1 + 7, 7 + 7, 1 + 1]


def test_a_layer_larger_than_the_bucket_goes_alone():
    buckets = list(iter_buckets(_model(num_layers=2), bucket_bytes=1))
    assert [len(b) for b in buckets] == [1, 7, 7, 1, 1]


def test_a_layer_that_comes_back_after_others_is_an_error_in_a_stream():
    tensors = _model(num_layers=2)
    tensors.append(("model.layers.0.extra.weight", torch.zeros(1)))
    with pytest.raises(ValueError, match="model.layers.0"):
        list(iter_buckets(iter(tensors), bucket_bytes=1 << 20))


def test_a_state_dict_in_any_order_is_regrouped_by_layer():
    tensors = _model(num_layers=2)
    shuffled = dict(tensors[i] for i in torch.randperm(len(tensors), generator=torch.Generator().manual_seed(0)))
    for source in (shuffled, shuffled.items()):
        buckets = list(iter_buckets(source, bucket_bytes=1))
        assert sorted(n for b in buckets for n, _ in b) == sorted(n for n, _ in tensors)
        assert all(len({layer_key(n) for n, _ in b}) == 1 for b in buckets)  # one layer per bucket at 1 byte
        assert len(buckets) == 2 + 2 + 1  # embed, 2 layers, norm, lm_head


def test_input_is_consumed_lazily():
    pulled = []

    def source():
        for name, tensor in _model(num_layers=3):
            pulled.append(name)
            yield name, tensor

    first = next(iter_buckets(source(), bucket_bytes=7 * 64))
    assert [n for n, _ in first] == ["model.embed_tokens.weight"]
    # To close the first bucket it had to see layer 0 entirely and the first tensor of layer 1, no more.
    assert len(pulled) == 1 + 7 + 1


def test_bucket_size_must_be_positive():
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(iter_buckets(_model(), bucket_bytes=0))


def test_a_flat_bucket_holds_every_tensor_aligned_and_its_views_are_bit_exact():
    from mrl.inference.buckets import FLAT_ALIGN, flat_layout, flat_views, pack_flat

    bucket = [("a", torch.arange(3, dtype=torch.float32)), ("b", torch.tensor([[1, -2]], dtype=torch.int64)),
              ("c", torch.randn(5, 7).to(torch.bfloat16)), ("d", torch.randn(4, 6)[:, ::2])]  # a strided view
    header, size = flat_layout(bucket)
    assert [entry[3] for entry in header] == [0, 16, 32, 112]  # 12 B -> 16, 16 B -> 32, 70 B -> 112
    assert all(offset % FLAT_ALIGN == 0 for *_, offset, _ in header) and size == 112 + 48
    buffer = torch.full((size + 5,), 255, dtype=torch.uint8)  # a reused, larger buffer
    pack_flat(bucket, header, buffer)
    views = flat_views(buffer, header)
    assert [name for name, _ in views] == ["a", "b", "c", "d"]
    for (_, want), (_, got) in zip(bucket, views):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.bfloat16 else got,
                           want.contiguous().view(torch.uint8) if want.dtype == torch.bfloat16 else want)
        assert got.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # views, not copies


def test_split_layers_cuts_inside_a_layer_within_the_bound():
    tensors = _model(num_layers=2) + [("model.layers.2.mlp.experts.weight", torch.zeros(8, 4))]  # 128 bytes
    for bound in (1, 64, 100, 3 * 64, 1000):
        buckets = list(iter_buckets(iter(tensors), bucket_bytes=bound, split_layers=True))
        assert [n for b in buckets for n, _ in b] == [n for n, _ in tensors]
        assert all(sum(t.numel() * 4 for _, t in b) <= bound or len(b) == 1 for b in buckets)
        if bound < 7 * 64:
            assert len({index for index, b in enumerate(buckets) for n, _ in b if ".layers.0." in n}) > 1
    assert [len(b) for b in iter_buckets(tensors, bucket_bytes=3 * 64, split_layers=True)] == [3, 3, 3, 3, 3, 2, 1]


def test_split_layers_consumes_a_stream_one_tensor_past_the_bucket():
    pulled = []

    def source():
        for name, tensor in _model(num_layers=3):
            pulled.append(name)
            yield name, tensor

    first = next(iter_buckets(source(), bucket_bytes=2 * 64, split_layers=True))
    assert len(first) == 2 and len(pulled) == 3
