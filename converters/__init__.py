"""HF <-> Megatron-Core checkpoint conversion for dense decoder families (Llama, Qwen2, Qwen3).

Public API (the single source of truth for parameter names and layouts):
- `model_dims(hf_config)`: validated dimensions; unsupported families/features raise `ConversionError`.
- `hf_to_megatron(hf_state, hf_config, tp_rank, tp_size)`: one TP rank's Megatron state dict.
- `megatron_to_hf(full_megatron_tensors, hf_config)`: iterator of (hf_name, tensor).
- `rule_for(megatron_name, hf_config)`: the rule of one parameter; `.tp_dim` (0 column/vocab parallel, 1 row
  parallel, None replicated) and `.gated` tell how to split or gather it with `tp_shard` / `tp_unshard`.
- `select_pp_stage(...)`: a pipeline stage's part of a full-model state, with local layer indices.
hf_io.py reads and writes HF folders. Imports nothing from mrl: the file-level commands (`mrl convert`) are
`mrl.app.convert`, the Megatron model they build is `mrl.model`.
"""

from converters.mapping import (
    ParamRule,
    expected_hf_shapes,
    hf_to_megatron,
    layer_index,
    megatron_to_hf,
    param_rules,
    resolve_padded_vocab,
    rule_for,
    select_pp_stage,
)
from converters.family import ConversionError
from converters.spec import ModelDims, detect_family, model_dims, supported_families
from converters.transforms import padded_vocab_size, tp_shard, tp_unshard

__all__ = [
    "ConversionError",
    "ModelDims",
    "ParamRule",
    "detect_family",
    "expected_hf_shapes",
    "hf_to_megatron",
    "layer_index",
    "megatron_to_hf",
    "model_dims",
    "padded_vocab_size",
    "param_rules",
    "resolve_padded_vocab",
    "rule_for",
    "select_pp_stage",
    "supported_families",
    "tp_shard",
    "tp_unshard",
]
