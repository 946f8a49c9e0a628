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
           "import torch, torch.distributed as dist\n"
           "from mrl.parallel.groups import destroy_process_groups, init_process_groups\n"
           "from mrl.parallel.layout import ParallelDims\n"
           "init_process_groups(ParallelDims())\n"
           "dist.all_gather_into_tensor(torch.empty(2), torch.ones(2))\n"  # Megatron's MoE dispatch: the deprecated name
           # a sequence-parallel linear, as a policy rank's with TP and sequence parallelism
           "from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce\n"
           "linear_with_grad_accumulation_and_async_allreduce(torch.ones(2, 1, 2), torch.ones(2, 2), None, False, False,"
           " True)\n"
           "import megatron.core.models.mimo.model.base\n"  # what get_megatron_optimizer imports (megatron-core 0.19)
           "import tempfile\n"  # a synchronous checkpoint save, as the policy's (logs 0.19's async deprecation)
           "from megatron.core.dist_checkpointing import ShardedTensor\n"
           "from mrl.checkpoint.megatron import save_sharded\n"
           "save_sharded({'w': ShardedTensor.from_rank_offsets('w', torch.ones(2))}, tempfile.mkdtemp())\n"
           # A gloo group still alive at interpreter exit races its threads against C++ static destructors: the
           # process once aborted there ("terminate called without an active exception", exit -6).
           "destroy_process_groups()\n")
KNOWN = ("Transformer Engine and Apex are not installed", "Apex is not installed. Falling back to Torch Norm",
         "`torch.distributed.reduce_op` is deprecated", "Triton is installed, but doesn't include CPU backend",
         "`torch.distributed.all_gather_into_tensor` is deprecated",
         "MimoModelConfig is experimental", "MCore's async save is deprecated",
         "set the environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1")
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
