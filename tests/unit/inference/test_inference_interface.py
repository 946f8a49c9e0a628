"""Generation records and sampling validation."""

import pytest
import torch

from mrl.inference.interface import FinishReason, GeneratedSample, GenerationOutput, RefitStats, SamplingConfig


def _sample(prompt: int, k: int, tokens: list[int], reason: FinishReason) -> GeneratedSample:
    return GeneratedSample(prompt, k, [5, 6], tokens, [-0.5 * (i + 1) for i in range(len(tokens))], reason)


def test_padded_tokens_and_lengths():
    out = GenerationOutput(
        [_sample(0, 0, [1, 2, 3], FinishReason.LENGTH), _sample(0, 1, [4], FinishReason.STOP)], num_prompts=1, n=2
    )
    ids, logprobs = out.padded_tokens(pad_token_id=0)
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert torch.equal(logprobs, torch.tensor([[-0.5, -1.0, -1.5], [-0.5, 0.0, 0.0]]))
    assert out.lengths().tolist() == [3, 1]
    assert out.samples[0].truncated and not out.samples[1].truncated


def test_output_must_hold_n_samples_per_prompt():
    with pytest.raises(ValueError, match="2 prompts x n=1"):
        GenerationOutput([_sample(0, 0, [1], FinishReason.STOP)], num_prompts=2, n=1)


@pytest.mark.parametrize(
    "kwargs, key",
    [({"n": 0}, "n=0"), ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
     ({"top_k": 0}, "top_k"), ({"max_new_tokens": 0}, "max_new_tokens")],
)
def test_sampling_config_rejects_impossible_values(kwargs, key):
    with pytest.raises(ValueError, match=key):
        SamplingConfig(**kwargs)


def test_refit_stats_metric_names():
    metrics = RefitStats(num_tensors=3, num_buckets=2, bytes=96, max_bucket_bytes=64, seconds=0.5).as_metrics()
    assert metrics == {"timing/refit": 0.5, "refit/bytes": 96.0, "refit/buckets": 2.0, "refit/max_bucket_bytes": 64.0}


def test_routing_is_stored_compactly_and_a_cpu_vllm_engine_refuses_to_return_it():
    from mrl.inference.interface import compact_routing
    from mrl.inference.vllm_backend import VllmEngineConfig, _llm_kwargs

    assert compact_routing(torch.tensor([[3, 255]], dtype=torch.uint8)).dtype == torch.int16  # vLLM: uint8 <= 256
    with pytest.raises(ValueError, match="does not fit"):
        compact_routing(torch.tensor([40_000]))
    if torch.cuda.is_available():
        assert _llm_kwargs(VllmEngineConfig("m", return_routing=True))["enable_return_routed_experts"]
    else:  # vLLM 0.32 captures the routing in its model runner V2, which needs CUDA and Triton
        with pytest.raises(ValueError, match="router_replay=off"):
            _llm_kwargs(VllmEngineConfig("m", return_routing=True))
    assert "enable_return_routed_experts" not in _llm_kwargs(VllmEngineConfig("m"))
