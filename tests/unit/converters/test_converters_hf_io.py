"""HF folder reading/writing: sharding with an index, and clear errors for missing or corrupt files."""
import json

import pytest
import torch
from safetensors.torch import save_file

from converters import ConversionError
from converters.hf_io import copy_model_metadata, load_hf_config, load_hf_state, save_hf_state
from mrl.testing.tiny_models import build_tiny_hf_model


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(100, 10, generator=g) for i in range(5)}  # 4000 bytes each


def test_save_shards_above_threshold_and_reads_back(tmp_path):
    tensors = _tensors()
    files = save_hf_state(tensors.items(), tmp_path, max_shard_bytes=9000, log=lambda m: None)
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 4000
    assert index["weight_map"]["t0"] == "model-00001-of-00003.safetensors"
    assert index["weight_map"]["t4"] == "model-00003-of-00003.safetensors"
    back = load_hf_state(tmp_path)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    assert not list(tmp_path.glob(".part-*"))


def test_single_file_below_threshold_and_views_sharing_memory(tmp_path):
    fused = torch.arange(12.0).reshape(6, 2)
    q, k = fused[:4], fused[4:]  # views of one storage, as split_qkv can return for one query group
    save_hf_state([("q", q), ("k", k)], tmp_path, log=lambda m: None)
    assert not (tmp_path / "model.safetensors.index.json").exists()
    back = load_hf_state(tmp_path)
    assert torch.equal(back["q"], q) and torch.equal(back["k"], k)


def test_missing_and_corrupt_files_are_named(tmp_path):
    with pytest.raises(ConversionError, match="config.json not found"):
        load_hf_config(tmp_path)
    with pytest.raises(ConversionError, match="no model.safetensors"):
        load_hf_state(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConversionError, match="not valid JSON"):
        load_hf_config(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    with pytest.raises(ConversionError, match="model.safetensors.*corrupt"):
        load_hf_state(tmp_path)


def test_index_naming_absent_file_or_tensor(tmp_path):
    save_file({"a": torch.ones(2)}, str(tmp_path / "s1.safetensors"))
    index = {"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConversionError, match=r"lacks tensor\(s\) \['b'\]"):
        load_hf_state(tmp_path)
    index["weight_map"]["b"] = "s2.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConversionError, match="s2.safetensors not found"):
        load_hf_state(tmp_path)


def test_copy_model_metadata_copies_config_and_tokenizer_not_weights(tmp_path):
    src = build_tiny_hf_model(tmp_path / "src", "llama")
    copied = copy_model_metadata(src, tmp_path / "dst")
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(copied)
    assert "model.safetensors" not in copied
