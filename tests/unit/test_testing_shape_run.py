"""The GPU tier's Qwen3-0.6B-shaped GRPO run, checked on CPU where it can be (mrl/testing/shape_run.py): its
overrides are a valid config of that shape, its figures are what the metrics rows say (hand-computed), and the
plan it compares with counts the model's own parameters."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from mrl.config import load_config
from mrl.testing import shape_run
from mrl.testing.runs import RECIPE


def test_the_overrides_are_a_valid_config_of_the_qwen3_06b_shape(tmp_path):
    cfg = load_config(RECIPE, shape_run.run_overrides(tmp_path / "run"))
    b = cfg.policy.build
    shape = (b.family, b.num_layers, b.hidden_size, b.num_attention_heads, b.num_key_value_heads)
    assert shape == ("qwen3", 28, 1024, 16, 8)
    assert (b.head_dim, b.intermediate_size, b.vocab_size, b.tie_word_embeddings) == (128, 3072, 151_936, True)
    assert (cfg.generation.backend, cfg.generation.colocated, cfg.policy.precision) == ("megatron", True, "bfloat16")
    rows = shape_run.PROMPTS * shape_run.GENERATIONS
    assert cfg.policy.train_global_batch_size < rows  # two updates a step, so the logprob pass runs
    assert cfg.generation.max_new_tokens + 6 <= cfg.policy.max_total_sequence_length  # the task's prompts: ~6 tokens


def _row(step, response, generation_s, train_s, logprob_s, **extra):
    return {"step": step, "timing/step": 1.0 + step, "train/response_length": response, "train/prompt_tokens_max": 6,
            "timing/generation": generation_s, "timing/train": train_s, "timing/logprobs": logprob_s,
            "timing/refit": 0.5, "train/refit_bytes": 2**30, "train/token_mult_prob_error": 1.0 + step / 100, **extra}


def test_the_figures_skip_the_first_step_and_take_medians_and_maxima():
    memory = {"train/peak_memory_gib": 30.0, "train/logprob_peak_memory_gib": 7.0}
    rows = [_row(1, 100, 1.0, 1.0, 1.0, **memory), {"val/accuracy": 0.0}, _row(2, 1000, 8.0, 2.0, 0.5, **memory),
            _row(3, 1022, 10.0, 4.0, 1.0, **{**memory, "train/peak_memory_gib": 31.0})]
    got = shape_run.step_figures(rows)
    n = shape_run.PROMPTS * shape_run.GENERATIONS  # 64 responses a step
    assert got["response_length"] == pytest.approx(1011)
    assert got["generation_tokens_s"] == pytest.approx((n * 1000 / 8 + n * 1022 / 10) / 2)
    assert got["train_tokens_s"] == pytest.approx((n * 1006 / 2 + n * 1028 / 4) / 2)
    assert got["logprob_tokens_s"] == pytest.approx((n * 1006 / 0.5 + n * 1028 / 1) / 2)
    assert (got["refit_s"], got["refit_gib_s"]) == (0.5, 2.0)
    assert got["token_mult_prob_error"] == pytest.approx(1.03)
    assert (got["peak_memory_gib"], got["logprob_peak_memory_gib"]) == (31.0, 7.0)
    assert (got["generation_s"], got["train_s"], got["logprob_s"]) == (9.0, 3.0, 0.75)
    assert "generation_device_used_gib" not in got  # not logged (a CPU run): not made up
    assert {key for key, _ in shape_run.FIGURES} <= set(got)  # every figure a session records is computed


def test_a_run_cut_before_or_after_its_first_step_gives_what_it_logged(tmp_path):
    """A GPU session's stage limit can cut the run: the figures are those of the steps it logged, none before."""
    assert shape_run.logged_rows(tmp_path) == [] and shape_run.step_figures([]) == {}
    lines = [{"step": 0, "val/accuracy": 0.0}, _row(1, 500, 5.0, 2.0, 1.0)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    rows = shape_run.logged_rows(tmp_path)
    assert shape_run.step_figures(rows[:1]) == {}
    got = shape_run.step_figures(rows)  # the first step alone: the only one there is
    assert (got["generation_s"], got["response_length"], got["step_s"]) == (5.0, 500, 2.0)


def test_the_plan_counts_the_models_own_parameters(tmp_path):
    config = AutoConfig.for_model("qwen3", vocab_size=151_936, hidden_size=1024, intermediate_size=3072,
                                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                  tie_word_embeddings=True, max_position_embeddings=1056)
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        params = AutoModelForCausalLM.from_config(config).num_parameters()  # tied: the embedding counted once
    plan = shape_run.planned(RECIPE, shape_run.run_overrides(tmp_path / "run"), tmp_path / "config.json", 140 * 2**30)
    weights_gib = 2 * params / 2**30  # bf16
    assert weights_gib < plan["logprob_gib"] < plan["train_gib"]
    assert plan["train_gib"] > 16 * params / 2**30  # bf16 weights, fp32 gradients, main weights and Adam's two moments
