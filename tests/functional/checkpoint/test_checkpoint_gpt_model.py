"""A checkpoint mrl wrote before its models became HybridModels (a GPTModel's, `decoder.final_layernorm`, one layer
index per transformer layer) loads into today's model: every weight lands on its hybrid name
(`mrl.model.hybrid.to_hybrid`), through megatron-core's GPT -> hybrid interoperation, as starting weights
(`load_megatron_checkpoint`) and from a step folder (`load_megatron_state`, weights only); and the two models give
the same logits to the bit."""

from __future__ import annotations

from mrl.testing.distributed import run_on_ranks
from mrl.testing.tiny_models import build_tiny_hf_model


# ---- rank side: imported by each rank process of run_on_ranks ----


def _gpt_checkpoint(hf_dir: str, step):
    """Write a GPTModel's checkpoint of the HF model into step/model; (the GPTModel, its weights by GPT name)."""
    import copy
    import json
    from pathlib import Path

    from megatron.core.models.gpt import GPTModel
    from safetensors.torch import load_file

    from converters import hf_to_megatron, model_dims, resolve_padded_vocab
    from mrl.checkpoint.megatron import MODEL_SUBDIR, save_sharded
    from mrl.model.build import rope_inv_freq, transformer_config_from_hf
    from mrl.parallel.attention import gpt_layer_spec

    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    dims = model_dims(cfg)
    config = copy.copy(transformer_config_from_hf(cfg))
    config.num_layers = dims.num_layers  # GPTModel counts transformer layers
    vocab = resolve_padded_vocab(dims, 1, None)  # as mrl pads it
    model = GPTModel(config, gpt_layer_spec(config, use_te=False), vocab_size=vocab,
                     max_sequence_length=dims.max_position_embeddings, position_embedding_type="rope",
                     rotary_base=dims.rope_theta, share_embeddings_and_output_weights=dims.tied)
    model.rotary_pos_emb.inv_freq = rope_inv_freq(dims)  # HF's frequencies, as mrl's build installs them
    model.load_state_dict(hf_to_megatron(load_file(str(Path(hf_dir) / "model.safetensors")), dims, 0, 1,
                                         padded_vocab=vocab, names="local"), strict=False)
    (step / MODEL_SUBDIR).mkdir(parents=True)
    save_sharded(model.sharded_state_dict(), step / MODEL_SUBDIR)
    return model, {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def _logits(model):
    import torch

    ids = torch.randint(2, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.eval()(ids, torch.arange(12).expand(2, 12), None)


def _differences(model, gpt_weights: dict) -> list[str]:
    """The GPT names whose weight the model lacks or holds another value of."""
    import torch

    from mrl.model.hybrid import to_gpt

    own = {to_gpt(k): v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    return sorted(set(own) ^ set(gpt_weights)) + [k for k in own if k in gpt_weights and
                                                   not torch.equal(own[k], gpt_weights[k])]


def gpt_checkpoint_loads(hf_dir: str, root: str) -> dict:
    import json
    from pathlib import Path

    from mrl.checkpoint.megatron import MODEL_SUBDIR, load_megatron_checkpoint, load_megatron_state
    from mrl.cpu import megatron_patches
    from mrl.model.build import build_model, transformer_config_from_hf
    from mrl.parallel.groups import destroy_process_groups, init_process_groups
    from mrl.parallel.layout import ParallelDims

    megatron_patches.apply()
    init_process_groups(ParallelDims(), seed=1234)
    step = Path(root) / "step_2"
    gpt, gpt_weights = _gpt_checkpoint(hf_dir, step)
    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    starting = build_model(cfg, transformer_config_from_hf(cfg))
    load_megatron_checkpoint(starting, step / MODEL_SUBDIR)
    resumed = build_model(cfg, transformer_config_from_hf(cfg))
    report = load_megatron_state(step, [resumed], None, None, load_optimizer=False)
    logits_gap = float((_logits(starting) - _logits(gpt)).abs().max())
    destroy_process_groups()
    return dict(starting=_differences(starting, gpt_weights), step_folder=_differences(resumed, gpt_weights),
                note=report.note, compared=len(gpt_weights), logits_gap=logits_gap)


# ---- test side ----


def test_a_gpt_model_checkpoint_loads_into_the_hybrid_model(tmp_path):
    # Qwen3: q/k norms inside attention; tied: the GPT checkpoint has no output layer
    hf_dir = build_tiny_hf_model(tmp_path / "hf", "qwen3", num_kv_heads=2, layers=3, tied=True)
    result = run_on_ranks(gpt_checkpoint_loads, world_size=1, args=(str(hf_dir), str(tmp_path)))[0]
    assert result["compared"] > 10
    assert result["starting"] == [] and result["step_folder"] == [], result
    assert result["note"] == "weights only"
    assert result["logits_gap"] == 0.0  # the same forward: GPT layer i is hybrid layers 2i and 2i+1
