"""The pure steps of building a policy rank (mrl/policy/construction.py): what each makes of a policy config, without
processes; the whole build runs for real in tests/functional/policy/test_policy_worker.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from converters import model_dims
from mrl.config.schema import MoEConfig, OptimizerConfig, ParallelConfig, PolicyConfig
from mrl.parallel.layout import ParallelLayoutError
from mrl.policy.construction import (
    ddp_settings,
    megatron_weights,
    optimizer_options,
    parallel_dims,
    routing_settings,
    transformer_overrides,
)
from mrl.policy.speed import SpeedSettings

DENSE = model_dims(
    dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=4, intermediate_size=128, vocab_size=500, rms_norm_eps=1e-6,
         tie_word_embeddings=False, hidden_act="silu", max_position_embeddings=256)
)
#: The tiny Qwen3-MoE of mrl.testing.tiny_models (no expert bias).
MOE = model_dims(
    dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=64, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=4, head_dim=16, intermediate_size=128, vocab_size=500,
         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
         mlp_only_layers=[], rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
         max_position_embeddings=256)
)
ALL_ON = SpeedSettings(gradient_accumulation_fusion=True, overlap_grad_reduce=True, overlap_param_gather=True,
                       compiled_fusions=True)
ALL_OFF = SpeedSettings(gradient_accumulation_fusion=False, overlap_grad_reduce=False, overlap_param_gather=False)


def test_parallel_dims_take_the_config_sizes_and_leave_the_rest_to_data_parallel():
    par = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, context_parallel_size=1,
                         expert_parallel_size=2, sequence_parallel=True)
    dims = parallel_dims(par, world_size=8)
    assert (dims.tp, dims.pp, dims.cp, dims.ep, dims.sequence_parallel) == (2, 2, 1, 2, True)
    assert dims.dp == 2 and dims.length_multiple == 2
    with pytest.raises(ParallelLayoutError, match="not divisible"):
        parallel_dims(par, world_size=6)


def test_transformer_overrides_of_a_dense_fp32_policy_are_the_sizes_and_dtype_alone():
    cfg = PolicyConfig(precision="float32", parallel=ParallelConfig(tensor_parallel_size=2, sequence_parallel=True))
    assert transformer_overrides(cfg, DENSE, ALL_OFF, trainable=True) == dict(
        tensor_parallel=2, pipeline_parallel=1, context_parallel=1, sequence_parallel=True,
        params_dtype=torch.float32, gradient_accumulation_fusion=False, compiled_fusions=False,
    )


def test_a_policy_with_lora_trains_on_megatrons_local_linears_even_where_transformer_engine_is_installed():
    from mrl.config.schema import LoraConfig

    cfg = PolicyConfig(lora=LoraConfig(rank=8))
    assert transformer_overrides(cfg, DENSE, ALL_OFF, trainable=True)["use_te"] is False
    assert "use_te" not in transformer_overrides(cfg, DENSE, ALL_OFF, trainable=False)  # a frozen copy: no adapters
    assert "use_te" not in transformer_overrides(PolicyConfig(), DENSE, ALL_OFF, trainable=True)


def test_activation_checkpointing_recomputes_every_layer_in_full():
    overrides = transformer_overrides(PolicyConfig(activation_checkpointing=True), DENSE, ALL_OFF, trainable=True)
    assert overrides["params_dtype"] == torch.bfloat16  # the default precision
    assert {k: overrides[k] for k in ("recompute_granularity", "recompute_method", "recompute_num_layers")} == dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )


def test_gradient_accumulation_fusion_only_for_a_model_that_trains():
    cfg = PolicyConfig()
    assert transformer_overrides(cfg, DENSE, ALL_ON, trainable=True)["gradient_accumulation_fusion"] is True
    assert transformer_overrides(cfg, DENSE, ALL_ON, trainable=False)["gradient_accumulation_fusion"] is False


def test_compiled_fusions_for_every_model_where_speed_resolved_them_on():
    cfg = PolicyConfig()
    for trainable in (True, False):  # the reference and a colocated engine's copy compute the same kernels
        assert transformer_overrides(cfg, DENSE, ALL_ON, trainable=trainable)["compiled_fusions"] is True
        assert transformer_overrides(cfg, DENSE, ALL_OFF, trainable=trainable)["compiled_fusions"] is False


def test_a_moe_policy_gets_its_router_settings_and_an_uneven_pipeline_its_stage_layers():
    cfg = PolicyConfig(
        parallel=ParallelConfig(pipeline_parallel_size=2, expert_parallel_size=2, first_stage_layers=3,
                                last_stage_layers=1),
        moe=MoEConfig(router_dtype="fp64", aux_loss_coeff=0.01),
    )
    overrides = transformer_overrides(cfg, MOE, ALL_OFF, trainable=True)
    assert {k: v for k, v in overrides.items() if k.startswith(("expert_", "moe_", "num_layers_in"))} == dict(
        expert_model_parallel_size=2, moe_router_dtype="fp64", moe_aux_loss_coeff=0.01,
        moe_router_load_balancing_type="aux_loss", num_layers_in_first_pipeline_stage=3,
        num_layers_in_last_pipeline_stage=1,
    )
    assert not any(k.startswith("moe_") for k in transformer_overrides(cfg, DENSE, ALL_OFF, trainable=True))


def test_ddp_reduces_in_fp32_with_the_configured_optimizer_and_the_resolved_overlaps():
    assert ddp_settings(OptimizerConfig(use_distributed_optimizer=True), ALL_ON) == dict(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True
    )
    assert ddp_settings(OptimizerConfig(), ALL_OFF) == dict(
        grad_reduce_in_fp32=True, use_distributed_optimizer=False, overlap_grad_reduce=False,
        overlap_param_gather=False,
    )


def test_the_megatron_optimizer_config_of_a_bf16_adamw_policy(monkeypatch):
    """build_optimizer (mrl/policy/optim.py) with the options the worker gives it: the Megatron config it asks for."""
    import megatron.core.optimizer

    from mrl.policy.optim import build_optimizer

    monkeypatch.setattr(megatron.core.optimizer, "get_megatron_optimizer", lambda config, model: config)
    cfg = PolicyConfig(precision="bfloat16", optimizer=OptimizerConfig(name="adamw", lr=3e-6, weight_decay=0.1,
                                                                       use_distributed_optimizer=True))
    options = optimizer_options(cfg, ALL_ON)
    assert options == dict(params_dtype=torch.bfloat16, overlap_param_gather=True)
    megatron_cfg = build_optimizer([], cfg.optimizer, **options)
    assert (megatron_cfg.optimizer, megatron_cfg.lr, megatron_cfg.weight_decay) == ("adam", 3e-6, 0.1)
    assert megatron_cfg.decoupled_weight_decay and megatron_cfg.bf16 and not megatron_cfg.fp16
    assert megatron_cfg.params_dtype == torch.bfloat16
    assert megatron_cfg.use_distributed_optimizer and megatron_cfg.overlap_param_gather


def test_fp32_policy_gives_the_optimizer_fp32_parameters_and_no_overlap_without_it():
    assert optimizer_options(PolicyConfig(precision="float32"), ALL_OFF) == dict(
        params_dtype=torch.float32, overlap_param_gather=False
    )


def test_the_starting_weights_come_from_the_megatron_checkpoint_model_folder_else_the_hf_folder():
    assert megatron_weights(None) is None  # the HF folder's safetensors
    assert megatron_weights("/runs/a/step_10") == Path("/runs/a/step_10/model")


def test_every_moe_policy_measures_the_routing_and_replays_it_only_when_asked():
    assert routing_settings(PolicyConfig(), moe=False) is None
    measured = routing_settings(PolicyConfig(moe=MoEConfig(router_replay="off")), moe=True)
    assert measured == dict(replay=False, recompute=False, tp_size=1, sequence_parallel=False)
    cfg = PolicyConfig(moe=MoEConfig(router_replay="replay"), activation_checkpointing=True,
                       parallel=ParallelConfig(tensor_parallel_size=2, sequence_parallel=True))
    assert routing_settings(cfg, moe=True) == dict(replay=True, recompute=True, tp_size=2, sequence_parallel=True)
