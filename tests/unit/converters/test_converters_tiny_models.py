"""The shared tiny-model fixtures: deterministic, loadable by transformers, shaped as asked."""
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from mrl.testing.tiny_models import build_tiny_hf_model, read_config


def test_same_seed_same_weights_other_seed_differs(tmp_path):
    a = load_file(build_tiny_hf_model(tmp_path / "a", "qwen2", seed=3) / "model.safetensors")
    b = load_file(build_tiny_hf_model(tmp_path / "b", "qwen2", seed=3) / "model.safetensors")
    c = load_file(build_tiny_hf_model(tmp_path / "c", "qwen2", seed=4) / "model.safetensors")
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_gqa_tied_qwen3_loads_and_logits_are_not_uniform(tmp_path):
    out = build_tiny_hf_model(tmp_path, "qwen3", tied=True, num_kv_heads=2, vocab=509)
    cfg = read_config(out)
    assert cfg["num_key_value_heads"] == 2 and cfg["tie_word_embeddings"] and cfg["vocab_size"] == 509
    tensors = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in tensors
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token_id == cfg["eos_token_id"] and tok.pad_token_id is not None
    ids = tok("what is 3 plus 4?", return_tensors="pt").input_ids
    probs = model(ids).logits.softmax(-1)
    assert probs.max() > 5.0 / cfg["vocab_size"]  # far from uniform: comparisons between implementations mean something
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
