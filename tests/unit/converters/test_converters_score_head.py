"""Reward models (`*ForSequenceClassification`, one label): the score head's mapping, and an LM turned into one."""

from __future__ import annotations

import json

import pytest
import torch

from converters import hf_to_megatron, megatron_to_hf, model_dims, score_rows, tp_unshard
from converters.hf_io import load_hf_config, load_hf_state
from mrl.app.model_source import ModelSource
from mrl.app.reward_model import reward_model_source
from mrl.testing.tiny_models import build_tiny_hf_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    lm = build_tiny_hf_model(root / "lm", "llama", tied=True, seed=1)
    return lm, reward_model_source(ModelSource(lm), root / "out", pad_token_id=0, seed=7).config_dir


def test_an_lm_becomes_a_reward_model_that_transformers_loads(rm_dir):
    from transformers import AutoModelForSequenceClassification

    lm, rm = rm_dir
    config = json.loads((rm / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["num_labels"] == 1
    lm_state, rm_state = load_hf_state(lm), load_hf_state(rm)
    assert set(rm_state) == (set(lm_state) - {"lm_head.weight"}) | {"score.weight"}
    assert all(torch.equal(rm_state[k], lm_state[k]) for k in rm_state if k != "score.weight")
    assert rm_state["score.weight"].shape == (1, 64) and 0.005 < float(rm_state["score.weight"].std()) < 0.05
    model = AutoModelForSequenceClassification.from_pretrained(rm, dtype=torch.float32)
    assert torch.equal(model.score.weight.detach(), rm_state["score.weight"])
    source = ModelSource(rm)
    assert reward_model_source(source, rm.parent, pad_token_id=0, seed=7) == source  # a reward model is used as is


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_score_head_round_trips_through_megatron_at_every_tp(rm_dir, tp):
    _, rm = rm_dir
    config, state = load_hf_config(rm), load_hf_state(rm)
    dims = model_dims(config)
    assert dims.score_head and not dims.tied
    shards = [hf_to_megatron(state, config, rank, tp) for rank in range(tp)]
    assert shards[0]["output_layer.weight"].shape == (score_rows(tp) // tp, 64)
    head = tp_unshard([s["output_layer.weight"] for s in shards], 0, gated=False)  # [score_rows(tp), h]
    assert torch.equal(head[0], state["score.weight"][0]) and head[1:].abs().sum() == 0  # row 0, then padding
    if tp == 1:
        back = dict(megatron_to_hf(shards[0].items(), config))
        assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_a_reward_model_with_several_labels_is_refused():
    from converters import ConversionError

    config = {"architectures": ["LlamaForSequenceClassification"], "num_labels": 3, "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}
    with pytest.raises(ConversionError, match="num_labels=3"):
        model_dims(config)
