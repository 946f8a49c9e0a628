"""`mrl plan`'s parameter and optimizer arithmetic (mrl/app/plan_memory.py) against megatron-core itself: one rank's
model of the real published configs (DeepSeek-R1-Distill-Qwen-1.5B, Qwen3-30B-A3B, Qwen1.5-MoE-A2.7B, DeepSeek-V3),
built on the meta device in the layouts of the shipped cluster recipes and others (mrl.testing.meta_build), on the
first and the last pipeline stage; the optimizer bytes from the built parameters' own attributes (Megatron marks a routed expert's
parameters allreduce=False under expert parallelism, so they shard over the expert data-parallel ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from converters.spec import model_dims
from mrl.app.plan_memory import (Layout, engine_stage_bytes, engine_stage_layers, kv_bytes_per_token,
                                 kv_capacity_tokens, policy_bytes, stage_layer_ranges, stage_params, total_params)
from mrl.model.build import freeze_routers
from mrl.testing.meta_build import meta_rank_model

CONFIGS = Path(__file__).parents[3] / "mrl" / "_shipped" / "hf_configs"
R1_1_5B = "deepseek-ai--DeepSeek-R1-Distill-Qwen-1.5B_config.json"
QWEN3_30B = "Qwen--Qwen3-30B-A3B_config.json"
DEEPSEEK_V3 = "deepseek-ai--DeepSeek-V3_config.json"
QWEN2_MOE = "Qwen--Qwen1.5-MoE-A2.7B_config.json"


def published(name: str, **changes) -> dict:
    config = json.loads((CONFIGS / name).read_text())
    config.pop("quantization_config", None)  # fp8 checkpoints: mrl trains in bf16
    return {**config, **changes}


def optimizer_bytes_of(model, layout: Layout) -> int:
    """12 B (fp32 main weights and Adam's two moments) per trainable parameter, over the data-parallel ranks its
    gradient is reduced over (as the distributed optimizer shards it), read off the parameters Megatron built."""
    total = 0
    for param in model.parameters():
        if param.requires_grad:
            expert = not getattr(param, "allreduce", True)
            total += -(-param.numel() // (layout.expert_dp if expert else layout.dp))
    return total * 12


LAYOUTS = [  # (config, world, tp, pp, ep, first, last, freeze_router): the recipes' layouts first
    (R1_1_5B, 8, 1, 1, 1, None, None, False),           # grpo-deepscaler-1.5b-8K/16K
    (R1_1_5B, 8, 2, 2, 1, None, None, False),
    (QWEN3_30B, 16, 2, 1, 8, None, None, True),         # grpo-qwen3-30b-a3b-2n8g
    (QWEN3_30B, 32, 2, 2, 8, None, None, True),
    (DEEPSEEK_V3, 256, 2, 8, 16, 7, 6, True),            # grpo-deepseek-v3-32n8g
    (QWEN2_MOE, 8, 2, 1, 4, None, None, False),         # Qwen2-MoE: QKV bias, a gated shared expert
]


@pytest.mark.parametrize("name, world, tp, pp, ep, first, last, frozen", LAYOUTS)
def test_parameters_and_optimizer_bytes_per_stage_equal_megatrons_own_model(name, world, tp, pp, ep, first, last,
                                                                             frozen):
    config = published(name)
    layout = Layout(world_size=world, tp=tp, pp=pp, ep=ep, sequence_parallel=tp > 1, first_stage_layers=first,
                    last_stage_layers=last)
    planned = stage_params(model_dims(config), layout, freeze_router=frozen)
    for stage in {0, pp - 1}:
        rank = stage * (world // pp)  # megatron-core's default order tp-cp-ep-dp-pp: the pipeline rank varies slowest
        with meta_rank_model(config, world=world, rank=rank, tp=tp, pp=pp, ep=ep, first_stage_layers=first,
                             last_stage_layers=last) as model:
            if frozen:
                freeze_routers(model)
            built = sum(p.numel() for p in model.parameters())
            assert planned[stage].total == built, (stage, planned[stage], built)
            plan = policy_bytes(planned[stage], layout, precision="bfloat16", distributed_optimizer=True,
                                reference=False)
            assert plan.optimizer == optimizer_bytes_of(model, layout)
            assert plan.weights == 2 * built
            assert plan.gradients == 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_a_tied_embedding_has_a_copy_on_the_last_stage():
    config = published(R1_1_5B, tie_word_embeddings=True)
    layout = Layout(world_size=4, pp=2)
    planned = stage_params(model_dims(config), layout)
    with meta_rank_model(config, world=4, rank=2, pp=2) as last:
        assert planned[1].total == sum(p.numel() for p in last.parameters())
        assert any(name == "output_layer.weight" for name, _ in last.named_parameters())
    untied = stage_params(model_dims(published(R1_1_5B)), layout)
    assert planned[1].total == untied[1].total  # the copy is as large as the untied output layer


def test_pipeline_stages_take_the_given_first_and_last_sizes_and_share_the_rest():
    assert stage_layer_ranges(61, Layout(world_size=256, pp=8, first_stage_layers=7, last_stage_layers=6)) == \
        [(0, 7), *[(7 + 8 * i, 15 + 8 * i) for i in range(6)], (55, 61)]
    assert stage_layer_ranges(28, Layout(world_size=8, pp=2)) == [(0, 14), (14, 28)]
    assert stage_layer_ranges(28, Layout(world_size=8)) == [(0, 28)]


def test_optimizer_states_without_the_distributed_optimizer_and_in_fp32():
    stage = stage_params(model_dims(published(R1_1_5B)), Layout(world_size=8))[0]
    assert stage.total == 1_777_088_000  # docs/guides/gpus.md's n
    whole = policy_bytes(stage, Layout(world_size=8), precision="bfloat16", distributed_optimizer=False,
                         reference=True)
    assert (whole.weights, whole.gradients, whole.optimizer, whole.reference) == \
        (2 * stage.total, 4 * stage.total, 12 * stage.total, 2 * stage.total)
    fp32 = policy_bytes(stage, Layout(world_size=8), precision="float32", distributed_optimizer=True, reference=False)
    assert (fp32.weights, fp32.optimizer) == (4 * stage.total, 8 * -(-stage.total // 8))


def test_kv_bytes_per_token_by_hand():
    # Qwen2 1.5B: 28 layers x (K and V) x 2 KV heads x 128 x 2 B; at TP 4 each rank keeps one of the 2 heads
    r1 = model_dims(published(R1_1_5B))
    assert kv_bytes_per_token(r1, 1) == 28 * 2 * 2 * 128 * 2
    assert kv_bytes_per_token(r1, 4) == 28 * 2 * 1 * 128 * 2
    # DeepSeek-V3 (MLA): 61 layers x (512 latent + 64 rope) x 2 B, whatever the TP
    v3 = model_dims(published(DEEPSEEK_V3))
    assert kv_bytes_per_token(v3, 1) == kv_bytes_per_token(v3, 8) == 61 * 576 * 2


def test_engine_pipeline_stages_split_the_layers_as_vllm_does():
    # vllm/distributed/utils.py get_pp_indices: even parts, the remainder to the stages before the last
    assert engine_stage_layers(61, 4) == [(0, 15), (15, 30), (30, 46), (46, 61)]  # one left: the second-to-last
    assert engine_stage_layers(61, 2) == [(0, 31), (31, 61)]
    assert engine_stage_layers(10, 4) == [(0, 2), (2, 5), (5, 8), (8, 10)]  # two left: the middle stages
    assert engine_stage_layers(28, 1) == [(0, 28)]


def test_engine_stage_weights_by_hand():
    r1 = model_dims(published(R1_1_5B))  # untied: embedding and output layer 151,936 x 1,536 each
    whole = total_params(r1)
    assert engine_stage_bytes(r1, 1) == [2 * whole]
    embedding = 151_936 * 1536
    layer = (whole - 2 * embedding - 1536) // 28  # the final norm (1,536) on the last stage
    first, last = engine_stage_bytes(r1, 2, 2)  # 14 layers each, over TP 2
    assert first == 2 * (embedding + 14 * layer) // 2
    assert last == 2 * (embedding + 1536 + 14 * layer) // 2
    tied = model_dims(published(R1_1_5B, tie_word_embeddings=True))
    assert engine_stage_bytes(tied, 1, 2)[1] - engine_stage_bytes(tied, 1, 2)[0] == 2 * 1536  # both hold the embedding
    v3 = model_dims(published(DEEPSEEK_V3))
    assert sum(engine_stage_bytes(v3, 8, 4)) == pytest.approx(2 * total_params(v3) / 8, abs=4)  # no layer twice


def test_kv_capacity_of_a_pipelined_engine_is_its_fullest_stages():
    r1 = model_dims(published(R1_1_5B))
    per_layer_block = 2 * 2 * 128 * 2 * 16  # K and V, 2 KV heads, head_dim 128, bf16, 16 tokens
    free = 1 << 30
    assert kv_capacity_tokens(r1, 1, free, pp=2) == free // (14 * per_layer_block) * 16  # 14 layers per stage
    r1_10 = model_dims(published(R1_1_5B, num_hidden_layers=10))  # stages of 2, 3, 3, 2 layers
    assert kv_capacity_tokens(r1_10, 1, free, pp=4) == free // (3 * per_layer_block) * 16
    # a stage with less memory left bounds every stage's blocks
    assert kv_capacity_tokens(r1_10, 1, [free, free, free, free // 4], pp=4) == free // 4 // (2 * per_layer_block) * 16


@pytest.mark.parametrize("name, world, tp, pp, ep", [(R1_1_5B, 8, 2, 2, 1), (QWEN3_30B, 16, 2, 1, 8)])
def test_lora_adapters_and_their_optimizer_bytes_equal_the_adapted_megatron_model(name, world, tp, pp, ep):
    """policy.lora: the adapters on one rank of Megatron's model (mrl/model/lora.py on the meta device, routed experts'
    too) are what the plan counts; they alone have gradients and optimizer states, a routed expert's sharded over the
    expert data-parallel ranks."""
    from mrl.model.lora import LoraSettings, apply_lora

    config = published(name)
    layout = Layout(world_size=world, tp=tp, pp=pp, ep=ep, sequence_parallel=tp > 1)
    settings = LoraSettings(rank=16, alpha=32.0)
    planned = stage_params(model_dims(config), layout, lora=settings)
    for stage in {0, pp - 1}:
        with meta_rank_model(config, world=world, rank=stage * (world // pp), tp=tp, pp=pp, ep=ep) as model:
            apply_lora(model, settings)
            adapters = sum(p.numel() for n, p in model.named_parameters() if ".lora.lora_" in n)
            trainable = [p for p in model.parameters() if p.requires_grad]
            assert planned[stage].adapters + planned[stage].expert_adapters == adapters
            assert adapters == sum(p.numel() for p in trainable)
            experts = sum(p.numel() for n, p in model.named_parameters() if ".lora.lora_" in n and ".experts." in n)
            assert planned[stage].expert_adapters == experts and (experts > 0) == (name == QWEN3_30B)
            plan = policy_bytes(planned[stage], layout, precision="bfloat16", distributed_optimizer=True,
                                reference=False)
            assert plan.optimizer == optimizer_bytes_of(model, layout)
            assert plan.gradients == 4 * adapters
            assert plan.weights == 2 * sum(p.numel() for p in model.parameters())
