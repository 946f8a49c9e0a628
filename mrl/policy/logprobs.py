"""Per-token log-probabilities from vocab-parallel logits, and the context-parallel split/merge of a sequence.

Convention used throughout mrl: `logprobs[b, t] = log p(token[b, t] | token[b, :t])`, so position 0 (no prefix)
is 0 and a response's logprobs sit on the response's own token positions.

The log-softmax is computed without gathering the vocabulary across tensor-parallel ranks: Megatron's
`vocab_parallel_cross_entropy` all-reduces the max, the sum of exponentials and the target logit over the TP group
(three [B, T] all-reduces instead of one [B, T, V] all-gather), and has the matching backward.
"""

from __future__ import annotations

import torch


def next_token_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """Targets for next-token prediction: position t predicts token t+1; the last position gets a dummy 0. [B, T]"""
    targets = torch.roll(input_ids, shifts=-1, dims=1)
    targets[:, -1] = 0
    return targets


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                            vocab_size: int | None = None) -> torch.Tensor:
    """log p(targets) under softmax(logits / temperature), with the vocabulary split over the TP group.

    logits:     [B, T, V_padded / tp] this rank's slice of the padded vocabulary
    targets:    [B, T] global token ids
    vocab_size: the real vocabulary; the padding rows Megatron adds (to divide by TP) are excluded from the
                softmax, else every logprob is off by log(1 + pad * e^0 / Z) compared with the HF model.
    returns:    [B, T] float32, differentiable
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    if vocab_size is not None:
        local = logits.shape[-1]
        start = parallel_state.get_tensor_model_parallel_rank() * local
        if start + local > vocab_size:
            padding = torch.arange(start, start + local, device=logits.device) >= vocab_size
            logits = logits.masked_fill(padding, float("-inf"))
    # Megatron's kernel expects [S, B, V]; it is elementwise over the leading dims, so [B, T, V] works as well.
    return -vocab_parallel_cross_entropy(logits, targets)


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
    chunks: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for rank, piece in enumerate(gathered):
        first, second = cp_chunk_order(rank, cp_size)
        chunks[first], chunks[second] = piece.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]
