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

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "deepseek_v3")

#: Family settings of the tiny MoE models (any of them can be overridden). The experts are small and few; DeepSeek-V3
#: keeps its structure: a dense first layer, 2 groups of experts with top-1 group routing (top-2 experts, so a group
#: scores by its top 2 as in DeepSeek-V3 itself), a shared expert, a q LoRA, YaRN rope with mscale, and the router
#: keys vLLM needs (`topk_method`, `scoring_func`; transformers 5 does not write them).
MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    "qwen2_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    "deepseek_v3": dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ),
}


def _make_config(family: str, kwargs: dict[str, Any]) -> Any:
    """The transformers config object of `family` built from `kwargs`."""
    from transformers import AutoConfig

    if family not in SUPPORTED_FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {SUPPORTED_FAMILIES}")
    return AutoConfig.for_model(family, **kwargs)


def _init_weights(model: torch.nn.Module, std: float, seed: int) -> None:
    """Matrices ~ N(0, std); norm weights ~ 1 + N(0, 0.1) and biases ~ N(0, std) so none is a trivial constant;
    DeepSeek-V3's expert selection bias (a buffer) ~ N(0, 0.1), so it changes which experts are chosen."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(std * noise)
        for name, buffer in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen, dtype=torch.float32))


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
    """Build a random tiny causal LM of `family` (`SUPPORTED_FAMILIES`) and save it in `out_dir`.

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
    if family == "deepseek_v3":
        del kwargs["head_dim"]  # DeepSeek-V3's config derives it: head_dim is the rotary part (qk_rope_head_dim)
    kwargs.update(MOE_DEFAULTS.get(family, {}))
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


def hf_token_logprobs(model_dir: str | Path, ids: list[int]) -> torch.Tensor:
    """log p(token t | tokens < t) for t = 1..len-1 under HF transformers (fp32): the reference for `mrl score`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
