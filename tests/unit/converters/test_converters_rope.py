"""RoPE inverse frequencies installed on the Megatron model equal transformers' own, per rope type."""
import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from converters import model_dims
from mrl.model.build import rope_inv_freq

ROPES = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 5e5, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: r["rope_type"])
def test_rope_inv_freq_matches_transformers(rope):
    config = LlamaConfig(hidden_size=96, num_attention_heads=4, head_dim=24, num_hidden_layers=1,
                         intermediate_size=32, vocab_size=10, rope_parameters=rope)
    init = ROPE_INIT_FUNCTIONS.get(rope["rope_type"], LlamaRotaryEmbedding.compute_default_rope_parameters)
    expected, attention_factor = init(config)
    assert attention_factor == 1.0
    ours = rope_inv_freq(model_dims(config))
    assert ours.dtype == torch.float32 and ours.shape == (12,)
    assert torch.equal(ours, expected.float())
    if rope["rope_type"] != "default":  # scaling really changes something
        default = rope_inv_freq(model_dims(LlamaConfig(hidden_size=96, num_attention_heads=4, head_dim=24,
                                                       num_hidden_layers=1, intermediate_size=32, vocab_size=10,
                                                       rope_parameters={"rope_type": "default",
                                                                        "rope_theta": rope["rope_theta"]})))
        assert not torch.equal(ours, default)
