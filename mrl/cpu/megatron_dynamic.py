"""The megatron-core 0.19.2 patches that run Megatron's dynamic inference engine (in-flight batching over a paged KV
cache) without CUDA, and without flash-attn (`mrl.cpu.megatron_patches` registers, applies and reverts them with the
others; each takes its `Patcher`).

- `dynamic_inference_cuda_tensors_on_cpu`: the engine, its context and its controller allocate pinned host
  buffers; those allocations run in the CPU device scope.
- `dynamic_kv_append_in_torch`: the context appends keys and values with a Triton kernel when Triton imports; Triton
  has no CPU backend, so the context's torch append is used.
- `dynamic_suspend_without_cuda_statistics`: suspending and resuming log CUDA memory statistics.
- `paged_attention_in_torch`: the engine's attention over the paged cache is flash-attn's (`flash_decode_and_prefill`,
  behind a flash-attn version check); without flash-attn it is computed in torch, request by request. Applied on a
  GPU without flash-attn too (the GPU tier's lent machine has none).
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch

from mrl.cpu.device_scope import wrap_in_cpu_scope

if TYPE_CHECKING:
    from mrl.cpu.megatron_patches import Patcher


def dynamic_inference_cuda_tensors_on_cpu(patch: Patcher) -> None:
    """Megatron's dynamic engine, its context and its controller allocate their buffers in a CPU device scope.

    Breaks: `DynamicInferenceContext.__init__` (and `reinitialize_inference_state_buffers`, which a resume calls)
    allocates its request table and bookkeeping with `pin_memory=True` / `.pin_memory()`, and
    `TextGenerationController.__init__` (with a dynamic context) its sampling buffers; on a CUDA build without a
    driver each raises "Found no NVIDIA driver" (a host buffer needs no pinning on a CPU). The scope is those
    allocations alone: the steps run outside it (their `torch.cuda.current_device()` is the CPU through
    `current_device_is_cpu`), so the model forward pays no device-rewriting mode on every operation.
    """
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    wrap_in_cpu_scope(
        patch, DynamicInferenceContext, ["__init__", "reinitialize_inference_state_buffers"], fake_cuda_type=False
    )
    wrap_in_cpu_scope(patch, TextGenerationController, ["__init__"], fake_cuda_type=False)
    wrap_in_cpu_scope(patch, DynamicInferenceEngine, ["__init__"], fake_cuda_type=False)


def dynamic_kv_append_in_torch(patch: Patcher) -> None:
    """The dynamic context appends each step's keys and values with torch indexing, not its Triton kernel.

    Breaks: `dynamic_context.triton_append_key_value_cache` is Triton's kernel whenever Triton imports (it does:
    megatron-core 0.19 needs Triton installed), and Triton has no CPU backend, so the first prefill fails to launch it.
    None is the value megatron-core itself uses without Triton: the context then appends with torch indexing.
    """
    from megatron.core.inference.contexts import dynamic_context

    patch.set(dynamic_context, "triton_append_key_value_cache", None)


@contextlib.contextmanager
def _no_statistics(key: str, *, unified_memory_level: int) -> Iterator[None]:
    yield


def dynamic_suspend_without_cuda_statistics(patch: Patcher) -> None:
    """Suspending and resuming the dynamic engine log no CUDA memory statistics.

    Breaks: `DynamicInferenceEngine.suspend_resume_ctx` reads `torch.cuda.memory_stats()` before and after, only to
    log them: without a driver a CUDA build's statistics are empty (a KeyError on the first one read), and a CPU
    build raises. The buffers are freed and reallocated all the same.
    """
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine

    patch.set(DynamicInferenceEngine, "suspend_resume_ctx", staticmethod(_no_statistics))


#: Most query x key scores `paged_attention` computes in one batched call (a step's requests are cut into groups).
SCORES_PER_CALL = 1 << 22


def paged_attention(
    self: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    seqlens_k: torch.Tensor,
    block_table: torch.Tensor,
    is_decode_only: bool,
    softmax_offset: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """`Attention.flash_decode_and_prefill` in torch: each request's queries (the last of its keys, in order) attend
    causally to its keys, gathered from the paged cache by its block table.

    Shapes (megatron-core 0.19.2's contract): q [tokens, 1, heads, d]; k, v the layer's cache [blocks, block size,
    kv heads, d]; cu_seqlens_q [requests + 1] offsets into q's tokens; seqlens_k [requests] keys per request (cached
    and new); block_table [requests, max blocks]. Returns [tokens, 1, heads, d]; rows past the last request's queries
    (padding) are zero. No sliding window, no attention sinks, no latent (MLA) cache. Requests are attended in
    groups, each padded to its longest query and key run (at most `SCORES_PER_CALL` scores a group).
    """
    window = getattr(self.config, "window_size", None)
    if softmax_offset is not None or (window is not None and tuple(window) != (-1, -1)):
        raise NotImplementedError("mrl's torch paged attention has no attention sinks or sliding window")
    heads, dim = q.shape[-2], q.shape[-1]
    scale = getattr(self, "softmax_scale", None) or dim**-0.5
    queries, out = q.reshape(-1, heads, dim), torch.zeros(q.shape[0], heads, dim, dtype=q.dtype, device=q.device)
    starts, key_counts = cu_seqlens_q[:-1].tolist(), seqlens_k.tolist()
    query_counts = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    group: list[int] = []
    for request in range(len(key_counts)):
        wider = group + [request]
        scores = len(wider) * max(query_counts[r] for r in wider) * max(key_counts[r] for r in wider)
        if group and scores > SCORES_PER_CALL:
            _attend(queries, out, k, v, block_table, group, starts, query_counts, key_counts, scale)
            wider = [request]
        group = wider
    if group:
        _attend(queries, out, k, v, block_table, group, starts, query_counts, key_counts, scale)
    return out.unsqueeze(1)


def _attend(
    queries: torch.Tensor,
    out: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_table: torch.Tensor,
    group: list[int],
    starts: list[int],
    query_counts: list[int],
    key_counts: list[int],
    scale: float,
) -> None:
    """Causal attention of the requests `group`, batched: queries, keys and values padded to the group's longest;
    writes each request's outputs into `out` [tokens, heads, d]."""
    device = queries.device
    most_q, most_k = max(query_counts[r] for r in group), max(key_counts[r] for r in group)
    if most_q == 0:
        return
    blocks = math.ceil(most_k / k.shape[1])
    table = block_table[group, :blocks].long().clamp(min=0)  # unused entries (-1) name a block the mask hides
    step = torch.arange(most_q, device=device)
    q_count = torch.tensor([query_counts[r] for r in group], device=device)
    k_count = torch.tensor([key_counts[r] for r in group], device=device)
    key = torch.arange(most_k, device=device)
    # Past a request's own keys the gathered rows are cache memory never written (torch.empty: possibly NaN), and a
    # masked key still multiplies its value by 0: zeroed, they cannot turn a row into NaN.
    unused = (key[None, :] >= k_count[:, None])[:, :, None, None]  # [group, keys, 1, 1]
    keys = k[table].flatten(1, 2)[:, :most_k].masked_fill(unused, 0)  # [group, keys, kv heads, d]
    values = v[table].flatten(1, 2)[:, :most_k].masked_fill(unused, 0)
    rows = torch.tensor([starts[r] for r in group], device=device)[:, None] + step  # [group, most_q]
    real = step[None, :] < q_count[:, None]
    position = (k_count - q_count)[:, None] + step  # each query's position among its request's keys
    mask = (key <= position[:, :, None]) & (key < k_count[:, None, None])  # [group, most_q, most_k]
    attended = torch.nn.functional.scaled_dot_product_attention(
        queries[rows.clamp(max=queries.shape[0] - 1)].transpose(1, 2),  # [group, heads, most_q, d]
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=True,
    )  # padded queries may see no key at all (NaN rows): they are not written
    out[rows[real]] = attended.transpose(1, 2)[real].to(out.dtype)


def paged_attention_in_torch(patch: Patcher) -> None:
    """The dynamic engine's attention over the paged KV cache is computed in torch where flash-attn is missing.

    Breaks: `Attention.forward` asserts flash-attn >= 2.7.3 (or FA3/FA4) for every dynamic batch, and
    `Attention.flash_decode_and_prefill` calls flash-attn's paged varlen kernels; neither exists on a CPU, nor on a
    GPU without flash-attn. `paged_attention` computes the same causal attention per request from the block table;
    the version check is answered for it. Slower than the kernel (it materialises the scores); equal to one full
    forward over prompt + response (tests/unit/cpu/test_cpu_megatron_patches.py).
    """
    from megatron.core.transformer import attention

    patch.set(attention, "is_fa_min_version", lambda version: True)
    patch.set(attention.Attention, "flash_decode_and_prefill", paged_attention)
