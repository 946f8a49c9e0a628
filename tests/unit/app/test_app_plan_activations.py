"""`mrl plan`'s activation estimate (mrl/app/plan_activations.py) against the bytes autograd saves in megatron-core's
own forward on CPU (mrl.testing.activation_bytes), with the CPU's kernels ("local"): tiny dense models with grouped-
query and multi-head attention and Qwen3's q/k norms, micro-batches of one and two sequences, several lengths, TP 1
and 2 with sequence parallelism, recompute on and off, each within 5% (issue #40 asks 15%; they agree within 2%: the
rest is the token ids and the rotary table's bookkeeping). The "te" kernels of the printed plan differ from "local"
only in the terms its docstring names."""

from __future__ import annotations

import pytest

from converters.spec import model_dims
from mrl.app.plan import model_config
from mrl.app.plan_activations import (decoder_activations, gather_buffer_bytes, layer_bytes, micro_batch_tokens,
                                      stage_activations)
from mrl.config import load_config
from mrl.config.recipes import RECIPES
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


def test_sequence_parallelism_adds_its_gathered_input_to_the_peaks():
    """Megatron-core's local linears all-gather the sequence-parallel input into one [tokens, hidden] bf16 buffer
    that stays allocated (the GPU tier measured it: tests/gpu/test_gpu_plan.py); the train and logprob peaks hold
    it once, with TP > 1 and sequence parallelism only."""
    dims = model_dims(MODELS["qwen2-gqa"])
    assert gather_buffer_bytes(dims, tokens=1000, tp=2, sequence_parallel=True) == 2 * 128 * 1000
    assert gather_buffer_bytes(dims, tokens=1000, tp=2, sequence_parallel=False) == 0
    assert gather_buffer_bytes(dims, tokens=1000, tp=1, sequence_parallel=True) == 0

    cfg = load_config(RECIPES / "grpo-deepscaler-1.5b-8K.yaml",
                      ["policy.parallel.tensor_parallel_size=2", "policy.parallel.sequence_parallel=true",
                       "policy.activation_checkpointing=false"])
    dims = model_dims(model_config(cfg)[0])
    tokens, lp_tokens = micro_batch_tokens(cfg), micro_batch_tokens(cfg, logprob=True)
    sp = stage_activations(cfg, dims, (0, dims.num_layers), last_stage=False, padded_vocab=dims.vocab_size)
    # without recompute the train peak's working set is the gathered input alone
    assert sp.working == 2 * dims.hidden_size * tokens
    # the logprob pass: one layer's whole set (sequence parallel, TP 2) and the gathered input of its tokens
    _, one_layer = decoder_activations(dims, (0, 1), tokens=lp_tokens, tp=2, sequence_parallel=True, recompute=True)
    assert sp.logprob_peak == one_layer + 2 * dims.hidden_size * lp_tokens
    cfg.policy.parallel.sequence_parallel = False
    no_sp = stage_activations(cfg, dims, (0, dims.num_layers), last_stage=False, padded_vocab=dims.vocab_size)
    _, one_layer = decoder_activations(dims, (0, 1), tokens=lp_tokens, tp=2, sequence_parallel=False, recompute=True)
    assert no_sp.working == 0 and no_sp.logprob_peak == one_layer


def test_a_micro_batch_holds_its_token_budget_and_a_logprob_pass_its_own():
    """With packing or dynamic batching a micro-batch is its token budget (a logprob pass's where one is set),
    without them sequences x the longest length."""
    cfg = load_config(RECIPES / "grpo-deepscaler-1.5b-8K.yaml")
    policy = cfg.policy
    policy.sequence_packing.enabled, policy.dynamic_batching.enabled = False, False
    assert micro_batch_tokens(cfg) == policy.train_micro_batch_size * policy.max_total_sequence_length
    assert micro_batch_tokens(cfg, logprob=True) == policy.logprob_micro_batch_size * policy.max_total_sequence_length
    for section in (policy.sequence_packing, policy.dynamic_batching):
        section.enabled, section.tokens_per_microbatch = True, 16384
        assert micro_batch_tokens(cfg) == micro_batch_tokens(cfg, logprob=True) == 16384
        section.logprob_tokens_per_microbatch = 32768
        assert (micro_batch_tokens(cfg), micro_batch_tokens(cfg, logprob=True)) == (16384, 32768)
        section.enabled = False
