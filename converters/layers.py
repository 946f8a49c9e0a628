"""The rules and HF shapes of one decoder layer: attention (grouped-query or multi-latent) + MLP (dense or experts).

A `ParamRule` is one Megatron parameter and the HF tensor(s) it is made of; mapping.py assembles the rules of a
whole model and moves tensors through them. Names here are relative to the layer (HF `model.layers.i.`, Megatron
`decoder.layers.i.`, global layer and expert indices).

Grouped-query attention:
    self_attn.{q,k,v}_proj.weight/.bias -> self_attention.linear_qkv.weight/.bias    grouped QKV, TP dim 0
    self_attn.o_proj.weight             -> self_attention.linear_proj.weight         row parallel, TP dim 1
    self_attn.{q,k}_norm.weight         -> self_attention.{q,k}_layernorm.weight     replicated (Qwen3)
Multi-latent attention (DeepSeek-V3; the down projections are replicated over TP, the up projections split by
heads, as in Megatron's Transformer Engine spec and mrl's local spec, mrl.parallel.attention.gpt_layer_spec):
    self_attn.q_a_proj | q_a_layernorm | q_b_proj | q_proj -> linear_q_down_proj | q_layernorm | linear_q_up_proj
                                                              | linear_q_proj
    self_attn.kv_a_proj_with_mqa | kv_a_layernorm | kv_b_proj -> linear_kv_down_proj | kv_layernorm | linear_kv_up_proj
MLP, dense:
    mlp.{gate,up}_proj.weight -> mlp.linear_fc1.weight (cat[gate, up], TP dim 0 gated); mlp.down_proj -> linear_fc2
MLP, experts (routed expert e of E, global index; expert parallelism keeps a contiguous block of them per rank):
    mlp.gate.weight [E, h] -> mlp.router.weight; mlp.gate.e_score_correction_bias [E] -> mlp.router.expert_bias
    mlp.experts.{e}.{gate,up,down}_proj.weight -> mlp.experts.local_experts.{e}.linear_fc1 / linear_fc2
    mlp.shared_experts.{gate,up,down}_proj.weight -> mlp.shared_experts.linear_fc1 / linear_fc2
Norms: input_layernorm -> input_layernorm, post_attention_layernorm -> pre_mlp_layernorm (local spec).

Transformer Engine names (`names="te"`): the TE layer spec fuses some norms into the linear that follows them
(TELayerNormColumnParallelLinear, whose norm is its `layer_norm_weight`); `TE_RENAMES` lists each such name with the
megatron-core 0.19.2 functions it comes from (the same four weight renames as megatron-core's own TE -> local load
hook, `mcore_gpt_load_te_state_dict_pre_hook` in post_training/modelopt/gpt/state_dict_hooks.py). Every other
parameter is named alike in both specs, as `get_gpt_layer_with_transformer_engine_submodules`
(models/gpt/gpt_layer_specs.py) builds them without `mla_down_proj_fusion`, which mrl leaves off: MLA's
input_layernorm (a separate TENorm, not fused into the down projections), qk-norm (TENorm q/k_layernorm), the MLA
down projections (TELinear), linear_q_proj without a q LoRA (TEColumnParallelLinear; megatron-core 0.19.2's
`QKNormConfigResolver` would fuse a q norm into it, which `mrl.cpu.megatron_patches.mla_q_proj_without_norm`
undoes), linear_proj, a MoE layer's pre_mlp_layernorm (TENorm), the router, the routed experts (a SequentialMLP of TE
linears with moe_grouped_gemm=False, as mrl builds them: TESpecProvider.grouped_mlp_modules in
extensions/transformer_engine_spec_provider.py; mrl's GroupedGemmExperts keeps its parameters), the shared experts
(TE column / row parallel linears: get_moe_module_spec_for_backend in models/gpt/moe_module_specs.py), the
embedding, the final norm and the output layer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Literal, Optional

from converters.family import ConversionError
from converters.spec import ModelDims

Kind = Literal["copy", "qkv", "gate_up", "vocab", "score"]
SpecNames = Literal["local", "te"]

_EXPERT_RE = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
Where = Literal["gqa", "mla", "dense"]


@dataclass(frozen=True)
class TERename:
    """A layer parameter the Transformer Engine spec names differently from the local spec (names relative to the
    layer). where: the layers it applies to (gqa / mla: by attention, dense: a layer with a dense MLP); source: the
    megatron-core 0.19.2 functions that make it so (in models/gpt/gpt_layer_specs.py unless another file is
    named)."""

    local: str
    te: str
    where: Where
    source: str


TE_RENAMES: tuple[TERename, ...] = (
    TERename(
        "input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_weight",
        "gqa",
        "get_gpt_layer_with_transformer_engine_submodules: no input_layernorm (the IdentityOp default of "
        "TransformerLayerSubmodules); linear_qkv = backend.column_parallel_layer_norm_linear() "
        "(TELayerNormColumnParallelLinear)",
    ),
    TERename(
        "self_attention.q_layernorm.weight",
        "self_attention.linear_q_up_proj.layer_norm_weight",
        "mla",
        "get_gpt_layer_with_transformer_engine_submodules: q_layernorm=IdentityOp, linear_q_up_proj = "
        "column_parallel_layer_norm_linear() when qk_layernorm (mrl sets it for MLA), which "
        "QKNormConfigResolver (transformer/mla_qk_norm_config.py) keeps; with no q LoRA there is neither "
        "(MLASelfAttention builds linear_q_proj)",
    ),
    TERename(
        "self_attention.kv_layernorm.weight",
        "self_attention.linear_kv_up_proj.layer_norm_weight",
        "mla",
        "get_gpt_layer_with_transformer_engine_submodules: kv_layernorm=IdentityOp, linear_kv_up_proj = "
        "column_parallel_layer_norm_linear() when qk_layernorm",
    ),
    TERename(
        "pre_mlp_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight",
        "dense",
        "get_gpt_layer_with_transformer_engine_submodules: pre_mlp_layernorm=IdentityOp without experts (a "
        "TENorm with them); get_mlp_module_spec_for_backend: a dense MLP's linear_fc1 = "
        "column_parallel_layer_norm_linear() (TESpecProvider.fuse_layernorm_and_linear)",
    ),
)


@dataclass(frozen=True)
class ParamRule:
    """One Megatron parameter and the HF tensor(s) it is made of.

    kind: copy (same tensor), qkv (grouped fusion of q/k/v), gate_up (cat[gate, up]), vocab (rows padded),
    score (a reward model's [1, h] head, rows padded to `SCORE_ROWS`).
    tp_dim: the dimension tensor parallelism splits (None = replicated); `gated` marks linear_fc1's layout.
    """

    megatron: str
    hf: tuple[str, ...]
    kind: Kind
    tp_dim: Optional[int]

    @property
    def gated(self) -> bool:
        return self.kind == "gate_up"

    @property
    def expert(self) -> Optional[int]:
        """The global index of the routed expert this parameter belongs to (None: not an expert's)."""
        match = _EXPERT_RE.search(self.megatron)
        return int(match.group(1)) if match else None


def _gqa_rules(dims: ModelDims, m: str, h: str) -> list[ParamRule]:
    attn = m + "self_attention."
    qkv_hf = tuple(f"{h}self_attn.{p}_proj.weight" for p in "qkv")
    rules = [
        ParamRule(m + "input_layernorm.weight", (h + "input_layernorm.weight",), "copy", None),
        ParamRule(attn + "linear_qkv.weight", qkv_hf, "qkv", 0),
        ParamRule(attn + "linear_proj.weight", (h + "self_attn.o_proj.weight",), "copy", 1),
    ]
    if dims.qkv_bias:
        bias_hf = tuple(f"{h}self_attn.{p}_proj.bias" for p in "qkv")
        rules.append(ParamRule(attn + "linear_qkv.bias", bias_hf, "qkv", 0))
    if dims.qk_norm:
        rules.append(ParamRule(attn + "q_layernorm.weight", (h + "self_attn.q_norm.weight",), "copy", None))
        rules.append(ParamRule(attn + "k_layernorm.weight", (h + "self_attn.k_norm.weight",), "copy", None))
    return rules


def _mla_rules(dims: ModelDims, m: str, h: str) -> list[ParamRule]:
    attn, hf = m + "self_attention.", h + "self_attn."
    assert dims.mla is not None  # layer_rules calls this for MLA models only
    rules = [ParamRule(m + "input_layernorm.weight", (h + "input_layernorm.weight",), "copy", None)]
    if dims.mla.q_lora_rank is None:
        rules.append(ParamRule(attn + "linear_q_proj.weight", (hf + "q_proj.weight",), "copy", 0))
    else:
        rules += [
            ParamRule(attn + "linear_q_down_proj.weight", (hf + "q_a_proj.weight",), "copy", None),
            ParamRule(attn + "q_layernorm.weight", (hf + "q_a_layernorm.weight",), "copy", None),
            ParamRule(attn + "linear_q_up_proj.weight", (hf + "q_b_proj.weight",), "copy", 0),
        ]
    return rules + [
        ParamRule(attn + "linear_kv_down_proj.weight", (hf + "kv_a_proj_with_mqa.weight",), "copy", None),
        ParamRule(attn + "kv_layernorm.weight", (hf + "kv_a_layernorm.weight",), "copy", None),
        ParamRule(attn + "linear_kv_up_proj.weight", (hf + "kv_b_proj.weight",), "copy", 0),
        ParamRule(attn + "linear_proj.weight", (hf + "o_proj.weight",), "copy", 1),
    ]


def _swiglu_rules(m: str, h: str) -> list[ParamRule]:
    """linear_fc1 = cat[gate, up] and linear_fc2 = down of one SwiGLU MLP (`m`, `h`: the two modules' prefixes)."""
    return [
        ParamRule(m + "linear_fc1.weight", (h + "gate_proj.weight", h + "up_proj.weight"), "gate_up", 0),
        ParamRule(m + "linear_fc2.weight", (h + "down_proj.weight",), "copy", 1),
    ]


def _mlp_rules(dims: ModelDims, i: int, m: str, h: str) -> list[ParamRule]:
    rules = [ParamRule(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), "copy", None)]
    if not _is_moe_layer(dims, i):
        return rules + _swiglu_rules(m + "mlp.", h + "mlp.")
    moe = dims.moe
    assert moe is not None  # an MoE layer has MoE dims
    rules.append(ParamRule(m + "mlp.router.weight", (h + "mlp.gate.weight",), "copy", None))
    if moe.expert_bias:
        rules.append(ParamRule(m + "mlp.router.expert_bias", (h + "mlp.gate.e_score_correction_bias",), "copy", None))
    for e in range(moe.num_experts):
        rules += _swiglu_rules(f"{m}mlp.experts.local_experts.{e}.", f"{h}mlp.experts.{e}.")
    if moe.shared_ffn_hidden_size:
        rules += _swiglu_rules(m + "mlp.shared_experts.", f"{h}mlp.{moe.shared_expert_name}.")
    if moe.shared_expert_gate:
        rules.append(
            ParamRule(m + "mlp.shared_experts.gate_weight", (h + "mlp.shared_expert_gate.weight",), "copy", None)
        )
    return rules


def _is_moe_layer(dims: ModelDims, i: int) -> bool:
    return dims.moe is not None and dims.moe.layers[i]


def te_renames(dims: ModelDims, i: int) -> dict[str, str]:
    """Local -> Transformer Engine name of the parameters of decoder layer `i` the two specs name differently
    (relative to the layer); every other parameter keeps its name."""
    where = {"mla" if dims.mla else "gqa"} | (set() if _is_moe_layer(dims, i) else {"dense"})
    renames = {r.local: r.te for r in TE_RENAMES if r.where in where}
    if dims.mla is not None and dims.mla.q_lora_rank is None:
        renames.pop("self_attention.q_layernorm.weight")  # no q LoRA: no q norm in either spec
    return renames


def layer_rules(dims: ModelDims, i: int, names: SpecNames) -> list[ParamRule]:
    """The rules of decoder layer `i`, attention first, with the parameter names of spec `names`."""
    if names not in ("local", "te"):
        raise ConversionError(f"unknown Megatron layer spec names {names!r}: 'local' or 'te'")
    m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    rules = (_mla_rules(dims, m, h) if dims.mla else _gqa_rules(dims, m, h)) + _mlp_rules(dims, i, m, h)
    if names == "local":
        return rules
    renames = {m + local: m + te for local, te in te_renames(dims, i).items()}
    return [replace(r, megatron=renames.get(r.megatron, r.megatron)) for r in rules]


def _gqa_shapes(dims: ModelDims) -> dict[str, tuple[int, ...]]:
    h, hd = dims.hidden_size, dims.head_dim
    q_rows, kv_rows = dims.num_heads * hd, dims.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "self_attn.q_proj.weight": (q_rows, h),
        "self_attn.k_proj.weight": (kv_rows, h),
        "self_attn.v_proj.weight": (kv_rows, h),
        "self_attn.o_proj.weight": (h, q_rows),
    }
    if dims.qkv_bias:
        shapes.update(
            {
                "self_attn.q_proj.bias": (q_rows,),
                "self_attn.k_proj.bias": (kv_rows,),
                "self_attn.v_proj.bias": (kv_rows,),
            }
        )
    if dims.qk_norm:
        shapes.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    return shapes


def _mla_shapes(dims: ModelDims) -> dict[str, tuple[int, ...]]:
    mla, h, nh = dims.mla, dims.hidden_size, dims.num_heads
    assert mla is not None
    q_rows = nh * mla.qk_head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "self_attn.kv_a_proj_with_mqa.weight": (mla.kv_lora_rank + mla.qk_rope_head_dim, h),
        "self_attn.kv_a_layernorm.weight": (mla.kv_lora_rank,),
        "self_attn.kv_b_proj.weight": (nh * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
        "self_attn.o_proj.weight": (h, nh * mla.v_head_dim),
    }
    if mla.q_lora_rank is None:
        shapes["self_attn.q_proj.weight"] = (q_rows, h)
    else:
        shapes.update(
            {
                "self_attn.q_a_proj.weight": (mla.q_lora_rank, h),
                "self_attn.q_a_layernorm.weight": (mla.q_lora_rank,),
                "self_attn.q_b_proj.weight": (q_rows, mla.q_lora_rank),
            }
        )
    return shapes


def _swiglu_shapes(prefix: str, hidden: int, ffn: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "gate_proj.weight": (ffn, hidden),
        prefix + "up_proj.weight": (ffn, hidden),
        prefix + "down_proj.weight": (hidden, ffn),
    }


def _mlp_shapes(dims: ModelDims, i: int) -> dict[str, tuple[int, ...]]:
    h, moe = dims.hidden_size, dims.moe
    if moe is None or not moe.layers[i]:
        return _swiglu_shapes("mlp.", h, dims.ffn_hidden_size)
    shapes: dict[str, tuple[int, ...]] = {"mlp.gate.weight": (moe.num_experts, h)}
    if moe.expert_bias:
        shapes["mlp.gate.e_score_correction_bias"] = (moe.num_experts,)
    for e in range(moe.num_experts):
        shapes.update(_swiglu_shapes(f"mlp.experts.{e}.", h, moe.ffn_hidden_size))
    if moe.shared_ffn_hidden_size:
        shapes.update(_swiglu_shapes(f"mlp.{moe.shared_expert_name}.", h, moe.shared_ffn_hidden_size))
    if moe.shared_expert_gate:
        shapes["mlp.shared_expert_gate.weight"] = (1, h)
    return shapes


def layer_shapes(dims: ModelDims, i: int) -> dict[str, tuple[int, ...]]:
    """The HF tensors of decoder layer `i` (names relative to `model.layers.i.`) with their shapes."""
    h = dims.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    shapes.update(_mla_shapes(dims) if dims.mla else _gqa_shapes(dims))
    shapes.update(_mlp_shapes(dims, i))
    return shapes
