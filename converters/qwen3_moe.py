"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 layout (q/k norm, no QKV bias) with routed experts.

Name map: the dense-decoder table of `converters.mapping` for attention and dense layers, plus per MoE layer
    mlp.gate.weight                              [E, h]     -> mlp.router.weight                       replicated
    mlp.experts.{e}.{gate,up}_proj.weight        [f_e, h]   -> mlp.experts.local_experts.{e}.linear_fc1 cat, TP dim 0
    mlp.experts.{e}.down_proj.weight             [h, f_e]   -> mlp.experts.local_experts.{e}.linear_fc2 TP dim 1
(experts split over expert-parallel ranks by index; HF's in-memory fused `mlp.experts.gate_up_proj` [E, 2f_e, h] /
`down_proj` [E, h, f_e] are read too). A layer is MoE when it is not in `mlp_only_layers` and
(i + 1) % decoder_sparse_step == 0 (HF's rule). Routing: softmax over all experts, top-k, renormalised over the k
when `norm_topk_prob` (Megatron: top-k of the logits then softmax over the k, the same numbers) or not (Megatron's
pre-softmax). Qwen3-MoE has no shared expert.
"""

from collections.abc import Mapping
from typing import Any

from converters.family import Family, MoEDims


def _num_experts(cfg: Mapping[str, Any]) -> int:
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def moe_dims(cfg: Mapping[str, Any]) -> MoEDims:
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense_only = set(cfg.get("mlp_only_layers") or [])
    layers = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(int(cfg["num_hidden_layers"])))
    return MoEDims(
        num_experts=_num_experts(cfg),
        topk=int(cfg["num_experts_per_tok"]),
        ffn_hidden_size=int(cfg["moe_intermediate_size"]),
        shared_ffn_hidden_size=0,
        layers=layers,
        score_function="softmax",
        normalize_topk=bool(cfg.get("norm_topk_prob", False)),
        scaling_factor=1.0,
        expert_bias=False,
    )


def _unsupported(cfg: Mapping[str, Any]) -> list[str]:
    problems = []
    if cfg.get("attention_bias"):
        problems.append("attention_bias=true (a bias on o_proj too; Megatron's add_qkv_bias cannot)")
    if _num_experts(cfg) < 1:
        problems.append("num_experts=0 (a MoE family without experts: use the qwen3 family)")
    if int(cfg.get("shared_expert_intermediate_size") or 0):
        problems.append("shared_expert_intermediate_size > 0 (a gated shared expert: the qwen2_moe family)")
    return problems


FAMILY = Family(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    qkv_bias=False,
    qk_norm=True,
    unsupported=_unsupported,
    moe=moe_dims,
)
