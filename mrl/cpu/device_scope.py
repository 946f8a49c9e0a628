"""A device-rewriting torch function mode for the megatron-core functions that allocate CUDA tensors, used only while
such a function runs (`cpu_device_scope`): the patches of `mrl.cpu.megatron_patches` and `mrl.cpu.megatron_dynamic`
wrap exactly those functions, so nothing outside them is rewritten and no other code pays the mode's per-operation
cost.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from mrl.cpu.megatron_patches import Patcher


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    # Megatron passes CUDA ordinals (`torch.cuda.current_device()` is an int on GPU builds).
    return isinstance(device, int) and not isinstance(device, bool)


class CudaToCpuMode(TorchFunctionMode):
    """Runs `device="cuda"` factory calls, `.cuda()` and `.to("cuda")` on the CPU.

    With `fake_cuda_type=True`, `tensor.type()` also reports `torch.cuda.<X>Tensor` for CPU tensors: megatron's
    optimizer wrappers accept parameters only if `param.type() == "torch.cuda.FloatTensor"`; on CPU every
    tensor is a host tensor, so the check's intent (a supported dtype on the compute device) holds.
    """

    def __init__(self, fake_cuda_type: bool) -> None:
        super().__init__()
        self.fake_cuda_type = fake_cuda_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        if self.fake_cuda_type and func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def cpu_device_scope(fn: Callable, fake_cuda_type: bool) -> Callable:
    """Wraps `fn` so that `CudaToCpuMode` is active exactly while it runs."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with CudaToCpuMode(fake_cuda_type):
            return fn(*args, **kwargs)

    return wrapper


def wrap_in_cpu_scope(patch: Patcher, module: Any, names: Iterable[str], fake_cuda_type: bool) -> None:
    """Replace each of `module`'s functions `names` by itself in `cpu_device_scope`, recorded by `patch`."""
    for name in names:
        patch.set(module, name, cpu_device_scope(getattr(module, name), fake_cuda_type))
