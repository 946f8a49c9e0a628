"""A reward model's starting folder: an HF `*ForSequenceClassification` (one label) made from a language model.

`mrl rm` usually starts from a language model (an SFT export): its decoder is kept, its LM head dropped, and a score
head `score.weight` [1, h] drawn from N(0, initializer_range^2) (transformers' initialisation of that head; seeded
by run.seed) is added. The result is written once to `<run.output_dir>/reward_model_init` (config with
`architectures: [<Family>ForSequenceClassification]`, `num_labels: 1`, the tokenizer's pad id) and is what the
policy loads and the final export inherits its config from. A model that already is a reward model is used as it is.
A language model given as a Megatron checkpoint folder is read in the controller's memory (the whole model, as an
HF language model folder would be) to make that new folder.

Where the score is read: at the response's last token, with the end-of-turn token left off (in training batches and
when the reward model scores GRPO rollouts). A response cut at the length limit has no end-of-turn token, so reading
at EOS would score finished and cut responses at different kinds of positions; reading the last content token
treats both alike, and the head sees the answer's final state directly (on the synthetic task a tiny reward model
reading at EOS stayed at chance for 800 steps where this reading reached 0.95 held-out pair accuracy in 600).
transformers reads a sequence's score at its last token that is not the pad token, so given the same tokens (no
end-of-turn token, no pad id inside) it computes the same score (tested to 1e-5).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from converters import is_score_model
from converters.hf_io import copy_model_metadata, load_hf_config, load_hf_state, save_hf_state
from converters.spec import causal_lm_architecture
from mrl.app.model_source import ModelSource

REWARD_MODEL_INIT_DIR = "reward_model_init"
DONE_MARKER = ".complete"


def sequence_classification_config(lm_config: dict, pad_token_id: int | None) -> dict:
    """The config of the reward model built on `lm_config`'s decoder (never tied: it has no LM head)."""
    archs = [causal_lm_architecture(a) for a in lm_config.get("architectures") or []]
    if not archs:
        raise ValueError("the model's config.json names no architecture; cannot make its reward-model variant")
    config = dict(
        lm_config,
        architectures=[a.replace("ForCausalLM", "ForSequenceClassification") for a in archs],
        num_labels=1,
        id2label={"0": "LABEL_0"},
        label2id={"LABEL_0": 0},
        tie_word_embeddings=False,
    )
    if pad_token_id is not None:
        config["pad_token_id"] = pad_token_id
    return config


def score_head(hidden_size: int, std: float, seed: int) -> torch.Tensor:
    """[1, h] score weights, N(0, std^2), reproducible from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, hidden_size, generator=generator) * std


def _lm_state(lm: ModelSource) -> dict[str, torch.Tensor]:
    """The language model's HF-named tensors: its safetensors, or its Megatron checkpoint read in memory."""
    if lm.megatron_dir is None:
        return load_hf_state(lm.config_dir)
    from mrl.app.convert import megatron_hf_state

    return megatron_hf_state(lm.megatron_dir)


def reward_model_source(
    lm: ModelSource, out_dir: Path, *, pad_token_id: int | None, seed: int, name: str = REWARD_MODEL_INIT_DIR
) -> ModelSource:
    """`lm` itself when it is a reward model, else its reward-model variant written as an HF folder to
    `out_dir / name` (once; marked complete last, so an interrupted write is redone). PPO's critic starts the same
    way (`name` critic_init)."""
    config = load_hf_config(lm.config_dir)
    if is_score_model(config):
        return lm
    out = out_dir / name
    if (out / DONE_MARKER).is_file():
        return ModelSource(config_dir=out)
    state = {k: v for k, v in _lm_state(lm).items() if k != "lm_head.weight"}
    rm_config = sequence_classification_config(config, pad_token_id)
    state["score.weight"] = score_head(
        int(config["hidden_size"]), float(config.get("initializer_range", 0.02)), seed
    ).to(state["model.embed_tokens.weight"].dtype)
    save_hf_state(state.items(), out, log=lambda message: None)
    copy_model_metadata(lm.config_dir, out)
    (out / "config.json").write_text(json.dumps(rm_config, indent=2) + "\n")
    (out / DONE_MARKER).write_text("")
    return ModelSource(config_dir=out)
