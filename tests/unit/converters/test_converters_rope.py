"""RoPE inverse frequencies installed on the Megatron model, and YaRN's cos/sin factor, equal transformers' own."""
import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from converters import model_dims
from mrl.model.build import context_length, rope_attention_factor, rope_inv_freq, transformer_config_from_hf

ROPES = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 5e5, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16,
     "beta_slow": 2, "truncate": False, "mscale": 0.8, "mscale_all_dim": 0.6},
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "original_max_position_embeddings": 64,
     "attention_factor": 1.3},
]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: r["rope_type"])
def test_rope_inv_freq_matches_transformers(rope):
    config = LlamaConfig(hidden_size=96, num_attention_heads=4, head_dim=24, num_hidden_layers=1,
                         intermediate_size=32, vocab_size=10, rope_parameters=rope)
    init = ROPE_INIT_FUNCTIONS.get(rope["rope_type"], LlamaRotaryEmbedding.compute_default_rope_parameters)
    expected, attention_factor = init(config)
    assert rope_attention_factor(model_dims(config)) == attention_factor
    assert (attention_factor == 1.0) == (rope["rope_type"] != "yarn")
    ours = rope_inv_freq(model_dims(config))
    assert ours.dtype == torch.float32 and ours.shape == (12,)
    assert torch.equal(ours, expected.float())
    if rope["rope_type"] != "default":  # scaling really changes something
        default = rope_inv_freq(model_dims(LlamaConfig(hidden_size=96, num_attention_heads=4, head_dim=24,
                                                       num_hidden_layers=1, intermediate_size=32, vocab_size=10,
                                                       rope_parameters={"rope_type": "default",
                                                                        "rope_theta": rope["rope_theta"]})))
        assert not torch.equal(ours, default)


def test_yarn_attention_factor_becomes_the_softmax_scale():
    """Scaling cos and sin by m scales q.k by m^2: the Megatron config carries m^2 / sqrt(head_dim)."""
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64}
    config = LlamaConfig(hidden_size=96, num_attention_heads=4, head_dim=24, num_hidden_layers=1,
                         intermediate_size=32, vocab_size=10, rope_parameters=yarn)
    m = 0.1 * math.log(4.0) + 1.0
    assert transformer_config_from_hf(config).softmax_scale == pytest.approx(m * m / math.sqrt(24), rel=1e-12)
    plain = LlamaConfig(hidden_size=96, num_attention_heads=4, head_dim=24, num_hidden_layers=1,
                        intermediate_size=32, vocab_size=10)
    assert transformer_config_from_hf(plain).softmax_scale is None


@pytest.mark.parametrize("rope, expected", [
    ({"rope_type": "default", "rope_theta": 1e4}, 256),
    ({"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}, 512),
    ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64}, 256),
], ids=["default", "linear", "yarn"])
def test_context_length_follows_the_rope_factor(rope, expected):
    """What vLLM allows as max_model_len: max positions, x factor for linear scaling (YaRN configs hold the extended
    length)."""
    config = LlamaConfig(hidden_size=96, num_attention_heads=4, head_dim=24, num_hidden_layers=1, intermediate_size=32,
                         vocab_size=10, max_position_embeddings=256, rope_parameters=rope)
    assert context_length(model_dims(config)) == expected
