"""Qwen3 (dense): the Llama layout plus a per-head RMSNorm on queries and keys before RoPE, no QKV bias.

Name map: the shared dense-decoder table in `converters.mapping` plus
self_attn.q_norm / k_norm [head_dim] <-> self_attention.q_layernorm / k_layernorm.
"""

from collections.abc import Mapping
from typing import Any

from converters.family import Family


def _unsupported(cfg: Mapping[str, Any]) -> list[str]:
    if cfg.get("attention_bias"):
        return ["attention_bias=true (Qwen3 puts a bias on o_proj too; Megatron's add_qkv_bias cannot)"]
    return []


FAMILY = Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    qkv_bias=False,
    qk_norm=True,
    unsupported=_unsupported,
)
