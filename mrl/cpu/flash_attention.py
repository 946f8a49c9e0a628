"""Memory-efficient causal attention for long sequences on CPU, from torch's flash kernel.

The dense path (`q k^T` -> mask -> softmax -> `@ v`) holds a [heads, sq, sk] score tensor, and autograd keeps it
for the backward: 24K tokens x 4 heads is 9 GB in fp32. torch's CPU flash kernel
(`aten::_scaled_dot_product_flash_attention_for_cpu`) walks key blocks with an online softmax and recomputes the
probabilities in its backward, so memory is O(sequence); it only knows two masks, none and top-left causal.

What context parallelism needs is more: a rank holds query chunks that start inside the sequence (chunks r and
2*CP-1-r of Megatron's load-balanced layout), and a chunk at global positions [a, a+c) sees keys [0, a+c), a
*lower-right* causal rectangle. It splits exactly into two blocks the kernel knows:

    keys [0, a)     every query sees every key       (no mask)
    keys [a, a+c)   top-left causal, a square        (is_causal)

Each block gives a partial output o_i and its row log-sum-exp l_i; the exact result is
`o = sum_i o_i * exp(l_i - l)` with `l = logaddexp(l_1, l_2)` (the merge of ring / flash attention).
The backward is the kernel's own, called per block with the *merged* output and log-sum-exp: a block's
probabilities are `exp(S_i - l)` and the softmax correction uses `D = rowsum(dO * o)` of the merged output, so the
two blocks' gradients sum to the exact gradient (the ring-attention backward). Nothing [sq, sk]-sized is stored.

Short sequences gain too (forward + backward, 4 heads of 16, 1 thread): 0.06 ms against the dense path's 0.11 ms at
16 tokens, 0.9 vs 1.8 ms at 256, 36 vs 287 ms at 2048; so it serves every causal case, not only long ones. The
exception is a pack of many short sequences batched into one call (`padded_pack_attention`): short rows attend
densely there.

Shapes: q [b, h, sq, d], k/v [b, h, sk, d] (heads already repeated for GQA). The kernel needs one head size for
q, k and v; multi-latent attention's narrower value heads are zero-padded and the padding is cut from the output
(zero columns of v give zero output columns and receive no gradient that matters).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def flash_available(*tensors: torch.Tensor) -> bool:
    """The kernel runs on CPU tensors of float dtypes."""
    return all(t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16, torch.float16) for t in tensors)


class _PrefixThenCausal(torch.autograd.Function):
    """Queries at positions [a, a+c) over keys [0, a) (no mask) and [a, a+c) (causal), merged exactly."""

    @staticmethod
    def forward(ctx, q, k_prefix, v_prefix, k_diag, v_diag, scale: float):
        out_p, lse_p = _flash(q, k_prefix, v_prefix, 0.0, False, scale=scale)  # out [b, h, sq, d], lse [b, h, sq]
        out_d, lse_d = _flash(q, k_diag, v_diag, 0.0, True, scale=scale)
        lse = torch.logaddexp(lse_p, lse_d)
        out = out_p * (lse_p - lse).exp().unsqueeze(-1) + out_d * (lse_d - lse).exp().unsqueeze(-1)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k_prefix, v_prefix, k_diag, v_diag, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k_prefix, v_prefix, k_diag, v_diag, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dq_p, dk_p, dv_p = _flash_backward(grad_out, q, k_prefix, v_prefix, out, lse, 0.0, False, scale=ctx.scale)
        dq_d, dk_d, dv_d = _flash_backward(grad_out, q, k_diag, v_diag, out, lse, 0.0, True, scale=ctx.scale)
        return dq_p + dq_d, dk_p, dv_p, dk_d, dv_d, None


def _position_runs(positions: torch.Tensor) -> list[tuple[int, int, int]]:
    """(first index, end index, first position) of each run of consecutive positions (a CP rank has one or two)."""
    breaks = ((positions[1:] - positions[:-1]) != 1).nonzero().squeeze(1).add(1).tolist()
    edges = [0, *breaks, len(positions)]
    return [(lo, hi, int(positions[lo])) for lo, hi in zip(edges[:-1], edges[1:])]


def _chunk(q, k, v, start: int, scale: float) -> torch.Tensor:
    """Queries at positions [start, start + len) of a sequence whose keys k/v [b, h, >= start + len, d] are in
    position order."""
    length = q.shape[2]
    if start == 0:
        return F.scaled_dot_product_attention(q, k[:, :, :length], v[:, :, :length], is_causal=True, scale=scale)
    end = start + length
    return _PrefixThenCausal.apply(q, k[:, :, :start], v[:, :, :start], k[:, :, start:end], v[:, :, start:end], scale)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of one sequence's queries at `q_positions` [sq] (ascending runs, as a CP rank holds them)
    over all of its keys k/v [b, h, L, d] in position order (key j at position j). Returns [b, h, sq, d_v]."""
    dq, dv = q.shape[-1], v.shape[-1]
    if dq != dv:  # one head size for the kernel: zero columns change neither scores nor the kept outputs
        width = max(dq, dv)
        q, k, v = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
    outs = [_chunk(q[:, :, lo:hi], k, v, start, scale) for lo, hi, start in _position_runs(q_positions)]
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out[..., :dv] if dq != dv else out


def padded_pack_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], scale: float
) -> torch.Tensor | None:
    """A pack's causal attention as ONE kernel call over its sequences laid out as a right-padded batch.

    q/k/v [1, h, t, d] hold whole sequences of `seq_lens` back to back (no context parallelism). Each sequence
    becomes a row of [n, h, longest, d]; top-left causal attention of a row is exactly that sequence's attention,
    because a row's padding comes after all of its real tokens (no real query sees it) and the padded queries'
    outputs are dropped. Returns [1, h, t, d], or None where padding would more than double the tokens (long and
    short sequences mixed: per-sequence calls cost less there) or v's head size differs from q's.
    One call instead of one per sequence: a GRPO pack of 64 short responses spends its attention time in the kernel,
    not in Python. Rows of at most `DENSE_MAX_LENGTH` tokens take the dense product instead of the flash kernel
    (faster there, same result to float32 rounding)."""
    n, longest, total = len(seq_lens), max(seq_lens), sum(seq_lens)
    if n * longest > 2 * total or v.shape[-1] != q.shape[-1]:
        return None
    lens = torch.tensor(seq_lens)
    seq = torch.repeat_interleave(torch.arange(n), lens)  # [t] the sequence of each token
    starts = torch.cumsum(lens, 0) - lens
    slot = (seq * longest + torch.arange(total) - starts[seq]).to(q.device)  # [t] its place in [n * longest]

    def padded(x: torch.Tensor) -> torch.Tensor:  # [1, h, t, d] -> [n, h, longest, d]
        rows = x.new_zeros(x.shape[1], n * longest, x.shape[3]).index_copy(1, slot, x[0])
        return rows.view(x.shape[1], n, longest, x.shape[3]).transpose(0, 1)

    attend = _dense_causal if longest <= DENSE_MAX_LENGTH else _flash_causal
    out = attend(padded(q), padded(k), padded(v), scale)
    return out.transpose(0, 1).reshape(q.shape[1], n * longest, q.shape[3]).index_select(1, slot).unsqueeze(0)


#: Rows up to this length attend densely (q k^T, masked softmax, @ v): the flash kernel's blocking loses on short
#: rows. Forward + backward of [64 rows, 4 heads, L, 32] on the CI's AMD EPYC, flash vs dense, 1 thread:
#: L=16 0.91 vs 0.69 ms, L=39 4.5 vs 3.7, L=64 8.4 vs 9.3; 2 threads: L=16 1.8 vs 0.7, L=39 4.7 vs 2.4, L=64 7.4
#: vs 6.1, L=128 27 vs 38. 48 lies between the 39 where dense wins on both and the 64 where flash wins on one
#: thread. The [rows, heads, L, L] scores kept for the backward are at most 48 per token and head.
DENSE_MAX_LENGTH = 48


def _flash_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def _dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    length = q.shape[2]
    hidden = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)  # key after query
    return (q @ k.transpose(-2, -1) * scale).masked_fill(hidden, float("-inf")).softmax(-1) @ v
