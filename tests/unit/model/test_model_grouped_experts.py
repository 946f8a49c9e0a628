"""`mrl.model.grouped_experts` in-process (world size 1): which layer specs get the grouped experts, and when a layer
runs megatron-core's loop instead. The grouped GEMMs' values against the loop are checked in
tests/functional/parallel/test_parallel_grouped_experts.py (CPU) and tests/gpu/test_gpu_speed.py (CUDA)."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.usefixtures("megatron_world_of_one")


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


def experts_of(layer_spec):
    """An MoE layer spec's experts builder: functools.partial(SequentialMLP, submodules=MLPSubmodules) inside
    functools.partial(MoELayer, submodules=MoESubmodules) (megatron-core 0.19.2 models/gpt/moe_module_specs.py)."""
    return layer_spec.submodules.mlp.keywords["submodules"].experts


def test_the_experts_of_either_spec_become_grouped_over_their_own_linears():
    from megatron.core.transformer.moe.experts import SequentialMLP

    from mrl.model.grouped_experts import GroupedGemmExperts, use_grouped_experts
    from mrl.parallel.attention import gpt_layer_spec

    block = gpt_layer_spec(moe_config(), use_te=False)
    # Transformer Engine's spec as mrl builds it (moe_grouped_gemm=False): the same SequentialMLP over TE's linears
    # (megatron-core 0.19.2 TESpecProvider.grouped_mlp_modules); its classes are not built here
    te_like = experts_of(block.layer_specs[1]).keywords["submodules"]
    te_like.linear_fc1, te_like.linear_fc2 = ColumnLinearOfAnotherBackend, RowLinearOfAnotherBackend
    local_linears = (experts_of(block.layer_specs[0]).keywords["submodules"].linear_fc1,
                     experts_of(block.layer_specs[0]).keywords["submodules"].linear_fc2)
    assert experts_of(block.layer_specs[0]).func is SequentialMLP and experts_of(block.layer_specs[1]).func is SequentialMLP
    use_grouped_experts(block)
    local, te = experts_of(block.layer_specs[0]), experts_of(block.layer_specs[1])
    assert local.func is GroupedGemmExperts and te.func is GroupedGemmExperts
    assert (local.keywords["submodules"].linear_fc1, local.keywords["submodules"].linear_fc2) == local_linears
    assert (te.keywords["submodules"].linear_fc1, te.keywords["submodules"].linear_fc2) == (
        ColumnLinearOfAnotherBackend, RowLinearOfAnotherBackend)


def build_experts(**overrides):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from mrl.model.grouped_experts import use_grouped_experts
    from mrl.parallel.attention import gpt_layer_spec

    config = moe_config(**overrides)
    block = gpt_layer_spec(config, use_te=False)
    use_grouped_experts(block)
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    return block.layer_specs[0].submodules.mlp(config=config, pg_collection=pg_collection).experts  # a MoE layer's


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


#: A two-layer Qwen3-MoE of 4 experts (hidden 16, expert MLP 8: multiples of 16 bytes in fp32).
TINY_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 16,
            "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 2,
            "intermediate_size": 32, "moe_intermediate_size": 8, "num_experts": 4, "num_experts_per_tok": 2,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 32,
            "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 1e4, "tie_word_embeddings": False}


def test_a_transformer_engine_build_groups_its_experts_too(monkeypatch):
    """`build_model(use_te=True, grouped_experts=True)` groups the experts of the spec it builds (until this
    change it left TE's alone). TE's linears cannot be built without TE, so the local spec, whose experts are the same SequentialMLP, stands in for it here; the
    grouped experts against TE's own linears are checked by tests/gpu/test_gpu_speed.py where TE is installed."""
    from mrl.model import build
    from mrl.model.grouped_experts import GroupedGemmExperts
    from mrl.parallel.attention import gpt_layer_spec

    asked = []

    def local_spec_for(config, use_te=None):
        asked.append(use_te)
        return gpt_layer_spec(config, use_te=False)

    monkeypatch.setattr(build, "gpt_layer_spec", local_spec_for)
    config = build.transformer_config_from_hf(TINY_MOE)
    model = build.build_model(TINY_MOE, config, use_te=True, grouped_experts=True)
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    assert asked == [True] and len(experts) == 2
    assert all(type(m) is GroupedGemmExperts and m.loop_reason is None for m in experts)
