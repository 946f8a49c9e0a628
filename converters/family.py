"""What one HF model family is to the converters (`Family`), and the error every converter raises.

Imports nothing from the rest of the package: each family module (llama.py, qwen2.py, qwen3.py) defines one
`Family`, and spec.py lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


class ConversionError(ValueError):
    """A checkpoint or config that cannot be converted; the message names the tensor / key and the fix."""


@dataclass(frozen=True)
class Family:
    """What the mapping needs to know about one HF model family.

    qkv_bias: q/k/v projections always carry a bias (Qwen2). Families that expose `attention_bias` also put a bias
    on o_proj, which Megatron's `add_qkv_bias` cannot represent: `unsupported` rejects it.
    qk_norm: per-head RMSNorm on queries and keys before RoPE (Qwen3) = Megatron q_layernorm / k_layernorm.
    """

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    qkv_bias: bool
    qk_norm: bool
    unsupported: Callable[[Mapping[str, Any]], list[str]] = field(default=lambda cfg: [])
