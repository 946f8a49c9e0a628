"""`mrl plan`'s activation estimate (mrl/app/plan_activations.py) against the bytes autograd saves in megatron-core's
own forward on CPU (mrl.testing.activation_bytes), with the CPU's kernels ("local"): tiny dense models with grouped-
query and multi-head attention and Qwen3's q/k norms, micro-batches of one and two sequences, several lengths, TP 1
and 2 with sequence parallelism, recompute on and off, each within 5% (issue #40 asks 15%; they agree within 2%: the
rest is the token ids and the rotary table's bookkeeping). The "te" kernels of the printed plan differ from "local"
only in the terms its docstring names."""

from __future__ import annotations

import pytest

from converters.spec import model_dims
from mrl.app.plan_activations import decoder_activations, layer_bytes
from mrl.testing.activation_bytes import saved_activation_bytes

BASE = {"hidden_size": 128, "intermediate_size": 384, "num_attention_heads": 4, "num_hidden_layers": 3,
        "vocab_size": 512, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False}
MODELS = {"qwen2-gqa": {**BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_key_value_heads": 2},
          "qwen2-mha": {**BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_key_value_heads": 4},
          "qwen3": {**BASE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_key_value_heads": 2,
                    "head_dim": 32}}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("recompute", [False, True])
def test_the_estimate_is_within_5_percent_of_what_megatron_saves(model, tp, recompute):
    config = MODELS[model]
    dims = model_dims(config)
    for tokens, sequences in ((256, 1), (1024, 1), (1024, 2)):
        measured = saved_activation_bytes(config, tokens=tokens, sequences=sequences, tp=tp, recompute=recompute)
        kept, _ = decoder_activations(dims, (0, dims.num_layers), tokens=tokens, tp=tp, sequence_parallel=tp > 1,
                                      recompute=recompute, kernels="local", sequence_length=tokens // sequences)
        assert abs(kept - measured) <= 0.05 * measured, (tokens, sequences, kept, measured)


def test_the_kernel_sets_differ_in_the_named_terms_only():
    dims = model_dims(MODELS["qwen2-gqa"])  # h 128, 4 heads of 32 (2 KV heads), MLP 384
    te, local = layer_bytes(dims, 0, "te"), layer_bytes(dims, 0, "local")
    h, hd, f = 128, 32, 384
    norms = 2 * ((8 * h + 4 + 2 * h) - (2 * h + 2 * h + 4))  # two fp32 copies instead of bf16 input and output
    repeated_kv = 2 * 2 * (4 - 2) * hd                        # keys and values for every query head
    unfused_swiglu = 2 * f + 2 * f                            # SiLU's output and the product's operand
    assert local.total - te.total == norms + repeated_kv + unfused_swiglu + 8 * hd + 8  # + RoPE's cos/sin, positions
