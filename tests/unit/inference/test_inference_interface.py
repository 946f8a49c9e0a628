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
    from mrl.model.router_replay import no_route, routing_dtype, routing_targets

    # vLLM returns uint8 ids up to 256 experts: DeepSeek-V3's 256 use every value, so its ids need int16 to leave room
    # for the "none" mark; Qwen3-30B-A3B's 128 keep one byte each
    assert compact_routing(torch.tensor([[3, 255]], dtype=torch.uint8), 256).dtype == torch.int16
    kept = compact_routing(torch.tensor([[3, 127]], dtype=torch.uint8), 128)
    assert kept.dtype == torch.uint8 and kept.tolist() == [[3, 127]]
    assert [routing_dtype(n) for n in (8, 255, 256, 32_767)] == [torch.uint8, torch.uint8, torch.int16, torch.int16]
    assert no_route(torch.uint8) == 255 and no_route(torch.int16) == -1
    with pytest.raises(ValueError, match="not those of a model with 128"):
        compact_routing(torch.tensor([3, 128]), 128)
    with pytest.raises(ValueError, match="below 32,768"):
        routing_dtype(40_000)
    for dtype in (torch.uint8, torch.int16):  # stored marks decode to -1, ids to themselves
        stored = torch.tensor([0, 7, no_route(dtype)], dtype=torch.int64).to(dtype)
        assert routing_targets(stored).tolist() == [0, 7, -1] and routing_targets(stored).dtype == torch.int64
    if torch.cuda.is_available():
        assert _llm_kwargs(VllmEngineConfig("m", return_routing=True))["enable_return_routed_experts"]
    else:  # vLLM 0.32 captures the routing in its model runner V2, which needs CUDA and Triton
        with pytest.raises(ValueError, match="router_replay=off"):
            _llm_kwargs(VllmEngineConfig("m", return_routing=True))
    assert "enable_return_routed_experts" not in _llm_kwargs(VllmEngineConfig("m"))


def test_vllm_routed_experts_become_the_samples_compact_routing():
    """vLLM 0.32's `CompletionOutput.routed_experts` ([prompt + response - 1, layers, k], uint8 up to 256 experts;
    vllm/outputs.py) becomes each sample's routing, in sample order, in the dtype the model's expert count asks for;
    a request without it (the engine was not asked) carries none; ids beyond the model's experts are refused."""
    import numpy as np
    from vllm.outputs import CompletionOutput, RequestOutput

    from mrl.inference.interface import SamplingConfig
    from mrl.inference.vllm_backend import _prompt_samples

    routed = [np.arange(4 * 2 * 2, dtype=np.uint8).reshape(4, 2, 2) + 10 * i for i in range(2)]  # 3 + 2 - 1 tokens
    output = RequestOutput("0", None, [5, 6, 7], None, [
        CompletionOutput(1, "", [8, 9], None, None, routed_experts=routed[1], finish_reason="stop"),
        CompletionOutput(0, "", [4, 2], None, None, routed_experts=routed[0], finish_reason="length")], True)
    sampling = SamplingConfig(n=2, logprobs=False)
    samples = _prompt_samples(0, output, sampling, False, 128)
    assert [s.routing.dtype for s in samples] == [torch.uint8, torch.uint8]
    assert [s.routing.tolist() for s in samples] == [r.tolist() for r in routed]  # sorted by the sample's index
    assert all(s.routing.dtype == torch.int16 for s in _prompt_samples(0, output, sampling, False, 256))
    assert all(s.routing is None for s in _prompt_samples(0, output, sampling, False, None))
    with pytest.raises(ValueError, match="not those of a model with 16"):
        _prompt_samples(0, output, sampling, False, 16)


def test_an_eager_engine_in_this_process_runs_vllms_compiled_helpers_eagerly_and_only_inside_its_scope():
    """`enforce_eager` with the worker in this process: a `torch.compile`d function run inside `eager_scope` is not
    compiled (the backend never called) and gives the eager result; outside the scope, or for an engine whose workers
    run elsewhere or that compiles, compilation happens as before."""
    from mrl.inference.vllm_backend import VllmEngineConfig, eager_scope

    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    def helper(x):
        return (x >= 2).sum(-1)

    x = torch.tensor([[1, 2, 3], [4, 0, 0]])
    compiled = torch.compile(helper, backend=backend, dynamic=False)
    with eager_scope(VllmEngineConfig("m", enforce_eager=True)):
        assert compiled(x).tolist() == [2, 1]
    assert graphs == []
    for config in (VllmEngineConfig("m", enforce_eager=False), VllmEngineConfig("m", multiprocessing=True, refit_transport="shm_file")):
        torch._dynamo.reset()  # the compiled code of `helper` forgotten: the next call compiles again where allowed
        with eager_scope(config):
            assert compiled(x).tolist() == [2, 1]
    assert len(graphs) == 2
    torch._dynamo.reset()
    assert compiled(x).tolist() == [2, 1] and len(graphs) == 3  # the stance restored after the scope
