"""What a recipe costs in GPU memory, per GPU role, by arithmetic on the model's config and the layout (`mrl plan`).

Policy rank (one per pipeline stage; every TP, CP, EP and DP rank of a stage holds the same amounts):
    parameters   the converters' parameter map (converters.mapping.param_rules) over the HF shapes: a TP-split
                 tensor (its rule's tp_dim) holds 1/TP of it, a routed expert's lives on one EP rank and is split
                 by the expert TP size (= TP, megatron-core's default), the vocabulary is padded to Megatron's
                 multiple of 128 x TP; the first stage holds the embedding, the last the final norm and the output
                 layer (with tied embeddings and PP > 1 the last stage keeps its own copy of the embedding, as
                 Megatron's shared-embedding group does). DeepSeek-V3's expert bias is a buffer, not a parameter.
    weights      parameters x 2 B (bf16) or 4 B (fp32).
    gradients    4 B per trainable parameter (mrl's DDP reduces gradients in fp32: grad_reduce_in_fp32); a frozen
                 router (policy.moe.freeze_router) has none.
    LoRA         with policy.lora the trainable parameters are the adapters alone (every base parameter frozen): per
                 adapted layer A [r, in] and B [out, r], a column-parallel layer's B and a row-parallel layer's A
                 split over TP like the weight, the other whole (mrl/model/lora.py); they add to the weights too.
    optimizer    Adam: fp32 main weights (bf16 training only) and two fp32 moments, 12 B (bf16) or 8 B (fp32) per
                 trainable parameter; with policy.optimizer.use_distributed_optimizer sharded over the data-parallel
                 ranks (dense parameters) and the expert data-parallel ranks (routed experts).
    reference    the frozen reference model's weights when loss.kl_beta > 0 (0 on the GPU with offload_reference).
    critic       PPO's value model (grpo.advantage_estimator: gae): the policy's weights, gradients and optimizer
                 states once more (its own layout is taken to be the policy's; its score head is counted as the
                 policy's output layer, a slight overestimate).
    teacher      distillation's frozen teacher: its weights over the policy's TP x PP (its config.json when it can be
                 read, else the policy's size).
    activations  an estimate (module `plan_activations`).
Engine GPU (vLLM, TP generation.vllm.tensor_parallel_size x PP generation.vllm.pipeline_parallel_size): its weights
(the parameters of its pipeline stage's layers over its TP, in bf16; the stages split the layers as vLLM does:
`engine_stage_layers`) and the KV cache that `gpu_memory_utilization` leaves (KV bytes per token of the stage's
layers: `kv_bytes_per_token`); every stage holds as many blocks as the one with the fewest (vLLM's rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from converters import transforms as T
from converters.layers import ParamRule
from converters.mapping import expected_hf_shapes, hf_layer_index, layer_index, param_rules
from converters.spec import ModelDims
from mrl.model.lora import LoraSettings, is_adapted
from mrl.parallel.layout import ParallelDims

GiB = 1024**3
#: megatron-core's default `make_vocab_size_divisible_by` (mrl does not change it).
VOCAB_MULTIPLE = 128


@dataclass(frozen=True)
class Layout(ParallelDims):
    """The policy's parallel sizes (validated as ParallelDims) and its pipeline split."""

    first_stage_layers: int | None = None
    last_stage_layers: int | None = None


@dataclass(frozen=True)
class StageParams:
    """Parameters one rank of a pipeline stage holds."""

    stage: int
    layers: tuple[int, int]  # [first, last) global decoder layer indices
    dense: int  # not routed experts (TP shards, replicated norms and routers)
    experts: int  # routed experts (this EP rank's, this TP shard of each)
    frozen: int  # frozen routers (no gradient, no optimizer state)
    adapters: int = 0  # LoRA's A and B of dense layers (this TP rank's shards)
    expert_adapters: int = 0  # LoRA's A and B of this EP rank's routed experts
    lora: bool = False  # the base frozen: only the adapters train

    @property
    def trainable(self) -> tuple[int, int]:
        """(dense, routed experts) parameters that have gradients and optimizer states on this rank."""
        if self.lora:
            return self.adapters, self.expert_adapters
        return self.dense - self.frozen, self.experts

    @property
    def held(self) -> int:
        """Every parameter on this rank, adapters included."""
        return self.total + self.adapters + self.expert_adapters

    @property
    def total(self) -> int:
        return self.dense + self.experts


def stage_layer_ranges(num_layers: int, layout: Layout) -> list[tuple[int, int]]:
    """[first, last) decoder layers of each pipeline stage: the given first/last stage sizes, an equal share of the
    rest for the stages between (the split the config checks accept: mrl.parallel.layout)."""
    sizes: list[int | None] = [None] * layout.pp
    if layout.pp > 1:
        sizes[0], sizes[-1] = layout.first_stage_layers, layout.last_stage_layers
    given = sum(s for s in sizes if s is not None)
    free = sum(s is None for s in sizes)
    share = (num_layers - given) // free if free else 0
    ranges, start = [], 0
    for size in sizes:
        end = start + (share if size is None else size)
        ranges.append((start, end))
        start = end
    return ranges


def padded_vocab(dims: ModelDims, tp: int) -> int:
    return T.padded_vocab_size(dims.vocab_size, VOCAB_MULTIPLE, tp)


def stage_params(
    dims: ModelDims, layout: Layout, *, freeze_router: bool = False, lora: LoraSettings | None = None
) -> list[StageParams]:
    """Parameters per rank of each pipeline stage (module docstring)."""
    shapes = expected_hf_shapes(dims)
    rules = param_rules(dims)
    ranges = stage_layer_ranges(dims.num_layers, layout)
    vocab_rows = padded_vocab(dims, layout.tp) // layout.tp
    out = []
    for stage, (first, last) in enumerate(ranges):
        dense = experts = frozen = adapters = expert_adapters = 0
        for rule in rules:
            layer = layer_index(rule.megatron)
            if rule.megatron.endswith("expert_bias") or not _on_stage(
                rule.megatron, layer, stage, first, last, layout.pp
            ):
                continue
            if rule.kind == "vocab":
                dense += vocab_rows * dims.hidden_size
                continue
            numel = sum(math.prod(shapes[name]) for name in rule.hf)
            local = numel // layout.tp if rule.tp_dim is not None else numel
            if lora is not None and is_adapted(rule.megatron, lora):
                if rule.expert is None:
                    adapters += _adapter_params(rule, shapes, lora.rank, layout.tp)
                else:  # all of the stage's experts here; one EP rank holds 1/EP of them
                    expert_adapters += _adapter_params(rule, shapes, lora.rank, layout.tp)
            if rule.expert is not None:
                experts += local  # all of the stage's experts here; one EP rank holds 1/EP of them
            else:
                dense += local
                frozen += local if freeze_router and rule.megatron.endswith("mlp.router.weight") else 0
        if layout.pp > 1 and dims.tied and stage == layout.pp - 1:
            dense += vocab_rows * dims.hidden_size  # the last stage's copy of the shared embedding
        out.append(
            StageParams(
                stage,
                (first, last),
                dense,
                experts // layout.ep,
                frozen,
                adapters,
                expert_adapters // layout.ep,
                lora is not None,
            )
        )
    return out


def _adapter_params(rule: ParamRule, shapes: dict[str, tuple[int, ...]], rank: int, tp: int) -> int:
    """A and B of one adapted layer on one TP rank: its weight's rows (q/k/v or gate/up together) and columns."""
    rows = sum(shapes[name][0] for name in rule.hf)
    cols = shapes[rule.hf[0]][1]
    if rule.tp_dim == 0:  # column-parallel: A whole, B split like W
        return rank * cols + rows // tp * rank
    return rank * cols // tp + rows * rank  # row-parallel: A split like W, B whole


def total_params(dims: ModelDims) -> int:
    """Every parameter of the model (one copy, unpadded vocabulary): what transformers counts."""
    return sum(
        math.prod(shape)
        for name, shape in expected_hf_shapes(dims).items()
        if not name.endswith("e_score_correction_bias")
    )


@dataclass(frozen=True)
class PolicyBytes:
    """Bytes on one policy GPU of a stage."""

    stage: int
    params: int
    weights: int
    gradients: int
    optimizer: int
    reference: int
    critic: int = 0
    teacher: int = 0

    @property
    def states(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.reference + self.critic + self.teacher


def policy_bytes(
    stage: StageParams, layout: Layout, *, precision: str, distributed_optimizer: bool, reference: bool
) -> PolicyBytes:
    """The model states of one rank of `stage` (module docstring)."""
    width = 2 if precision == "bfloat16" else 4
    per_param_optimizer = 12 if precision == "bfloat16" else 8
    trainable_dense, trainable_experts = stage.trainable
    if distributed_optimizer:
        optimizer = (-(-trainable_dense // layout.dp) + -(-trainable_experts // layout.expert_dp)) * per_param_optimizer
    else:
        optimizer = (trainable_dense + trainable_experts) * per_param_optimizer
    return PolicyBytes(
        stage.stage,
        stage.held,
        stage.held * width,
        (trainable_dense + trainable_experts) * 4,
        optimizer,
        stage.total * width if reference else 0,
    )


def engine_stage_layers(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """[first, last) layers of each pipeline stage of a vLLM engine, as vLLM 0.32 splits them
    (vllm/distributed/utils.py `get_pp_indices`, VLLM_PP_LAYER_PARTITION unset): evenly, the remainder one more
    layer each to the stages before the last, from the second-to-last backwards."""
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    starts = [sum(parts[:k]) for k in range(pp)]
    return [(start, start + part) for start, part in zip(starts, parts)]


def engine_stage_bytes(dims: ModelDims, tp: int, pp: int = 1, *, width: int = 2) -> list[int]:
    """Each pipeline stage's weights on one engine GPU: its layers' tensors (the first stage also the embedding, the
    last the final norm and the output layer, and with tied embeddings the embedding too, as vLLM's models build
    them) over vLLM's TP (its vocabulary padding to 64 per rank, under a megabyte, left out). A checkpoint's layers
    past the model's (DeepSeek-V3's multi-token prediction) are not loaded by vLLM's model."""
    stage_of = [
        k for k, (first, last) in enumerate(engine_stage_layers(dims.num_layers, pp)) for _ in range(first, last)
    ]
    out = [0] * pp
    for name, shape in expected_hf_shapes(dims).items():
        numel = math.prod(shape)
        layer = hf_layer_index(name)
        if name.endswith("e_score_correction_bias") or (layer is not None and layer >= dims.num_layers):
            continue
        if layer is not None:
            out[stage_of[layer]] += numel
        elif "embed_tokens" in name:
            out[0] += numel
            out[-1] += numel if dims.tied and pp > 1 else 0
        else:
            out[-1] += numel
    return [params * width // tp for params in out]


def engine_weight_bytes(dims: ModelDims, tp: int, *, width: int = 2) -> int:
    """The whole model's weights over vLLM's TP: what one GPU of a tensor-parallel group reads per decode step, its
    pipeline stages together (`engine_stage_bytes` gives each stage's)."""
    return sum(engine_stage_bytes(dims, tp, width=width))


def kv_bytes_per_token(dims: ModelDims, tp: int, *, layers: int | None = None, width: int = 2) -> int:
    """KV-cache bytes one token takes on one engine GPU, over `layers` layers (every layer by default): grouped-query
    attention keeps a key and a value of head_dim for each of its KV heads on the rank (max(1, kv_heads // TP):
    replicated past the KV heads); multi-latent attention one latent of kv_lora_rank + qk_rope_head_dim, the same on
    every rank (vLLM 0.32, vllm/v1/kv_cache_interface.py: FullAttentionSpec and MLAAttentionSpec page sizes)."""
    layers = dims.num_layers if layers is None else layers
    if dims.mla is not None:
        return layers * (dims.mla.kv_lora_rank + dims.mla.qk_rope_head_dim) * width
    heads = max(1, dims.num_kv_heads // tp)
    return layers * 2 * heads * dims.head_dim * width


def kv_capacity_tokens(
    dims: ModelDims, tp: int, available_bytes: int | list[int], *, pp: int = 1, block_size: int = 16, width: int = 2
) -> int:
    """Tokens of KV cache an engine holds when each GPU of pipeline stage k has `available_bytes[k]` for it (one
    number: the same on every stage): on each stage whole blocks of `block_size` tokens of the stage's layers, and
    every stage as many blocks as the one with the fewest (vLLM 0.32, vllm/v1/core/kv_cache_utils.py
    `get_kv_cache_configs`: num_blocks = available // bytes per block of the worker's layers, then the smallest over
    the workers; the capacity it logs is num_blocks x block_size, its null block included)."""
    available = available_bytes if isinstance(available_bytes, list) else [available_bytes] * pp
    blocks = min(
        max(free, 0) // (kv_bytes_per_token(dims, tp, layers=b - a, width=width) * block_size)
        for free, (a, b) in zip(available, engine_stage_layers(dims.num_layers, pp))
    )
    return blocks * block_size


def _on_stage(name: str, layer: int | None, stage: int, first: int, last: int, pp: int) -> bool:
    if layer is not None:
        return first <= layer < last
    if name.startswith("embedding."):
        return stage == 0
    return stage == pp - 1  # final norm, output layer


def layout_of(cfg: Any) -> Layout:
    """The policy's layout from a config."""
    par = cfg.policy.parallel
    return Layout(
        tp=par.tensor_parallel_size,
        pp=par.pipeline_parallel_size,
        cp=par.context_parallel_size,
        ep=par.expert_parallel_size,
        sequence_parallel=par.sequence_parallel,
        world_size=cfg.policy_world_size,
        first_stage_layers=par.first_stage_layers,
        last_stage_layers=par.last_stage_layers,
    )
