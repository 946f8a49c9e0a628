"""`mrl.model.grouped_experts` in-process (world size 1): which layer specs get the grouped experts, and when a layer
runs megatron-core's loop instead. The grouped GEMMs' values against the loop are checked in
tests/functional/parallel/test_parallel_grouped_experts.py (CPU) and tests/gpu/test_gpu_speed.py (CUDA)."""

import pytest
import torch
import torch.nn.functional as F

from mrl.parallel import cpu_compat
from mrl.parallel.groups import destroy_process_groups, init_process_groups
from mrl.parallel.layout import ParallelDims


@pytest.fixture(scope="module", autouse=True)
def megatron_world_of_one():
    cpu_compat.apply()
    init_process_groups(ParallelDims(), seed=1234)
    yield
    destroy_process_groups()


def moe_config(**overrides):
    from megatron.core.transformer import TransformerConfig

    settings = dict(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4, moe_ffn_hidden_size=8,
                    moe_router_topk=2, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
                    moe_permute_fusion=False, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                    normalization="RMSNorm", use_cpu_initialization=True, gradient_accumulation_fusion=False,
                    bias_activation_fusion=False)
    return TransformerConfig(**{**settings, **overrides})


class ColumnLinearOfAnotherBackend:
    """Stands for Transformer Engine's TEColumnParallelLinear in a spec (never built here)."""


class RowLinearOfAnotherBackend:
    """Stands for TERowParallelLinear."""


def test_the_experts_of_either_spec_become_grouped_over_their_own_linears():
    from megatron.core.transformer.moe.experts import SequentialMLP

    from mrl.model.grouped_experts import GroupedGemmExperts, use_grouped_experts
    from mrl.parallel.attention import gpt_layer_spec

    block = gpt_layer_spec(moe_config(), use_te=False)
    # Transformer Engine's spec as mrl builds it (moe_grouped_gemm=False): the same SequentialMLP over TE's linears
    # (megatron-core 0.16.1 TESpecProvider.grouped_mlp_modules); its classes cannot be imported without TE
    te_like = block.layer_specs[1].submodules.mlp.submodules.experts
    te_like.submodules.linear_fc1 = ColumnLinearOfAnotherBackend
    te_like.submodules.linear_fc2 = RowLinearOfAnotherBackend
    local = block.layer_specs[0].submodules.mlp.submodules.experts
    local_linears = (local.submodules.linear_fc1, local.submodules.linear_fc2)
    assert local.module is SequentialMLP and te_like.module is SequentialMLP
    use_grouped_experts(block)
    assert local.module is GroupedGemmExperts and te_like.module is GroupedGemmExperts
    assert (local.submodules.linear_fc1, local.submodules.linear_fc2) == local_linears
    assert (te_like.submodules.linear_fc1, te_like.submodules.linear_fc2) == (ColumnLinearOfAnotherBackend,
                                                                              RowLinearOfAnotherBackend)


def build_experts(**overrides):
    from megatron.core.transformer.spec_utils import build_module

    from mrl.model.grouped_experts import use_grouped_experts
    from mrl.parallel.attention import gpt_layer_spec

    config = moe_config(**overrides)
    block = gpt_layer_spec(config, use_te=False)
    use_grouped_experts(block)
    return build_module(block.layer_specs[0].submodules.mlp, config=config).experts  # a MoE layer's


def test_the_grouped_path_applies_or_names_why_the_loop_runs():
    from mrl.model.grouped_experts import grouped_path_applies

    experts = build_experts()
    assert experts.loop_reason is None
    assert build_experts(moe_ffn_hidden_size=6).loop_reason.startswith("hidden 16 or expert MLP 6")  # 24 bytes
    assert build_experts(gated_linear_unit=False).loop_reason == "an activation other than SwiGLU"
    experts.config.delay_wgrad_compute = True  # TE's delayed weight gradients: the linears' own backward must run
    assert grouped_path_applies(experts).startswith("delay_wgrad_compute")
    experts.config.delay_wgrad_compute = False
    fc2 = experts.local_experts[2].linear_fc2
    fc2.weight = torch.nn.Parameter(fc2.weight.detach().t().contiguous())  # [F, H]: not a linear's [H, F]
    assert grouped_path_applies(experts) == "expert linears' weights not [2F, H] and [H, F]"
