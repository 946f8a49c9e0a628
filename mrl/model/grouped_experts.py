"""Routed experts through grouped GEMMs (`policy.speed.grouped_expert_gemm`): one `torch._grouped_mm` per linear for
all of a rank's local experts, in place of megatron-core's `SequentialMLP` loop of two GEMMs per expert.

Data flow (megatron-core 0.19.2: `MoELayer` calls `experts(permuted_hidden, tokens_per_expert, permuted_probs)`; the
dispatcher has grouped the tokens by local expert, expert e's rows at offsets[e - 1]:offsets[e]):
    hidden [T, H] x stack_e(W1_e^T) [E, H, 2F] -> [T, 2F]     one grouped GEMM (fc1: gate and up, SwiGLU's halves)
    silu(gate) * up * prob of each row -> [T, F]               as `MLP.forward` without fusions
    [T, F] x stack_e(W2_e^T) [E, F, H] -> [T, H]              one grouped GEMM (fc2)
The parameters stay `SequentialMLP`'s (`local_experts.{e}.linear_fc1.weight` ...), so the converters, the refit, the
checkpoints and the expert-parallel selection see the same names and shapes; the stacks are made at each forward, a
copy of the rank's expert weights (their gradients flow back through the stack to each expert's own parameter, where
Megatron's DDP hooks take them as they take SequentialMLP's).

Either layer spec: the local spec's experts are Megatron's own column / row parallel linears, Transformer Engine's
(as mrl builds it, `moe_grouped_gemm=False`) TE's `TEColumnParallelLinear` / `TERowParallelLinear` (megatron-core
0.19.2 extensions/transformer_engine_spec_provider.py `grouped_mlp_modules`). The grouped path reads only each
linear's `weight`, [2F, H] and [H, F] in both (with expert parallelism and no expert TP, TE's expert linears are built
unsplit: extensions/transformer_engine.py `explicit_expert_comm`), and never calls the linears, so TE's own
weight-gradient accumulation (`gradient_accumulation_fusion`) does not run for them: their gradient lands in `.grad`,
which Megatron's DDP hook adds to `main_grad` when `grad_added_to_main_grad` is unset
(distributed/distributed_data_parallel.py, `_make_backward_post_hook`), as for the local spec. Megatron's own grouped
module under TE, `TEGroupedMLP` (`moe_grouped_gemm=True`), names its weights `linear_fc1.weight{e}`, names the
converters do not map; it is not used.

Where the grouped path does not apply, the module runs `SequentialMLP.forward` unchanged: expert tensor parallelism
above 1 (the linears' collectives), biases, FP8/FP4, `moe_apply_probs_on_input`, a single local expert, an activation
other than SwiGLU, or row strides `torch._grouped_mm` refuses (it needs multiples of 16 bytes: H and F multiples of 4
in fp32, of 8 in bf16), a delayed weight-gradient computation (`delay_wgrad_compute`, TE's), or expert linears
whose weights are not of the [2F, H] / [H, F] layout. `grouped_path_applies` says which, once per layer at its
construction.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: `torch._grouped_mm`'s backward refuses stride-0
    (expanded) gradients, such as a sum's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_linear(x: torch.Tensor, weights: list[torch.Tensor], offsets: torch.Tensor) -> torch.Tensor:
    """Rows offsets[e - 1]:offsets[e] of x [T, K] times weights[e]^T ([N, K] each, a linear's layout) -> [T, N]."""
    stacked = torch.stack(weights).transpose(1, 2)  # [E, K, N]
    return _ContiguousGrad.apply(torch._grouped_mm(x, stacked, offs=offsets))


def _aligned(size: int, dtype: torch.dtype) -> bool:
    return (size * torch.empty((), dtype=dtype).element_size()) % 16 == 0


def grouped_path_applies(experts: SequentialMLP) -> str | None:
    """None when `experts` can run as grouped GEMMs, else why not (the module then runs SequentialMLP's loop)."""
    config = experts.config
    first = experts.local_experts[0]
    hidden, ffn = config.hidden_size, config.moe_ffn_hidden_size
    layout = [
        (tuple(e.linear_fc1.weight.shape), tuple(e.linear_fc2.weight.shape)) == ((2 * ffn, hidden), (hidden, ffn))
        for e in experts.local_experts
    ]
    reasons = [
        (experts.num_local_experts < 2, "one local expert"),
        (experts.tp_group is not None and experts.tp_group.size() > 1, "expert tensor parallelism > 1"),
        (config.add_bias_linear, "biased linears"),
        (bool(config.fp8 or config.fp4), "FP8/FP4"),
        (config.moe_apply_probs_on_input, "moe_apply_probs_on_input"),
        (not (config.gated_linear_unit and config.activation_func is F.silu), "an activation other than SwiGLU"),
        (config.activation_func_clamp_value is not None or config.glu_linear_offset != 0, "a clamped or offset GLU"),
        (config.delay_wgrad_compute, "delay_wgrad_compute (the linears' own delayed backward)"),
        (not all(layout), "expert linears' weights not [2F, H] and [H, F]"),
        (
            not (_aligned(hidden, first.linear_fc1.weight.dtype) and _aligned(ffn, first.linear_fc1.weight.dtype)),
            f"hidden {hidden} or expert MLP {ffn} not a multiple of 16 bytes",
        ),
    ]
    return next((why for bad, why in reasons if bad), None)


def use_grouped_experts(block_spec) -> None:
    """Make the routed experts of a decoder block spec (`mrl.parallel.attention.gpt_layer_spec`, local or Transformer
    Engine's) grouped: each MoE layer's `SequentialMLP` becomes `GroupedGemmExperts` over the same linears."""
    for layer in getattr(block_spec, "layer_specs", []):
        # megatron-core 0.19: an MoE layer's `mlp` is a builder, functools.partial(MoELayer, submodules=MoESubmodules),
        # whose `experts` is another, functools.partial(SequentialMLP, submodules=...) (models/backends.py
        # LocalSpecProvider.grouped_mlp_modules; TE's provider likewise with its linears).
        mlp = layer.submodules.mlp
        submodules = mlp.keywords.get("submodules") if isinstance(mlp, functools.partial) else None
        experts = getattr(submodules, "experts", None)
        if submodules is not None and isinstance(experts, functools.partial) and experts.func is SequentialMLP:
            submodules.experts = functools.partial(GroupedGemmExperts, *experts.args, **experts.keywords)


class GroupedGemmExperts(SequentialMLP):
    """`SequentialMLP` with the same parameters whose forward is two grouped GEMMs (module docstring).
    `loop_reason`: why this layer runs the loop instead (decided once, from its config and weights), or None."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loop_reason = grouped_path_applies(self)

    def forward(
        self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor
    ):
        if self.loop_reason is not None:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = permuted_local_hidden_states  # [T, H]
        counts = torch.as_tensor(tokens_per_expert, device=x.device)
        offsets = torch.cumsum(counts, 0).to(torch.int32)  # [E]
        fc1 = grouped_linear(x, [e.linear_fc1.weight for e in self.local_experts], offsets)  # [T, 2F]
        gate, up = torch.chunk(fc1, 2, dim=-1)
        intermediate = (F.silu(gate) * up * permuted_probs.unsqueeze(-1)).to(x.dtype)  # [T, F]
        return grouped_linear(intermediate, [e.linear_fc2.weight for e in self.local_experts], offsets), None
