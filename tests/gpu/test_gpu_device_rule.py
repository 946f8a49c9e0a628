"""The device rule on a real GPU: a rank that sees one GPU (as a Ray actor holding one does) and has LOCAL_RANK=3 of 8
starts its NCCL process group on cuda:0, where indexing by LOCAL_RANK would fail with "invalid device ordinal"."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import torch
from mrl.parallel.groups import _init_torch_distributed
from mrl.parallel.layout import ParallelDims
_init_torch_distributed(ParallelDims(), "nccl", 60.0)
x = torch.ones(4, device="cuda")
torch.distributed.all_reduce(x)  # a real NCCL collective on the chosen device
print("device", torch.cuda.current_device(), torch.cuda.device_count(), float(x.sum()))
"""


def test_a_rank_with_one_visible_gpu_and_local_rank_3_uses_device_0():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(CUDA_VISIBLE_DEVICES=env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0], LOCAL_RANK="3",
               LOCAL_WORLD_SIZE="8", PYTHONPATH=os.getcwd())
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-4:] == ["device", "0", "1", "4.0"]
