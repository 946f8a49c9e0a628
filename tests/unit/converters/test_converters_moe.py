"""Qwen3-MoE, Qwen2-MoE (a gated shared expert) and DeepSeek-V3 (MLA) converters: bit-exact round trips in every TP x EP split, HF's fused in-memory
experts, the MTP layer of real checkpoints, what Megatron cannot represent, and the published configs' sizes.

The HF side is transformers itself (tiny random models saved with save_pretrained); the published configs are
fixtures (mrl/_shipped/hf_configs: the config.json files of Qwen3-30B-A3B, Qwen3-235B-A22B and DeepSeek-V3 verbatim;
Qwen1.5-MoE-A2.7B's (Qwen2-MoE) with its published values, cross-checked against several public copies).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import converters as C
from converters.hf_io import load_hf_config, load_hf_state
from mrl.testing.tiny_models import build_tiny_hf_model

CONFIGS = Path(__file__).parents[3] / "mrl" / "_shipped" / "hf_configs"
FAMILIES = {"qwen3_moe": {}, "qwen2_moe": {}, "deepseek_v3": {}, "deepseek_v3-no-q-lora": {"q_lora_rank": None}}


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory) -> Path:
    family = request.param.split("-")[0]
    return build_tiny_hf_model(tmp_path_factory.mktemp(request.param), family, layers=3, **FAMILIES[request.param])


def _assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]


def test_hf_megatron_hf_is_bit_exact_with_equal_keys(tiny):
    hf, config = load_hf_state(tiny), load_hf_config(tiny)
    megatron = C.hf_to_megatron(hf, config)
    dims = C.model_dims(config)
    assert sum(n.count("local_experts") for n in megatron) == dims.moe.num_experts * 2 * sum(dims.moe.layers)
    _assert_same_state(dict(C.megatron_to_hf(megatron, config)), hf)


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2), (2, 2), (1, 4)])
def test_every_tp_x_ep_split_reassembles_exactly(tiny, tp, ep):
    """Each (tp, ep) rank's tensors as the policy loads them; gathered back (TP unshard, experts from their owner
    rank) they give the HF checkpoint again."""
    hf, config = load_hf_state(tiny), load_hf_config(tiny)
    dims = C.model_dims(config)
    per_rank = C.experts_per_rank(dims, ep)
    ranks = {(t, e): C.select_ep_experts(C.hf_to_megatron(hf, config, t, tp), dims, e, ep)
             for t in range(tp) for e in range(ep)}
    full = {}
    for rule in C.param_rules(dims):
        owner = 0 if rule.expert is None else rule.expert // per_rank
        local = C.to_local_expert(rule.megatron, owner, per_rank)
        shards = [ranks[(t, owner)][local] for t in range(tp)]
        full[rule.megatron] = C.tp_unshard(shards, rule.tp_dim, gated=rule.gated)
    _assert_same_state(dict(C.megatron_to_hf(full, config)), hf)


def test_fused_in_memory_experts_convert_like_the_checkpoint(tiny):
    from transformers import AutoModelForCausalLM

    config = load_hf_config(tiny)
    in_memory = AutoModelForCausalLM.from_pretrained(tiny).state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in in_memory)  # transformers 5 fuses them in memory
    _assert_same_state(C.hf_to_megatron(in_memory, config), C.hf_to_megatron(load_hf_state(tiny), config))


def test_mtp_layer_is_dropped_with_a_warning_and_unknown_tensors_are_errors(tmp_path, caplog):
    model = build_tiny_hf_model(tmp_path, "deepseek_v3", layers=2)
    hf, config = load_hf_state(model), load_hf_config(model)
    mtp = {"model.layers.2.eh_proj.weight": torch.zeros(4, 4), "model.layers.2.mlp.gate.weight": torch.zeros(8, 64)}
    with caplog.at_level(logging.WARNING, logger="converters.mapping"):
        converted = C.hf_to_megatron({**hf, **mtp}, config)
    assert "multi-token-prediction layer(s) [2]" in caplog.text
    _assert_same_state(converted, C.hf_to_megatron(hf, config))
    with pytest.raises(C.ConversionError, match="model.layers.1.self_attn.kv_a_extra.weight"):
        C.hf_to_megatron({**hf, "model.layers.1.self_attn.kv_a_extra.weight": torch.zeros(2)}, config)


@pytest.mark.parametrize("change, reason", [
    ({"num_experts_per_tok": 3}, "topk_group = 3 / 1 != 2"),
    ({"norm_topk_prob": False}, "norm_topk_prob=false"),
    ({"rope_interleave": False}, "rope_interleave=false"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
])
def test_what_megatron_cannot_represent_is_refused_with_the_reason(change, reason):
    config = json.loads((CONFIGS / "deepseek-ai--DeepSeek-V3_config.json").read_text())
    config.update(n_group=8, topk_group=1 if "num_experts_per_tok" in change else 4, **change)
    with pytest.raises(C.ConversionError, match=reason.replace("(", r"\(").replace(".", r"\.")):
        C.model_dims(config)


def test_published_configs_read_as_their_papers_describe():
    qwen = C.model_dims(json.loads((CONFIGS / "Qwen--Qwen3-30B-A3B_config.json").read_text()))
    assert (qwen.moe.num_experts, qwen.moe.topk, qwen.moe.ffn_hidden_size, all(qwen.moe.layers)) == (128, 8, 768, True)
    assert (qwen.moe.score_function, qwen.moe.normalize_topk, qwen.mla) == ("softmax", True, None)
    ds = C.model_dims(json.loads((CONFIGS / "deepseek-ai--DeepSeek-V3_config.json").read_text()))
    assert ds.moe.layers[:4] == (False, False, False, True) and sum(ds.moe.layers) == 58
    assert (ds.moe.num_groups, ds.moe.group_topk, ds.moe.scaling_factor, ds.moe.shared_ffn_hidden_size) == \
        (8, 4, 2.5, 2048)
    assert (ds.mla.q_lora_rank, ds.mla.kv_lora_rank, ds.mla.qk_head_dim, ds.rope_type) == (1536, 512, 192, "yarn")


@pytest.mark.parametrize("fixture, billions", [("Qwen--Qwen3-30B-A3B_config.json", 30.53),
                                               ("Qwen--Qwen1.5-MoE-A2.7B_config.json", 14.32),
                                               ("deepseek-ai--DeepSeek-V3_config.json", 671.03)])
def test_megatron_model_of_a_published_config_has_transformers_parameter_count(fixture, billions):
    """Built on the meta device (no memory): the Megatron model the converter targets has exactly the parameters of
    transformers' model of the same config (DeepSeek-V3 without its MTP layer, which transformers does not build)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mrl.model.build import build_model, transformer_config_from_hf
    from mrl.parallel.groups import destroy_process_groups, init_process_groups
    from mrl.parallel.layout import ParallelDims

    config = json.loads((CONFIGS / fixture).read_text())
    config.pop("quantization_config", None)
    init_process_groups(ParallelDims(), seed=0)
    try:
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
            megatron = build_model(config, transformer_config_from_hf(config, perform_initialization=False))
    finally:
        destroy_process_groups()
    count = sum(p.numel() for p in megatron.parameters())
    assert count == sum(p.numel() for p in hf.parameters())
    assert round(count / 1e9, 2) == billions
