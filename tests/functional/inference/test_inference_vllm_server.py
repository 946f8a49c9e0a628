"""The OpenAI-compatible model server over real HTTP on loopback, in front of a real (in-process) vLLM engine: the
token ids and logprobs it returns are the engine's own for the chat template's rendering of the messages."""

from __future__ import annotations

import httpx
import pytest
from transformers import PreTrainedTokenizerFast

from mrl.environments.servers import serve
from mrl.inference.interface import SamplingConfig
from mrl.inference.model_server import build_model_app
from mrl.testing.tiny_models import build_tiny_hf_model

pytestmark = pytest.mark.functional

MAX_MODEL_LEN = 96


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """An in-process engine of its own. vLLM's parallel state is process-global: an engine left by an earlier module
    is collected first (its shutdown would tear the state down under this one), and this one is shut down at the
    end, not whenever the garbage collector gets to it."""
    import gc

    from mrl.inference.vllm_backend import VllmBackend, VllmEngineConfig

    gc.collect()
    model = build_tiny_hf_model(tmp_path_factory.mktemp("served"), "qwen2", hidden=128, heads=4, num_kv_heads=2,
                                intermediate=256, seed=2)
    # As a colocated engine: it sleeps between generations (on CPU, vLLM's sleep contract alone: CpuSleepMode)
    engine = VllmBackend(VllmEngineConfig(model_path=str(model), max_model_len=MAX_MODEL_LEN, kv_cache_bytes=64 << 20,
                                          sleep_when_idle=True))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model)
    try:
        with serve(build_model_app(engine, tokenizer, default_max_tokens=8)) as running:
            yield running.url, engine, tokenizer
    finally:
        engine.shutdown()


def test_a_request_wakes_a_sleeping_engine(served):
    url, engine, _ = served
    engine.finish_generation()  # as GRPO leaves it after generating
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 200
    events = [what for what, _ in engine.sleep_events()]
    assert events[-3:] == ["sleep(level=1)", "wake_up(['kv_cache', 'weights'])", "generate"]


def test_chat_completion_returns_the_engines_tokens_and_logprobs(served):
    url, engine, tokenizer = served
    messages = [{"role": "user", "content": "guess a number"}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 1.0, "n": 2, "seed": 5}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    prompt = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"]
    direct = engine.generate([prompt], SamplingConfig(n=2, max_new_tokens=6, seed=5,
                                                      stop_token_ids=(tokenizer.convert_tokens_to_ids("<|im_end|>"),)))
    assert len(answer["choices"]) == 2
    for choice, sample in zip(answer["choices"], direct.samples):
        message = choice["message"]
        assert message["prompt_token_ids"] == prompt
        assert message["generation_token_ids"] == sample.token_ids
        assert message["generation_log_probs"] == pytest.approx(sample.logprobs, abs=1e-6)
        assert message["content"] == tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        assert choice["finish_reason"] in ("stop", "length")
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "mrl-policy"


def test_responses_api_returns_the_engines_tokens_too(served):
    url, engine, tokenizer = served
    body = {"input": "guess a number", "instructions": "be brief", "max_output_tokens": 5, "seed": 3}
    answer = httpx.post(f"{url}/v1/responses", json=body, timeout=60).json()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "guess a number"}]
    prompt = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"]
    (sample,) = engine.generate([prompt], SamplingConfig(
        n=1, max_new_tokens=5, seed=3, stop_token_ids=(tokenizer.convert_tokens_to_ids("<|im_end|>"),))).samples
    (message,) = answer["output"]
    assert answer["object"] == "response" and message["type"] == "message" and message["role"] == "assistant"
    assert message["prompt_token_ids"] == prompt and message["generation_token_ids"] == sample.token_ids
    assert message["generation_log_probs"] == pytest.approx(sample.logprobs, abs=1e-6)
    text = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
    assert message["content"] == [{"type": "output_text", "text": text, "annotations": []}] and answer["output_text"] == text
    assert answer["status"] == ("completed" if sample.finish_reason.value == "stop" else "incomplete")
    assert answer["usage"] == {"input_tokens": len(prompt), "output_tokens": len(sample.token_ids),
                               "total_tokens": len(prompt) + len(sample.token_ids)}
    assert httpx.post(f"{url}/v1/responses", json={"max_output_tokens": 3}, timeout=30).status_code == 422


def test_bad_requests_name_the_problem(served):
    url = served[0]
    missing = httpx.post(f"{url}/v1/chat/completions", json={"max_tokens": 4}, timeout=30)
    assert missing.status_code == 422 and "messages" in missing.text
    long = [{"role": "user", "content": "word " * 400}]
    too_long = httpx.post(f"{url}/v1/chat/completions", json={"messages": long}, timeout=30)
    assert too_long.status_code == 400 and "more than the engine takes" in too_long.text
