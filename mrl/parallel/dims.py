"""Parallel layout of the policy: validated sizes, and the functions that turn them into process groups.

Megatron-Core orders ranks tp -> cp -> dp -> pp (tensor parallel innermost). With world size W:
    dp = W / (tp * pp * cp)
Experts are laid out separately over the same ranks with expert-tensor-parallel = tp (Megatron's default):
    expert_dp = W / (tp * ep * pp), which needs ep to divide dp * cp.

`init_process_groups` is the only place mrl creates process groups; model and loss code receive groups
from `megatron.core.parallel_state` (or as arguments), never by building their own.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


class ParallelLayoutError(ValueError):
    """The requested TP/PP/CP/EP/SP combination cannot be laid out on the given world size."""


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of each parallel dimension; `dp` is derived. Construction validates the combination.

    Fields mirror `policy.parallel` in the config (tensor/pipeline/context/expert parallel sizes,
    sequence_parallel) plus the number of ranks the policy runs on.
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    world_size: int = 1

    def __post_init__(self) -> None:
        problems = layout_problems(self)
        if problems:
            raise ParallelLayoutError("invalid parallel layout " + self.describe() + ":\n- " + "\n- ".join(problems))

    @property
    def dp(self) -> int:
        """Data-parallel size: the ranks that hold the same model shard and see different data."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of the expert weights (expert tensor parallel = tp, Megatron's default)."""
        return self.world_size // (self.tp * self.ep * self.pp)

    def describe(self) -> str:
        return (
            f"(world_size={self.world_size}, tp={self.tp}, pp={self.pp}, cp={self.cp}, ep={self.ep}, "
            f"sequence_parallel={self.sequence_parallel})"
        )


def layout_problems(dims: ParallelDims) -> list[str]:
    """Every rule of Megatron's layout that `dims` breaks, each as a message naming the fix."""
    problems: list[str] = []
    for name in ("tp", "pp", "cp", "ep", "world_size"):
        value = getattr(dims, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"{name} must be a positive integer, got {value!r}")
    if problems:
        return problems
    model_parallel = dims.tp * dims.pp * dims.cp
    if dims.world_size % model_parallel:
        problems.append(
            f"world_size {dims.world_size} is not divisible by tp*pp*cp = {model_parallel}: "
            "use a world size that is a multiple of it, or smaller tp/pp/cp"
        )
    elif (dims.world_size // (dims.tp * dims.pp)) % dims.ep:
        problems.append(
            f"ep {dims.ep} must divide dp*cp = {dims.world_size // (dims.tp * dims.pp)} "
            "(experts are spread over the data- and context-parallel ranks of each tp*pp shard)"
        )
    if dims.sequence_parallel and dims.tp == 1:
        problems.append("sequence_parallel needs tp > 1 (it splits the sequence over the tensor-parallel ranks)")
    return problems


def default_backend() -> str:
    """NCCL when CUDA is available, gloo on CPU."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _init_torch_distributed(dims: ParallelDims, backend: str, timeout_s: float) -> None:
    """Start torch.distributed from the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing and dims.world_size > 1:
            raise RuntimeError(
                f"torch.distributed is not initialised and {', '.join(missing)} not set: launch with torchrun "
                "(or mrl.testing.distributed.run_on_ranks), or call torch.distributed.init_process_group first"
            )
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = datetime.timedelta(seconds=timeout_s)
        if missing:  # a single process: a private rendezvous on a free local port
            from mrl.testing.distributed import free_port

            init_method = f"tcp://127.0.0.1:{free_port()}"
            dist.init_process_group(backend, init_method=init_method, rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    if dist.get_world_size() != dims.world_size:
        raise ParallelLayoutError(
            f"torch.distributed runs {dist.get_world_size()} ranks but the layout {dims.describe()} expects "
            f"{dims.world_size}: launch as many ranks as the layout's world_size"
        )


def init_process_groups(
    dims: ParallelDims, backend: str | None = None, seed: int = 1234, timeout_s: float = 600.0
) -> None:
    """Create every Megatron process group for `dims` and seed the model-parallel RNG.

    Initialises torch.distributed if needed (from the torchrun environment), applies the CPU compatibility
    patches when CUDA is absent, then `parallel_state.initialize_model_parallel(tp, pp, cp, ep)` and
    `model_parallel_cuda_manual_seed(seed)` (the same seed gives the same initial model for every layout:
    Megatron draws full weights and slices them with `use_cpu_initialization=True`).
    Re-initialising with new sizes first destroys the previous groups.
    """
    from mrl.parallel import cpu_compat

    cpu_compat.apply()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    _init_torch_distributed(dims, backend or default_backend(), timeout_s)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy_process_groups() -> None:
    """Destroy Megatron's groups and torch.distributed's default group (safe to call when not initialised)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
