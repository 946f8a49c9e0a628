"""The flash path (`mrl.cpu.flash_attention`): outputs and gradients equal dense masked softmax attention in
float64, for the query layouts a context-parallel rank holds, and its memory stays O(sequence)."""

import resource

import pytest
import torch

from mrl.cpu import flash_attention
from mrl.cpu.flash_attention import _position_runs, causal_attention, padded_pack_attention


def dense_reference(q, k, v, q_positions, scale):
    """float64 softmax(q k^T * scale) v with key j visible to a query at position p iff j <= p."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-2, -1) * scale  # [b, h, sq, L]
    hidden = torch.arange(k.shape[2])[None, :] > q_positions[:, None]
    return scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v


def cp_positions(length: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of a load-balanced CP rank's tokens: chunks rank and 2cp-1-rank."""
    chunk = length // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


LAYOUTS = {
    "whole sequence": (48, lambda: torch.arange(48)),
    "cp2 rank 0 (chunks 0 and 3)": (48, lambda: cp_positions(48, 2, 0)),
    "cp2 rank 1 (chunks 1 and 2 merge)": (48, lambda: cp_positions(48, 2, 1)),
    "cp4 rank 1": (64, lambda: cp_positions(64, 4, 1)),
    "one-token chunks": (4, lambda: cp_positions(4, 2, 1)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("v_dim", [8, 6, 12], ids=["same-dims", "narrow-v", "wide-v"])
def test_outputs_and_gradients_equal_dense_attention(layout, v_dim):
    length, positions = LAYOUTS[layout][0], LAYOUTS[layout][1]()
    g = torch.Generator().manual_seed(len(positions) * v_dim)
    q = torch.randn(2, 3, len(positions), 8, generator=g, requires_grad=True)
    k = torch.randn(2, 3, length, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 3, length, v_dim, generator=g, requires_grad=True)
    upstream = torch.randn(2, 3, len(positions), v_dim, generator=g)
    out = causal_attention(q, k, v, positions, scale=0.3)
    grads = torch.autograd.grad((out * upstream).sum(), (q, k, v))
    expected = dense_reference(q, k, v, positions, 0.3)
    expected_grads = torch.autograd.grad((expected * upstream.double()).sum(), (q, k, v))
    assert out.shape == expected.shape
    assert (out.double() - expected).abs().max() <= 2e-6
    for got, want in zip(grads, expected_grads):
        assert (got.double() - want).abs().max() <= 2e-6


@pytest.mark.parametrize("dense_max_length", [48, 0], ids=["dense-rows", "flash-rows"])
def test_a_pack_as_one_padded_batch_equals_each_sequence_alone(monkeypatch, dense_max_length):
    """A pack of 5 sequences (lengths 1..9) through one padded call, its rows attending densely or by the flash
    kernel: every sequence's outputs and q/k/v gradients are those of its own float64 causal attention, and nothing
    crosses a sequence boundary."""
    monkeypatch.setattr(flash_attention, "DENSE_MAX_LENGTH", dense_max_length)
    lens = [7, 1, 9, 4, 6]
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 3, sum(lens), 8, generator=g, requires_grad=True) for _ in range(3))
    upstream = torch.randn(1, 3, sum(lens), 8, generator=g)
    out = padded_pack_attention(q, k, v, lens, scale=0.3)
    grads = torch.autograd.grad((out * upstream).sum(), (q, k, v))
    ends = torch.tensor(lens).cumsum(0).tolist()
    expected = torch.cat([dense_reference(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], torch.arange(b - a), 0.3)
                          for a, b in zip([0, *ends[:-1]], ends)], dim=2)
    expected_grads = torch.autograd.grad((expected * upstream.double()).sum(), (q, k, v))
    assert (out.double() - expected).abs().max() <= 2e-6
    for got, want in zip(grads, expected_grads):
        assert (got.double() - want).abs().max() <= 2e-6


def test_a_pack_too_uneven_to_pad_or_with_narrow_values_is_declined():
    q = torch.randn(1, 2, 44, 8)
    assert padded_pack_attention(q, q, q, [40, 2, 2], scale=0.3) is None  # 3 x 40 rows for 44 tokens
    assert padded_pack_attention(q, q, q[..., :6], [20, 24], scale=0.3) is None  # MLA's narrower value heads
    assert padded_pack_attention(q, q, q, [20, 24], scale=0.3) is not None


def test_position_runs_split_at_gaps():
    assert _position_runs(torch.tensor([0, 1, 2, 9, 10])) == [(0, 3, 0), (3, 5, 9)]
    assert _position_runs(cp_positions(16, 2, 1)) == [(0, 8, 4)]  # chunks 1 and 2 are adjacent


def test_memory_stays_linear_in_the_sequence():
    """8K queries over 16K keys (a CP2 rank's far chunk of a 16K sequence), forward and backward: dense scores and
    probabilities would be 2 x 4 heads x 8K x 16K x 4 bytes = 4.3 GB; the flash path adds well under 1 GB."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    q = torch.randn(1, 4, 8192, 16, requires_grad=True)
    k, v = (torch.randn(1, 4, 16384, 16, requires_grad=True) for _ in range(2))
    out = causal_attention(q, k, v, torch.arange(8192, 16384), scale=0.25)
    out.sum().backward()
    added_gb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1e6
    assert torch.isfinite(k.grad).all()
    assert added_gb < 1.0, added_gb
