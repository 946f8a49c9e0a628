"""Megatron side of the converters, on real ranks (CPU, gloo, fp32), for every family tied/untied, GQA/MHA.

- TP=1: HF -> Megatron checkpoint -> HF reproduces every tensor bit for bit (equal key sets, sharded export with
  an index); Megatron logits (from HF weights and from the checkpoint) equal transformers' to <= 1e-5; the
  exported folder loads with AutoModelForCausalLM and gives the original logits exactly.
- TP=2 (2 ranks): logits equal transformers'; a checkpoint converted at TP=1 loads at TP=2 and one converted at
  TP=2 loads at TP=1, both with the same logits; the TP=2 checkpoint exports back bit for bit.
- Mixture of experts (Qwen3-MoE, DeepSeek-V3 with MLA): checkpoints written at TP1, EP2 and TP2 x EP2 (1, 2 and 4
  ranks, experts saved by the rank that holds them) export back bit for bit, and load at TP1 with HF's logits.

Each test runs its steps in fresh rank processes (`run_on_ranks`); the rank-side code is `run_plan_on_rank`.
A step is one of
  {"op": "forward_hf", "hf": dir, "tp": n, "out": file}      logits of the model built from HF weights
  {"op": "forward_ckpt", "meg": dir, "hf": dir, "tp": n, "out": file}   logits after loading a Megatron checkpoint
  {"op": "hf_to_megatron", "hf": dir, "meg": dir, "tp": n}   converters.convert.hf_to_megatron (world = tp or a multiple)
  {"op": "megatron_to_hf", "meg": dir, "out": dir}           converters.convert.megatron_to_hf
Rank-side logits are gathered over TP and cut to the real vocabulary: [B, T, V] float32, saved by rank 0.
"""

from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from converters.hf_io import load_hf_state
from mrl.testing.distributed import run_on_ranks
from mrl.testing.tiny_models import build_tiny_hf_model

TOL = 1e-5


# ---- rank side ----


def _forward(model, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    model.eval()
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)  # [B, T]
    with torch.no_grad():
        logits = model(tokens, positions, None)  # [B, T, V_padded / tp]
        logits = gather_from_tensor_model_parallel_region(logits)  # [B, T, V_padded]
    return logits[..., :vocab].contiguous()


def _save(tensor: torch.Tensor, path: str) -> None:
    if torch.distributed.get_rank() == 0:
        torch.save(tensor, path)


def _build(hf_dir: str, tp: int, padded_vocab: int | None):
    from mrl.app import convert
    from converters.hf_io import load_hf_config
    from mrl.model.build import build_model, transformer_config_from_hf

    from megatron.core import parallel_state

    convert.init_parallel(tp, 1)
    assert parallel_state.get_tensor_model_parallel_world_size() == tp
    config = load_hf_config(hf_dir)
    model = build_model(config, transformer_config_from_hf(config, tensor_parallel=tp), padded_vocab=padded_vocab)
    return model, config


def run_step(step: dict, tokens: torch.Tensor) -> None:
    from mrl.app import convert
    from converters.hf_io import load_hf_state
    from mrl.model.build import load_hf_weights

    op = step["op"]
    if op == "forward_hf":
        model, config = _build(step["hf"], step["tp"], None)
        load_hf_weights(model, load_hf_state(step["hf"]), config)
        _save(_forward(model, tokens, config["vocab_size"]), step["out"])
    elif op == "forward_ckpt":
        model_dir = f"{step['meg']}/{convert.MODEL_SUBDIR}"
        model, config = _build(step["hf"], step["tp"], convert.checkpoint_padded_vocab(model_dir))
        convert.load_megatron_checkpoint(model, model_dir)
        _save(_forward(model, tokens, config["vocab_size"]), step["out"])
    elif op == "hf_to_megatron":
        convert.hf_to_megatron(step["hf"], step["meg"], tp=step["tp"], ep=step.get("ep", 1))
    elif op == "megatron_to_hf":
        convert.megatron_to_hf(step["meg"], step["out"], max_shard_bytes=step.get("max_shard_bytes", 5 * 1024**3))
    else:
        raise ValueError(f"unknown op {op}")


def run_plan_on_rank(tokens: torch.Tensor, steps: list[dict]) -> None:
    for step in steps:
        run_step(step, tokens)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# ---- test side ----

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
#: YaRN past the native length: the test's 24 tokens exceed original_max_position_embeddings
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16}
#: (name, family, tied, kv heads (None = MHA), config overrides): every family, tied and untied, GQA and MHA.
VARIANTS = [
    ("llama_gqa_llama3rope", "llama", False, 2, {"rope_parameters": LLAMA3_ROPE}),
    ("llama_tied_mha", "llama", True, None, {}),
    ("qwen2_mha", "qwen2", False, None, {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6,
                                                              "factor": 2.0}}),
    ("qwen2_tied_gqa", "qwen2", True, 2, {}),
    ("qwen3_gqa_yarn", "qwen3", False, 2, {"rms_norm_eps": 1e-5, "rope_parameters": YARN_ROPE}),
    ("qwen3_tied_mha", "qwen3", True, None, {}),
]


def build_variants(root: Path) -> dict[str, Path]:
    return {name: build_tiny_hf_model(root / name, fam, tied=tied, num_kv_heads=kv, seed=i, **ov)
            for i, (name, fam, tied, kv, ov) in enumerate(VARIANTS)}


def sample_tokens(vocab: int = 500) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))  # [B, T]


def hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits  # [B, T, V]


def run_plan(tokens: torch.Tensor, steps: list[dict], nproc: int, timeout_s: float = 240.0) -> None:
    """Run the worker steps on `nproc` ranks (fresh processes, torchrun environment, OMP_NUM_THREADS=1)."""
    run_on_ranks(run_plan_on_rank, world_size=nproc, args=(tokens, steps), timeout_s=timeout_s,
                 env={"TOKENIZERS_PARALLELISM": "false"})


def test_tp1_forward_and_round_trip_every_variant(tmp_path):
    models = build_variants(tmp_path / "hf")
    tokens = sample_tokens()
    steps = []
    for name, src in models.items():
        meg, back = tmp_path / "meg" / name, tmp_path / "back" / name
        steps += [{"op": "forward_hf", "hf": str(src), "tp": 1, "out": str(tmp_path / f"{name}.hf.pt")},
                  {"op": "hf_to_megatron", "hf": str(src), "meg": str(meg), "tp": 1},
                  {"op": "forward_ckpt", "meg": str(meg), "hf": str(src), "tp": 1,
                   "out": str(tmp_path / f"{name}.ckpt.pt")},
                  # a small shard limit: the export is split into several files with an index
                  {"op": "megatron_to_hf", "meg": str(meg), "out": str(back), "max_shard_bytes": 150_000}]
    run_plan(tokens, steps, 1)
    for name, src in models.items():
        reference = hf_logits(src, tokens)
        for source in ("hf", "ckpt"):
            ours = torch.load(tmp_path / f"{name}.{source}.pt")
            assert ours.shape == reference.shape
            assert (ours - reference).abs().max().item() <= TOL, (name, source)
        original, back = load_file(src / "model.safetensors"), load_hf_state(tmp_path / "back" / name)
        assert original.keys() == back.keys(), name
        for key, tensor in original.items():
            assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), (name, key)
        assert (tmp_path / "back" / name / "model.safetensors.index.json").is_file()
        # the exported folder is a complete HF model: same logits bit for bit, tokenizer alongside
        assert torch.equal(hf_logits(tmp_path / "back" / name, tokens), reference), name
        for file in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            assert (tmp_path / "back" / name / file).is_file(), (name, file)
    assert len(models) == len(VARIANTS)


def test_tp2_forward_and_cross_tp_checkpoints(tmp_path):
    models = build_variants(tmp_path / "hf")
    tokens = sample_tokens()
    steps = []
    for name, src in models.items():
        meg1, meg2 = str(tmp_path / "meg1" / name), str(tmp_path / "meg2" / name)
        out = lambda tag: str(tmp_path / f"{name}.{tag}.pt")  # noqa: E731
        steps += [
            {"op": "forward_hf", "hf": str(src), "tp": 2, "out": out("hf_tp2")},
            {"op": "hf_to_megatron", "hf": str(src), "meg": meg1, "tp": 1},  # written by 2 data-parallel replicas
            {"op": "hf_to_megatron", "hf": str(src), "meg": meg2, "tp": 2},  # each rank writes its TP shard
            {"op": "forward_ckpt", "meg": meg1, "hf": str(src), "tp": 2, "out": out("tp1_ckpt_at_tp2")},
            {"op": "forward_ckpt", "meg": meg2, "hf": str(src), "tp": 1, "out": out("tp2_ckpt_at_tp1")},
            {"op": "megatron_to_hf", "meg": meg2, "out": str(tmp_path / "back" / name)},
        ]
    run_plan(tokens, steps, 2)
    for name, src in models.items():
        reference = hf_logits(src, tokens)
        for tag in ("hf_tp2", "tp1_ckpt_at_tp2", "tp2_ckpt_at_tp1"):
            ours = torch.load(tmp_path / f"{name}.{tag}.pt")
            assert ours.shape == reference.shape
            assert (ours - reference).abs().max().item() <= TOL, (name, tag)
        original, back = load_file(src / "model.safetensors"), load_hf_state(tmp_path / "back" / name)
        assert original.keys() == back.keys(), name
        assert all(torch.equal(back[k], original[k]) for k in original), name


def test_moe_checkpoints_written_under_expert_parallelism_export_bit_exact(tmp_path):
    models = {fam: build_tiny_hf_model(tmp_path / "hf" / fam, fam, layers=2, seed=11)
              for fam in ("qwen3_moe", "deepseek_v3")}
    tokens = sample_tokens()
    layouts = {"tp1": (1, {"tp": 1}), "tp1_ep2": (2, {"tp": 1, "ep": 2}), "tp2_ep2": (4, {"tp": 2, "ep": 2})}
    writes = {tag: [{"op": "hf_to_megatron", "hf": str(src), "meg": str(tmp_path / tag / fam), **layout}
                    for fam, src in models.items()] for tag, (_, layout) in layouts.items()}
    for tag, (world, _) in layouts.items():
        if world > 1:
            run_plan(tokens, writes[tag], world, timeout_s=400)
    steps = list(writes["tp1"])  # the single-process checkpoints, then every checkpoint read back, in one process
    for tag in layouts:
        for fam, src in models.items():
            meg = str(tmp_path / tag / fam)
            steps += [{"op": "megatron_to_hf", "meg": meg, "out": str(tmp_path / "back" / tag / fam)},
                      {"op": "forward_ckpt", "meg": meg, "hf": str(src), "tp": 1,
                       "out": str(tmp_path / f"{tag}.{fam}.pt")}]
    run_plan(tokens, steps, 1)
    for fam, src in models.items():
        original, reference = load_file(src / "model.safetensors"), hf_logits(src, tokens)
        for tag in layouts:
            back = load_hf_state(tmp_path / "back" / tag / fam)
            assert original.keys() == back.keys(), (tag, fam)
            assert all(torch.equal(back[k], original[k]) for k in original), (tag, fam)
            assert (torch.load(tmp_path / f"{tag}.{fam}.pt") - reference).abs().max().item() <= TOL, (tag, fam)
