"""Process groups: the only place mrl creates them (the policy's ranks, the Megatron engine, `mrl convert`, the
refit broadcast groups). Collectives over them go through mrl/parallel/collectives.py.

Model and loss code receive groups from `megatron.core.parallel_state` (or as arguments), never build their own.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

from mrl.parallel.layout import ParallelDims, ParallelLayoutError
from mrl.parallel.ports import free_port


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
            from mrl.parallel.devices import local_cuda_device

            torch.cuda.set_device(local_cuda_device())  # the device rule: a Ray actor's one GPU is device 0
        timeout = datetime.timedelta(seconds=timeout_s)
        if missing:  # a single process: a private rendezvous on a free local port
            init_method = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
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
    from mrl.cpu import megatron_patches

    megatron_patches.apply()
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


def init_fake_process_groups(world: int, rank: int, *, tp: int = 1, pp: int = 1, ep: int = 1) -> None:
    """Megatron's groups of a `world`-rank layout with this process as rank `rank`, over torch's fake process group
    (torch.testing._internal.distributed.fake_pg: every collective a no-op, nothing is sent): to build one rank's
    model on the meta device and count what it holds (mrl.testing.meta_build). No gloo groups: the fake backend has
    none. `destroy_process_groups` undoes it."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from mrl.cpu import megatron_patches

    megatron_patches.apply()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        create_gloo_process_groups=False,
    )
    model_parallel_cuda_manual_seed(0)  # the model-parallel RNG states a forward pass forks


def destroy_process_groups() -> None:
    """Destroy Megatron's groups and torch.distributed's default group (safe to call when not initialised; a
    process that never imported Megatron has no Megatron groups, and does not import it here: seconds)."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def standalone_group(
    address: str, port: int, member: int, size: int, backend: str, timeout_s: float = 600.0
) -> dist.ProcessGroup:
    """A process group of `size` members outside torch.distributed's world (no init_process_group: the policy's
    and vLLM's worlds are left alone), joined as `member`; member 0 hosts its TCPStore at address:port. One gloo or
    NCCL backend, registered for the device type it serves (gloo: the CPU; NCCL: CUDA), as torch's own group
    factories do (torch 2.13 distributed/_dist2.py:64-119), so collectives.group_device applies to it. Its
    collectives name ranks with `group_src` (members), as it has no global ranks. Blocks until every member
    connected to the store."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, size, is_master=member == 0, timeout=timeout)
    group = dist.ProcessGroup(store, member, size)
    backend_group: torch._C._distributed_c10d.Backend  # ProcessGroupNCCL or ProcessGroupGloo (not evaluated)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        kind, device, backend_group = (
            dist.ProcessGroup.BackendType.NCCL,
            torch.device("cuda"),
            dist.ProcessGroupNCCL(store, member, size, options),
        )
    else:
        kind, device, backend_group = (
            dist.ProcessGroup.BackendType.GLOO,
            torch.device("cpu"),
            dist.ProcessGroupGloo(store, member, size, timeout),
        )
    group._register_backend(device, kind, backend_group)
    group._set_default_backend(kind)
    return group


def world_from_launcher() -> int:
    """The number of processes torchrun started (1 when run as a plain process)."""
    return int(os.environ.get("WORLD_SIZE", "1"))
