"""The megatron-core patches that make a train step fast, not possible (`mrl.cpu.megatron_patches` registers,
applies and reverts them with the others; each takes its `Patcher`).

Same results, less time. Measured on the GRPO benchmark's train step (64 packed sequences, 1486 tokens, the 4-layer
hidden-128 demo model, fp32, 1 thread, AMD EPYC with AVX-512): 155 ms -> 108 ms.
- `linear_gemms_on_onednn`: Megatron's linear layers multiply with oneDNN instead of MKL (float32 rounding apart).
- `packed_rope_in_one_gather`: packed RoPE without context parallelism, bit for bit, without a Python loop. It also
  applies on a GPU without Transformer Engine (`megatron_patches.WITHOUT_TE`), where Megatron's loop read the offsets to
  the host twice a layer (an H200's Qwen3-0.6B step: 560 of its 1,135 host synchronisations).
- `grad_norm_on_device`: gradient clipping's norm without Apex (and TE) computed on the device, not read to the host
  tensor by tensor; GPUs without Transformer Engine take it too.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from mrl.cpu.megatron_patches import Patcher


def _onednn_fits(a: Any, b: Any) -> bool:
    """`a @ b` that oneDNN's linear computes: fp32 [..., k] @ [k, n], no autograd through the call, no empty
    operand (oneDNN has no primitive for k = 0: the weight gradient of an MoE expert that received no token)."""
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.dtype == torch.float32
        and b.dtype == torch.float32
        and a.dim() >= 2
        and b.dim() == 2
        and a.numel() > 0
        and b.numel() > 0
        and not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))
    )


#: GEMM sizes that vary with the batch are rounded to this many steps per power of two (see `_linear`).
SIZES_PER_OCTAVE = 32


def _size_step(size: int) -> int:
    """The rounding step of a GEMM dimension of `size`: a power of two, 1/SIZES_PER_OCTAVE of `size` or less."""
    return 1 << max(0, size.bit_length() - SIZES_PER_OCTAVE.bit_length())


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`x @ w^T` ([rows, inner] @ [inner, out]) by oneDNN's fp32 GEMM, with `rows` and `inner` rounded.

    oneDNN builds (JIT-compiles) a primitive for every GEMM shape and caches it: ~2 ms and ~0.6 MB the first time a
    shape is seen (measured, [M, 128] x [128, 512], 1 thread). A packed batch has a new token count almost every
    step, which is `rows` of the forward and input-gradient GEMMs and `inner` of the weight gradient's, so without
    rounding a train step paid that for each of its GEMMs again: steps of 120 ms took 200-300 ms, and the process
    grew by 10-50 MB each time (the GRPO benchmark, 1 thread). Rounded, a run meets at most SIZES_PER_OCTAVE sizes
    per power of two: `rows` is padded up with zero rows (their outputs are dropped; <= 3% more work), `inner` is
    split into a rounded part (oneDNN) and the remainder (< 1/SIZES_PER_OCTAVE of it, torch's own GEMM), added.
    The price, where a size is not a rounded one already: copying the input into its padded rows, ~9% more time
    on these GEMMs at a fixed size (measured with the layers' shapes at 1486 tokens, the workers' malloc settings);
    with sizes that change every step a whole train step took 4% less, with half the kernel time (page faults).
    Rounding depends on the shape alone, so a resumed run computes exactly what the uninterrupted one did.
    """
    inner = x.shape[1]
    main = inner - inner % _size_step(inner)
    if main == inner:
        return _linear_rows(x, w)
    return _linear_rows(x[:, :main], w[:, :main]).addmm_(x[:, main:], w[:, main:].t())


def _linear_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`x @ w^T` by oneDNN, `x`'s rows padded to a rounded count; any strides for `w`, a copy of `x` unless its
    rows are contiguous and their count is rounded. The result is a plain tensor, not a view (see `_onednn_matmul`)."""
    rows = x.shape[0]
    step = _size_step(rows)
    padded = -(-rows // step) * step
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    filled = x.new_empty((padded, x.shape[1]))
    filled[:rows].copy_(x)
    filled[rows:].zero_()
    out = torch.ops.mkldnn._linear_pointwise(filled, w, None, "none", [], "")
    return torch.ops.aten._unsafe_view(out.narrow(0, 0, rows), (rows, out.shape[1]))


def _onednn_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` through `_linear`. Leading dimensions of `a` are folded into rows, and the result is unfolded without
    making it a view (as `torch.matmul` does): Megatron modifies linear outputs in place, which autograd forbids on
    a view returned by a custom Function. A transposed 2-D `a` (the weight gradient's `dY^T @ X`) is computed as
    `(b^T @ a^T)^T`, made contiguous, when that copies less: X^T [in, tokens] and the [out, in] result instead of
    dY^T [out, tokens]."""
    if a.dim() == 2:
        copied_as_is = 0 if a.is_contiguous() else a.numel()
        copied_swapped = (0 if b.t().is_contiguous() else b.numel()) + a.shape[0] * b.shape[1]
        if copied_swapped < copied_as_is:
            return _linear(b.t(), a).t().contiguous()
        return _linear(a, b.t())
    out = _linear(a.reshape(-1, a.shape[-1]), b.t())
    return torch.ops.aten._unsafe_view(out, (*a.shape[:-1], b.shape[1]))


class _OneDnnMatmulMode(TorchFunctionMode):
    """`torch.matmul(a, b)` / `a.matmul(b)` of fp32 tensors computed by `_onednn_matmul`; other calls unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (func is torch.matmul or func is torch.Tensor.matmul) and not kwargs and _onednn_fits(*args):
            return _onednn_matmul(*args)
        return func(*args, **(kwargs or {}))


def _in_onednn_mode(fn: Callable) -> staticmethod:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _OneDnnMatmulMode():
            return fn(*args, **kwargs)

    return staticmethod(wrapper)


def linear_gemms_on_onednn(patch: Patcher) -> None:
    """Megatron's linear layers multiply with oneDNN, not MKL (speed; results equal to float32 rounding).

    Why: torch's CPU `matmul` calls MKL's sgemm, and MKL runs its AVX2 kernels on AMD CPUs; oneDNN (in every x86
    torch build, the library vLLM's CPU backend computes with) uses AVX-512 where the CPU has it. Measured on the
    2-core AMD EPYC of this project's CI, 1 thread, [1486, 128] x [128, 1024]: MKL 3.4 ms, oneDNN 1.5 ms; the
    weight-gradient GEMM 4.0 vs 2.1 ms. The GEMMs are most of a CPU train step (63% of the GRPO benchmark's).
    How: the forward and backward of `LinearWithGradAccumulationAndAsyncCommunication` (every parallel linear and
    the output layer) and `LinearWithFrozenWeight` (reference and frozen models) run under `_OneDnnMatmulMode`,
    which computes their `matmul` calls with `torch.ops.mkldnn._linear_pointwise`; their communication and
    gradient bookkeeping are Megatron's own. Where `mrl.cpu.isa` picks torch's own GEMMs (a torch build
    without oneDNN, a CPU below AVX2), the patch does nothing.
    """
    from mrl.cpu.isa import current

    if current().linear_gemm != "onednn":
        return
    from megatron.core.tensor_parallel import layers

    for cls in (layers.LinearWithGradAccumulationAndAsyncCommunication, layers.LinearWithFrozenWeight):
        for name in ("forward", "backward"):
            patch.set(cls, name, _in_onednn_mode(cls.__dict__[name].__func__))


def packed_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[total] each packed token's position within its own sequence (cu_seqlens [n + 1], cumulative lengths, ending
    at `total`), computed where the offsets are: nothing is read back to the host (a GPU does not wait)."""
    tokens = torch.arange(total, device=cu_seqlens.device)
    offsets = cu_seqlens.long()
    sequence = torch.searchsorted(offsets[1:], tokens, right=True)  # the first sequence ending after the token
    return tokens - offsets[sequence]


def frequencies_per_token(freqs: torch.Tensor, cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[total, ...] the rotary frequencies of each packed token: `freqs` itself where it holds one row per packed
    token (megatron-core's branch for them; without context parallelism its per-sequence slices tile the pack in
    order), else the rows at each token's position within its own sequence."""
    return freqs if freqs.size(0) == total else freqs[packed_positions(cu_seqlens, total)]


def packed_rope_in_one_gather(patch: Patcher) -> None:
    """Packed (thd) RoPE without context parallelism gathers its frequencies in one indexing op (speed; bit-equal).

    Why: the unfused `rope_utils._apply_rotary_pos_emb_thd` (0.19.2; GPUs use TE's fused kernel instead) splits
    the packed tensor into its sequences and rotates each with its own frequency slice, a Python loop run for
    q and k of every layer: 64 short GRPO responses cost ~4 ms of a 110 ms CPU train step in that loop.
    How: the frequencies of token j are `freqs[position of j in its sequence]`, the rows the loop concatenates, so
    `freqs[packed_positions(cu_seqlens)]` is the same tensor and the rotation that follows is Megatron's own.
    Frequencies given per packed token (Megatron's branch for them, which it also takes when a pack's length equals
    its longest sequence's, a pack of one sequence) are, without context parallelism, sliced at each sequence's
    offset: the slices tile the pack in order, so they are `freqs` itself, used as it is. Context parallelism
    keeps Megatron's code. Without it the pack's length is the offsets' last entry, so the branch is chosen from
    shapes alone.
    """
    from megatron.core.models.common.embeddings import rope_utils

    loop = rope_utils._apply_rotary_pos_emb_thd

    def gathered(
        t,
        cu_seqlens,
        freqs,
        rotary_interleaved=False,
        mla_rotary_interleaved=False,
        mscale=1.0,
        cp_group=None,
        multi_latent_attention=None,
    ):
        if multi_latent_attention is not None or cp_group is None or cp_group.size() > 1:
            return loop(
                t,
                cu_seqlens,
                freqs,
                rotary_interleaved=rotary_interleaved,
                mla_rotary_interleaved=mla_rotary_interleaved,
                mscale=mscale,
                cp_group=cp_group,
                multi_latent_attention=multi_latent_attention,
            )
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1),
            frequencies_per_token(freqs, cu_seqlens, t.shape[0]),
            rotary_interleaved=rotary_interleaved,
            mla_rotary_interleaved=mla_rotary_interleaved,
            mscale=mscale,
        ).squeeze(1)

    patch.set(rope_utils, "_apply_rotary_pos_emb_thd", gathered)


def _l2_norm_on_device(chunk_size: int, noop_flag: Any, tensor_lists: list, per_tensor: bool, *args: Any):
    """megatron-core's `local_multi_tensor_l2_norm` (core/utils.py) without its host reads: the same per-tensor
    norms and norm of norms, stacked where the tensors are instead of read one by one into a host tensor."""
    norms = [torch.norm(tensor).float() for tensor_list in tensor_lists for tensor in tensor_list]
    return torch.norm(torch.stack(norms)).reshape(1), None


def grad_norm_on_device(patch: Patcher) -> None:
    """Gradient clipping's norm without Apex computes on the device, not through the host (speed; the same value).

    Why: without Apex's `amp_C.multi_tensor_l2norm` (no TE either), `clip_grads.get_grad_norm_fp32` falls back to
    `local_multi_tensor_l2_norm`, which builds a host tensor from every parameter's norm: one host read per
    parameter tensor and step, where the GPU drains its queue each time (an H200's Qwen3-0.6B step: 226 of its
    1,135 host synchronisations). How: the norms stay on the device and are stacked; the norm of the stack is the
    fallback's result (bit for bit on CPU). Left alone where Apex or TE provides the kernel."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        patch.set(clip_grads, "l2_norm_impl", _l2_norm_on_device)
