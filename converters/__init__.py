"""HF <-> Megatron-Core checkpoint conversion for decoder families: dense (Llama, Qwen2, Qwen3) and mixture of
experts (Qwen3-MoE, DeepSeek-V3 with multi-latent attention).

Public API (the single source of truth for parameter names and layouts):
- `model_dims(hf_config)`: validated dimensions; unsupported families/features raise `ConversionError`.
- `hf_to_megatron(hf_state, hf_config, tp_rank, tp_size)`: one TP rank's Megatron state dict.
- `megatron_to_hf(full_megatron_tensors, hf_config)`: iterator of (hf_name, tensor).
- `rule_for(megatron_name, hf_config)`: the rule of one parameter; `.tp_dim` (0 column/vocab parallel, 1 row
  parallel, None replicated) and `.gated` tell how to split or gather it with `tp_shard` / `tp_unshard`.
- `select_pp_stage(...)` / `select_ep_experts(...)`: a pipeline stage's layers / an expert-parallel rank's experts
  of a full-model state, with local indices.
hf_io.py reads and writes HF folders. Imports nothing from mrl: the file-level commands (`mrl convert`) are
`mrl.app.convert`, the Megatron model they build is `mrl.model`.
"""

from converters.family import ConversionError, MLADims, MoEDims
from converters.mapping import (
    ParamRule,
    expected_hf_shapes,
    experts_per_rank,
    hf_to_megatron,
    layer_index,
    megatron_to_hf,
    param_rules,
    resolve_padded_vocab,
    rule_for,
    score_rows,
    select_ep_experts,
    select_pp_stage,
    to_local_expert,
)
from converters.spec import ModelDims, detect_family, is_score_model, model_dims, supported_families
from converters.transforms import padded_vocab_size, tp_shard, tp_unshard

__all__ = [
    "ConversionError",
    "MLADims",
    "MoEDims",
    "ModelDims",
    "ParamRule",
    "detect_family",
    "expected_hf_shapes",
    "experts_per_rank",
    "hf_to_megatron",
    "is_score_model",
    "layer_index",
    "megatron_to_hf",
    "model_dims",
    "padded_vocab_size",
    "param_rules",
    "resolve_padded_vocab",
    "rule_for",
    "score_rows",
    "select_ep_experts",
    "select_pp_stage",
    "supported_families",
    "tp_shard",
    "to_local_expert",
    "tp_unshard",
]
