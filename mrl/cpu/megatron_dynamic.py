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

Also here, on any device: `no_stack_dumps_on_stop_signals`, the workaround for the stack dumps the engine's import
registers, called by whatever imports the engine (the first patch above, mrl/inference/megatron_dynamic.py).
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import signal
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch

from mrl.cpu.device_scope import wrap_in_cpu_scope

if TYPE_CHECKING:
    from mrl.cpu.megatron_patches import Patcher


def no_stack_dumps_on_stop_signals() -> None:
    """Workaround (megatron-core 0.19.2): importing its dynamic engine imports its data-parallel coordinator module,
    which registers faulthandler stack dumps on SIGTERM and SIGINT for the whole process, at import time. Every
    worker Ray stops at a run's end then prints a Python stack, as if it had crashed, and so does a process that
    gets Ctrl-C. mrl runs no coordinator, and its own stack dumps (a call past its deadline) are on SIGUSR1
    (mrl.distributed.stacks). Unregistering puts back the handlers the registration chained to (Ray's exit on
    SIGTERM): to be called right after the import, before anything else sets one."""
    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        faulthandler.unregister(stop_signal)


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

    no_stack_dumps_on_stop_signals()  # the engine's import registered them
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
    groups, each padded to its longest query and key run (at most `SCORES_PER_CALL` scores a group). A decode-only
    step (the same number of queries per request: megatron-core's own reshape of q) reads nothing back to the host
    (`_decode_attention`); the other steps read each request's query and key counts.
    """
    window = getattr(self.config, "window_size", None)
    if softmax_offset is not None or (window is not None and tuple(window) != (-1, -1)):
        raise NotImplementedError("mrl's torch paged attention has no attention sinks or sliding window")
    heads, dim = q.shape[-2], q.shape[-1]
    scale = getattr(self, "softmax_scale", None) or dim**-0.5
    if is_decode_only and q.shape[0] % max(seqlens_k.shape[0], 1) == 0:
        return _decode_attention(q, k, v, max_seqlen_k, seqlens_k, block_table, scale).unsqueeze(1)
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


def _gathered(
    k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, k_count: torch.Tensor, most_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `most_k` keys and values of each request whose blocks `table` [requests, blocks] names, as
    [requests, most_k, kv heads, d]. Past a request's own `k_count` keys the gathered rows are cache memory never
    written (torch.empty: possibly NaN), and a masked key still multiplies its value by 0: zeroed, they cannot turn
    a row into NaN."""
    unused = (torch.arange(most_k, device=k.device)[None, :] >= k_count[:, None])[:, :, None, None]
    keys = k[table].flatten(1, 2)[:, :most_k].masked_fill(unused, 0)
    values = v[table].flatten(1, 2)[:, :most_k].masked_fill(unused, 0)
    return keys, values


def _decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    max_seqlen_k: int,
    seqlens_k: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """A decode-only step's attention, with nothing read back to the host: every request has the same number of
    queries (q's rows / requests, in request order: the last of its keys), so the shapes follow from q's and from
    `max_seqlen_k`, a host integer the context computes from its own host copies. Returns [tokens, heads, d].

    The general path reads each request's query and key counts to the host (a GPU waits for them, in every attention
    layer of every step); the decode steps, nearly all of a generation's, skip that. Requests are attended in
    groups of at most `SCORES_PER_CALL` scores, as there; a request without keys (padding) gets zeros.
    """
    requests = seqlens_k.shape[0]
    per_request, heads, dim = q.shape[0] // requests, q.shape[-2], q.shape[-1]
    most_k = min(max(max_seqlen_k, 1), block_table.shape[1] * k.shape[1])
    blocks = math.ceil(most_k / k.shape[1])
    queries = q.reshape(requests, per_request, heads, dim).transpose(1, 2)  # [requests, heads, per_request, d]
    key = torch.arange(most_k, device=q.device)
    step = torch.arange(per_request, device=q.device)
    rows_per_call = max(1, SCORES_PER_CALL // (per_request * most_k))
    outs = []
    for first in range(0, requests, rows_per_call):
        rows = slice(first, first + rows_per_call)
        k_count = seqlens_k[rows].long()
        table = block_table[rows, :blocks].long().clamp(min=0)  # unused entries (-1) name a block the mask hides
        keys, values = _gathered(k, v, table, k_count, most_k)  # [rows, keys, kv heads, d]
        position = (k_count[:, None] - per_request) + step  # [rows, per_request]
        mask = (key <= position[:, :, None]) & (key < k_count[:, None, None])  # [rows, per_request, keys]
        attended = torch.nn.functional.scaled_dot_product_attention(
            queries[rows],
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask[:, None],
            scale=scale,
            enable_gqa=True,
        )  # [rows, heads, per_request, d]; a request without keys: NaN rows
        outs.append(torch.where((k_count > 0)[:, None, None, None], attended, 0).transpose(1, 2))
    return torch.cat(outs).reshape(q.shape[0], heads, dim).to(q.dtype)


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
    keys, values = _gathered(k, v, table, k_count, most_k)  # [group, keys, kv heads, d]
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
