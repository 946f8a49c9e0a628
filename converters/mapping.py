"""The HF <-> Megatron-Core parameter map of a whole model: the single source of truth for names and layouts.

Used by the checkpoint converters, the policy loader (HF -> one TP rank's Megatron state), the HF export and the
weight refit into rollout engines (Megatron full tensors -> HF names, streamed one tensor at a time).

Per layer: the rules of `converters.layers` (attention: grouped-query or multi-latent; MLP: dense or experts).
Model level: model.embed_tokens.weight -> embedding.word_embeddings.weight (vocab padded, TP dim 0),
model.norm.weight -> decoder.final_layernorm.weight, lm_head.weight -> output_layer.weight (vocab padded, TP dim 0;
absent when embeddings are tied: Megatron then shares the embedding). A reward model (`*ForSequenceClassification`,
one label) has score.weight [1, h] -> output_layer.weight instead, zero rows padded to `score_rows(tp)`.
Parallel layouts: `hf_to_megatron` gives one TP rank's tensors (global layer and expert indices);
`select_pp_stage` and `select_ep_experts` keep a pipeline stage's layers and an expert-parallel rank's experts,
renamed to local indices.

Nothing is dropped silently: an HF or Megatron tensor that no rule covers, a missing tensor or a wrong shape raises
ConversionError naming it. The only names skipped on purpose are Megatron `_extra_state` entries (TE/FP8 metadata,
not weights), HF `rotary_emb.inv_freq` buffers (recomputed from the config), the multi-token-prediction layers
of DeepSeek-V3 checkpoints (`model.layers.<num_hidden_layers + k>.*`: not part of the model transformers and vLLM
build; dropped with a logged warning) and, with tied embeddings, an `output_layer.weight` / `lm_head.weight` copy
that equals the embedding (checked when both are present). HF's in-memory fused experts (`mlp.experts.gate_up_proj`
[E, 2f, h], `mlp.experts.down_proj` [E, h, f]) are read as the per-expert tensors checkpoints hold.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from converters import transforms as T
from converters.family import ConversionError
from converters.layers import ParamRule, SpecNames, layer_rules, layer_shapes
from converters.spec import ModelDims, model_dims

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_SKIPPED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
SCORE_ROW_MULTIPLE = 8
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_FUSED_EXPERTS_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
log = logging.getLogger(__name__)


def param_rules(dims: ModelDims, names: SpecNames = "local") -> list[ParamRule]:
    """Every Megatron parameter of the full (unsplit) model, with global layer indices, in a stable order."""
    rules = [ParamRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", 0)]
    for i in range(dims.num_layers):
        rules += layer_rules(dims, i, names)
    rules.append(ParamRule("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", None))
    if dims.score_head:
        rules.append(ParamRule("output_layer.weight", ("score.weight",), "score", 0))
    elif not dims.tied:
        rules.append(ParamRule("output_layer.weight", ("lm_head.weight",), "vocab", 0))
    return rules


def score_rows(tp_size: int) -> int:
    """Rows of a reward model's Megatron output layer: the one real score row, zero rows up to a multiple of 8 (and
    of TP), so a checkpoint reshards between TP 1, 2, 4 and 8 like the vocabulary does."""
    return -(-max(tp_size, SCORE_ROW_MULTIPLE) // SCORE_ROW_MULTIPLE) * SCORE_ROW_MULTIPLE


def expected_hf_shapes(dims: ModelDims) -> dict[str, tuple[int, ...]]:
    """The HF tensors a checkpoint of `dims` must contain, with their shapes (lm_head only when untied)."""
    h = dims.hidden_size
    shapes = {"model.embed_tokens.weight": (dims.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(dims.num_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in layer_shapes(dims, i).items()})
    if dims.score_head:
        shapes["score.weight"] = (1, h)
    elif not dims.tied:
        shapes["lm_head.weight"] = (dims.vocab_size, h)
    return shapes


def per_expert_state(hf_state: Mapping[str, torch.Tensor], dims: ModelDims) -> dict[str, torch.Tensor]:
    """The state with fused in-memory experts ([E, 2f, h] gate_up_proj, [E, h, f] down_proj) as per-expert tensors
    (views) and the multi-token-prediction layers of a checkpoint dropped (with a logged warning)."""
    out: dict[str, torch.Tensor] = {}
    mtp: set[int] = set()
    for name, tensor in hf_state.items():
        layer = hf_layer_index(name)
        if layer is not None and layer >= dims.num_layers and dims.mla is not None:
            mtp.add(layer)
            continue
        fused = _FUSED_EXPERTS_RE.match(name)
        if fused is None:
            out[name] = tensor
        elif fused.group(2) == "down_proj":
            out.update({f"{fused.group(1)}.{e}.down_proj.weight": t for e, t in enumerate(tensor)})
        else:
            for e, t in enumerate(tensor):
                out[f"{fused.group(1)}.{e}.gate_proj.weight"], out[f"{fused.group(1)}.{e}.up_proj.weight"] = (
                    T.split_gate_up(t)
                )
    if mtp:
        log.warning(
            "dropping the multi-token-prediction layer(s) %s of the checkpoint: transformers and vLLM do not "
            "build them, so they are not part of the model",
            sorted(mtp),
        )
    return out


def _as_dims(config: ModelDims | Mapping[str, Any] | Any) -> ModelDims:
    return config if isinstance(config, ModelDims) else model_dims(config)


def _check_hf_state(hf_state: Mapping[str, torch.Tensor], dims: ModelDims) -> None:
    """Key set and shapes of an HF state dict against the config; raises naming the first offending tensors."""
    expected = expected_hf_shapes(dims)
    present = {k for k in hf_state if not k.endswith(_SKIPPED_HF_SUFFIXES)}
    if dims.tied and "lm_head.weight" in present:
        if not torch.equal(hf_state["lm_head.weight"], hf_state.get("model.embed_tokens.weight", torch.empty(0))):
            raise ConversionError(
                "tie_word_embeddings=true but lm_head.weight differs from model.embed_tokens.weight;"
                " set tie_word_embeddings=false in config.json to keep both"
            )
        present.discard("lm_head.weight")
    missing, unmapped = sorted(set(expected) - present), sorted(present - set(expected))
    if missing:
        raise ConversionError(f"HF checkpoint is missing {len(missing)} tensor(s) the config requires: {missing[:8]}")
    if unmapped:
        raise ConversionError(
            f"HF checkpoint has {len(unmapped)} tensor(s) no {dims.family} rule maps "
            f"(they would be lost): {unmapped[:8]}"
        )
    for name, shape in expected.items():
        if tuple(hf_state[name].shape) != shape:
            raise ConversionError(
                f"HF tensor {name} has shape {tuple(hf_state[name].shape)}, but config.json implies {shape}"
            )


def _to_megatron_full(
    rule: ParamRule, hf_state: Mapping[str, torch.Tensor], dims: ModelDims, padded_vocab: int, tp_size: int
) -> torch.Tensor:
    parts = [hf_state[n] for n in rule.hf]
    if rule.kind == "qkv":
        q, k, v = parts
        return T.merge_qkv(q, k, v, dims.num_heads, dims.num_kv_heads, dims.head_dim)
    if rule.kind == "gate_up":
        return T.merge_gate_up(*parts)
    if rule.kind == "vocab":
        return T.pad_vocab(parts[0], padded_vocab)
    if rule.kind == "score":
        return T.pad_vocab(parts[0], score_rows(tp_size))
    return parts[0]


def resolve_padded_vocab(
    dims: ModelDims, tp_size: int, padded_vocab: int | None, make_vocab_size_divisible_by: int = 128
) -> int:
    """The padded vocabulary: given (e.g. recorded in a checkpoint) or Megatron's rule; must be divisible by TP."""
    size = padded_vocab or T.padded_vocab_size(dims.vocab_size, make_vocab_size_divisible_by, tp_size)
    if size < dims.vocab_size or size % tp_size != 0:
        raise ConversionError(
            f"padded vocab size {size} must be >= vocab_size={dims.vocab_size} and divisible by "
            f"tensor parallel size {tp_size}"
        )
    return size


def hf_to_megatron(
    hf_state: Mapping[str, torch.Tensor],
    hf_config: ModelDims | Mapping[str, Any] | Any,
    tp_rank: int = 0,
    tp_size: int = 1,
    *,
    padded_vocab: int | None = None,
    names: SpecNames = "local",
) -> dict[str, torch.Tensor]:
    """HF state dict -> the Megatron state dict of tensor-parallel rank `tp_rank` (all layers, global indices).

    Validates the HF key set and every shape first. Pipeline stages select their layers with `select_pp_stage`.
    """
    dims = _as_dims(hf_config)
    hf_state = per_expert_state(hf_state, dims)
    _check_hf_state(hf_state, dims)
    vocab = resolve_padded_vocab(dims, tp_size, padded_vocab)
    out = {}
    for rule in param_rules(dims, names):
        full = _to_megatron_full(rule, hf_state, dims, vocab, tp_size)
        out[rule.megatron] = T.tp_shard(full, rule.tp_dim, tp_rank, tp_size, gated=rule.gated)
    return out


def _rule_index(dims: ModelDims) -> dict[str, ParamRule]:
    """Megatron name -> rule for both naming conventions (local and TE spec), so either kind of state converts."""
    index = {r.megatron: r for r in param_rules(dims, "local")}
    index.update({r.megatron: r for r in param_rules(dims, "te")})
    return index


#: The lookup tables of the last few models converted: (dims, rule index, expected HF shapes), newest first.
_TABLES: list[tuple[ModelDims, dict[str, ParamRule], dict[str, tuple[int, ...]]]] = []


def _tables(dims: ModelDims) -> tuple[dict[str, ParamRule], dict[str, tuple[int, ...]]]:
    """The rule index and the expected HF shapes of `dims`, built once per model and shared (read only). A refit
    converts one parameter per `megatron_to_hf` call; building both per call made it quadratic in the parameter
    count (0.14 s a call for Qwen3-30B-A3B's 12,627 parameters: half an hour a refit; 0.32 s for DeepSeek-V3's
    30,486: 2.7 hours). Found by equality (ModelDims holds a dict: no hash)."""
    for known, index, expected in _TABLES:
        if known == dims:
            return index, expected
    entry = (dims, _rule_index(dims), expected_hf_shapes(dims))
    _TABLES.insert(0, entry)
    del _TABLES[4:]
    return entry[1], entry[2]


def rule_for(megatron_name: str, hf_config: ModelDims | Mapping[str, Any] | Any) -> ParamRule:
    """The rule of one Megatron parameter (full model name); raises for names no rule covers."""
    dims = _as_dims(hf_config)
    rule = _tables(dims)[0].get(megatron_name)
    if rule is None:
        raise ConversionError(f"Megatron parameter {megatron_name} has no {dims.family} mapping rule")
    return rule


def _to_hf(rule: ParamRule, tensor: torch.Tensor, dims: ModelDims) -> list[tuple[str, torch.Tensor]]:
    parts: tuple[torch.Tensor, ...]
    if rule.kind == "qkv":
        parts = T.split_qkv(tensor, dims.num_heads, dims.num_kv_heads, dims.head_dim)
    elif rule.kind == "gate_up":
        parts = T.split_gate_up(tensor)
    elif rule.kind == "vocab":
        parts = (T.unpad_vocab(tensor, dims.vocab_size),)
    elif rule.kind == "score":
        parts = (T.unpad_vocab(tensor, 1),)
    else:
        parts = (tensor,)
    return list(zip(rule.hf, parts))


def hf_parts(rule: ParamRule, tensor: torch.Tensor, hf_config: ModelDims | Mapping[str, Any] | Any):
    """The HF names of `rule` with `tensor` cut as that parameter is (q/k/v per query group, gate/up halves, vocab
    padding stripped on dim 0), whatever its other dimensions: a LoRA adapter's B of a fused layer is cut into its
    HF modules' B this way. No shape check (`megatron_to_hf` checks the weights')."""
    return _to_hf(rule, tensor, _as_dims(hf_config))


def megatron_to_hf(
    megatron_state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    hf_config: ModelDims | Mapping[str, Any] | Any,
    *,
    require_complete: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full (TP-gathered, global layer index) Megatron tensors -> (hf_name, tensor), one input tensor at a time.

    Accepts local- and TE-spec names. `require_complete=False` lets a refit stream a subset (e.g. some layers);
    with True, a Megatron parameter the config requires but the input lacks raises at the end.
    """
    dims = _as_dims(hf_config)
    index, expected = _tables(dims)
    items = megatron_state.items() if isinstance(megatron_state, Mapping) else megatron_state
    produced: set[str] = set()
    embedding: torch.Tensor | None = None
    tied_output: torch.Tensor | None = None
    for name, tensor in items:
        if name.endswith("_extra_state"):
            continue
        if dims.tied and name == "output_layer.weight":
            tied_output = tensor  # a copy Megatron keeps on the last pipeline stage; checked against the embedding
            continue
        rule = index.get(name)
        if rule is None:
            raise ConversionError(f"Megatron tensor {name} has no {dims.family} mapping rule (it would be lost)")
        for hf_name, hf_tensor in _to_hf(rule, tensor, dims):
            if tuple(hf_tensor.shape) != expected[hf_name]:
                raise ConversionError(
                    f"Megatron tensor {name} gives {hf_name} of shape {tuple(hf_tensor.shape)}, "
                    f"but the config implies {expected[hf_name]}"
                )
            produced.add(hf_name)
            yield hf_name, hf_tensor
        if name == "embedding.word_embeddings.weight":
            embedding = tensor
    if tied_output is not None and embedding is not None and not torch.equal(tied_output, embedding):
        raise ConversionError("tied embeddings, but output_layer.weight differs from embedding.word_embeddings.weight")
    missing = sorted(set(expected) - produced)
    if require_complete and missing:
        raise ConversionError(f"Megatron state is missing the source of {len(missing)} HF tensor(s): {missing[:8]}")


def layer_index(megatron_name: str) -> int | None:
    """The decoder layer index in a Megatron name (`decoder.layers.3.mlp...` -> 3), None for model-level names."""
    match = _LAYER_RE.match(megatron_name)
    return int(match.group(1)) if match else None


def hf_layer_index(hf_name: str) -> int | None:
    """The decoder layer index in an HF name (`model.layers.3.mlp...` -> 3), None for model-level names."""
    match = _HF_LAYER_RE.match(hf_name)
    return int(match.group(1)) if match else None


def select_pp_stage(
    state: Mapping[str, torch.Tensor],
    layer_offset: int,
    num_layers: int,
    *,
    pre_process: bool,
    post_process: bool,
    tied: bool,
) -> dict[str, torch.Tensor]:
    """The part of a full-model Megatron state one pipeline stage holds, renamed to its local layer indices.

    Stage layers [layer_offset, layer_offset + num_layers) become decoder.layers.0..; the embedding goes to the
    first stage, the final norm and output layer to the last. With tied embeddings a last stage that is not also
    the first holds `output_layer.weight` as a copy of the embedding (Megatron syncs the two).
    """
    out = {}
    for name, tensor in state.items():
        idx = layer_index(name)
        if idx is not None:
            if layer_offset <= idx < layer_offset + num_layers:
                renamed = _LAYER_RE.sub(lambda m: f"decoder.layers.{idx - layer_offset}.{m.group(2)}", name)  # noqa: B023 (called here)
                out[renamed] = tensor
        elif name.startswith("embedding.") and pre_process:
            out[name] = tensor
        elif (name.startswith("decoder.final_layernorm") or name.startswith("output_layer.")) and post_process:
            out[name] = tensor
    if tied and post_process and not pre_process:
        out["output_layer.weight"] = state["embedding.word_embeddings.weight"]
    return out


def experts_per_rank(dims: ModelDims, ep_size: int) -> int:
    """Routed experts each expert-parallel rank holds (a contiguous block: rank r holds [r * n, (r + 1) * n))."""
    if dims.moe is None:
        return 0
    if dims.moe.num_experts % ep_size:
        raise ConversionError(f"expert parallel size {ep_size} does not divide the {dims.moe.num_experts} experts")
    return dims.moe.num_experts // ep_size


def to_local_expert(name: str, ep_rank: int, per_rank: int) -> str | None:
    """The name of routed-expert parameter `name` (global expert index) on expert-parallel rank `ep_rank`, None when
    another rank holds that expert; other names are returned unchanged."""
    match = _EXPERT_RE.search(name)
    if match is None:
        return name
    local = int(match.group(1)) - ep_rank * per_rank
    if not 0 <= local < per_rank:
        return None
    return name[: match.start(1)] + str(local) + name[match.end(1) :]


def select_ep_experts(
    state: Mapping[str, torch.Tensor], dims: ModelDims, ep_rank: int, ep_size: int
) -> dict[str, torch.Tensor]:
    """The part of a state an expert-parallel rank holds: its block of routed experts, renamed to local indices, and
    every other (non-expert) tensor."""
    per_rank = experts_per_rank(dims, ep_size)
    out = {}
    for name, tensor in state.items():
        local = to_local_expert(name, ep_rank, per_rank)
        if local is not None:
            out[local] = tensor
    return out
