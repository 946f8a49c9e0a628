"""Collectives: the one module through which mrl talks to torch.distributed at run time.

groups.py makes and destroys process groups; every collective and every rank or size query goes through here, and
tests/unit/parallel/test_parallel_collectives.py reads mrl/ and converters/ and fails on any other use.

Rule: a collective runs on its group's device, whatever device the caller's tensors are on.
    the group serves the CPU (gloo, or a "cpu:gloo,cuda:nccl" mix)   -> the CPU
    it serves accelerators only (NCCL: CUDA alone, torch 2.13's       -> this process's current device of that type
      Backend.backend_capability in distributed_c10d.py)                 (CUDA: the one the device rule set)
That is torch's own choice for object collectives (`_get_object_coll_device` in distributed_c10d.py). Every
rank of a group has the same backends, so every rank picks the same device and sender and receivers meet in one
backend: a choice per call from the caller's tensor could put a CUDA sender on a mixed group's NCCL half and a CPU
receiver on its gloo half. An NCCL group refuses host tensors at dispatch ("No backend type associated with device
type cpu", ProcessGroup::getBackend), so without this rule every host tensor mrl sends over NCCL is a crash.

Data flow of one call:
    caller's tensor (any device) --copied only when it is elsewhere--> the group's device --torch.distributed-->
    copied back into the caller's tensor (in-place calls), returned on the caller's tensor's device (gathers) or on
    `device` (a broadcast receiver, which has no tensor of its own)
Nothing is copied on CPU machines (gloo) nor for CUDA tensors on NCCL. The host tensors mrl sends (tensor headers,
pipeline stage layouts, metric scalars) are a few bytes; their copy back is a host sync the caller's read of the
result makes anyway.

The default group on GPUs stays "nccl", not "cpu:gloo,cuda:nccl": megatron-core 0.19.2's initialize_model_parallel
makes its groups with `new_group(backend=None)` (through parallel_state.create_group; the pipeline group gets
pipeline_model_parallel_comm_backend, None by default), which inherits the default group's backend string, so every
TP/PP/DP/CP/EP group and their combinations would open a gloo mesh and its threads beside NCCL, to carry bytes this
module moves to the device instead. Megatron makes the gloo groups it wants itself, with backend="gloo"
(DATA_PARALLEL_GROUP_GLOO and the other *_GLOO groups, while its create_gloo_process_groups argument is on, the
default). A mixed group still works here, over its gloo half (slow for model tensors: keep mixed groups for
metadata).

Callers run a collective even over a group of one where it runs once per step or refit (the expert-load reduce,
the pipeline layout gather): a one-GPU world then issues the same NCCL calls a larger one does, which is how the GPU
tier (tests/gpu/test_gpu_collectives.py) catches a host tensor sent to NCCL. Per-parameter and per-micro-batch
paths keep their shortcut for a group of one.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch
import torch.distributed as dist

#: A torch.distributed ProcessGroup (None: the default group).
Group = Optional[Any]
ReduceOp = Literal["sum", "max", "min"]
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

#: The dtypes `broadcast_tensor` carries (a dtype's index goes in the header).
DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
)
_MAX_DIMS = 7


# ------------------------------------------------------------------------------------------------------ queries
def is_initialized() -> bool:
    """Whether torch.distributed's default group is up in this process."""
    return dist.is_available() and dist.is_initialized()


def rank(group: Group = None) -> int:
    """This process's rank in `group` (the global rank for the default group)."""
    return dist.get_rank(group)


def world_size(group: Group = None) -> int:
    return dist.get_world_size(group)


def group_device(group: Group = None) -> torch.device:
    """The device `group`'s collectives run on (the rule in the module docstring)."""
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None  # a collective needs the default group up (is_initialized)
    types = [device.type for device in pg._device_types]
    if not types or "cpu" in types:  # no backend registered yet: torch picks the CPU too
        return torch.device("cpu")
    return torch.device(types[0], torch.get_device_module(types[0]).current_device())


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`, contiguous: itself where it already is."""
    return tensor.to(device).contiguous()


def _back(result: torch.Tensor, caller: torch.Tensor) -> None:
    """The result of an in-place collective into the caller's tensor (nothing to do where it was the same)."""
    if result is not caller:
        caller.copy_(result)


# -------------------------------------------------------------------------------------------------- collectives
def all_reduce(tensor: torch.Tensor, op: ReduceOp = "sum", group: Group = None) -> None:
    """In place: `tensor` becomes the `op` reduction of every member's `tensor` (the same shape everywhere)."""
    work = _on(tensor, group_device(group))
    dist.all_reduce(work, op=_REDUCE_OPS[op], group=group)
    _back(work, tensor)


class _SumEverywhere(torch.autograd.Function):
    """The sum over a group whose backward is the sum over the group again: every member's result depends on every
    member's input, so the gradient reaching one input is the sum of every member's upstream gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        out = tensor.detach().clone()
        all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.contiguous().clone()
        all_reduce(out, group=ctx.group)
        return out, None


def summed_with_grad(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """The sum of every member's `tensor` (a new tensor; the same shape everywhere), differentiable: where each
    member computes the same function of the sum, the backward gives each member's input the whole gradient (every
    member must run the backward, as every member ran the forward)."""
    return _SumEverywhere.apply(tensor, group)


def all_gather(tensor: torch.Tensor, group: Group = None) -> list[torch.Tensor]:
    """Every member's `tensor` (the same shape and dtype everywhere) in group-rank order, on `tensor`'s device."""
    work = _on(tensor, group_device(group))
    gathered = [torch.empty_like(work) for _ in range(world_size(group))]
    dist.all_gather(gathered, work, group=group)
    return [g.to(tensor.device) for g in gathered]


def all_gather_into_tensor(output: torch.Tensor, tensor: torch.Tensor, group: Group = None) -> None:
    """In place: `output` [world * n, ...] becomes every member's `tensor` [n, ...] stacked in group-rank order."""
    device = group_device(group)
    work = _on(output, device)
    dist.all_gather_into_tensor(work, _on(tensor, device), group=group)
    _back(work, output)


def broadcast(tensor: torch.Tensor, group_src: int, group: Group = None) -> None:
    """In place: `tensor` takes group rank `group_src`'s value on every member (the same shape everywhere)."""
    work = _on(tensor, group_device(group))
    dist.broadcast(work, group=group, group_src=group_src)
    _back(work, tensor)


def broadcast_tensor(
    tensor: Optional[torch.Tensor], group_src: int, group: Group = None, device: Optional[torch.device] = None
) -> torch.Tensor:
    """Group rank `group_src`'s `tensor` (None on the other members) on every member: its rank, dtype and shape go
    first, in a header of 2 + 7 int64, then the data. Receivers get it on `device` (default: the group's device);
    the sender gets its own tensor back."""
    header = torch.zeros(2 + _MAX_DIMS, dtype=torch.long)  # [rank, dtype index, shape..., 0 padding]
    if tensor is not None:
        if tensor.dim() > _MAX_DIMS or tensor.dtype not in DTYPES:
            raise ValueError(
                f"broadcast_tensor carries up to {_MAX_DIMS} dims of {DTYPES}; got {tensor.dim()} dims "
                f"of {tensor.dtype}"
            )
        header[0], header[1] = tensor.dim(), DTYPES.index(tensor.dtype)
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
    broadcast(header, group_src, group)
    if tensor is None:
        shape = tuple(int(s) for s in header[2 : 2 + int(header[0])])
        tensor = torch.empty(shape, dtype=DTYPES[int(header[1])], device=device or group_device(group))
    broadcast(tensor, group_src, group)
    return tensor


def barrier(group: Group = None) -> None:
    """Every member of `group` waits for the others (on the group's device: NCCL's barrier is a one-element
    all-reduce, on the device named here rather than one torch guesses)."""
    device = group_device(group)
    dist.barrier(group=group, device_ids=None if device.type == "cpu" else [device.index])
