"""The known-noise entries match what the dependencies really print: importing Megatron-Core and vLLM in a fresh
process shows each known message without the filters and none of them with."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")

# What an engine and a policy rank do at start-up that prints the known messages.
IMPORTS = ("import torch.distributed, megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs\n"
           "from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec\n"
           "get_gpt_layer_local_spec()\n"
           "import vllm.v1.worker.cpu_worker\n"
           "from vllm.platforms.cpu import CpuPlatform\n"
           "CpuPlatform.register_triton_kernel_overrides()\n"
           "import os, torch, torch.distributed as dist\n"  # Megatron's MoE dispatch gathers by the deprecated name
           "from mrl.parallel.groups import free_port\n"
           "dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)\n"
           "dist.all_gather_into_tensor(torch.empty(2), torch.ones(2))\n"
           # A gloo group still alive at interpreter exit races its threads against C++ static destructors: the
           # process once aborted there ("terminate called without an active exception", exit -6).
           "dist.destroy_process_group()\n")
KNOWN = ("Transformer Engine and Apex are not installed", "Apex is not installed. Falling back to Torch Norm",
         "`torch.distributed.reduce_op` is deprecated", "Triton not available",
         "`torch.distributed.all_gather_into_tensor` is deprecated")
if torch.version.cuda is not None:  # a CUDA build of torch (the lock's, PyPI's) on a machine without a GPU
    KNOWN += ("No CUDA runtime is found",)


def _stderr(silenced: bool) -> str:
    prefix = "from mrl.logging.known_noise import silence_known_noise\nsilence_known_noise()\n" if silenced else ""
    done = subprocess.run([sys.executable, "-c", prefix + IMPORTS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def test_known_messages_appear_without_the_filters_and_not_with_them():
    loud, quiet = _stderr(silenced=False), _stderr(silenced=True)
    assert all(message in loud for message in KNOWN), loud[-3000:]
    assert not any(message in quiet for message in KNOWN), quiet[-3000:]
