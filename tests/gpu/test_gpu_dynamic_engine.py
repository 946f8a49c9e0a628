"""Megatron's dynamic inference engine on CUDA (the Megatron backend's `engine="dynamic"`, mrl/inference/
megatron_dynamic.py) on a machine without flash-attn: its paged attention is mrl's torch one
(`mrl.cpu.megatron_dynamic.paged_attention_in_torch`, applied on a GPU without flash-attn), its KV append
megatron-core's Triton kernel. Against the static loop on the same weights in fp32: the same greedy tokens and
log-probabilities; sampled log-probabilities against an HF forward; a refit lands in place.

Figures: dynamic_engine.{static,dynamic}_tokens_s (greedy, 32 rows of 32 tokens), dynamic_engine.max_logprob_diff.
"""

from __future__ import annotations

import time

import torch

from mrl.inference import SamplingConfig
from mrl.testing.tiny_models import build_tiny_hf_model

PROMPTS = [[5, 17, 42, 8], [9, 10, 11], [100, 3, 77, 21, 60, 4, 250, 31], [7]] * 8  # 32 rows, 1 to 8 tokens
TOKENS = 32


def test_dynamic_engine_equals_the_static_loop_on_cuda(tmp_path, figure):
    from transformers import AutoModelForCausalLM

    from converters.hf_io import load_hf_state
    from mrl.inference.megatron_backend import MegatronBackend, MegatronEngineConfig
    from mrl.parallel.groups import destroy_process_groups

    path = build_tiny_hf_model(tmp_path, "qwen2", num_kv_heads=2, seed=3)
    try:
        engines = {
            loop: MegatronBackend(MegatronEngineConfig(str(path), max_model_len=64, max_batch_size=32, engine=loop,
                                                       kv_block_tokens=16))
            for loop in ("static", "dynamic")
        }
        assert next(engines["dynamic"].model.parameters()).is_cuda
        greedy = SamplingConfig(temperature=0.0, max_new_tokens=TOKENS, ignore_eos=True)
        out = {}
        for loop, engine in engines.items():
            engine.generate(PROMPTS[:2], greedy)  # builds the dynamic engine; warms the kernels
            torch.cuda.synchronize()
            start = time.perf_counter()
            out[loop] = engine.generate(PROMPTS, greedy)
            torch.cuda.synchronize()
            figure(f"dynamic_engine.{loop}_tokens_s", len(PROMPTS) * TOKENS / (time.perf_counter() - start),
                   "tokens/s")
        diff = 0.0
        for a, b in zip(out["static"].samples, out["dynamic"].samples):
            assert a.token_ids == b.token_ids
            diff = max(diff, max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)))
        figure("dynamic_engine.max_logprob_diff", diff, "nats")
        assert diff <= 1e-3

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        state = load_hf_state(path)
        perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(0))
                     for k, v in state.items()}
        engines["dynamic"].update_weights(perturbed)
        hf.load_state_dict(perturbed, strict=False)
        sampled = engines["dynamic"].generate(PROMPTS[:4], SamplingConfig(n=2, max_new_tokens=12, seed=1,
                                                                          ignore_eos=True))
        worst = 0.0
        for sample in sampled.samples:
            ids = torch.tensor([sample.prompt_token_ids + sample.token_ids])
            with torch.no_grad():
                logits = hf(ids).logits[0].float()
            start = len(sample.prompt_token_ids)
            ref = torch.log_softmax(logits[start - 1 : -1], dim=-1).gather(1, torch.tensor(sample.token_ids)[:, None])
            worst = max(worst, (torch.tensor(sample.logprobs) - ref.squeeze(1)).abs().max().item())
        figure("dynamic_engine.refit_sampled_vs_hf", worst, "nats")
        assert worst <= 1e-3
    finally:
        destroy_process_groups()
