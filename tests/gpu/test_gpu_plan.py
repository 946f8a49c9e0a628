"""#40 on a GPU: `mrl plan`'s activation estimate for GPUs without Transformer Engine (kernels "local": megatron-
core's local spec with mrl's attention, which takes torch's SDPA on CUDA) against what one bf16 forward of megatron-
core's own decoder keeps on this GPU, counted two ways (the tensors autograd saves, and the caching allocator's
growth, which also holds sequence parallelism's gathered input; mrl.testing.activation_bytes), each within the
issue's 15%; and `cluster.memory_check` against this GPU's own memory as `mrl run` reads it: the 8K DeepScaleR
recipe fits one GPU of it, DeepSeek-V3's layout is refused with the plan as the message."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mrl.testing.distributed import run_on_ranks

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
#: a Qwen2-shaped decoder big enough that the allocator's 512-byte rounding is noise: hidden 1024, 16 query heads
#: over 4 KV heads of 64, MLP 2816, 4 layers
MODEL = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1024,
         "intermediate_size": 2816, "num_attention_heads": 16, "num_key_value_heads": 4, "num_hidden_layers": 4,
         "vocab_size": 8192, "max_position_embeddings": 16384, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
         "tie_word_embeddings": False}
CASES = [(tokens, sequences, tp, recompute) for tokens, sequences in ((2048, 1), (8192, 1), (8192, 4))
         for tp in (1, 2) for recompute in (False, True)]


def measure_all() -> list[dict]:
    """Rank side: every case's two measurements on this GPU."""
    from mrl.testing.activation_bytes import activation_bytes

    out = []
    for tokens, sequences, tp, recompute in CASES:
        measured = activation_bytes(MODEL, tokens=tokens, sequences=sequences, tp=tp, recompute=recompute,
                                    device="cuda")
        out.append({"tokens": tokens, "sequences": sequences, "tp": tp, "recompute": recompute, **measured})
    return out


def test_the_activation_estimate_holds_on_this_gpu(figure):
    from converters.spec import model_dims
    from mrl.app.plan_activations import decoder_activations, gather_buffer_bytes

    dims = model_dims(MODEL)
    misses = []
    for case in run_on_ranks(measure_all, 1, timeout_s=600)[0]:
        tokens, sequences, tp, recompute = case["tokens"], case["sequences"], case["tp"], case["recompute"]
        estimate = {kernels: decoder_activations(dims, (0, dims.num_layers), tokens=tokens, tp=tp,
                                                 sequence_parallel=tp > 1, recompute=recompute, kernels=kernels,
                                                 sequence_length=tokens // sequences)[0]
                    for kernels in ("local", "te")}
        # the allocator also holds sequence parallelism's gathered input (megatron-core's global memory buffer)
        held = {"saved": estimate["local"],
                "allocated": estimate["local"] + gather_buffer_bytes(dims, tokens=tokens, tp=tp,
                                                                     sequence_parallel=tp > 1)}
        name = f"plan.activations.t{tokens}_s{sequences}_tp{tp}_{'recompute' if recompute else 'kept'}"
        for how in ("saved", "allocated"):
            ratio = held[how] / case[how]
            figure(f"{name}.local_over_{how}", ratio, "x", measured_mb=case[how] / 2**20,
                   local_mb=held[how] / 2**20, te_mb=estimate["te"] / 2**20)
            if abs(ratio - 1) > 0.15:
                misses.append((name, how, case[how], held[how]))
    assert not misses, misses


def test_a_run_checks_its_layout_against_this_gpu(figure):
    from mrl.app.plan import check_this_gpu
    from mrl.config import ConfigError, load_config

    total = torch.cuda.get_device_properties(0).total_memory  # what mrl.app.runtime passes
    figure("plan.this_gpu_total_gib", total / 2**30, "GiB", gpu=torch.cuda.get_device_name(0))
    assert check_this_gpu(load_config(RECIPES / "grpo-deepscaler-1.5b-8K.yaml"), total) is None
    with pytest.raises(ConfigError, match="does not fit this GPU") as refused:
        check_this_gpu(load_config(RECIPES / "grpo-deepseek-v3-32n8g.yaml",  # engines on one node: 156 GiB a GPU
                                   ["generation.vllm.pipeline_parallel_size=1"]), total)
    assert "verdict: does NOT fit" in str(refused.value)
