"""The HF <-> Megatron name map: exact round trips, TP sharding, and loud errors for anything unmapped."""
import json

import pytest
import torch
from safetensors.torch import load_file

import converters as C
from mrl.testing.tiny_models import build_tiny_hf_model

CASES = [("llama", False, 2), ("llama", True, None), ("qwen2", False, None), ("qwen2", True, 1),
         ("qwen3", False, 2), ("qwen3", True, None)]


def _tiny(tmp_path, family, tied, kv, **kw):
    out = build_tiny_hf_model(tmp_path / family, family, tied=tied, num_kv_heads=kv, **kw)
    return load_file(out / "model.safetensors"), json.loads((out / "config.json").read_text())


@pytest.mark.parametrize("family,tied,kv", CASES)
def test_round_trip_is_bit_exact_with_equal_key_sets(tmp_path, family, tied, kv):
    hf, cfg = _tiny(tmp_path, family, tied, kv)
    meg = C.hf_to_megatron(hf, cfg)
    assert meg["embedding.word_embeddings.weight"].shape == (512, 64)  # 500 padded to a multiple of 128
    assert ("output_layer.weight" in meg) == (not tied)
    assert ("decoder.layers.1.self_attention.linear_qkv.bias" in meg) == (family == "qwen2")
    assert ("decoder.layers.0.self_attention.q_layernorm.weight" in meg) == (family == "qwen3")
    back = dict(C.megatron_to_hf(meg, cfg))
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_tp2_shards_gather_to_the_tp1_state_and_follow_split_dims(tmp_path):
    hf, cfg = _tiny(tmp_path, "qwen2", False, 2, intermediate=96)
    full = C.hf_to_megatron(hf, cfg, padded_vocab=512)
    shards = [C.hf_to_megatron(hf, cfg, r, 2) for r in range(2)]
    for name, tensor in full.items():
        rule = C.rule_for(name, cfg)
        assert torch.equal(C.tp_unshard([s[name] for s in shards], rule.tp_dim, gated=rule.gated), tensor), name
    assert shards[0]["decoder.layers.0.self_attention.linear_proj.weight"].shape == (64, 32)  # row parallel
    assert shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 16 // 2, 64)
    assert shards[1]["output_layer.weight"].shape == (256, 64)  # vocab parallel
    # rank 1 holds query group 1: q heads 2, 3, then k head 1, then v head 1
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    expected = torch.cat([q[32:64], k[16:32], v[16:32]])
    assert torch.equal(shards[1]["decoder.layers.0.self_attention.linear_qkv.weight"], expected)
    # rank 0 of fc1 holds its half of gate, then its half of up
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(shards[0]["decoder.layers.1.mlp.linear_fc1.weight"], torch.cat([gate[:48], up[:48]]))


def test_te_names_round_trip(tmp_path):
    hf, cfg = _tiny(tmp_path, "qwen3", False, 2)
    meg = C.hf_to_megatron(hf, cfg, names="te")
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in meg
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in meg
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in meg)
    meg["decoder.layers.0.self_attention.linear_qkv._extra_state"] = None  # TE metadata: skipped, not a weight
    back = dict(C.megatron_to_hf(meg, cfg))
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


def test_unmapped_missing_and_misshapen_hf_tensors_are_named(tmp_path):
    hf, cfg = _tiny(tmp_path, "llama", False, 2)
    with pytest.raises(C.ConversionError, match="model.layers.0.self_attn.extra_scale"):
        C.hf_to_megatron({**hf, "model.layers.0.self_attn.extra_scale": torch.ones(1)}, cfg)
    missing = {k: v for k, v in hf.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(C.ConversionError, match="missing.*model.layers.1.mlp.up_proj.weight"):
        C.hf_to_megatron(missing, cfg)
    bad = {**hf, "model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)}
    with pytest.raises(C.ConversionError, match=r"k_proj.weight has shape \(64, 64\).*\(32, 64\)"):
        C.hf_to_megatron(bad, cfg)
    # rotary inv_freq buffers of older checkpoints are recomputed from the config, so they are accepted
    C.hf_to_megatron({**hf, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}, cfg)


def test_unmapped_and_missing_megatron_tensors_are_named(tmp_path):
    hf, cfg = _tiny(tmp_path, "qwen2", True, None)
    meg = C.hf_to_megatron(hf, cfg)
    with pytest.raises(C.ConversionError, match="decoder.layers.0.mlp.router.weight"):
        list(C.megatron_to_hf({**meg, "decoder.layers.0.mlp.router.weight": torch.ones(2)}, cfg))
    partial = {k: v for k, v in meg.items() if k != "decoder.final_layernorm.weight"}
    with pytest.raises(C.ConversionError, match="model.norm.weight"):
        list(C.megatron_to_hf(partial, cfg))
    assert len(list(C.megatron_to_hf(partial, cfg, require_complete=False))) == len(hf) - 1
    bad = {**meg, "decoder.layers.1.mlp.linear_fc2.weight": torch.zeros(64, 100)}
    with pytest.raises(C.ConversionError, match="linear_fc2.weight gives model.layers.1.mlp.down_proj.weight"):
        list(C.megatron_to_hf(bad, cfg))


def test_tied_embeddings_copies_are_checked(tmp_path):
    hf, cfg = _tiny(tmp_path, "llama", True, 2)
    # a redundant lm_head equal to the embedding is fine; a different one would be lost, so it is an error
    C.hf_to_megatron({**hf, "lm_head.weight": hf["model.embed_tokens.weight"].clone()}, cfg)
    with pytest.raises(C.ConversionError, match="lm_head.weight differs"):
        C.hf_to_megatron({**hf, "lm_head.weight": torch.zeros(500, 64)}, cfg)
    meg = C.hf_to_megatron(hf, cfg)
    meg["output_layer.weight"] = torch.zeros_like(meg["embedding.word_embeddings.weight"])
    with pytest.raises(C.ConversionError, match="output_layer.weight differs"):
        list(C.megatron_to_hf(meg, cfg))


def test_family_detection_and_unsupported_configs():
    assert C.detect_family({"architectures": ["Qwen3ForCausalLM"]}).name == "qwen3"
    assert C.detect_family({"model_type": "llama"}).name == "llama"
    with pytest.raises(C.ConversionError, match=r"MistralForCausalLM.*Supported families: deepseek_v3.*llama.*qwen2.*qwen3.*qwen3_moe"):
        C.detect_family({"architectures": ["MistralForCausalLM"], "model_type": "mistral"})
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}
    with pytest.raises(C.ConversionError, match="attention_bias"):
        C.model_dims({**base, "attention_bias": True})
    with pytest.raises(C.ConversionError, match="rope_type='longrope'"):
        C.model_dims({**base, "rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}})
    with pytest.raises(C.ConversionError, match="partial_rotary_factor"):
        C.model_dims({**base, "partial_rotary_factor": 0.5})
    with pytest.raises(C.ConversionError, match="hidden_act='gelu'"):
        C.model_dims({**base, "hidden_act": "gelu"})
    legacy = C.model_dims({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (legacy.rope_type, legacy.rope_theta, legacy.head_dim, legacy.num_kv_heads) == ("linear", 5e5, 16, 4)


def test_select_pp_stage_renames_layers_and_copies_tied_embedding(tmp_path):
    hf, cfg = _tiny(tmp_path, "qwen2", True, None, layers=3)
    meg = C.hf_to_megatron(hf, cfg)
    first = C.select_pp_stage(meg, 0, 2, pre_process=True, post_process=False, tied=True)
    last = C.select_pp_stage(meg, 2, 1, pre_process=False, post_process=True, tied=True)
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert {C.layer_index(k) for k in first} - {None} == {0, 1}
    assert {C.layer_index(k) for k in last} - {None} == {0}
    assert torch.equal(last["decoder.layers.0.mlp.linear_fc2.weight"], meg["decoder.layers.2.mlp.linear_fc2.weight"])
    assert torch.equal(last["output_layer.weight"], meg["embedding.word_embeddings.weight"])
    assert "decoder.final_layernorm.weight" in last and "embedding.word_embeddings.weight" not in last


def test_one_parameter_at_a_time_builds_the_model_tables_once(tmp_path, monkeypatch):
    """A refit converts one parameter per `megatron_to_hf` call: the rule tables are built once per model, not per
    call (per call a refit was quadratic in the parameter count: hours for DeepSeek-V3), and a model of other
    dimensions gets its own (its shapes, not the first model's)."""
    import converters.mapping as M

    hf, cfg = _tiny(tmp_path, "qwen2", False, 2)
    meg = C.hf_to_megatron(hf, cfg)
    dims = C.model_dims(cfg)
    builds = []
    real = M.param_rules
    monkeypatch.setattr(M, "param_rules", lambda *a, **k: builds.append(a) or real(*a, **k))
    monkeypatch.setattr(M, "_TABLES", [])
    back = {}
    for name, tensor in meg.items():
        back.update(C.megatron_to_hf([(name, tensor)], dims, require_complete=False))
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
    assert len(builds) <= 2  # the local and the TE spec's names, once
    wider_hf, wider_cfg = _tiny(tmp_path / "wider", "qwen2", False, 2, intermediate=96)
    wider = C.hf_to_megatron(wider_hf, wider_cfg)
    name = "decoder.layers.0.mlp.linear_fc2.weight"
    (converted,) = C.megatron_to_hf([(name, wider[name])], C.model_dims(wider_cfg), require_complete=False)
    assert converted[1].shape == wider_hf["model.layers.0.mlp.down_proj.weight"].shape
    with pytest.raises(C.ConversionError, match="shape"):  # the first model's tables would have taken it
        list(C.megatron_to_hf([(name, wider[name])], dims, require_complete=False))
