"""`mrl.model.hybrid` by hand: the GPT <-> HybridModel names, the config fields counted in hybrid layers, the layer
pattern with its pipeline stages, and that a model built by mrl is a HybridModel whose names map onto the
converters' GPT names one to one (world size 1). Its forward against transformers: tests/functional/model."""

import pytest

from mrl.model import hybrid


@pytest.mark.parametrize("gpt, hybrid_name", [
    ("decoder.layers.0.input_layernorm.weight", "decoder.layers.0.input_layernorm.weight"),
    ("decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.self_attention.linear_qkv.weight"),
    ("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight",
     "decoder.layers.6.self_attention.linear_qkv.layer_norm_weight"),
    ("decoder.layers.3.pre_mlp_layernorm.weight", "decoder.layers.7.pre_mlp_layernorm.weight"),
    ("decoder.layers.3.mlp.linear_fc1.layer_norm_weight", "decoder.layers.7.mlp.linear_fc1.layer_norm_weight"),
    ("decoder.layers.12.mlp.experts.local_experts.5.linear_fc2.weight",
     "decoder.layers.25.mlp.experts.local_experts.5.linear_fc2.weight"),
    ("decoder.layers.1.mlp.router.expert_bias", "decoder.layers.3.mlp.router.expert_bias"),
    ("decoder.final_layernorm.weight", "decoder.final_norm.weight"),
    ("embedding.word_embeddings.weight", "embedding.word_embeddings.weight"),
    ("output_layer.weight", "output_layer.weight"),
    ("module.decoder.layers.2.mlp.linear_fc2.weight", "module.decoder.layers.5.mlp.linear_fc2.weight"),
])
def test_names_map_both_ways(gpt, hybrid_name):
    assert hybrid.to_hybrid(gpt) == hybrid_name
    assert hybrid.to_gpt(hybrid_name) == gpt


def test_layer_numbers_are_transformer_layers():
    # hybrid layer numbers are 1-based: GPT layer i holds 2i+1 (attention) and 2i+2 (MLP)
    assert [hybrid.gpt_layer_index(n) for n in range(1, 7)] == [0, 0, 1, 1, 2, 2]


def test_gpt_counted_fields_become_hybrid_counted():
    fields = dict(num_layers=5, num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=2,
                  recompute_num_layers=1, num_moe_experts=4, moe_layer_freq=[0, 1, 1, 0, 1])
    out = hybrid.gpt_config_fields(fields)
    assert out == dict(num_layers=10, num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=4,
                       recompute_num_layers=2, num_moe_experts=4, moe_layer_freq=[0, 0, 0, 1, 0, 1, 0, 0, 0, 1])
    assert fields["num_layers"] == 5  # the input is not changed
    every_other = hybrid.gpt_config_fields(dict(num_layers=4, num_moe_experts=2, moe_layer_freq=2))
    assert every_other["moe_layer_freq"] == [0, 1, 0, 0, 0, 1, 0, 0]  # GPT layers 0 and 2, as megatron reads an int
    assert hybrid.gpt_config_fields(dict(num_layers=3)) == dict(num_layers=6)


class _Config:
    def __init__(self, **fields):
        base = dict(num_moe_experts=None, moe_layer_freq=1, pipeline_model_parallel_size=1,
                    num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None)
        self.__dict__.update({**base, **fields})


def test_the_pattern_has_a_pair_per_transformer_layer_and_a_bar_per_stage():
    assert hybrid.layer_pattern(_Config(num_layers=6)) == "*-*-*-"
    assert hybrid.layer_pattern(_Config(num_layers=4, num_moe_experts=8)) == "*E*E"
    deepseek = _Config(num_layers=8, num_moe_experts=8, moe_layer_freq=[0, 0, 0, 0, 0, 1, 0, 1])
    assert hybrid.layer_pattern(deepseek) == "*-*-*E*E"
    assert hybrid.layer_pattern(_Config(num_layers=8, pipeline_model_parallel_size=2)) == "*-*-|*-*-"
    uneven = _Config(num_layers=10, pipeline_model_parallel_size=3, num_layers_in_first_pipeline_stage=2,
                     num_layers_in_last_pipeline_stage=4)
    assert hybrid.layer_pattern(uneven) == "*-|*-*-|*-*-"
    with pytest.raises(ValueError, match="first_stage_layers"):
        hybrid.layer_pattern(_Config(num_layers=6, pipeline_model_parallel_size=2))  # 3 layers over 2 stages


def test_the_split_moves_into_the_pattern_while_the_model_is_built():
    config = _Config(num_layers=6, pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=2)
    with hybrid.split_by_pattern(config):
        assert config.num_layers_in_first_pipeline_stage is None
    assert config.num_layers_in_first_pipeline_stage == 2


@pytest.mark.parametrize("moe", [False, True])
def test_mrls_model_is_a_hybrid_model_whose_names_are_the_converters(megatron_world_of_one, moe):
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from converters import model_dims, param_rules
    from mrl.model.build import build_model, moe_transformer_config, transformer_config_from_hf

    hf = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=32, intermediate_size=64,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
              max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
    settings = dict(perform_initialization=False)
    config = (moe_transformer_config(hf, num_experts=4, **settings) if moe
              else transformer_config_from_hf(hf, **settings))
    model = build_model(hf, config)
    assert isinstance(model, HybridModel) and model.hybrid_layer_pattern == ("*E" if moe else "*-") * 3
    assert config.num_layers == 6 and len(model.decoder.layers) == 6
    names = {hybrid.to_gpt(k) for k in model.state_dict() if not k.endswith("_extra_state")}
    if not moe:
        assert names == {r.megatron for r in param_rules(model_dims(hf), "local")}
    else:  # no converter maps a dense HF model's MoE variant: its layers hold a router and experts instead
        assert "decoder.layers.2.mlp.router.weight" in names and "decoder.final_layernorm.weight" in names
    assert hybrid.stage_gpt_layers(model) == (0, 3)
