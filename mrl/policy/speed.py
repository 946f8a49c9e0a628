"""Megatron's speed options of one policy (`policy.speed`): what `auto` becomes on this rank's hardware, and the
wiring each option needs beyond its flag.

- Gradient-accumulation fusion: `TransformerConfig.gradient_accumulation_fusion`. Transformer Engine's linears fuse
  the accumulation themselves, but the output layer is Megatron's own `ColumnParallelLinear` on every spec, which
  raises at build time unless Apex's `fused_weight_gradient_mlp_cuda` imports (megatron-core 0.19.2,
  `ColumnParallelLinear.__init__` in `tensor_parallel/layers.py`): `auto` asks for both CUDA and that module.
- Overlapped gradient reduce: `DistributedDataParallelConfig.overlap_grad_reduce`. Each bucket is reduced from its
  parameters' backward hooks once the step's last micro-batch has filled it. The schedule runs the other
  micro-batches under the model's `no_sync()` (`TransformerConfig.no_sync_func`) and, with pipeline stages, starts
  the reduce of a chunk it has finished (`grad_sync_func`), as Megatron's own trainer sets them
  (`megatron/training/training.py`). (Without `no_sync` megatron-core 0.19.2 would also count each parameter's
  hook calls against those of the first step, in `_ParamAndGradBucketGroup.register_grad_ready`; measured with
  0.16.1, which counts the same way: the same steps either way.) The step's `finalize_model_grads` waits for the
  reduces.
- Overlapped parameter gather: `overlap_param_gather` (the distributed optimizer only). The optimizer step updates
  this rank's shard alone; forward pre-hooks gather each bucket just before the next forward uses it. Whatever reads
  the weights outside a forward (a refit's export, a save) calls `gather_weights` first, or it reads the other
  shards as they were before the step.

- Grouped expert GEMMs: `build_model(grouped_experts=...)` gives the routed experts
  `mrl.model.grouped_experts.GroupedGemmExperts` (same parameters, two `torch._grouped_mm` per layer), in the local
  spec and in Transformer Engine's, whose experts mrl builds as megatron-core's `SequentialMLP` loop of TE linears.
  `auto` asks for CUDA; `true` runs on CPU too (torch._grouped_mm has a CPU kernel: the tests' way to check the
  wiring).

- Compiled fusions: `transformer_config_from_hf(compiled_fusions=...)` sets megatron-core's `bias_activation_fusion`
  (its SwiGLU, compiled by its `jit_fuser`) and `apply_rope_fusion` with `mrl.model.compiled_kernels` standing for
  Transformer Engine's RoPE kernels. Where TE builds the model its own kernels are used and the option changes
  nothing. `auto` asks for CUDA and a torch.compile that works there (`compiled_kernels.inductor_works`, asked once
  per process: a machine without Triton or a C compiler runs unfused, and the log says why); `true` compiles on CPU
  too (inductor's C++ backend, gcc).

`auto` leaves the overlaps off on CPU: gloo's collectives would overlap nothing but the two cores' own compute.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from mrl.config.schema import SpeedConfig


class SpeedOptionError(RuntimeError):
    """An option set to true that this rank's hardware or installed kernels cannot run."""


@dataclass(frozen=True)
class SpeedSettings:
    gradient_accumulation_fusion: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    grouped_expert_gemm: bool = False
    compiled_fusions: bool = False


def fused_wgrad_available() -> bool:
    """Whether Apex's `fused_weight_gradient_mlp_cuda` (the kernel Megatron's local linears call) is installed."""
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def resolve_speed(
    cfg: SpeedConfig,
    *,
    cuda: bool,
    fused_wgrad: bool,
    data_parallel: int,
    distributed_optimizer: bool,
    compiles: bool = True,
) -> SpeedSettings:
    """Each option's value on a rank with (or without) CUDA and Apex's kernel, `data_parallel` ranks (with context
    parallelism), the distributed optimizer or not, and torch.compile working on its GPU or not (`compiles`);
    `SpeedOptionError` for a forced option that cannot run."""
    if cfg.gradient_accumulation_fusion is True and not (cuda and fused_wgrad):
        raise SpeedOptionError(
            "policy.speed.gradient_accumulation_fusion=true needs CUDA and Apex's fused_weight_gradient_mlp_cuda "
            f"(CUDA {'present' if cuda else 'absent'}, the kernel {'installed' if fused_wgrad else 'not installed'}); "
            "set it to auto, or install Apex with its CUDA extensions"
        )
    if cfg.overlap_param_gather is True and not distributed_optimizer:
        raise SpeedOptionError(
            "policy.speed.overlap_param_gather=true needs policy.optimizer.use_distributed_optimizer=true (without it "
            "every rank holds all the weights and nothing is gathered); set one of them"
        )
    several = data_parallel > 1

    def pick(value: Any, auto: bool) -> bool:
        return auto if value == "auto" else bool(value)

    return SpeedSettings(
        gradient_accumulation_fusion=pick(cfg.gradient_accumulation_fusion, cuda and fused_wgrad),
        overlap_grad_reduce=pick(cfg.overlap_grad_reduce, cuda and several),
        overlap_param_gather=pick(cfg.overlap_param_gather, cuda and several and distributed_optimizer),
        grouped_expert_gemm=pick(cfg.grouped_expert_gemm, cuda),
        compiled_fusions=pick(cfg.compiled_fusions, cuda and compiles),
    )


def wire_overlaps(settings: SpeedSettings, tconfig: Any, model: list) -> None:
    """Set the schedule's hooks on `tconfig` that the overlapped reduce needs (see the module docstring); the
    DDP-wrapped `model` chunks provide them."""
    if not settings.overlap_grad_reduce:
        return
    no_sync = [chunk.no_sync for chunk in model]
    start_reduce = [chunk.start_grad_sync for chunk in model]
    tconfig.no_sync_func = no_sync[0] if len(model) == 1 else no_sync
    tconfig.grad_sync_func = start_reduce[0] if len(model) == 1 else start_reduce


def gather_weights(settings: SpeedSettings, model: list) -> None:
    """Complete the parameter gather that an overlapped optimizer step leaves to the next forward, so every rank
    holds the whole of its weights (before an export or a save); a no-op without `overlap_param_gather`."""
    if settings.overlap_param_gather:
        for chunk in model:
            chunk.start_param_sync(force_sync=True)
