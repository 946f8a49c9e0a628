"""What one HF model family is to the converters (`Family`, with its MoE and MLA dimensions when it has them), and
the error every converter raises.

Imports nothing from the rest of the package: each family module (llama.py, qwen2.py, qwen3.py) defines one
`Family`, and spec.py lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional


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
    moe: Optional[Callable[[Mapping[str, Any]], "MoEDims"]] = None
    """Reads the MoE dimensions of a config (None: a dense family)."""
    mla: Optional[Callable[[Mapping[str, Any]], "MLADims"]] = None
    """Reads the multi-latent attention dimensions (None: grouped-query attention)."""


@dataclass(frozen=True)
class MoEDims:
    """The mixture-of-experts part of a model (Qwen3-MoE, Qwen2-MoE, DeepSeek-V3), read from an HF config by its
    family.

    Routing (per token, E experts, k chosen): scores = softmax(logits) or sigmoid(logits); the k experts with the
    highest scores (plus `expert_bias` for the choice only, DeepSeek-V3), within the `group_topk` best of `num_groups`
    groups when grouped; weights = their scores, divided by their sum when `normalize_topk`, times `scaling_factor`.
    """

    num_experts: int
    topk: int
    ffn_hidden_size: int
    """Hidden size of each routed expert's MLP."""
    shared_ffn_hidden_size: int
    """Hidden size of the shared expert MLP every token also goes through (0: none)."""
    layers: tuple[bool, ...]
    """Per decoder layer: True for a MoE layer, False for a dense MLP (of the model's ffn_hidden_size)."""
    score_function: str
    """"softmax" or "sigmoid"."""
    normalize_topk: bool
    scaling_factor: float
    expert_bias: bool
    """A per-expert bias added to the scores for the choice only (e_score_correction_bias)."""
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    shared_expert_name: str = "shared_experts"
    """The shared expert's HF module under `mlp.` (DeepSeek-V3: shared_experts; Qwen2-MoE: shared_expert)."""
    shared_expert_gate: bool = False
    """The shared expert's output is scaled by sigmoid(x . w), w = HF's `mlp.shared_expert_gate.weight` [1, h]
    (Qwen2-MoE; Megatron's moe_shared_expert_gate, `mlp.shared_experts.gate_weight`)."""


@dataclass(frozen=True)
class MLADims:
    """Multi-latent attention (DeepSeek-V2/V3): queries through an optional low-rank bottleneck, keys and values
    from one shared latent of `kv_lora_rank` plus one rotary key head of `qk_rope_head_dim`."""

    q_lora_rank: Optional[int]
    """None: a plain q_proj."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim
