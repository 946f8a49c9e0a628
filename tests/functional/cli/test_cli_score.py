"""`mrl score` through the command line: per-token logprobs equal HF transformers at TP1 and TP2, bad rows are
reported and skipped, perplexity is exp(-mean logprob)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mrl.testing.runs import finish, mrl
from mrl.testing.tiny_models import build_tiny_hf_model, hf_token_logprobs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_hf_model(tmp_path_factory.mktemp("score"), seed=2, family="qwen3", hidden=64, heads=4,
                               num_kv_heads=2, intermediate=128, layers=2)



@pytest.mark.parametrize("layout", [[], ["cluster.devices_per_node=2", "policy.parallel.tensor_parallel_size=2"]],
                         ids=["tp1", "tp2"])
def test_score_matches_hf_transformers(model_dir, tmp_path, layout):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rows = [{"text": "The quick brown fox jumps over the lazy dog number 7."},
            {"prompt": "Question: what is 3 plus 10?", "completion": " Answer: 13"},
            {"input_ids": [5, 17, 42, 8, 9], "num_prompt_tokens": 3},
            {"nothing": "here"}]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    finish(mrl("score", "--model", str(model_dir), "--input", str(source), "--out", str(out), *layout))
    result = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in result] == [0, 1, 2, 3] and "error" in result[3]

    text_ids = tokenizer(rows[0]["text"])["input_ids"]
    expected = hf_token_logprobs(model_dir, text_ids)
    assert result[0]["num_scored_tokens"] == len(text_ids) - 1
    assert (torch.tensor(result[0]["logprobs"]) - expected).abs().max() <= 1e-5
    assert result[0]["perplexity"] == pytest.approx(math.exp(-expected.double().mean().item()), rel=1e-5)

    prompt = tokenizer(rows[1]["prompt"])["input_ids"]
    full = prompt + tokenizer(rows[1]["completion"], add_special_tokens=False)["input_ids"]
    expected = hf_token_logprobs(model_dir, full)[len(prompt) - 1:]  # completion tokens only
    assert result[1]["token_ids"] == full[len(prompt):]
    assert (torch.tensor(result[1]["logprobs"]) - expected).abs().max() <= 1e-5

    expected = hf_token_logprobs(model_dir, rows[2]["input_ids"])[2:]
    assert (torch.tensor(result[2]["logprobs"]) - expected).abs().max() <= 1e-5
