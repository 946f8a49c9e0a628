"""Log-probabilities a chunk of tokens at a time (mrl.policy.logprobs.vocab_parallel_logprobs) against Megatron's
own `vocab_parallel_cross_entropy` over the full fp32 logits, the path mrl used before: the same values and the same
gradients, bit for bit, on one rank and with the vocabulary split over two TP ranks, in fp32 and bf16, with a
temperature and with Megatron's vocabulary padding (also where a rank's whole slice is padding); the entropy from the
same chunks against torch's over the whole vocabulary; and what the chunked path keeps for its backward (the logits
in their own dtype, nothing of the full fp32 size)."""

from __future__ import annotations

import itertools

import pytest
import torch

from mrl.testing.distributed import run_on_ranks

# (real vocabulary, Megatron's padded one, divisible by TP = 2): a few padding columns on the last rank; and a tiny
# vocabulary padded to 128, where the last rank's slice is nothing but padding (the tiny test models' case).
VOCABS = ((45, 48), (17, 128))


# ---- rank side: imported by each rank process of run_on_ranks ----
def compare_with_megatron(tp: int) -> list[tuple]:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from mrl.parallel.groups import init_process_groups
    from mrl.parallel.layout import ParallelDims
    from mrl.policy.logprobs import vocab_parallel_logprobs

    init_process_groups(ParallelDims(world_size=tp, tp=tp))
    rank = ps.get_tensor_model_parallel_rank()
    results = []
    for (vocab, padded), dtype in itertools.product(VOCABS, (torch.float32, torch.bfloat16)):
        local = padded // tp
        for temperature in (1.0, 0.7):
            for chunk in (1, 5, 4096):
                torch.manual_seed(0)  # the same full logits on every rank; each takes its slice
                full = torch.randn(3, 7, padded) * 3
                targets = torch.randint(0, vocab, (3, 7))
                upstream = torch.randn(3, 7)
                mine = full[..., rank * local:(rank + 1) * local].to(dtype).requires_grad_()
                theirs = mine.detach().clone().requires_grad_()
                scaled = theirs.float() / temperature
                scaled = scaled.masked_fill(torch.arange(rank * local, (rank + 1) * local) >= vocab, float("-inf"))
                expected = -vocab_parallel_cross_entropy(scaled, targets)
                (expected * upstream).sum().backward()
                got, entropy = vocab_parallel_logprobs(mine, targets, temperature, vocab, chunk_tokens=chunk,
                                                       entropy=True)
                (got * upstream).sum().backward()
                # the entropy of the whole (unsharded, unpadded) distribution, from torch's own log-softmax
                whole = torch.log_softmax(full[..., :vocab].to(dtype).float() / temperature, dim=-1)
                expected_entropy = -(whole.exp() * whole).sum(dim=-1)
                entropy_close = torch.allclose(entropy, expected_entropy, rtol=1e-5, atol=1e-5)
                results.append((vocab, str(dtype), temperature, chunk, torch.equal(got, expected),
                                torch.equal(mine.grad, theirs.grad), got.dtype == torch.float32,
                                entropy_close and not entropy.requires_grad))
    return results


def saved_for_backward() -> list[tuple]:
    from mrl.parallel.groups import init_process_groups
    from mrl.parallel.layout import ParallelDims
    from mrl.policy.logprobs import vocab_parallel_logprobs

    init_process_groups(ParallelDims(world_size=1))
    logits = torch.randn(4, 64, 1000, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, t.numel())) or t, lambda t: t):
        vocab_parallel_logprobs(logits, torch.randint(0, 1000, (4, 64)), 1.0, None, chunk_tokens=32)
    return saved


# ---- test side ----
@pytest.mark.parametrize("tp", [1, 2])
def test_chunked_logprobs_equal_megatrons_bit_for_bit(tp):
    for rank_results in run_on_ranks(compare_with_megatron, world_size=tp, args=(tp,)):
        assert len(rank_results) == 24
        for vocab, dtype, temperature, chunk, values_equal, grads_equal, fp32, entropy_close in rank_results:
            assert values_equal and grads_equal and fp32 and entropy_close, (vocab, dtype, temperature, chunk)


def test_the_backward_keeps_the_logits_in_their_dtype_and_no_full_fp32_copy():
    saved = run_on_ranks(saved_for_backward, world_size=1)[0]
    assert (torch.bfloat16, 4 * 64 * 1000) in saved
    assert all(not (dtype == torch.float32 and numel >= 4 * 64 * 1000) for dtype, numel in saved), saved
