"""The model a run starts from, its tokenizer and its padded vocabulary.

Model source (`policy.*`):
- `policy.build`: a randomly initialised model of the given size is written once, as an HF folder with the task's
  tokenizer (the arithmetic character tokenizer when `data.arith` is set), to `<run.output_dir>/initial_model`;
- `policy.model_name`: an HF folder (config.json + safetensors + tokenizer), e.g. the previous stage's export, or a
  Megatron checkpoint folder (mrl/app/model_source.py says which is which).
From an HF folder, the policy (Megatron) and the engine (vLLM) both load its weights. From a Megatron folder, each
policy rank reads its slices of the checkpoint (any layout: resharded on load), the tokenizer comes from its hf/
part, and the engine starts from hf/'s config alone (random weights) and is refitted from the policy before anything
else runs, so it never generates from other weights than the policy's and no HF safetensors are written. A command
without a policy (`mrl eval`) starts a frozen one for that refit and stops it after.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from mrl.app.model_source import ModelSource, classify_model_path
from mrl.app.preflight import check_tokenizer_folder
from mrl.config.errors import ConfigError
from mrl.config.schema import ModelBuildConfig, MrlConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

INITIAL_MODEL_DIR = "initial_model"


def _build_tokenizer(cfg: MrlConfig, build: ModelBuildConfig, out: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    kind = build.tokenizer
    if kind == "characters" or (kind == "auto" and cfg.data.arith is not None):
        from mrl.data.arith import build_arith_tokenizer

        tokenizer = build_arith_tokenizer()
        tokenizer.save_pretrained(out)
        return tokenizer
    from mrl.data.tokenizers import build_tokenizer

    build_tokenizer(out)
    return PreTrainedTokenizerFast.from_pretrained(out)


def _family_settings(build: ModelBuildConfig) -> dict[str, Any]:
    """Config keys a family adds to the shared ones."""
    if build.family == "qwen2":
        return {"use_sliding_window": False}
    if build.family == "qwen3_moe":
        return {
            "num_experts": build.num_experts,
            "num_experts_per_tok": build.num_experts_per_tok,
            "moe_intermediate_size": build.moe_intermediate_size,
            "norm_topk_prob": True,
        }
    return {}


def _rope_settings(cfg: MrlConfig, build: ModelBuildConfig) -> dict:
    """max_position_embeddings and rope_parameters of `build`. The native length is the run's sequence length; with
    YaRN max_position_embeddings holds the extended one (transformers derives the factor from it, vLLM its limit),
    with linear scaling the native one (vLLM multiplies it by the factor)."""
    native = max(64, cfg.policy.max_total_sequence_length)
    if build.rope_scaling is None:
        return {"max_position_embeddings": native}
    extended = int(native * build.rope_scaling_factor) if build.rope_scaling == "yarn" else native
    return {
        "max_position_embeddings": extended,
        "rope_parameters": {
            "rope_type": build.rope_scaling,
            "factor": build.rope_scaling_factor,
            "original_max_position_embeddings": native,
        },
    }  # rope_theta: the family's default


def build_initial_model(cfg: MrlConfig, build: ModelBuildConfig, out: Path) -> Path:
    """Write a random-init HF model of `build`'s size (transformers' default init, seeded by run.seed) to `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out  # written by an earlier (interrupted or resumed) run with the same config
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(cfg, build, out)
    if build.vocab_size is not None and build.vocab_size < len(tokenizer):
        raise ConfigError(
            f"policy.build.vocab_size={build.vocab_size} is smaller than the built tokenizer's {len(tokenizer)} tokens",
            key="policy.build.vocab_size",
            given=build.vocab_size,
            allowed=f"at least {len(tokenizer)}, or null (the tokenizer's size)",
            fix=f"policy.build.vocab_size={len(tokenizer)} or more, or remove it",
        )
    config = AutoConfig.for_model(
        build.family,
        vocab_size=build.vocab_size or len(tokenizer),
        hidden_size=build.hidden_size,
        intermediate_size=build.intermediate_size,
        num_hidden_layers=build.num_layers,
        num_attention_heads=build.num_attention_heads,
        num_key_value_heads=build.num_key_value_heads or build.num_attention_heads,
        head_dim=build.head_dim or build.hidden_size // build.num_attention_heads,
        **_rope_settings(cfg, build),
        tie_word_embeddings=build.tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **_family_settings(build),
    )
    torch.manual_seed(cfg.run.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf_logging.disable_progress_bar()  # one tiny shard: a progress bar would be noise
    try:
        model.save_pretrained(out)
    finally:
        hf_logging.enable_progress_bar()
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    return out


def resolve_model(cfg: MrlConfig) -> ModelSource:
    """The model the run starts from (see the module docstring)."""
    if cfg.policy.build is not None:
        return ModelSource(build_initial_model(cfg, cfg.policy.build, Path(cfg.run.output_dir) / INITIAL_MODEL_DIR))
    if not cfg.policy.model_name:
        raise ConfigError(
            "no model to start from",
            key="policy.model_name",
            fix="set policy.model_name (an HF model folder or a Megatron checkpoint folder) or "
            "policy.build (a random model of a given size)",
        )
    return classify_model_path(cfg.policy.model_name, key="policy.model_name")


def policy_padded_vocab(cfg: MrlConfig, source: ModelSource, resume: Optional[int]) -> Optional[int]:
    """The padded vocabulary the policy is built with: the resumed checkpoint's (`resume`), else the Megatron
    source's (Megatron pads to a multiple of 128 x the TP size that wrote it, and the tensor shapes keep that size),
    else None (this TP size's rule). Either must split over policy.parallel.tensor_parallel_size."""
    from mrl.checkpoint.megatron import MODEL_SUBDIR, checkpoint_padded_vocab

    start = None if source.megatron_dir is None else checkpoint_padded_vocab(source.megatron_dir / MODEL_SUBDIR)
    if resume is not None and start is not None and resume != start:
        raise ConfigError(
            f"the checkpoint to resume pads the vocabulary to {resume} rows, the Megatron checkpoint "
            f"the run starts from to {start}",
            key="policy.model_name",
            given=cfg.policy.model_name,
            fix="start from the model the run was started from, or set checkpointing.resume=false",
        )
    padded, tp = resume or start, cfg.policy.parallel.tensor_parallel_size
    if padded is not None and padded % tp:
        raise ConfigError(
            f"the checkpoint's vocabulary is padded to {padded} rows, which do not split over {tp} "
            "tensor-parallel ranks",
            key="policy.parallel.tensor_parallel_size",
            given=tp,
            fix="use a tensor parallel size that divides it (any that divides the size it was written with)",
        )
    return padded


def load_tokenizer(cfg: MrlConfig, source: ModelSource) -> "PreTrainedTokenizerBase":
    """policy.tokenizer's, else the model folder's (checked to hold one first: mrl/app/preflight.py)."""
    from mrl.data.tokenizers import load_tokenizer as load

    folder = cfg.policy.tokenizer or source.config_dir
    check_tokenizer_folder(folder, "policy.tokenizer" if cfg.policy.tokenizer else "policy.model_name")
    return load(folder)
