"""`mrl plan`'s KV-cache capacity (mrl/app/plan_memory.py, kv_capacity_tokens) equals vLLM 0.32's own computation
(mrl.testing.vllm_kv: vLLM's KV-cache specs and get_kv_cache_configs on a VllmConfig of the same config.json) for
the published configs of the shipped cluster recipes' models at their engines' TP, and past the KV heads; and for
engines of several pipeline stages (each stage its own layers and its own free memory; every stage as many blocks
as the one with the fewest)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from converters.spec import model_dims
from mrl.app.plan_memory import kv_capacity_tokens

CONFIGS = Path(__file__).parents[3] / "mrl" / "_shipped" / "hf_configs"


@pytest.mark.parametrize("name, tp", [("deepseek-ai--DeepSeek-R1-Distill-Qwen-1.5B_config.json", 1),
                                      ("deepseek-ai--DeepSeek-R1-Distill-Qwen-1.5B_config.json", 4),  # 2 KV heads
                                      ("Qwen--Qwen3-30B-A3B_config.json", 2),
                                      ("Qwen--Qwen3-30B-A3B_config.json", 8),
                                      ("deepseek-ai--DeepSeek-V3_config.json", 8)])
def test_kv_cache_tokens_equal_vllms_own_computation(name, tp):
    from mrl.testing.vllm_kv import vllm_kv_capacity

    config = json.loads((CONFIGS / name).read_text())
    config.pop("quantization_config", None)
    for available in (20 * 2**30, 7 * 2**30 + 12345):
        vllm = vllm_kv_capacity(config, tp_size=tp, available_bytes=available, max_model_len=8192)
        assert kv_capacity_tokens(model_dims(config), tp, available) == vllm["tokens"] == vllm["num_blocks"] * 16


@pytest.mark.parametrize("name, tp, pp", [("deepseek-ai--DeepSeek-R1-Distill-Qwen-1.5B_config.json", 1, 3),  # 10/9/9
                                          ("Qwen--Qwen3-30B-A3B_config.json", 4, 2),
                                          ("deepseek-ai--DeepSeek-V3_config.json", 8, 4)])  # 15/15/16/15 layers
def test_kv_cache_tokens_of_pipeline_stages_equal_vllms_own_computation(name, tp, pp):
    from mrl.testing.vllm_kv import vllm_kv_capacity

    config = json.loads((CONFIGS / name).read_text())
    config.pop("quantization_config", None)
    dims = model_dims(config)
    for available in (20 * 2**30, [9 * 2**30 + 12345, *[20 * 2**30] * (pp - 2), 5 * 2**30]):
        vllm = vllm_kv_capacity(config, tp_size=tp, pp_size=pp, available_bytes=available, max_model_len=8192)
        assert kv_capacity_tokens(dims, tp, available, pp=pp) == vllm["num_blocks"] * 16
        least = min(available) if isinstance(available, list) else available
        assert kv_capacity_tokens(dims, tp, available, pp=pp) > kv_capacity_tokens(dims, tp, least)  # fewer layers
