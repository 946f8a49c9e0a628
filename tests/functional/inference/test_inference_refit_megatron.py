"""End to end at policy TP2: a Megatron policy trained a few steps, its weights exported to HF names and refit into
vLLM; the engine's logprobs of its own samples must equal the TP2 policy's logprobs of the same tokens (<= 1e-4,
token_mult_prob_error <= 1.0001), and differ from the untrained model's.

Rank side (2 gloo ranks, fresh processes): build the policy at TP2 from the HF model, 3 SGD steps on random tokens
(vocab-parallel cross entropy), save a reshardable Megatron checkpoint, export it to HF names with the converters;
later, load that checkpoint at TP2 again and score the engine's samples. Test side: refit + generate.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from mrl.inference import SamplingConfig  # noqa: E402
from mrl.objectives.mismatch import mismatch_metrics  # noqa: E402
from mrl.testing.distributed import run_on_ranks  # noqa: E402
from mrl.testing.tiny_models import build_tiny_hf_model  # noqa: E402

TP = 2
TOL = 1e-4
MODEL_KW = dict(family="qwen2", hidden=128, heads=4, num_kv_heads=2, intermediate=256, layers=2)
PROMPTS = [[5, 17, 42, 8], [9, 10, 11], [100, 3, 77, 21, 60, 4]]


# ---- rank side ----


def _build_policy(hf_dir: str, padded_vocab: int | None):
    from mrl.app import convert
    from converters.hf_io import load_hf_config
    from converters.mapping import resolve_padded_vocab
    from converters.spec import model_dims
    from mrl.model.build import build_model, transformer_config_from_hf

    convert.init_parallel(TP, 1)
    config = load_hf_config(hf_dir)
    padded = padded_vocab or resolve_padded_vocab(model_dims(config), TP, None)
    model = build_model(config, transformer_config_from_hf(config, tensor_parallel=TP), padded_vocab=padded)
    return model, config, padded


def train_export_on_rank(hf_dir: str, meg_dir: str, export_dir: str) -> None:
    """3 SGD steps at TP2, then a Megatron checkpoint (converters' layout) and its HF export."""
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from mrl.app import convert
    from converters.hf_io import copy_model_metadata, load_hf_state
    from mrl.model.build import load_hf_weights

    model, config, padded = _build_policy(hf_dir, None)
    load_hf_weights(model, load_hf_state(hf_dir), config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    tokens = torch.randint(3, config["vocab_size"], (4, 17), generator=torch.Generator().manual_seed(0))  # [B, T+1]
    positions = torch.arange(16).unsqueeze(0).expand(4, 16)
    for _ in range(3):
        logits = model(tokens[:, :-1], positions, None)  # [B, T, V_padded / TP]
        loss = vocab_parallel_cross_entropy(logits.float(), tokens[:, 1:]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    out = Path(meg_dir)
    if torch.distributed.get_rank() == 0:
        (out / convert.MODEL_SUBDIR).mkdir(parents=True)
        copy_model_metadata(hf_dir, out / convert.HF_SUBDIR)
        meta = {"family": config["model_type"], "padded_vocab_size": padded, "written_with": {"tp": TP, "pp": 1}}
        (out / convert.META_FILE).write_text(json.dumps(meta))
    torch.distributed.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(out / convert.MODEL_SUBDIR))
    torch.distributed.barrier()
    convert.megatron_to_hf(meg_dir, export_dir)  # TP1 on every rank (resharded load), rank 0 writes
    torch.distributed.destroy_process_group()


def score_on_rank(hf_dir: str, meg_dir: str, sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]:
    """Policy logprobs (TP2, loaded from the checkpoint) of each response token given its prompt."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from mrl.app import convert

    model_dir = f"{meg_dir}/{convert.MODEL_SUBDIR}"
    model, config, _ = _build_policy(hf_dir, convert.checkpoint_padded_vocab(model_dir))
    convert.load_megatron_checkpoint(model, model_dir)
    model.eval()
    scores = []
    with torch.no_grad():
        for prompt, response in sequences:
            ids = torch.tensor([prompt + response])  # [1, P + R]
            logits = model(ids, torch.arange(ids.shape[1]).unsqueeze(0), None)  # [1, P + R, V_padded / TP]
            logits = gather_from_tensor_model_parallel_region(logits)[0, :, : config["vocab_size"]]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            positions = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
            scores.append(logprobs[positions, torch.tensor(response)].tolist())
    torch.distributed.destroy_process_group()
    return scores


# ---- test side ----


def test_refit_from_tp2_policy_matches_policy_logprobs(tmp_path):
    from converters.hf_io import load_hf_state
    from mrl.inference.vllm_backend import VllmBackend, VllmEngineConfig

    hf_dir = build_tiny_hf_model(tmp_path / "hf", seed=0, **MODEL_KW)
    meg_dir, export_dir = tmp_path / "meg", tmp_path / "export"
    run_on_ranks(train_export_on_rank, world_size=TP, args=(str(hf_dir), str(meg_dir), str(export_dir)),
                 timeout_s=240)
    trained = load_hf_state(export_dir)

    backend = VllmBackend(VllmEngineConfig(model_path=str(hf_dir), max_model_len=64, kv_cache_bytes=64 << 20))
    try:
        stats = backend.update_weights(trained.items())
        out = backend.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=10, seed=3))
    finally:
        backend.shutdown()
    assert stats.num_tensors == len(trained)

    sequences = [(s.prompt_token_ids, s.token_ids) for s in out.samples]
    policy = run_on_ranks(score_on_rank, world_size=TP, args=(str(hf_dir), str(meg_dir), sequences),
                          timeout_s=240)[0]
    ids, gen = out.padded_tokens(pad_token_id=0)
    train = torch.zeros_like(gen)
    for row, scores in enumerate(policy):
        train[row, : len(scores)] = torch.tensor(scores)
    mask = (torch.arange(ids.shape[1]) < out.lengths()[:, None]).float()
    metrics = mismatch_metrics(gen, train, mask)
    print(f"TP{TP} policy vs vLLM after refit: {metrics}; refit {1000 * stats.seconds:.1f} ms")
    assert metrics["max_abs_logprob_error"] <= TOL, metrics
    assert metrics["token_mult_prob_error"] <= 1.0001, metrics
    # Training moved the weights: the untrained model scores the same tokens differently.
    original = load_hf_state(hf_dir)
    assert max(float((trained[k] - original[k]).abs().max()) for k in original) > 1e-3
