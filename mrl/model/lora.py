"""Low-rank adapters on Megatron's tensor-parallel linears (`policy.lora`): the adapters, their sharding in a forward
and in a distributed checkpoint, and their merge (what the refit sends).

Each wrapped layer keeps its base (frozen, names unchanged) and gains a child `lora` holding A [r, in] and B [out, r],
added to its output by a forward hook:  y = W x + s * B (A x),  s = alpha / r.  B starts at zero (the model's outputs
are unchanged until it trains), A at PEFT's initialisation (Kaiming-uniform, a = sqrt(5)), seeded per layer.

Sharding contract, per kind of base layer (shapes are this rank's):
    column-parallel (linear_qkv, linear_fc1; output split over TP):
        A [r, in] replicated, B [out/tp, r] split on dim 0 like W.
        h = A x, then `copy_to_tensor_model_parallel_region(h)` (identity forward, all-reduce of dh backward, so A's
        gradient is whole on every rank); under sequence parallelism x is this rank's sequence chunk, so
        h = gather_from_sequence_parallel_region(A x) instead (reduce-scatter backward) and A's gradient is partial
        over the chunks: A is marked `sequence_parallel`, which Megatron's finalize_model_grads sums over TP.
    row-parallel (linear_proj, linear_fc2; input split over TP, output reduced):
        A [r, in/tp] split on dim 1 like W, B [out, r] replicated.
        h = reduce_from_tensor_model_parallel_region(A x) (reduce_scatter_to_sequence_parallel_region under sequence
        parallelism), then B h; under sequence parallelism B's gradient is partial over the chunks: B is marked
        `sequence_parallel`.
    a routed expert (target `experts`: its linear_fc1 and linear_fc2 on each expert-parallel rank's local experts,
        with explicit expert communication, `explicit_expert_comm`: under TP or EP the token dispatcher gathers the
        expert's input over the expert-TP group and reduces its output, the linears run no collective):
        the same shapes and splits over the expert-TP group, and no collective in the adapter either (a row layer's
        B h_partial is summed by the dispatcher's reduction like W_shard x_shard); the replicated factor's gradient
        is then this rank's part of it and a tensor hook sums it over the expert-TP group (`_summed_over`). Both
        factors carry the base weight's `allreduce` mark, so Megatron's DDP reduces them over the expert
        data-parallel ranks like the expert's weights; A is seeded by the global expert index.
The merged weight of a rank's shard (`merged_weight`): column W + s * B @ A, row W + s * B @ A, the shard's own shape.
In a distributed checkpoint (the layer's `sharded_state_dict`, extended) B of a column layer is split on axis 0 and A
of a row layer on axis 1, like W (a gated MLP's fc1 B as Megatron saves that W: its gate and up halves apart, since
each TP rank holds [gate_r; up_r]); the replicated ones are saved once: a checkpoint reshards to any TP size.
Dropout (PEFT's: on the adapter's input, training only) draws its mask from the generator that matches how x is
split (`LoraAdapter._dropped`).
Only Megatron's local linears are wrapped (`_check_local`): a policy with LoRA is built without Transformer Engine's
fused norm + linear layers, on GPUs too (mrl/policy/construction.py), and routed experts with adapters run
SequentialMLP's loop, not the grouped GEMMs (which read the weights without calling the linears).
"""

from __future__ import annotations

import functools
import math
import re
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from mrl.parallel import collectives

Kind = Literal["column", "row"]
#: The layers adapters may wrap (Megatron's local-spec names) and their kind.
TARGETS: dict[str, Kind] = {
    "linear_qkv": "column",
    "linear_fc1": "column",
    "linear_proj": "row",
    "linear_fc2": "row",
}
#: The target naming a mixture-of-experts layer's routed experts (their linear_fc1 and linear_fc2); the other targets
#: name dense layers (a shared expert's MLP among them).
EXPERTS = "experts"
_LOCAL_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    targets: tuple[str, ...] = (*TARGETS, EXPERTS)
    seed: int = 0
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def of(cls, config: Any, seed: int = 0) -> "LoraSettings":
        """The settings of a `policy.lora` section (mrl.config.schema.LoraConfig)."""
        return cls(config.rank, config.alpha, tuple(config.targets), seed, config.dropout)


class LoraAdapter(torch.nn.Module):
    """A and B of one wrapped layer (see the module docstring); `forward(x)` is the adapter's term of the output."""

    def __init__(self, base: Any, kind: Kind, settings: LoraSettings, seed: int, *, gated: bool = False) -> None:
        super().__init__()
        self.kind, self.scale = kind, settings.scale
        self.dropout = torch.nn.Dropout(settings.dropout) if settings.dropout > 0 else None
        self.gated = gated  # a gated MLP's fc1: its rows are [gate; up] per TP rank (the checkpoint splits them)
        self.sequence_parallel = bool(base.sequence_parallel)
        self.tp_group = base.tp_group
        # a routed expert under TP or EP: the token dispatcher moves its tokens, and its linears take no collective
        self.explicit = bool(getattr(base, "explicit_expert_comm", False))
        if kind == "column":
            inputs, outputs = base.input_size, base.output_size_per_partition
        else:
            inputs, outputs = base.input_size_per_partition, base.output_size
        dtype, device = base.weight.dtype, base.weight.device
        self.lora_a = torch.nn.Parameter(torch.empty(settings.rank, inputs, dtype=dtype, device=device))
        self.lora_b = torch.nn.Parameter(torch.zeros(outputs, settings.rank, dtype=dtype, device=device))
        self._init_a(seed)
        split, replicated = (self.lora_b, self.lora_a) if kind == "column" else (self.lora_a, self.lora_b)
        split.tensor_model_parallel = True  # type: ignore[attr-defined]
        split.partition_dim = 0 if kind == "column" else 1  # type: ignore[attr-defined]
        split.partition_stride = 1  # type: ignore[attr-defined]
        for param in (self.lora_a, self.lora_b):  # a routed expert's: reduced over the expert data-parallel ranks
            param.allreduce = getattr(base.weight, "allreduce", True)  # type: ignore[attr-defined]
        if not self.explicit:
            replicated.sequence_parallel = self.sequence_parallel  # type: ignore[attr-defined]
        elif self._tp_size() > 1:  # its gradient is this rank's part (see the module docstring)
            replicated.register_hook(functools.partial(_summed_over, group=self.tp_group))

    def _tp_size(self) -> int:
        return collectives.world_size(self.tp_group) if collectives.is_initialized() else 1

    def _init_a(self, seed: int) -> None:
        """PEFT's Kaiming-uniform init of A, drawn for the whole [r, in] and sliced to this rank's columns (row
        layers), so that every TP size starts from the same adapters."""
        generator = torch.Generator().manual_seed(seed)
        rank, local = self.lora_a.shape
        full = local * (self._tp_size() if self.kind == "row" else 1)
        bound = 1.0 / math.sqrt(full)  # kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / 6), bound gain * sqrt(3 / fan_in)
        whole = (torch.rand(rank, full, generator=generator) * 2 - 1) * bound
        if self.kind == "row":
            tp_rank = collectives.rank(self.tp_group) if self._tp_size() > 1 else 0
            whole = whole[:, tp_rank * local : (tp_rank + 1) * local]
        with torch.no_grad():
            self.lora_a.copy_(whole)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.linear(self._dropped(x), self.lora_a)
        if not self.explicit:  # a routed expert's h needs none: the dispatcher gathers and reduces around it
            h = self._exchanged(h)
        return self.scale * torch.nn.functional.linear(h, self.lora_b)

    def _exchanged(self, h: torch.Tensor) -> torch.Tensor:
        """h = A x after the base's collective of its kind (the module docstring's contract)."""
        from megatron.core.tensor_parallel import mappings

        if self.kind == "column":
            if self.sequence_parallel:
                return mappings.gather_from_sequence_parallel_region(h, group=self.tp_group)
            return mappings.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
        return mappings.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        """x with PEFT's dropout on the adapter's input (training only). A column layer's x without sequence
        parallelism is the same on every TP rank, so its mask comes from the default generator, which Megatron seeds
        alike on them; a row layer's x (this rank's input columns) and a sequence-parallel chunk are this rank's own:
        their masks come from the tensor-parallel generator (Megatron's RNG tracker), as Megatron's own dropout in a
        sequence-parallel region does."""
        if self.dropout is None or not self.training:
            return x
        if self.kind == "column" and not self.sequence_parallel:
            return self.dropout(x)
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        with get_cuda_rng_tracker().fork():
            return self.dropout(x)


def _summed_over(grad: torch.Tensor, group: Any) -> torch.Tensor:
    """A gradient summed over `group` (a routed expert's replicated factor: each expert-TP rank holds its part)."""
    grad = grad.clone()
    collectives.all_reduce(grad, "sum", group)
    return grad


def _add_adapter(module: Any, inputs: tuple, output: Any) -> Any:
    """Forward hook of a wrapped layer: its (output, bias) with the adapter's term added to the output."""
    out, bias = output
    return out + module.lora(inputs[0]), bias


def apply_lora(model: Any, settings: LoraSettings) -> list[str]:
    """Adapters on every target layer of `model` (mrl's HybridModel, this rank's stage), the rest of it frozen; the
    wrapped layers' names. Call after the base weights are loaded and before Megatron's DDP wraps the model (DDP makes
    gradient buffers, and the optimizer states, for the parameters that require gradients: the adapters alone)."""
    from mrl.model.build import stage_layer_offset
    from mrl.model.hybrid import to_gpt

    model.requires_grad_(False)
    offset = stage_layer_offset(model)
    wrapped = []
    for name, module in list(model.named_modules()):
        if not _targeted(name, settings) or hasattr(module, "lora"):
            continue
        _check_local(name, module)
        # GPT's global name (`mrl.model.hybrid`): the adapters are seeded as before the model became a HybridModel
        global_name = _global_layer_name(to_gpt(_global_expert_name(name, model)), offset)
        leaf = name.rsplit(".", 1)[-1]
        gated = leaf == "linear_fc1" and bool(module.config.gated_linear_unit)
        seed = settings.seed + zlib.crc32(global_name.encode())
        module.lora = LoraAdapter(module, TARGETS[leaf], settings, seed, gated=gated)
        module.register_forward_hook(_add_adapter)
        module.sharded_state_dict = functools.partial(_sharded_state_dict, module, module.sharded_state_dict)
        wrapped.append(name)
    if not wrapped:
        raise ValueError(f"no layer of the model is one of the LoRA targets {list(settings.targets)}")
    model.lora_settings = settings  # what every stage adapts (an exporter on another stage reads it)
    return wrapped


def _check_local(name: str, module: Any) -> None:
    """Adapters wrap Megatron's local tensor-parallel linears only: Transformer Engine's fused norm + linear takes its
    input before the norm, which an adapter on its output must not see."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        raise ValueError(
            f"LoRA adapts Megatron's local ColumnParallelLinear / RowParallelLinear layers; {name} is "
            f"{type(module).__name__} (build the model with use_te=False, as the policy does with policy.lora)"
        )


def _targeted(layer: str, settings: LoraSettings) -> bool:
    """Whether layer `layer` is one of `settings.targets`: a routed expert's fc1 or fc2 under `experts`, any other
    layer under its own name."""
    leaf = layer.rsplit(".", 1)[-1]
    if leaf not in TARGETS:
        return False
    if ".experts." in layer:
        return EXPERTS in settings.targets and leaf in ("linear_fc1", "linear_fc2")
    return leaf in settings.targets


def is_adapted(megatron_name: str, settings: LoraSettings) -> bool:
    """Whether parameter `megatron_name` (any stage's) is the weight of a layer `apply_lora` wraps."""
    layer, _, kind = megatron_name.rpartition(".")
    return kind == "weight" and _targeted(layer, settings)


def _global_expert_name(name: str, model: Any) -> str:
    """`name` with a routed expert's local index made global (its expert-parallel rank's first expert added)."""
    match = _LOCAL_EXPERT.search(name)
    if match is None:
        return name
    from megatron.core import parallel_state

    experts = model.get_submodule(name[: match.start()] + ".experts.local_experts")
    first = parallel_state.get_expert_model_parallel_rank() * len(experts)
    return name[: match.start(1)] + str(int(match.group(1)) + first) + name[match.end(1) :]


def _sharded_state_dict(
    module: Any, base: Callable[..., dict], prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None
) -> dict:
    """The wrapped layer's sharded state dict: the base's, its adapter's split tensor on the base's TP axis (Megatron's
    own map names `weight` and `bias` only, and would save it as replicated)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    out = base(prefix, sharded_offsets, metadata)
    lora = module.lora
    axis = {"lora_b": 0} if lora.kind == "column" else {"lora_a": 1}
    dp_cp_group = metadata["dp_cp_group"] if metadata else parallel_state.get_data_parallel_group(True)
    adapter = make_sharded_tensors_for_checkpoint(
        lora.state_dict(prefix="", keep_vars=True),
        f"{prefix}lora.",
        axis,
        sharded_offsets,
        tp_group=module.tp_group,
        dp_cp_group=dp_cp_group,
    )
    if lora.gated:  # B's rows are [gate_r; up_r] per TP rank like fc1's weight: saved as the MLP saves that weight
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        key = f"{prefix}lora.lora_b"
        singleton = (metadata or {}).get("singleton_local_shards", False)
        adapter[key] = apply_swiglu_sharded_factory(adapter[key], sharded_offsets, singleton)
    out.update(adapter)
    return out


def _global_layer_name(name: str, offset: int) -> str:
    """`decoder.layers.<i>...` with this stage's layer index made global (adapters seeded alike in any layout)."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + offset)
    return ".".join(parts)


def merged_weight(module: Any) -> torch.Tensor:
    """The wrapped layer's weight with its adapter merged, W + s * B @ A, for this rank's shard (no gradient)."""
    lora = module.lora
    with torch.no_grad():
        return module.weight + lora.scale * (lora.lora_b @ lora.lora_a)


def adapters(model: Any) -> dict[str, LoraAdapter]:
    """`<layer>.weight` (this rank's names) -> that wrapped layer's adapter."""
    return {
        f"{name}.weight": module.lora
        for name, module in model.named_modules()
        if isinstance(getattr(module, "lora", None), LoraAdapter)
    }


def merged_weights(model: Any) -> dict[str, Callable[[], torch.Tensor]]:
    """`<layer>.weight` -> a function giving that wrapped layer's merged shard now (the exporter reads them when it
    sends, so the refit carries the adapters' current values); {} without adapters."""
    return {
        f"{name}.weight": functools.partial(merged_weight, module)
        for name, module in model.named_modules()
        if isinstance(getattr(module, "lora", None), LoraAdapter)
    }
