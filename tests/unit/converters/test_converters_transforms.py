"""Layout transforms against hand-written layouts, including odd sizes."""
import pytest
import torch

from converters import transforms as T


def _labelled(prefix: int, rows: int, hd: int, width: int) -> torch.Tensor:
    """[rows*hd, width] whose row r holds prefix*1000 + r everywhere: layouts can be read off column 0."""
    return (prefix * 1000 + torch.arange(rows * hd, dtype=torch.float32)).unsqueeze(1).repeat(1, width)


def test_merge_qkv_gqa_layout_matches_hand_written_order():
    nh, ng, hd = 6, 3, 1
    q, k, v = _labelled(1, nh, hd, 2), _labelled(2, ng, hd, 2), _labelled(3, ng, hd, 2)
    fused = T.merge_qkv(q, k, v, nh, ng, hd)
    expected = [1000, 1001, 2000, 3000, 1002, 1003, 2001, 3001, 1004, 1005, 2002, 3002]
    assert fused[:, 0].tolist() == expected
    assert fused[:, 1].tolist() == expected


def test_merge_qkv_head_dim_2_keeps_heads_contiguous():
    nh, ng, hd = 2, 1, 2  # MQA: one group with both query heads, then k, then v
    fused = T.merge_qkv(_labelled(1, nh, hd, 1), _labelled(2, ng, hd, 1), _labelled(3, ng, hd, 1), nh, ng, hd)
    assert fused[:, 0].tolist() == [1000, 1001, 1002, 1003, 2000, 2001, 3000, 3001]


@pytest.mark.parametrize("nh,ng,hd,h", [(5, 5, 3, 7), (6, 2, 5, 3), (3, 1, 4, 9), (12, 4, 7, 11)])
def test_qkv_round_trip_weight_and_bias_odd_sizes(nh, ng, hd, h):
    g = torch.Generator().manual_seed(nh * 100 + ng)
    q, k, v = (torch.randn(n * hd, h, generator=g) for n in (nh, ng, ng))
    fused = T.merge_qkv(q, k, v, nh, ng, hd)
    assert fused.shape == ((nh + 2 * ng) * hd, h)
    for a, b in zip(T.split_qkv(fused, nh, ng, hd), (q, k, v)):
        assert torch.equal(a, b)
    qb, kb, vb = (torch.randn(n * hd, generator=g) for n in (nh, ng, ng))
    fused_b = T.merge_qkv(qb, kb, vb, nh, ng, hd)
    assert fused_b.shape == ((nh + 2 * ng) * hd,)
    # bias is laid out exactly like the weight rows
    assert torch.equal(T.merge_qkv(qb[:, None], kb[:, None], vb[:, None], nh, ng, hd)[:, 0], fused_b)
    for a, b in zip(T.split_qkv(fused_b, nh, ng, hd), (qb, kb, vb)):
        assert torch.equal(a, b)


def test_qkv_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of num_query_groups"):
        T.merge_qkv(torch.zeros(5, 2), torch.zeros(2, 2), torch.zeros(2, 2), 5, 2, 1)
    with pytest.raises(ValueError, match="k has shape"):
        T.merge_qkv(torch.zeros(4, 2), torch.zeros(3, 2), torch.zeros(2, 2), 4, 2, 1)
    with pytest.raises(ValueError, match="expected 8"):
        T.split_qkv(torch.zeros(9, 2), 4, 2, 1)


def test_gate_up_round_trip_and_layout():
    gate, up = _labelled(1, 3, 1, 5), _labelled(2, 3, 1, 5)
    fc1 = T.merge_gate_up(gate, up)
    assert fc1[:, 0].tolist() == [1000, 1001, 1002, 2000, 2001, 2002]
    g2, u2 = T.split_gate_up(fc1)
    assert torch.equal(g2, gate) and torch.equal(u2, up)
    with pytest.raises(ValueError, match="odd number of rows"):
        T.split_gate_up(torch.zeros(7, 2))


def test_gated_tp_shard_holds_its_slice_of_gate_and_of_up():
    fc1 = T.merge_gate_up(_labelled(1, 4, 1, 1), _labelled(2, 4, 1, 1))
    r0, r1 = (T.tp_shard(fc1, 0, r, 2, gated=True) for r in (0, 1))
    assert r0[:, 0].tolist() == [1000, 1001, 2000, 2001]
    assert r1[:, 0].tolist() == [1002, 1003, 2002, 2003]
    assert torch.equal(T.tp_unshard([r0, r1], 0, gated=True), fc1)


@pytest.mark.parametrize("dim", [0, 1, None])
def test_tp_shard_unshard_round_trip(dim):
    full = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    shards = [T.tp_shard(full, dim, r, 2) for r in range(2)]
    if dim is not None:
        assert shards[0].shape[dim] == full.shape[dim] // 2
        assert torch.equal(shards[1], full.narrow(dim, full.shape[dim] // 2, full.shape[dim] // 2))
    assert torch.equal(T.tp_unshard(shards, dim), full)
    with pytest.raises(ValueError, match="not divisible"):
        T.tp_shard(full, 0, 0, 4)


def test_padded_vocab_size_follows_megatron_rule():
    assert T.padded_vocab_size(500, 128, 1) == 512
    assert T.padded_vocab_size(512, 128, 2) == 512
    assert T.padded_vocab_size(513, 128, 2) == 768
    assert T.padded_vocab_size(7, 4, 1) == 8
    assert T.padded_vocab_size(151936, 128, 2) == 152064


def test_pad_unpad_vocab_odd_size():
    w = torch.randn(7, 3)
    padded = T.pad_vocab(w, 12)
    assert padded.shape == (12, 3) and torch.equal(padded[:7], w) and not padded[7:].any()
    assert torch.equal(T.unpad_vocab(padded, 7), w)
    with pytest.raises(ValueError, match="smaller than the vocabulary"):
        T.pad_vocab(w, 6)
    with pytest.raises(ValueError, match="fewer than the vocabulary"):
        T.unpad_vocab(w, 8)
