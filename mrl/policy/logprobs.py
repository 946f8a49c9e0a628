"""Per-token log-probabilities from vocab-parallel logits, and the context-parallel split/merge of a sequence.

Convention used throughout mrl: `logprobs[b, t] = log p(token[b, t] | token[b, :t])`, so position 0 (no prefix)
is 0 and a response's logprobs sit on the response's own token positions.

The log-softmax is computed without gathering the vocabulary across tensor-parallel ranks: as Megatron's
`vocab_parallel_cross_entropy`, it all-reduces the max, the sum of exponentials and the target logit over the TP
group (three [B, T] all-reduces instead of one [B, T, V] all-gather), and has the matching backward; unlike it, it
works through the tokens a chunk at a time, so the full fp32 logits and softmax never exist (LOGPROB_CHUNK_TOKENS).
"""

from __future__ import annotations

from typing import Literal, overload

import torch


def next_token_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """Targets for next-token prediction: position t predicts token t+1; the last position gets a dummy 0. [B, T]"""
    targets = torch.roll(input_ids, shifts=-1, dims=1)
    targets[:, -1] = 0
    return targets


#: Tokens whose fp32 logits exist at once in the log-softmax. The logits stay in the model's dtype; each chunk of
#: rows is upcast, reduced and dropped, in the forward and again in the backward. Unchunked, an 8K-token micro-batch
#: over Qwen's 151,936-token vocabulary is 8192 x 151,936 x 4 B = 5 GB of fp32 logits, and Megatron's kernel keeps
#: as much again for its backward (the softmax); a 1024-token chunk is 0.6 GB, held only while it is computed.
LOGPROB_CHUNK_TOKENS = 1024


@overload
def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
    entropy: Literal[False] = False,
) -> torch.Tensor: ...


@overload
def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
    *,
    entropy: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
    entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
    entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log p(targets) under softmax(logits / temperature), with the vocabulary split over the TP group; with
    `entropy`, also that distribution's entropy at every token (a metric: no gradient flows through it).

    logits:       [B, T, V_padded / tp] this rank's slice of the padded vocabulary, in the model's dtype
    targets:      [B, T] global token ids
    vocab_size:   the real vocabulary; the padding rows Megatron adds (to divide by TP) are excluded from the
                  softmax, else every logprob is off by log(1 + pad * e^0 / Z) compared with the HF model.
    chunk_tokens: rows of fp32 logits computed at once (LOGPROB_CHUNK_TOKENS)
    returns:      [B, T] float32, differentiable; with `entropy`, (those, [B, T] float32 entropies in nats)

    The arithmetic is Megatron's `vocab_parallel_cross_entropy` (megatron-core 0.19.2,
    tensor_parallel/cross_entropy.py): the max, the sum of exponentials and the target logit all-reduced over the
    TP group, logprob = (target - max) - log(sum exp(logits - max)), gradient (onehot - softmax) / temperature; done
    chunk by chunk of tokens, so neither the fp32 logits nor the fp32 softmax of the whole micro-batch ever exist.
    Entropy from the same chunks: with x = logits / temperature - max and S = sum exp(x) (both over the whole
    vocabulary), H = log S - sum(exp(x) x) / S; the one extra sum is all-reduced with the others.
    """
    from megatron.core import parallel_state

    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    local = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * local
    # The first padding column of this slice: 0 where the whole slice is padding (a tiny vocabulary padded to a
    # multiple of 128 x TP leaves the last ranks nothing but padding), `local` where there is none.
    padded_from = local if vocab_size is None else min(max(vocab_size - start, 0), local)
    group = parallel_state.get_tensor_model_parallel_group()
    flat, entropies = _ChunkedVocabParallelLogprobs.apply(
        logits.reshape(-1, local),
        targets.reshape(-1),
        float(temperature),
        start,
        padded_from,
        group,
        chunk_tokens,
        entropy,
    )
    if entropy:
        return flat.view(targets.shape), entropies.view(targets.shape)
    return flat.view(targets.shape)


def _scaled_chunk(logits: torch.Tensor, temperature: float, padded_from: int) -> torch.Tensor:
    """A new fp32 copy of one chunk of rows (never a view: it is worked on in place), divided by the temperature,
    the vocabulary's padding columns at -inf."""
    chunk = logits.to(torch.float32, copy=True)
    if temperature != 1.0:
        chunk /= temperature
    if padded_from < chunk.shape[-1]:
        chunk[:, padded_from:] = float("-inf")
    return chunk


def _local_targets(targets: torch.Tensor, start: int, local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(column of each target in this rank's slice, clamped to a valid column; whether the target is in the slice)."""
    inside = (targets >= start) & (targets < start + local)
    return (targets - start).clamp(0, local - 1), inside


class _ChunkedVocabParallelLogprobs(torch.autograd.Function):
    """[N, V/tp] logits (any float dtype), [N] targets -> [N] fp32 logprobs, and [N] entropies (empty unless
    `with_entropy`; not differentiable); see `vocab_parallel_logprobs`."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, start, padded_from, group, chunk_tokens, with_entropy):
        from mrl.parallel import collectives

        reduce = collectives.world_size(group) > 1  # per micro-batch: a group of one keeps its shortcut
        n, local = logits.shape
        out = torch.empty(n, dtype=torch.float32, device=logits.device)
        top_all, sum_exp_all = torch.empty_like(out), torch.empty_like(out)  # the max and sum of exps, for the backward
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=logits.device)
        for first in range(0, n, chunk_tokens):
            rows = slice(first, first + chunk_tokens)
            chunk = _scaled_chunk(logits[rows], temperature, padded_from)
            top = chunk.max(dim=-1).values
            if reduce:
                collectives.all_reduce(top, "max", group)
            chunk -= top[:, None]
            column, inside = _local_targets(targets[rows], start, local)
            predicted = torch.where(inside, chunk.gather(1, column[:, None]).squeeze(1), torch.zeros_like(top))
            if with_entropy:  # sum exp(x) x over the real columns (the padding's exp(-inf) * -inf would be NaN)
                exps = chunk.exp()
                sum_exp = exps.sum(dim=-1)
                weighted = exps[:, :padded_from].mul_(chunk[:, :padded_from]).sum(dim=-1)
                del exps
            else:
                sum_exp = chunk.exp_().sum(dim=-1)
            del chunk  # before the next chunk is made: one chunk's fp32 rows at a time
            if reduce:
                collectives.all_reduce(predicted, "sum", group)
                collectives.all_reduce(sum_exp, "sum", group)
                if with_entropy:
                    collectives.all_reduce(weighted, "sum", group)
            out[rows] = predicted - torch.log(sum_exp)
            if with_entropy:
                entropy[rows] = torch.log(sum_exp) - weighted / sum_exp
            top_all[rows], sum_exp_all[rows] = top, sum_exp
        ctx.save_for_backward(logits, targets, top_all, sum_exp_all)
        ctx.temperature, ctx.start, ctx.padded_from, ctx.chunk_tokens = temperature, start, padded_from, chunk_tokens
        ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    def backward(ctx, grad_out, _grad_entropy):
        logits, targets, top, sum_exp = ctx.saved_tensors
        n, local = logits.shape
        grad = torch.empty_like(logits)
        for first in range(0, n, ctx.chunk_tokens):
            rows = slice(first, first + ctx.chunk_tokens)
            chunk = _scaled_chunk(logits[rows], ctx.temperature, ctx.padded_from)
            softmax = chunk.sub_(top[rows, None]).exp_().div_(sum_exp[rows, None])  # padding: exp(-inf) = 0
            column, inside = _local_targets(targets[rows], ctx.start, local)
            softmax[torch.arange(len(column), device=column.device), column] -= inside.float()
            softmax.mul_(-grad_out[rows].float()[:, None])  # d logprob / d logits = (onehot - softmax) / T
            if ctx.temperature != 1.0:
                softmax /= ctx.temperature
            grad[rows] = softmax.to(grad.dtype)
            del chunk, softmax
        return grad, None, None, None, None, None, None, None


def score_values(output: torch.Tensor) -> torch.Tensor:
    """A reward model's value at every position: [B, T, rows / tp] output of its score head (row 0 is the score,
    the others padding; `converters.score_rows`) -> [B, T] float32, differentiable. The value at position t reads
    the hidden state of token t (no shift: nothing is predicted)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(output)[..., 0].float()


def shift_to_token_positions(next_token_logprobs: torch.Tensor) -> torch.Tensor:
    """[B, T] logprobs indexed by predicting position -> indexed by the predicted token (position 0 becomes 0)."""
    out = torch.zeros_like(next_token_logprobs)
    out[:, 1:] = next_token_logprobs[:, :-1]
    return out


# --------------------------------------------------------------------------------------- context parallel layout
def cp_chunk_order(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """Megatron's load-balanced context parallelism: the sequence is cut into 2*cp chunks and rank r holds chunks
    r and 2*cp-1-r, so every rank gets the same amount of causal-attention work."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def split_for_context_parallel(tensor: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's two chunks of `tensor` along the sequence dim (length must be a multiple of 2*cp)."""
    if cp_size == 1:
        return tensor
    length = tensor.shape[dim]
    if length % (2 * cp_size):
        raise ValueError(f"sequence length {length} must be a multiple of 2 * context_parallel_size = {2 * cp_size}")
    chunks = tensor.chunk(2 * cp_size, dim=dim)
    first, second = cp_chunk_order(cp_rank, cp_size)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def merge_from_context_parallel(local: torch.Tensor, cp_group, dim: int = 1) -> torch.Tensor:
    """Inverse of `split_for_context_parallel`: all-gather every rank's two chunks and put them back in order."""
    from mrl.parallel import collectives

    cp_size = collectives.world_size(cp_group)
    if cp_size == 1:
        return local
    gathered = collectives.all_gather(local, cp_group)
    chunks: dict[int, torch.Tensor] = {}  # position in the sequence -> chunk
    for rank, piece in enumerate(gathered):
        first, second = cp_chunk_order(rank, cp_size)
        chunks[first], chunks[second] = piece.chunk(2, dim=dim)
    return torch.cat([chunks[position] for position in range(2 * cp_size)], dim=dim)
