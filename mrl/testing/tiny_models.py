"""Tiny Hugging Face models and tokenizers built locally, for tests and CPU demos.

No hub downloads are possible on the project's machines, so every test that needs "a real checkpoint" builds one
here: a byte-level BPE tokenizer trained on a fixed corpus with the `tokenizers` library, and a randomly initialised
Llama / Qwen2 / Qwen3 causal LM saved with `save_pretrained` (fp32 safetensors, config.json,
generation_config.json) next to the tokenizer files. Everything is deterministic given `seed`.

Weights are drawn with a larger std than HF's default 0.02 (`init_std=0.15`) so that logits are far from uniform
and numerical comparisons between implementations actually test something.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mrl.data.tokenizers import build_tokenizer

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3")


def _make_config(family: str, kwargs: dict[str, Any]) -> Any:
    """The transformers config object of `family` built from `kwargs`."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    if family not in classes:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {SUPPORTED_FAMILIES}")
    return classes[family](**kwargs)


def _init_weights(model: torch.nn.Module, std: float, seed: int) -> None:
    """Matrices ~ N(0, std); norm weights ~ 1 + N(0, 0.1) and biases ~ N(0, std) so none is a trivial constant."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(std * noise)


def build_tiny_hf_model(
    out_dir: str | Path,
    family: str = "qwen2",
    *,
    tied: bool = False,
    num_kv_heads: int | None = None,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    intermediate: int = 128,
    vocab: int | None = None,
    seed: int = 0,
    init_std: float = 0.15,
    **overrides: Any,
) -> Path:
    """Build a random tiny causal LM of `family` ("llama" | "qwen2" | "qwen3") and save it in `out_dir`.

    `num_kv_heads=None` means MHA (= heads); fewer gives GQA. `vocab=None` uses the tokenizer's size (a tokenizer
    is always built into `out_dir`); a larger `vocab` leaves unused rows, as real checkpoints often do.
    `overrides` go to the transformers config (e.g. `rope_parameters`, `rms_norm_eps`, `head_dim`,
    `max_position_embeddings`). Saved in fp32. Returns `out_dir`.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    out = Path(out_dir)
    build_tokenizer(out)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out)
    vocab_size = len(tokenizer) if vocab is None else vocab
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab={vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        # Qwen2Config defaults to 32 kv heads in transformers 5: always set it explicitly.
        num_key_value_heads=heads if num_kv_heads is None else num_kv_heads,
        # Qwen3Config defaults head_dim to 128 whatever the hidden size: derive it unless overridden.
        head_dim=hidden // heads,
        intermediate_size=intermediate,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    if family == "qwen2":
        kwargs["use_sliding_window"] = False
    kwargs.update(overrides)
    config = _make_config(family, kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, init_std, seed)
    if tied:
        model.tie_weights()
    model.save_pretrained(out)
    GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id
    ).save_pretrained(out)
    return out


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """config.json of a saved model as a dict."""
    return json.loads((Path(model_dir) / "config.json").read_text())
