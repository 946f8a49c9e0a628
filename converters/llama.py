"""Llama (Llama-2/3 style): RMSNorm, SwiGLU, RoPE (default / linear / llama3 scaling), GQA, no biases.

Name map: the shared dense-decoder table in `converters.mapping` with no QKV bias and no q/k norm.
"""

from collections.abc import Mapping
from typing import Any

from converters.family import Family


def _unsupported(cfg: Mapping[str, Any]) -> list[str]:
    problems = []
    if cfg.get("attention_bias"):
        problems.append("attention_bias=true (Llama puts a bias on o_proj too; Megatron's add_qkv_bias cannot)")
    if cfg.get("mlp_bias"):
        problems.append("mlp_bias=true (biases on the MLP projections are not supported)")
    return problems


FAMILY = Family(
    name="llama",
    architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    qkv_bias=False,
    qk_norm=False,
    unsupported=_unsupported,
)
