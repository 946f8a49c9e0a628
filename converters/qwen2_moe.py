"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): the Qwen2 layout (QKV bias, no q/k norm) with routed experts and
a gated shared expert.

Name map: the dense-decoder table of `converters.mapping` with QKV bias, the routed experts as Qwen3-MoE's
(`converters.qwen3_moe`), plus per MoE layer
    mlp.shared_expert.{gate,up}_proj.weight      [f_s, h]   -> mlp.shared_experts.linear_fc1             cat, TP dim 0
    mlp.shared_expert.down_proj.weight           [h, f_s]   -> mlp.shared_experts.linear_fc2             TP dim 1
    mlp.shared_expert_gate.weight                [1, h]     -> mlp.shared_experts.gate_weight            replicated
The shared expert's output is scaled by sigmoid(x . gate) in both (HF `Qwen2MoeSparseMoeBlock`; Megatron's
`SharedExpertMLP` with moe_shared_expert_gate). Routing: softmax over all experts, top-k, renormalised over the k
only when `norm_topk_prob` (false in the published configs: Megatron's pre-softmax). Layers: as Qwen3-MoE
(`mlp_only_layers`, `decoder_sparse_step`).
"""

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from converters import qwen3_moe
from converters.family import Family, MoEDims


def moe_dims(cfg: Mapping[str, Any]) -> MoEDims:
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    return replace(
        qwen3_moe.moe_dims(cfg),
        shared_ffn_hidden_size=shared,
        shared_expert_name="shared_expert",
        shared_expert_gate=shared > 0,
    )


def _unsupported(cfg: Mapping[str, Any]) -> list[str]:
    problems = []
    if cfg.get("qkv_bias") is False:
        problems.append("qkv_bias=false (the family maps q/k/v biases; a checkpoint without them would lack keys)")
    if int(cfg.get("num_experts") or 0) < 1:
        problems.append("num_experts=0 (a MoE family without experts: use the qwen2 family)")
    return problems


FAMILY = Family(
    name="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    model_types=("qwen2_moe",),
    qkv_bias=True,
    qk_norm=False,
    unsupported=_unsupported,
    moe=moe_dims,
)
