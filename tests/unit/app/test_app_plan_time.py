"""`mrl plan`'s step-time estimate (mrl/app/plan_time.py): active parameters against the published figures (Qwen3-
30B-A3B: 3.3B activated; DeepSeek-V3: 37B), and each phase of the DeepScaleR 8K recipe on an H100 computed by hand
from the module's stated model and the default assumptions."""

from __future__ import annotations

import json

import pytest

from converters.spec import model_dims
from mrl.app.plan import SHIPPED_CONFIGS, make_plan
from mrl.app.plan_time import active_params
from mrl.config import load_config
from mrl.config.recipes import RECIPES


def published(name: str):
    config = json.loads((SHIPPED_CONFIGS / f"{name}_config.json").read_text())
    config.pop("quantization_config", None)
    return model_dims(config)


def test_active_parameters_match_the_published_counts():
    # the model cards' figures are truncated: "3.3B activated" (3.35B with the embedding and output layer), "37B"
    assert active_params(published("Qwen--Qwen3-30B-A3B")) // 10**8 == 33
    assert active_params(published("deepseek-ai--DeepSeek-V3")) // 10**9 == 37
    dense = published("deepseek-ai--DeepSeek-R1-Distill-Qwen-1.5B")
    assert active_params(dense) == 1_777_088_000


def test_the_deepscaler_8k_step_by_hand():
    plan = make_plan(load_config(RECIPES / "grpo-deepscaler-1.5b-8K.yaml"))
    n, layers, heads, head_dim = 1_777_088_000, 28, 12, 128
    mean = 256 + 0.5 * 7680                              # prompt + half of max_new_tokens
    sequences = 128 * 8                                  # prompts x samples
    attention = 2 * layers * heads * head_dim * mean     # FLOPs a token, causal QK^T and AV
    rate = 8 * 989e12 * 0.35                             # 8 H100s at 35% of the bf16 peak
    assert plan.time.train == pytest.approx(sequences * mean * (8 * n + 4 * attention) / rate)  # recompute on
    assert plan.time.logprobs == pytest.approx(sequences * mean * (2 * n + attention) / rate)  # kl_beta 0: one pass
    weights = n * 2                                      # one engine of TP 1 a GPU, bf16
    # every HF tensor broadcast over the 8 ranks of one node, then each engine GPU's weights loaded by CUDA IPC
    assert plan.time.refit == pytest.approx(weights / (150 * 2**30) + weights / (200 * 2**30))
    # 8 engines x 128 sequences each; the KV cache holds 1,590,768 // (256 + 7680) = 200 at once: one wave
    kv_token = layers * 2 * 2 * head_dim * 2             # K and V of 2 KV heads, bf16
    step = (weights + 128 * mean * kv_token) / (3.35e12 * 0.6)
    prefill = 128 * 256 * 2 * n / (989e12 * 0.35)
    assert plan.engine.kv_tokens == 1_590_768
    assert plan.time.generation == pytest.approx(7680 * step + prefill)
    assert plan.time.total == pytest.approx(plan.time.generation + plan.time.logprobs + plan.time.train +
                                            plan.time.refit)


def test_the_refit_broadcast_crosses_nodes_at_the_cluster_rate():
    v3 = make_plan(load_config(RECIPES / "grpo-deepseek-v3-32n8g.yaml"))  # 256 ranks on 32 nodes
    assert v3.time.refit == pytest.approx(v3.engine.weights / (200 * 2**30) + v3.refit.total / (40 * 2**30))
    assert v3.time.refit > 30  # 1250 GiB over InfiniBand
    alone = make_plan(load_config(RECIPES / "grpo-deepscaler-1.5b-8K.yaml", ["cluster.devices_per_node=1"]))
    assert alone.time.refit == pytest.approx(alone.engine.weights / (200 * 2**30))  # one GPU: nothing to broadcast


def test_assume_replaces_a_rate():
    cfg = load_config(RECIPES / "grpo-deepscaler-1.5b-8K.yaml")
    base, faster = make_plan(cfg), make_plan(cfg, assume=["mfu=0.7"])
    assert faster.time.train == pytest.approx(base.time.train / 2)
