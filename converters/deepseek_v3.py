"""DeepSeek-V3 / R1: multi-latent attention, sigmoid-routed experts with a selection bias, a shared expert, and
the first `first_k_dense_replace` layers dense.

Name map per layer (HF `model.layers.i.` <-> Megatron `decoder.layers.i.`, local spec):
    self_attn.q_a_proj.weight            [q_lora, h]                -> self_attention.linear_q_down_proj.weight
    self_attn.q_a_layernorm.weight       [q_lora]                   -> self_attention.q_layernorm.weight
    self_attn.q_b_proj.weight            [nh*(nope+rope), q_lora]   -> self_attention.linear_q_up_proj.weight
    self_attn.q_proj.weight              [nh*(nope+rope), h]        -> self_attention.linear_q_proj.weight (no q_lora)
    self_attn.kv_a_proj_with_mqa.weight  [kv_lora+rope, h]          -> self_attention.linear_kv_down_proj.weight
    self_attn.kv_a_layernorm.weight      [kv_lora]                  -> self_attention.kv_layernorm.weight
    self_attn.kv_b_proj.weight           [nh*(nope+v), kv_lora]     -> self_attention.linear_kv_up_proj.weight
    self_attn.o_proj.weight              [h, nh*v]                  -> self_attention.linear_proj.weight
    mlp.gate.weight / .e_score_correction_bias                      -> mlp.router.weight / .expert_bias
    mlp.experts.{e}.*, mlp.shared_experts.*                         -> mlp.experts.local_experts.{e}.*,
    mlp.shared_experts.*
Row orders are the same on both sides (kv_b_proj per head [k_nope, v]; kv_a_proj_with_mqa [latent, k_rope]), and
Megatron's MLA de-interleaves the rotary part exactly as HF's `rope_interleave=True` does, so every tensor copies
(tensor parallelism splits the up projections by heads; the down projections are replicated).
The MTP layer of the published checkpoints (`model.layers.<num_hidden_layers>.*`) is not part of the model: a
reader of such a checkpoint drops it with a logged note (`converters.hf_io`).

What Megatron-Core 0.19.2 cannot represent is refused with the reason: a group scored by other than its top 2
experts (Megatron scores a group by its top topk/topk_group), routing weights not renormalised, attention biases,
latent-norm epsilons other than 1e-6 (HF fixes them at 1e-6, Megatron uses rms_norm_eps), non-interleaved rope
(vLLM 0.32 applies MLA rope interleaved whatever the config says).
"""

from collections.abc import Mapping
from typing import Any

from converters.family import Family, MLADims, MoEDims


def moe_dims(cfg: Mapping[str, Any]) -> MoEDims:
    first_moe = int(cfg.get("first_k_dense_replace") or 0)
    groups = int(cfg.get("n_group") or 1)
    return MoEDims(
        num_experts=int(cfg["n_routed_experts"]),
        topk=int(cfg["num_experts_per_tok"]),
        ffn_hidden_size=int(cfg["moe_intermediate_size"]),
        shared_ffn_hidden_size=int(cfg["moe_intermediate_size"]) * int(cfg.get("n_shared_experts") or 0),
        layers=tuple(i >= first_moe for i in range(int(cfg["num_hidden_layers"]))),
        score_function="sigmoid",
        normalize_topk=bool(cfg.get("norm_topk_prob", True)),
        scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        expert_bias=True,
        num_groups=groups if groups > 1 else None,
        group_topk=int(cfg["topk_group"]) if groups > 1 else None,
    )


def mla_dims(cfg: Mapping[str, Any]) -> MLADims:
    q_lora = cfg.get("q_lora_rank")
    return MLADims(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
    )


def _routing_problems(cfg: Mapping[str, Any]) -> list[str]:
    problems = []
    groups, topk = int(cfg.get("n_group") or 1), int(cfg["num_experts_per_tok"])
    if groups > 1 and topk // int(cfg["topk_group"]) != 2:
        problems.append(
            f"num_experts_per_tok / topk_group = {topk} / {cfg['topk_group']} != 2 (DeepSeek-V3 scores a "
            "group by its top 2 experts, Megatron by its top num_experts_per_tok / topk_group)"
        )
    if not cfg.get("norm_topk_prob", True) and topk > 1:
        problems.append("norm_topk_prob=false (Megatron's sigmoid router always renormalises the top-k weights)")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        problems.append(f"scoring_func={cfg['scoring_func']!r} (only DeepSeek-V3's 'sigmoid' is mapped)")
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        problems.append(f"topk_method={cfg['topk_method']!r} (only DeepSeek-V3's 'noaux_tc' is mapped)")
    if int(cfg.get("moe_layer_freq") or 1) != 1:
        problems.append("moe_layer_freq != 1 (transformers builds every layer from first_k_dense_replace on as MoE)")
    return problems


def _unsupported(cfg: Mapping[str, Any]) -> list[str]:
    problems = _routing_problems(cfg)
    if cfg.get("attention_bias"):
        problems.append("attention_bias=true (Megatron's MLA projections have no biases)")
    if float(cfg.get("rms_norm_eps", 1e-6)) != 1e-6:
        problems.append(f"rms_norm_eps={cfg['rms_norm_eps']} (HF's latent norms use 1e-6, Megatron rms_norm_eps)")
    if cfg.get("rope_interleave", True) is False:
        problems.append("rope_interleave=false (vLLM 0.32 applies MLA rope interleaved whatever the config says)")
    return problems


FAMILY = Family(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    model_types=("deepseek_v3",),
    qkv_bias=False,
    qk_norm=False,
    unsupported=_unsupported,
    moe=moe_dims,
    mla=mla_dims,
)
