"""A random model of a given shape (`policy.build`, mrl/app/starting_model.py): a real model's head size and vocabulary,
and a clear error for a vocabulary the built tokenizer does not fit."""

import json

import pytest
from safetensors import safe_open
from transformers import PreTrainedTokenizerFast

from mrl.app.starting_model import build_initial_model
from mrl.config import load_config
from mrl.config.errors import ConfigError
from mrl.testing.runs import RECIPE

QWEN3_LIKE = ["policy.build.family=qwen3", "policy.build.hidden_size=32", "policy.build.num_attention_heads=2",
              "policy.build.num_key_value_heads=1", "policy.build.num_layers=1", "policy.build.intermediate_size=16"]


def test_head_size_and_vocabulary_as_given(tmp_path):
    cfg = load_config(RECIPE, [*QWEN3_LIKE, "policy.build.head_dim=24", "policy.build.vocab_size=1000"])
    out = build_initial_model(cfg, cfg.policy.build, tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert (config["head_dim"], config["vocab_size"]) == (24, 1000)
    with safe_open(str(out / "model.safetensors"), "pt") as f:  # the weights have the shapes, not the config alone
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [1000, 32]
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape() == [2 * 24, 32]
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [1 * 24, 32]


def test_defaults_derive_them_from_the_tokenizer_and_the_hidden_size(tmp_path):
    cfg = load_config(RECIPE, QWEN3_LIKE)  # the arithmetic task: its character tokenizer
    config = json.loads((build_initial_model(cfg, cfg.policy.build, tmp_path) / "config.json").read_text())
    assert config["head_dim"] == 32 // 2
    assert config["vocab_size"] == len(PreTrainedTokenizerFast.from_pretrained(tmp_path)) == 17


def test_a_vocabulary_smaller_than_the_tokenizer_names_the_key_and_the_size(tmp_path):
    cfg = load_config(RECIPE, [*QWEN3_LIKE, "policy.build.vocab_size=5"])
    with pytest.raises(ConfigError) as err:
        build_initial_model(cfg, cfg.policy.build, tmp_path)
    assert err.value.key == "policy.build.vocab_size" and err.value.given == 5
    assert "17 tokens" in str(err.value)  # the arithmetic task's character tokenizer
