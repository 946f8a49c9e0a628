"""Low-rank adapters on Megatron's tensor-parallel linears (issue 66, first piece: the adapters, their sharding and
their merge; not yet wired into the policy worker, its checkpoints or the refit).

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
The merged weight of a rank's shard (`merged_weight`): column W + s * B @ A, row W + s * B @ A, the shard's own shape.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, Literal

import torch

Kind = Literal["column", "row"]
#: The layers adapters may wrap (Megatron's local-spec names) and their kind.
TARGETS: dict[str, Kind] = {
    "linear_qkv": "column",
    "linear_fc1": "column",
    "linear_proj": "row",
    "linear_fc2": "row",
}


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    targets: tuple[str, ...] = tuple(TARGETS)
    seed: int = 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoraAdapter(torch.nn.Module):
    """A and B of one wrapped layer (see the module docstring); `forward(x)` is the adapter's term of the output."""

    def __init__(self, base: Any, kind: Kind, settings: LoraSettings, seed: int) -> None:
        super().__init__()
        self.kind, self.scale = kind, settings.scale
        self.sequence_parallel = bool(base.sequence_parallel)
        self.tp_group = base.tp_group
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
        replicated.sequence_parallel = self.sequence_parallel  # type: ignore[attr-defined]

    def _init_a(self, seed: int) -> None:
        """PEFT's Kaiming-uniform init of A, drawn for the whole [r, in] and sliced to this rank's columns (row
        layers), so that every TP size starts from the same adapters."""
        from megatron.core import parallel_state

        generator = torch.Generator().manual_seed(seed)
        rank, local = self.lora_a.shape
        full = local * (parallel_state.get_tensor_model_parallel_world_size() if self.kind == "row" else 1)
        bound = 1.0 / math.sqrt(full)  # kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / 6), bound gain * sqrt(3 / fan_in)
        whole = (torch.rand(rank, full, generator=generator) * 2 - 1) * bound
        if self.kind == "row":
            tp_rank = parallel_state.get_tensor_model_parallel_rank()
            whole = whole[:, tp_rank * local : (tp_rank + 1) * local]
        with torch.no_grad():
            self.lora_a.copy_(whole)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        h = torch.nn.functional.linear(x, self.lora_a)
        if self.kind == "column":
            if self.sequence_parallel:
                h = mappings.gather_from_sequence_parallel_region(h, group=self.tp_group)
            else:
                h = mappings.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        elif self.sequence_parallel:
            h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
        else:
            h = mappings.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return self.scale * torch.nn.functional.linear(h, self.lora_b)


def _add_adapter(module: Any, inputs: tuple, output: Any) -> Any:
    """Forward hook of a wrapped layer: its (output, bias) with the adapter's term added to the output."""
    out, bias = output
    return out + module.lora(inputs[0]), bias


def apply_lora(model: Any, settings: LoraSettings) -> list[str]:
    """Adapters on every target layer of `model` (a GPTModel, this rank's stage), the rest of it frozen; the wrapped
    layers' names. Call after the base weights are loaded and before Megatron's DDP wraps the model (DDP makes
    gradient buffers, and the optimizer states, for the parameters that require gradients: the adapters alone)."""
    from mrl.model.build import stage_layer_offset

    model.requires_grad_(False)
    offset = stage_layer_offset(model)
    wrapped = []
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in settings.targets or hasattr(module, "lora") or ".experts." in name:
            continue  # routed experts (explicit expert communication) are not adapted yet
        global_name = _global_layer_name(name, offset)
        module.lora = LoraAdapter(module, TARGETS[leaf], settings, settings.seed + zlib.crc32(global_name.encode()))
        module.register_forward_hook(_add_adapter)
        wrapped.append(name)
    if not wrapped:
        raise ValueError(f"no layer of the model is one of the LoRA targets {list(settings.targets)}")
    return wrapped


def _global_layer_name(name: str, offset: int) -> str:
    """`decoder.layers.<i>...` with this stage's layer index made global (adapters seeded alike in any layout)."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + offset)
    return ".".join(parts)


def merged_weight(module: Any) -> torch.Tensor:
    """The wrapped layer's weight with its adapter merged, W + s * B @ A, for this rank's shard."""
    lora = module.lora
    return module.weight + lora.scale * (lora.lora_b @ lora.lora_a)


def adapter_parameters(model: Any) -> dict[str, torch.Tensor]:
    """This rank's adapter parameters by name (what the optimizer sees and what an adapter checkpoint holds)."""
    return {name: p for name, p in model.named_parameters() if ".lora.lora_" in name}
