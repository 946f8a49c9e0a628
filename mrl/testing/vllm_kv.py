"""KV-cache capacity as vLLM itself computes it: how many tokens fit in a given number of KV-cache bytes per GPU.

An independent reference for planner arithmetic. Nothing here re-derives the formula; every number comes from vLLM's
own code, on the CPU, without a GPU, weights or an engine:

- `vllm/config/model.py` (`ModelConfig`, built from a temporary folder holding only `config.json`):
  `get_num_kv_heads` (per-rank KV heads, max(1, total // tp), 1 for MLA), `get_head_size` (kv_lora_rank +
  qk_rope_head_dim for MLA), `use_mla`, `get_num_layers_by_block_type`.
- `vllm/v1/kv_cache_interface.py`: `FullAttentionSpec` / `MLAAttentionSpec`, built per layer with the same
  arguments as `Attention.get_kv_cache_spec` (`model_executor/layers/attention/attention.py`) and
  `MLAAttention.get_kv_cache_spec` (`model_executor/layers/attention/mla_attention.py`); their `page_size_bytes`.
- `vllm/v1/attention/backends/utils.py`: `resolve_kv_cache_layout` with the default layout preference.
- `vllm/v1/core/kv_cache_utils.py`: `get_kv_cache_configs` (groups, the one-request-at-max_model_len check,
  `num_blocks = available_bytes // bytes_per_block`), `generate_scheduler_kv_cache_config` and
  `get_kv_cache_capacity` (the "KV cache size: N tokens, maximum concurrency" that vLLM logs at startup).

`available_bytes` is what `Worker.determine_available_memory` (`vllm/v1/worker/gpu_worker.py`) would return on each
rank: ceil(total * gpu_memory_utilization) minus the profiled non-KV memory and CUDA-graph estimate. With pipeline
stages each stage's worker holds its own layers (`vllm/distributed/utils.py` `get_pp_indices`) and reports its own
available bytes; `get_kv_cache_configs` takes one spec and one figure per worker.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_kv_cache_capacity,
    get_kv_cache_configs,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, MLAAttentionSpec, get_kv_quant_mode

# kv_cache_dtype strings vLLM uses for fp8 caches; any other dtype is the "auto" cache (the given dtype as is).
_FP8_CACHE_DTYPES = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


def _vllm_config(
    hf_config: dict[str, Any], tp_size: int, block_size: int, max_model_len: int, pp_size: int = 1
) -> VllmConfig:
    """A VllmConfig for `hf_config` from a folder holding only config.json. The platform hook run by VllmConfig
    (here the CPU platform's) sets process environment variables; they are restored afterwards."""
    with tempfile.TemporaryDirectory() as folder, mock.patch.dict(os.environ):
        (Path(folder) / "config.json").write_text(json.dumps(hf_config))
        model_config = ModelConfig(model=folder, max_model_len=max_model_len, skip_tokenizer_init=True)
        return VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(block_size=block_size),
            parallel_config=ParallelConfig(tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size),
        )


def _layer_spec(vllm_config: VllmConfig, block_size: int, kv_dtype: torch.dtype) -> KVCacheSpec:
    """One decoder layer's spec on one TP rank, as the attention layer's get_kv_cache_spec builds it."""
    model_config = vllm_config.model_config
    cache_dtype = _FP8_CACHE_DTYPES.get(kv_dtype, "auto")
    head_size = model_config.get_head_size()
    kv_quant_mode = get_kv_quant_mode(cache_dtype)
    if model_config.use_mla:
        return MLAAttentionSpec(
            block_size=block_size,
            num_kv_heads=1,
            head_size=head_size,
            dtype=kv_dtype,
            kv_quant_mode=kv_quant_mode,
            max_tp_shards=1,
            cache_dtype_str=cache_dtype,
        )
    return FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
        head_size=head_size,
        dtype=kv_dtype,
        kv_quant_mode=kv_quant_mode,
    )


def vllm_kv_capacity(
    hf_config: dict[str, Any],
    *,
    tp_size: int,
    available_bytes: int | list[int],
    block_size: int = 16,
    kv_dtype: torch.dtype = torch.bfloat16,
    max_model_len: int,
    pp_size: int = 1,
) -> dict[str, Any]:
    """KV blocks and tokens vLLM fits in `available_bytes` of KV-cache memory per rank (a list: per pipeline stage).

    Returns page_size_bytes_per_layer (one block of one layer on one rank), num_layers, num_blocks (the engine's
    num_gpu_blocks, the pool's null block included), tokens and max_concurrency (vLLM's logged capacity:
    int(max_concurrency * max_model_len) and num_blocks / blocks per max_model_len request). Raises vLLM's
    ValueError when one request of max_model_len tokens does not fit."""
    from vllm.distributed.utils import get_pp_indices

    vllm_config = _vllm_config(hf_config, tp_size, block_size, max_model_len, pp_size)
    spec = _layer_spec(vllm_config, block_size, kv_dtype)
    num_layers = vllm_config.model_config.get_total_num_hidden_layers()  # every stage's
    stages = [get_pp_indices(num_layers, rank, pp_size) for rank in range(pp_size)]
    specs = [{f"model.layers.{i}.self_attn.attn": spec for i in range(first, last)} for first, last in stages]
    available = available_bytes if isinstance(available_bytes, list) else [available_bytes] * pp_size
    resolve_kv_cache_layout(
        vllm_config, [[layout.name for layout in get_supported_kv_cache_layouts(())]], specs[0].values()
    )
    kv_cache_config = generate_scheduler_kv_cache_config(get_kv_cache_configs(vllm_config, specs, available))
    tokens, max_concurrency = get_kv_cache_capacity(vllm_config, kv_cache_config)
    return {
        "page_size_bytes_per_layer": spec.page_size_bytes,
        "num_layers": num_layers,
        "num_blocks": kv_cache_config.num_blocks,
        "tokens": tokens,
        "max_concurrency": max_concurrency,
    }
