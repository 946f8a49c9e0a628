"""TorchCoreAttention against straightforward per-sequence causal softmax attention, and in a GPTModel."""

import math

import pytest
import torch

from mrl.parallel.layout import ParallelDims
from mrl.parallel.groups import destroy_process_groups, init_process_groups


@pytest.fixture(scope="module", autouse=True)
def megatron_world_of_one():
    init_process_groups(ParallelDims(), seed=1234)
    yield
    destroy_process_groups()


def make_config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
    )
    return TransformerConfig(**{**base, **overrides})


def make_attention(config):
    from megatron.core.transformer.enums import AttnMaskType

    from mrl.parallel.attention import TorchCoreAttention

    return TorchCoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


def reference_attention(q, k, v):
    """One sequence, loops over heads: q [s, np, hn], k/v [s, ng, hn] -> [s, np*hn]."""
    s, heads, hn = q.shape
    per_group = heads // k.shape[1]
    out = torch.zeros(s, heads, hn, dtype=torch.float64)
    for h in range(heads):
        kh, vh = k[:, h // per_group].double(), v[:, h // per_group].double()
        for i in range(s):
            scores = (kh[: i + 1] @ q[i, h].double()) / math.sqrt(hn)  # keys 0..i only
            out[i, h] = scores.softmax(0) @ vh[: i + 1]
    return out.reshape(s, heads * hn)


def test_sbhd_gqa_equals_reference():
    attention = make_attention(make_config())
    q, k, v = torch.randn(7, 3, 4, 8), torch.randn(7, 3, 2, 8), torch.randn(7, 3, 2, 8)  # [s, b, heads, hn]
    out = attention(q, k, v, None)  # [s, b, np*hn]
    for b in range(3):
        torch.testing.assert_close(out[:, b].double(), reference_attention(q[:, b], k[:, b], v[:, b]), atol=1e-6, rtol=0)


def test_thd_packed_is_block_diagonal_causal():
    from megatron.core.packed_seq_params import PackedSeqParams

    attention = make_attention(make_config())
    lens = [5, 2, 6]
    cu = torch.tensor([0, 5, 7, 13], dtype=torch.int32)
    q, k, v = torch.randn(13, 4, 8), torch.randn(13, 2, 8), torch.randn(13, 2, 8)  # [t, heads, hn]
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6, max_seqlen_kv=6)
    out = attention(q, k, v, None, packed_seq_params=params)  # [t, np*hn]
    expected = torch.cat([reference_attention(*(t[a:b] for t in (q, k, v))) for a, b in zip(cu[:-1], cu[1:])])
    assert out.shape == (sum(lens), 32)
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=0)


def test_load_balanced_layout_matches_megatron_chunking():
    from mrl.parallel.attention import token_layout

    # A sequence of 8 over CP2 is cut in 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert token_layout([8], 2, 0)[1].tolist() == [0, 1, 6, 7]
    assert token_layout([8], 2, 1)[1].tolist() == [2, 3, 4, 5]
    ids, pos = token_layout([4, 8], 2, 1)
    assert ids.tolist() == [0, 0, 1, 1, 1, 1] and pos.tolist() == [1, 2, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="multiple of 2\\*context_parallel_size = 4"):
        token_layout([6], 2, 0)


def test_gpt_model_packed_equals_per_sequence():
    """Two sequences packed in one THD row give the logits of each sequence run alone (RoPE restarts)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.packed_seq_params import PackedSeqParams

    from mrl.parallel.attention import gpt_layer_spec

    config = make_config()
    model = GPTModel(config, gpt_layer_spec(config, use_te=False), vocab_size=40, max_sequence_length=16,
                     position_embedding_type="rope").eval()
    seqs = [torch.randint(0, 40, (1, n)) for n in (6, 3, 5)]
    packed_tokens = torch.cat(seqs, dim=1)  # [1, t]
    cu = torch.tensor([0, 6, 9, 14], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6, max_seqlen_kv=6)
    with torch.no_grad():
        packed = model(packed_tokens, None, None, packed_seq_params=params)  # [1, t, vocab]
        alone = [model(s, torch.arange(s.shape[1])[None], None) for s in seqs]
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), atol=1e-5, rtol=0)


def test_layer_spec_puts_torch_attention_in_the_local_spec():
    from mrl.parallel.attention import TorchCoreAttention, gpt_layer_spec, transformer_engine_available

    spec = gpt_layer_spec(make_config(), use_te=False)
    assert spec.submodules.self_attention.submodules.core_attention is TorchCoreAttention
    if not transformer_engine_available():
        assert gpt_layer_spec(make_config()).submodules.self_attention.submodules.core_attention is TorchCoreAttention


def test_the_gpu_route_through_torch_sdpa_equals_the_reference(monkeypatch):
    """GPUs without Transformer Engine attend through torch's SDPA (`sdpa_device`); SDPA runs on CPU too, so the
    route is taken here with the device test answering as a GPU would, and checked against the reference and
    against the CPU route's gradients, for a batch and for a pack."""
    from megatron.core.packed_seq_params import PackedSeqParams

    import mrl.parallel.attention as attention_module

    attention = make_attention(make_config())
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(kwargs.get("is_causal"))
        return original(*args, **kwargs)

    cu = torch.tensor([0, 5, 7, 13], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6, max_seqlen_kv=6)
    cases = [((7, 3, 4, 8), (7, 3, 2, 8), None), ((13, 4, 8), (13, 2, 8), packed)]
    for q_shape, kv_shape, params in cases:
        torch.manual_seed(0)
        inputs = [torch.randn(q_shape), torch.randn(kv_shape), torch.randn(kv_shape)]
        grads = {}
        for route in ("cpu", "gpu"):
            leaves = [t.clone().requires_grad_() for t in inputs]
            with monkeypatch.context() as patch:
                if route == "gpu":
                    patch.setattr(attention_module, "sdpa_device", lambda tensor: True)
                    patch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
                out = attention(*leaves, None, packed_seq_params=params)
            out.sum().backward()
            grads[route] = [t.grad for t in leaves]
            if params is None:
                expected = torch.stack([reference_attention(*(t[:, b] for t in inputs)) for b in range(3)], dim=1)
            else:
                expected = torch.cat([reference_attention(*(t[a:b] for t in inputs)) for a, b in zip(cu[:-1], cu[1:])])
            torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=0)
        for cpu_grad, gpu_grad in zip(grads["cpu"], grads["gpu"]):
            torch.testing.assert_close(gpu_grad, cpu_grad, atol=1e-5, rtol=0)
    assert calls == [True] + [True] * 3  # one call for the batch, one per sequence of the pack


def test_a_kv_cached_decode_step_sees_every_key_in_one_call_without_copying_the_cache(monkeypatch):
    """Megatron's static loop passes `no_mask` on its KV-cached decode steps: the newest token (the last of the
    sequence) attends to every cached key. One SDPA call with the K/V groups shared in the kernel (no
    repeat_interleave of the cache per query head); equal to the last row of the causal reference."""
    from megatron.core.transformer.enums import AttnMaskType

    attention = make_attention(make_config())
    q, k, v = torch.randn(7, 3, 4, 8), torch.randn(7, 3, 2, 8), torch.randn(7, 3, 2, 8)  # [s, b, heads, hn]
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(kwargs.get("enable_gqa"))
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", lambda *a, **kw: pytest.fail("the cache was copied"))
    out = attention(q[-1:], k, v, None, attn_mask_type=AttnMaskType.no_mask)  # [1, b, np*hn]
    for b in range(3):
        expected = reference_attention(q[:, b], k[:, b], v[:, b])[-1:]
        torch.testing.assert_close(out[:, b].double(), expected, atol=1e-6, rtol=0)
    assert calls == [True]
