"""The transformer as megatron-core's `HybridModel`: one GPT layer as an attention layer and an MLP (or MoE) layer.

megatron-core 0.19 deprecates `GPTModel` for `HybridModel`, whose stack is a pattern of one-part layers: `*`
attention, `-` dense MLP, `E` mixture of experts, `|` a pipeline stage's end. A transformer of N layers is the
pattern `*-` (or `*E`) N times: GPT layer i is hybrid layers 2i (norm + attention) and 2i+1 (norm + MLP), the same
modules under the same names below the layer, so the forward is the same to the bit (tests/functional/model).

Names. Everything outside the model speaks GPTModel's parameter names: the converters' rules, the refit to vLLM,
LoRA's seeds, HF exports, and router replay's layer index (= HF's and vLLM's layer index). The model's own names
differ in two places only: the layer index (2i or 2i+1 for GPT's i) and the final norm (`decoder.final_norm` for
`decoder.final_layernorm`). `to_hybrid` and `to_gpt` map one onto the other; they are pure renames, valid for
global and stage-local indices alike (a pipeline stage holds whole GPT layers, so its hybrid offset is even).

The TransformerConfig counts hybrid layers (`num_layers` = 2N; the uneven pipeline split and a per-layer
`moe_layer_freq` and `recompute_num_layers` doubled to match, so a recomputed chunk is still whole transformer
layers): megatron-core reads it that way (MoE layer-wise tracking, recomputation), and `gpt_config_fields` turns
GPT-counted settings into those.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from typing import Any

ATTENTION, MLP, MOE, PIPE = "*", "-", "E", "|"

_ATTENTION_PARTS = ("input_layernorm.", "self_attention.", "self_attn_bda.")
_GPT_LAYER = re.compile(r"(^|\.)decoder\.layers\.(\d+)\.")
_GPT_FINAL_NORM, _HYBRID_FINAL_NORM = "decoder.final_layernorm.", "decoder.final_norm."


# ----------------------------------------------------------------------------------------------------- names
def to_hybrid(name: str) -> str:
    """GPTModel's name of a parameter -> HybridModel's (`decoder.layers.3.mlp.x` -> `decoder.layers.7.mlp.x`)."""
    match = _GPT_LAYER.search(name)
    if match is None:
        return name.replace(_GPT_FINAL_NORM, _HYBRID_FINAL_NORM, 1)
    rest = name[match.end() :]
    index = 2 * int(match.group(2)) + (0 if rest.startswith(_ATTENTION_PARTS) else 1)
    return f"{name[: match.start()]}{match.group(1)}decoder.layers.{index}.{rest}"


def to_gpt(name: str) -> str:
    """HybridModel's name of a parameter -> GPTModel's (`decoder.layers.7.mlp.x` -> `decoder.layers.3.mlp.x`)."""
    match = _GPT_LAYER.search(name)
    if match is None:
        return name.replace(_HYBRID_FINAL_NORM, _GPT_FINAL_NORM, 1)
    return f"{name[: match.start()]}{match.group(1)}decoder.layers.{int(match.group(2)) // 2}.{name[match.end() :]}"


def gpt_state_dict(model: Any) -> dict[str, Any]:
    """The model's state dict under GPT's names (what the converters map)."""
    return {to_gpt(name): value for name, value in model.state_dict().items()}


def gpt_layer_index(layer_number: int) -> int:
    """The GPT layer (0-based, HF's index) of a hybrid layer's 1-based global `layer_number`."""
    return (layer_number - 1) // 2


def stage_gpt_layers(model: Any) -> tuple[int, int]:
    """(global index of the first GPT layer, GPT layers) of this pipeline stage of a HybridModel."""
    layers = model.decoder.layers
    if len(layers) == 0:
        return 0, 0
    return gpt_layer_index(layers[0].layer_number), len(layers) // 2


# ----------------------------------------------------------------------------------------------------- config
def gpt_config_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """TransformerConfig keyword arguments counted in GPT layers -> the same counted in hybrid layers."""
    out = dict(fields)
    out["num_layers"] = 2 * fields["num_layers"]
    for key in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage", "recompute_num_layers"):
        if fields.get(key) is not None:
            out[key] = 2 * fields[key]
    freq = fields.get("moe_layer_freq")
    if isinstance(freq, list):
        out["moe_layer_freq"] = [flag for is_moe in freq for flag in (0, is_moe)]
    elif fields.get("num_moe_experts") and freq not in (None, 1):
        # an int k (every k-th GPT layer): spelled out per hybrid layer, since 2i+1 % k says nothing
        out["moe_layer_freq"] = [flag for i in range(fields["num_layers"]) for flag in (0, int(i % freq == 0))]
    return out


def _gpt_moe_layers(config: Any) -> list[bool]:
    """Whether each GPT layer's MLP is a mixture of experts, read from a hybrid-counted config."""
    n = config.num_layers // 2
    if not config.num_moe_experts:
        return [False] * n
    freq = config.moe_layer_freq
    if isinstance(freq, list):
        return [bool(freq[2 * i + 1]) for i in range(n)]
    return [i % freq == 0 for i in range(n)]


def _stage_sizes(config: Any) -> list[int]:
    """GPT layers of each pipeline stage, as the config splits them (an even split, or a first/last stage set)."""
    n, pp = config.num_layers // 2, config.pipeline_model_parallel_size
    first, last = config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage
    ends = [first // 2] if first is not None else []
    tail = [last // 2] if last is not None else []
    middle_stages = pp - len(ends) - len(tail)
    middle = n - sum(ends) - sum(tail)
    sizes = ends + [middle // max(middle_stages, 1)] * middle_stages + tail
    if sum(sizes) != n or len(sizes) != pp:
        raise ValueError(
            f"{n} transformer layers do not split over {pp} pipeline stages as the config says "
            f"(first stage {first and first // 2}, last stage {last and last // 2}): set policy.parallel."
            "first_stage_layers / last_stage_layers so that the other stages get equal whole layers"
        )
    return sizes


def layer_pattern(config: Any) -> str:
    """The hybrid layer pattern of a hybrid-counted config: `*-` / `*E` per GPT layer, `|` between stages."""
    kinds = [ATTENTION + (MOE if moe else MLP) for moe in _gpt_moe_layers(config)]
    stages, start = [], 0
    for size in _stage_sizes(config):
        stages.append("".join(kinds[start : start + size]))
        start += size
    return PIPE.join(stages)


@contextlib.contextmanager
def split_by_pattern(config: Any) -> Iterator[None]:
    """Hide the config's first/last stage sizes while a HybridModel is built: the pattern's `|` marks carry the same
    split, and megatron-core refuses both at once (`select_pipeline_segment`)."""
    saved = config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage
    config.num_layers_in_first_pipeline_stage = config.num_layers_in_last_pipeline_stage = None
    try:
        yield
    finally:
        config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage = saved


# ----------------------------------------------------------------------------------------------------- spec
def _halves(layer: Any) -> tuple[Any, Any]:
    """A GPT layer spec split into its attention layer and its MLP layer (the same submodule specs). The checkpoint
    key map (the local spec saves its norms under TE's fused names) goes with the norm it renames."""
    s = layer.submodules
    keys = s.sharded_state_dict_keys_map
    attention = _layer_like(
        layer,
        {k: v for k, v in keys.items() if k.startswith(_ATTENTION_PARTS)},
        input_layernorm=s.input_layernorm,
        self_attention=s.self_attention,
        self_attn_bda=s.self_attn_bda,
    )
    mlp = _layer_like(
        layer,
        {k: v for k, v in keys.items() if not k.startswith(_ATTENTION_PARTS)},
        pre_mlp_layernorm=s.pre_mlp_layernorm,
        mlp=s.mlp,
        mlp_bda=s.mlp_bda,
    )
    return attention, mlp


def _layer_like(layer: Any, keys: dict[str, str], **parts: Any) -> Any:
    """A layer spec of `layer`'s class and parameters holding `parts` alone."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    submodules = TransformerLayerSubmodules(**parts, sharded_state_dict_keys_map=keys)
    return ModuleSpec(module=layer.module, params=dict(layer.params), submodules=submodules)


def _is_moe_spec(layer: Any) -> bool:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    mlp = layer.submodules.mlp
    return getattr(mlp, "func", getattr(mlp, "module", None)) is MoELayer


def stack_spec(layer_specs: Sequence[Any]) -> Any:
    """The HybridStack spec of a model whose GPT layer specs (dense and, for an MoE model, MoE; any stage's, as
    `mrl.parallel.attention.gpt_layer_spec` gives them) are `layer_specs`."""
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    dense = next((s for s in layer_specs if not _is_moe_spec(s)), None)
    moe = next((s for s in layer_specs if _is_moe_spec(s)), None)
    attention, mlp = _halves(dense if dense is not None else moe)
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            attention_layer=attention,
            mlp_layer=mlp if dense is not None else IdentityOp,
            moe_layer=_halves(moe)[1] if moe is not None else IdentityOp,
        ),
    )
