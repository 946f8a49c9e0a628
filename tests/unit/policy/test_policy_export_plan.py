"""Refit bucket plans (mrl.policy.export.plan_buckets): whole units up to the bound, or a unit larger than it cut at
tensor granularity (`split_units=True`), every HF tensor exactly once and in model order either way."""

from __future__ import annotations

import pytest
import torch

from converters import model_dims
from converters.mapping import expected_hf_shapes, param_rules
from mrl.policy.export import Piece, StageInfo, bucket_names, bucket_stage, plan_buckets

#: The tiny Qwen3-MoE of mrl.testing.tiny_models (fp32): a MoE layer is 264,832 bytes, the embedding 128,000.
CONFIG = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, head_dim=16, intermediate_size=128, vocab_size=500,
              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
              decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, tie_word_embeddings=False,
              hidden_act="silu", max_position_embeddings=256)
DIMS = model_dims(CONFIG)
SIZES = {name: torch.Size(shape).numel() * 4 for name, shape in expected_hf_shapes(DIMS).items()}
ORDER = [h for rule in param_rules(DIMS, "local") for h in rule.hf]
LAYER = sum(size for name, size in SIZES.items() if name.startswith("model.layers.0."))


def _check(plan, bound):
    names = [n for bucket in plan for n in bucket_names(bucket)]
    assert names == ORDER  # every HF tensor once, in model order
    for bucket in plan:
        assert sum(SIZES[n] for n in bucket_names(bucket)) <= bound or len(bucket_names(bucket)) == 1


def test_whole_units_by_default_a_larger_unit_alone():
    assert LAYER == 264_832
    plan = plan_buckets(DIMS, "local", 200_000, 4)
    assert [sorted({n.split(".")[2] if n.startswith("model.layers.") else n for n in bucket_names(b)})
            for b in plan] == [["model.embed_tokens.weight"], ["0"], ["1"], ["lm_head.weight", "model.norm.weight"]]
    assert all(piece.hf == piece.rule.hf for bucket in plan for piece in bucket)
    assert len(plan_buckets(DIMS, "local", 1 << 40, 4, split_units=True)) == 1


@pytest.mark.parametrize("bound", [1, 20_000, 60_000, 160_000, 200_000, LAYER])
def test_split_units_never_exceed_the_bound(bound):
    plan = plan_buckets(DIMS, "local", bound, 4, split_units=True)
    _check(plan, bound)
    for bucket in plan:
        for piece in bucket:
            if sum(SIZES[h] for h in piece.rule.hf) <= bound:
                assert piece.hf == piece.rule.hf  # a parameter that fits is never cut (q/k/v, gate/up together)
    if bound >= LAYER:  # a unit that fits is never cut
        assert plan == plan_buckets(DIMS, "local", bound, 4)


def test_a_parameter_larger_than_the_bound_is_cut_between_its_hf_tensors():
    plan = plan_buckets(DIMS, "local", 20_000, 4, split_units=True)  # fused q/k/v: 3 x 16,384 bytes
    qkv = [piece for bucket in plan for piece in bucket if piece.rule.megatron.endswith("0.self_attention.linear_qkv"
                                                                                          ".weight")]
    assert [piece.hf for piece in qkv] == [(h,) for h in qkv[0].rule.hf]
    assert isinstance(qkv[0], Piece)
    alone = [b for b in plan if bucket_names(b) == ["model.embed_tokens.weight"]]  # 128,000 bytes > the bound
    assert len(alone) == 1


def test_experts_of_a_split_layer_spread_over_buckets():
    plan = plan_buckets(DIMS, "local", 160_000, 4, split_units=True)
    layer0 = [b for b in plan if any(n.startswith("model.layers.0.") for n in bucket_names(b))]
    assert len(layer0) == 2
    experts = [{n.split(".")[5] for n in bucket_names(b) if ".mlp.experts." in n} for b in layer0]
    assert all(0 < len(e) < 8 for e in experts)


def test_bound_must_be_positive():
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(DIMS, "local", 0, 4)


@pytest.mark.parametrize("split", [False, True])
def test_a_bucket_never_spans_two_pipeline_stages(split):
    """Stage 0: the embedding and layer 0; stage 1: layer 1, the final norm and the output layer. A bound that would
    put both layers (or the embedding and everything) in one bucket still cuts at the stage boundary."""
    stages = StageInfo(offsets=(0, 1), counts=(1, 1))
    for bound in (1 << 40, 2 * LAYER, 160_000):
        plan = plan_buckets(DIMS, "local", bound, 4, split_units=split, stages=stages)
        _check(plan, bound if split else max(bound, LAYER))
        owners = [bucket_stage(bucket, stages) for bucket in plan]
        assert owners == sorted(owners) and set(owners) == {0, 1}
        stage1 = {n for bucket, owner in zip(plan, owners) if owner == 1 for n in bucket_names(bucket)}
        assert stage1 == {n for n in ORDER if n.startswith("model.layers.1.") or not n.startswith(("model.layers.",
                                                                                                   "model.embed"))}
    assert len(plan_buckets(DIMS, "local", 1 << 40, 4, split_units=split, stages=stages)) == 2
    whole = plan_buckets(DIMS, "local", 1 << 40, 4, split_units=split)  # no stages: one bucket, both stages in it
    with pytest.raises(ValueError, match="spans pipeline stages"):
        bucket_stage(whole[0], stages)
