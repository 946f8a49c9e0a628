"""A stand-in for NCCL on a machine without CUDA: process groups whose only backend serves an accelerator device
type, so that torch's own dispatch refuses host tensors exactly as it does for an NCCL group.

It changes torch for the whole process (it names torch's PrivateUse1 device "standin" and registers kernels), so it
runs in a process of its own: `python nccl_standin.py` prints what it observed as one JSON line
(tests/unit/parallel/test_parallel_collectives.py reads it).

The contract it enforces (torch 2.13):
- A collective dispatches on its tensors' device type: c10d::allreduce_ and the others have a CPU, a CUDA and a
  PrivateUse1 kernel (torch/csrc/distributed/c10d/Ops.cpp:551-552, as `torch._C._dispatch_dump("c10d::allreduce_")`
  prints), each asking the group for its backend of that device type, ProcessGroup::getBackend(deviceType)
  (torch/csrc/distributed/c10d/ProcessGroup.cpp; declared at include/torch/csrc/distributed/c10d/ProcessGroup.hpp:957
  of the wheel), which raises "No backend type associated with device type cpu" where the group registered no
  backend for the CPU.
- NCCL serves CUDA alone (torch/distributed/distributed_c10d.py:311-313, Backend.backend_capability), so an NCCL
  group registers no CPU backend. The stand-in backend is registered for the "standin" device alone
  (Backend.register_backend(..., devices=["standin"]), distributed_c10d.py:341-407), so its groups register no CPU
  backend either: a host tensor takes torch's unchanged CPU kernel to the same error.
What is the stand-in's own is the accelerator: "standin" tensors are torch's PrivateUse1 device set up from Python
(torch/utils/backend_registration.py:542 `_setup_privateuseone_for_python_backend`), each keeping its data in a host
tensor. The few aten ops collectives.py runs on a device (allocate, copy in and out) and the PrivateUse1 kernels of
the collectives it issues are written here: like torch's own PrivateUse1 kernels they fetch the group's backend for
the device type, and they run its (gloo) algorithm on the host payloads; a tensor on another device among the
arguments is refused as ProcessGroupNCCL refuses one ("Tensors must be CUDA and dense").
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

DEVICE = "standin"
BACKEND = "standin_ccl"
_KEY = "PrivateUse1"


# ------------------------------------------------------------------------------------- the accelerator: tensors
def _wrap(host: torch.Tensor) -> torch.Tensor:
    """A "standin" tensor holding `host` (contiguous) as its data."""
    tensor = torch._C._acc.create_empty_tensor(tuple(host.shape), host.dtype)
    tensor.host = host
    return tensor


def _host(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type != DEVICE:
        raise RuntimeError(f"Tensors must be {DEVICE} and dense (got one on {tensor.device})")
    return tensor.host


def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _wrap(torch.empty(size, dtype=dtype or torch.float32))


def _empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return _wrap(torch.empty(size, dtype=dtype or torch.float32))


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    data = src.host if src.device.type == DEVICE else src
    (dst.host if dst.device.type == DEVICE else dst).copy_(data)
    return dst


# ------------------------------------------------------------------------------ the accelerator: collectives
def _backend(boxed_group: Any) -> Any:
    """The group's backend for the stand-in device (as torch's PrivateUse1 kernels look it up)."""
    return dist.ProcessGroup.unbox(boxed_group)._get_backend(torch.device(DEVICE))


def _allreduce(tensors, group, reduce_op, sparse_indices, async_op=True, timeout=-1):
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp(dist.ReduceOp.RedOpType(reduce_op.op()))
    return tensors, _backend(group).allreduce([_host(t) for t in tensors], options).boxed()


def _broadcast(tensors, group, root_rank, root_tensor, async_op=True, timeout=-1):
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = root_rank, root_tensor
    return tensors, _backend(group).broadcast([_host(t) for t in tensors], options).boxed()


def _allgather(outputs, inputs, group, async_op=True, timeout=-1):
    work = _backend(group).allgather([[_host(t) for t in ts] for ts in outputs], [_host(t) for t in inputs])
    return outputs, work.boxed()


def _allgather_base(output, tensor, group, async_op=True, timeout=-1):
    return output, _backend(group)._allgather_base(_host(output), _host(tensor)).boxed()


def _barrier(tensor, group, device_ids, async_op=True, timeout=-1):
    _host(tensor)  # the device check alone: gloo's barrier takes no tensor
    return _backend(group).barrier(dist.BarrierOptions()).boxed()


def _creator(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    return dist.ProcessGroupGloo(store, rank, size, timeout)


_LIBRARIES: list[Any] = []


def install() -> None:
    """Make the "standin" device and the backend that serves it alone (once per process)."""
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(DEVICE)
    aten = torch.library.Library("aten", "IMPL")
    for name, kernel in (("empty_strided", _empty_strided), ("empty.memory_format", _empty),
                         ("_copy_from", _copy_from)):
        aten.impl(name, kernel, _KEY)
    c10d = torch.library.Library("c10d", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": torch's own PrivateUse1 ones
        warnings.simplefilter("ignore")
        for name, kernel in (("allreduce_", _allreduce), ("broadcast_", _broadcast), ("allgather_", _allgather),
                             ("_allgather_base_", _allgather_base), ("barrier", _barrier)):
            c10d.impl(name, kernel, _KEY)
    _LIBRARIES.extend([aten, c10d])  # a Library's registrations last as long as the object
    dist.Backend.register_backend(BACKEND, _creator, devices=[DEVICE])


# ------------------------------------------------------------------------------------------------ observations
def _refusal(call: Callable[[], Any]) -> str:
    """The error a direct torch.distributed call raises ("" if it went through)."""
    try:
        call()
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return ""


def _world_of_one(collectives: Any) -> dict[str, Any]:
    """The default group (one rank), a group made by new_group from it, as Megatron makes its groups, and a gloo
    group beside them."""
    from mrl.parallel.ports import free_port

    dist.init_process_group(BACKEND, init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}", rank=0, world_size=1)
    subgroup, gloo = dist.new_group([0]), dist.new_group([0], backend="gloo")
    host = torch.tensor([1.0, 2.0, 3.0])
    seen: dict[str, Any] = {
        "device_types": [str(d) for d in dist.group.WORLD._device_types],
        "subgroup_device_types": [str(d) for d in subgroup._device_types],
        "refused": {"all_reduce": _refusal(lambda: dist.all_reduce(host.clone())),
                    "broadcast": _refusal(lambda: dist.broadcast(host.clone(), src=0)),
                    "all_gather": _refusal(lambda: dist.all_gather([host.clone()], host.clone())),
                    "subgroup all_reduce": _refusal(lambda: dist.all_reduce(host.clone(), group=subgroup))},
        "group_device": str(collectives.group_device()), "gloo_group_device": str(collectives.group_device(gloo)),
        "rank": collectives.rank(), "world_size": collectives.world_size(),
    }
    out = {name: host.clone() for name in ("all_reduce max", "subgroup", "gloo", "broadcast")}
    out["all_gather_into_tensor"] = torch.zeros(3)
    collectives.all_reduce(out["all_reduce max"], op="max")
    collectives.all_reduce(out["subgroup"], group=subgroup)
    collectives.all_reduce(out["gloo"], group=gloo)
    collectives.broadcast(out["broadcast"], 0)
    collectives.all_gather_into_tensor(out["all_gather_into_tensor"], host)
    (out["all_gather"],) = collectives.all_gather(host)  # a world of one: one tensor
    out["broadcast_tensor"] = collectives.broadcast_tensor(host, 0)
    collectives.barrier()
    seen["results"] = {name: (t.tolist(), str(t.device)) for name, t in out.items()}
    seen["sender keeps its tensor"] = out["broadcast_tensor"] is host
    dist.destroy_process_group()
    return seen


def _device_only_group(store: Any, member: int, size: int) -> Any:
    """A group outside the default world whose one backend serves the stand-in device alone."""
    group = dist.ProcessGroup(store, member, size)
    group._register_backend(torch.device(DEVICE), dist.ProcessGroup.BackendType.CUSTOM,
                            _creator(store, member, size, datetime.timedelta(seconds=60)))
    return group


def _member(collectives: Any, member: int, port: int, seen: dict[int, Any]) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=member == 0, timeout=datetime.timedelta(seconds=60))
    group = _device_only_group(store, member, 2)
    mine = torch.tensor([float(member + 1), 10.0 * (member + 1)])
    summed, largest = mine.clone(), mine.clone()
    collectives.all_reduce(summed, group=group)
    collectives.all_reduce(largest, op="max", group=group)
    gathered = collectives.all_gather(mine, group)
    leaf = mine.clone().requires_grad_()
    total = collectives.summed_with_grad(leaf, group)
    (float(member + 1) * total.square().sum()).backward()  # member m's loss: (m + 1) |S|^2
    payload = torch.arange(6, dtype=torch.float32).view(2, 3).to(torch.bfloat16)
    to_host = collectives.broadcast_tensor(payload if member == 0 else None, 0, group, device=torch.device("cpu"))
    on_device = collectives.broadcast_tensor(payload if member == 0 else None, 0, group)
    seen[member] = {
        "refused": _refusal(lambda: dist.broadcast(mine.clone(), group=group, group_src=0)),
        "all_reduce sum": summed.tolist(), "all_reduce max": largest.tolist(),
        "all_gather": [g.tolist() for g in gathered],
        "summed_with_grad": (total.tolist(), leaf.grad.tolist()),
        "broadcast_tensor to host": (to_host.float().tolist(), str(to_host.dtype), str(to_host.device)),
        "broadcast_tensor default": (str(on_device.device), on_device.to("cpu").float().tolist()),
    }


def _two_members(collectives: Any) -> dict[str, Any]:
    """Two members (threads) of a group made by hand, so values travel between members."""
    from mrl.parallel.ports import free_port

    port, seen = free_port("127.0.0.1"), {}
    errors: list[BaseException] = []

    def run(member: int) -> None:
        try:
            _member(collectives, member, port, seen)
        except BaseException as error:  # noqa: BLE001 -- reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(m,)) for m in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return {str(m): seen[m] for m in sorted(seen)}


def observe() -> dict[str, Any]:
    install()
    from mrl.parallel import collectives

    return {"world_of_one": _world_of_one(collectives), "two_members": _two_members(collectives)}


if __name__ == "__main__":
    print(json.dumps(observe()), flush=True)
    os._exit(0)  # without the interpreter's teardown: the two members' gloo pairs take ~1.5 s to close
