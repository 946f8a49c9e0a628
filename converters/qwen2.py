"""Qwen2 / Qwen2.5: the Llama layout plus a bias on q_proj, k_proj and v_proj (= Megatron linear_qkv.bias).

Name map: the shared dense-decoder table in `converters.mapping` with QKV bias (fused like the weights).
"""

from collections.abc import Mapping
from typing import Any

from converters.family import Family


def _unsupported(cfg: Mapping[str, Any]) -> list[str]:
    return []  # sliding windows, activation and rope type are checked for every family in converters.spec


FAMILY = Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    model_types=("qwen2",),
    qkv_bias=True,
    qk_norm=False,
    unsupported=_unsupported,
)
