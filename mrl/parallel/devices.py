"""The device rule: which CUDA device a rank uses. Written once; every rank, engine and reward model asks here.

A Ray actor that holds GPUs sees only those, renumbered from 0 (Ray 2.60 sets CUDA_VISIBLE_DEVICES to the actor's GPU
ids: ray/_private/utils.py `set_visible_accelerator_ids`), so a policy rank with LOCAL_RANK=3 on an 8-GPU node sees one
device and it is device 0; indexing by LOCAL_RANK there fails with "invalid device ordinal". Two actors sharing a
bundle's GPU by fractions see the same one. A process started by torchrun (or Slurm's srun with every GPU visible)
sees all of its node's devices, and LOCAL_RANK picks its own. (An actor that asks for no GPU sees every GPU of its
node since Ray 2.60, which no longer blanks CUDA_VISIBLE_DEVICES for it: ray/_private/accelerators/accelerator.py.
Ray then accounts for none of them, so mrl never places a GPU worker that way: mrl/app/runtime.py.)

    visible devices                      device index
    1                                    0          (a Ray actor: its bundle's GPU; colocated groups share it)
    >= LOCAL_WORLD_SIZE                  LOCAL_RANK (torchrun: the node's GPUs, one per local rank)
    anything else                        DeviceRuleError (the launcher exposed neither one GPU nor the node's)
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch


class DeviceRuleError(RuntimeError):
    """A rank sees a number of devices that matches no launcher's convention."""


def device_index(local_rank: int, local_world_size: int, visible: int) -> int:
    """The CUDA device index of the rank at `local_rank` of `local_world_size` ranks on its node, which sees
    `visible` devices (see the module docstring)."""
    if visible < 1:
        raise DeviceRuleError(
            f"rank {local_rank} of {local_world_size} on its node sees no CUDA device (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}): a Ray actor placed on GPUs must ask for a GPU share "
            "(num_gpus > 0), else Ray hides every GPU from it"
        )
    if visible == 1:
        return 0
    if visible >= local_world_size and 0 <= local_rank < visible:
        return local_rank
    raise DeviceRuleError(
        f"rank {local_rank} of {local_world_size} on its node sees {visible} CUDA devices: expected 1 (a Ray actor's "
        f"own GPU) or at least {local_world_size} (every GPU of the node, as torchrun starts ranks); set "
        "CUDA_VISIBLE_DEVICES accordingly"
    )


def local_cuda_device(visible: Optional[int] = None) -> int:
    """This process's device index by the rule, from LOCAL_RANK / LOCAL_WORLD_SIZE (0 / 1 when unset) and the
    devices it sees (`visible`: torch.cuda.device_count() unless given)."""
    if visible is None:
        import torch

        visible = torch.cuda.device_count()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(max(1, local_rank + 1))))
    return device_index(local_rank, local_world_size, visible)


def current_device() -> torch.device:
    """This process's torch device: its current CUDA device (chosen by the rule above when its process group
    started, or device 0 for a process that runs none), else the CPU."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
