"""The families mrl converts, their detection from config.json, and the dimensions the mapping needs.

A `Family` (family.py) says what differs between the dense decoder families mrl converts (QKV bias, q/k RMSNorm) and
which
config values it cannot represent in Megatron-Core (so they fail loudly instead of converting into a different
model). `model_dims(config)` reads an HF config (a dict from config.json or a transformers config object) into a
validated `ModelDims`, the one record both the name mapping and the Megatron model builder read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from converters import deepseek_v3, llama, qwen2, qwen2_moe, qwen3, qwen3_moe
from converters.family import ConversionError, Family, MLADims, MoEDims

#: Rope types whose inverse frequencies Megatron's RoPE can use unchanged. YaRN's cos/sin factor (`attention_factor`)
#: is folded into the softmax scale instead (`mrl.model.build.rope_attention_factor`): with every head dim rotated,
#: scaling q and k by m scales their scores by m^2.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

#: Rope types multi-latent attention adds: Megatron's YaRN reproduces DeepSeek-V3's (inverse frequencies, the cos/sin
#: concentration factor and the softmax scale), applied by Megatron itself rather than through our frequencies.
MLA_ROPE_TYPES = ("default", "yarn")

#: Every family mrl converts, looked up by architecture first, then by model type.
FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    qwen3_moe.FAMILY,
    qwen2_moe.FAMILY,
    deepseek_v3.FAMILY,
)


def supported_families() -> tuple[str, ...]:
    return tuple(sorted(f.name for f in FAMILIES))


def detect_family(config: Mapping[str, Any]) -> Family:
    """The family of an HF config, by `architectures` first, then `model_type`.

    Raises ConversionError listing the supported families when nothing matches.
    """
    architectures = [causal_lm_architecture(a) for a in config.get("architectures") or []]
    model_type = config.get("model_type")
    for family in FAMILIES:
        if any(arch in family.architectures for arch in architectures):
            return family
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    supported = ", ".join(f"{f.name} ({'/'.join(f.architectures)})" for f in sorted(FAMILIES, key=lambda f: f.name))
    raise ConversionError(
        f"unsupported model family: architectures={architectures}, model_type={model_type!r}. "
        f"Supported families: {supported}."
    )


#: The HF class name suffix of a reward model: the decoder with a one-output `score` head on the last token.
SEQUENCE_CLASSIFICATION = "ForSequenceClassification"


def causal_lm_architecture(architecture: str) -> str:
    """`LlamaForSequenceClassification` -> `LlamaForCausalLM` (the decoder a reward model is built on)."""
    if architecture.endswith(SEQUENCE_CLASSIFICATION):
        return architecture[: -len(SEQUENCE_CLASSIFICATION)] + "ForCausalLM"
    return architecture


def is_score_model(config: Mapping[str, Any]) -> bool:
    """Whether an HF config is a reward model (`*ForSequenceClassification`)."""
    return any(a.endswith(SEQUENCE_CLASSIFICATION) for a in config.get("architectures") or [])


@dataclass(frozen=True)
class ModelDims:
    """Shapes and numerics of a decoder, read from an HF config (`moe` / `mla` for the families that have them;
    with MLA, `head_dim` is the value head dim and `num_kv_heads` the number of heads)."""

    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    norm_eps: float
    rope_theta: float
    rope_type: str
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    moe: Optional[MoEDims] = None
    """Routed experts (None: every layer has a dense MLP of ffn_hidden_size)."""
    mla: Optional[MLADims] = None
    """Multi-latent attention (None: grouped-query attention of num_kv_heads x head_dim)."""
    score_head: bool = False
    """A reward model: `score.weight` [1, h] (one value per position, read at the last token) replaces the LM head
    (`*ForSequenceClassification` with num_labels = 1; never tied to the embedding)."""


def config_dict(config: Mapping[str, Any] | Any) -> dict[str, Any]:
    """A plain dict from a config.json dict or a transformers PretrainedConfig."""
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"expected an HF config dict or PretrainedConfig, got {type(config).__name__}")


def rope_parameters(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Rope settings in transformers 5 form ({"rope_type", "rope_theta", ...}) from either config generation.

    transformers >= 5 writes `rope_parameters`; older config.json files carry `rope_theta` and `rope_scaling`.
    """
    params = dict(cfg.get("rope_parameters") or {})
    if not params:
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    return params


def _common_problems(cfg: Mapping[str, Any], rope: Mapping[str, Any], family: Family) -> list[str]:
    problems = []
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={cfg['hidden_act']!r} (only 'silu' / SwiGLU is supported)")
    rope_types = MLA_ROPE_TYPES if family.mla else SUPPORTED_ROPE_TYPES
    if rope["rope_type"] not in rope_types:
        problems.append(f"rope_type={rope['rope_type']!r} (supported for {family.name}: {', '.join(rope_types)})")
    elif rope["rope_type"] == "yarn" and not rope.get("mscale_all_dim") and rope.get("mscale", 1.0) != 1.0:
        problems.append(
            "yarn with mscale != 1 and no mscale_all_dim (transformers then ignores mscale, Megatron does not)"
        )
    if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0)) != 1.0:
        problems.append("partial_rotary_factor != 1 (mrl rotates every head dim)")
    if cfg.get("use_sliding_window"):
        problems.append("use_sliding_window=true (sliding-window attention is not supported)")
    if is_score_model(cfg) and int(cfg.get("num_labels", len(cfg.get("id2label") or [0]) or 1)) != 1:
        problems.append(f"num_labels={cfg.get('num_labels')} (a reward model has one output)")
    if family.moe is None and (cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")):
        problems.append(f"mixture-of-experts layers (the {family.name} family is dense)")
    return problems


def model_dims(config: Mapping[str, Any] | Any) -> ModelDims:
    """Validate an HF config and read the dimensions the conversion and the Megatron model need."""
    cfg = config_dict(config)
    family = detect_family(cfg)
    rope = rope_parameters(cfg)
    problems = _common_problems(cfg, rope, family) + family.unsupported(cfg)
    if problems:
        raise ConversionError(f"{family.name} config cannot be converted: " + "; ".join(problems))
    num_heads = int(cfg["num_attention_heads"])
    num_kv = int(cfg.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv != 0:
        raise ConversionError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv}")
    hidden = int(cfg["hidden_size"])
    mla = family.mla(cfg) if family.mla else None
    return ModelDims(
        family=family.name,
        hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=num_heads if mla else num_kv,  # MLA: every head has its own keys and values
        head_dim=mla.v_head_dim if mla else int(cfg.get("head_dim") or hidden // num_heads),
        ffn_hidden_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        tied=bool(cfg.get("tie_word_embeddings", False)) and not is_score_model(cfg),
        qkv_bias=family.qkv_bias,
        qk_norm=family.qk_norm,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_type=str(rope["rope_type"]),
        rope_parameters=rope,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        moe=family.moe(cfg) if family.moe else None,
        mla=mla,
        score_head=is_score_model(cfg),
    )
