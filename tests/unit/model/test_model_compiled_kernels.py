"""`policy.speed.compiled_fusions` (mrl/model/compiled_kernels.py, mrl/model/build.py): the RoPE kernels that stand
for Transformer Engine's compute megatron-core's unfused rotation, the config turns megatron-core's fusions on only
where they are covered, and a model built with them gives the unfused model's logits and gradients: eagerly to the
bit (torch.compile's functions run as written under its `force_eager` stance), compiled by inductor within fp32
rounding."""

from __future__ import annotations

import pytest
import torch

from mrl.model import compiled_kernels

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("megatron_world_of_one")]

QWEN3 = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=128,
             rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", max_position_embeddings=256,
             rope_theta=10000.0)
LENGTHS = [5, 1, 9, 3]


@pytest.fixture
def eager_rotation(monkeypatch):
    """The kernels' rotation run as written, not compiled (what inductor compiles is `rotate` itself)."""
    monkeypatch.setattr(compiled_kernels, "_compiled", compiled_kernels.rotate)


def test_the_rope_kernels_compute_megatrons_unfused_rotation(eager_rotation):
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.parallel_state import get_context_parallel_group

    g = torch.Generator().manual_seed(0)
    t = torch.randn(7, 2, 3, 16, generator=g)  # [s, b, h, d]
    for rotated in (16, 8):  # every channel, and the first half with the rest passed through
        freqs = torch.randn(7, 1, 1, rotated, generator=g)
        assert torch.equal(compiled_kernels.rope_bshd(t, freqs, interleaved=False),
                           rope_utils._apply_rotary_pos_emb_bshd(t, freqs))
    interleaved = compiled_kernels.rope_bshd(t, freqs, interleaved=True)
    assert torch.equal(interleaved, rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=True))

    cu_seqlens = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
    packed = torch.randn(18, 3, 16, generator=g)  # [T, h, d]
    by_position = torch.randn(12, 1, 1, 16, generator=g)  # a table by position within a sequence
    per_token = torch.randn(18, 1, 1, 16, generator=g)  # one row per packed token (the dynamic engine's queries)
    group = get_context_parallel_group()
    for freqs in (by_position, per_token):
        assert torch.equal(compiled_kernels.rope_thd(packed, cu_seqlens, freqs, cp_size=1, cp_rank=0),
                           rope_utils._apply_rotary_pos_emb_thd(packed, cu_seqlens, freqs, cp_group=group))
    with pytest.raises(NotImplementedError, match="context_parallel_size=2"):
        compiled_kernels.rope_thd(packed, cu_seqlens, by_position, cp_size=2, cp_rank=0)


def test_the_config_turns_the_fusions_on_only_where_they_are_covered():
    from megatron.core.models.common.embeddings import rope_utils

    from mrl.model.build import transformer_config_from_hf

    on = transformer_config_from_hf(QWEN3, use_te=False, compiled_fusions=True)
    assert on.bias_activation_fusion and on.apply_rope_fusion
    assert rope_utils.fused_apply_rotary_pos_emb is compiled_kernels.rope_bshd
    assert rope_utils.fused_apply_rotary_pos_emb_thd is compiled_kernels.rope_thd
    with_cp = transformer_config_from_hf(QWEN3, use_te=False, compiled_fusions=True, context_parallel=2)
    assert with_cp.bias_activation_fusion and not with_cp.apply_rope_fusion
    off = transformer_config_from_hf(QWEN3, use_te=False, compiled_fusions=False)
    assert not (off.bias_activation_fusion or off.apply_rope_fusion)
    default = transformer_config_from_hf(QWEN3, use_te=False)  # None: with CUDA, which this machine lacks
    assert (default.bias_activation_fusion, default.apply_rope_fusion) == ((torch.cuda.is_available(),) * 2)


def _packed_forward_and_grads(compiled: bool, seed: int = 0):
    """Logits [1, T, V] of one pack of LENGTHS and every parameter's gradient of their sum of squares, for a tiny
    Qwen3 built with or without the compiled fusions from the same initialisation."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from mrl.model.build import build_model, transformer_config_from_hf

    torch.manual_seed(seed)
    config = transformer_config_from_hf(QWEN3, use_te=False, compiled_fusions=compiled)
    model = build_model(dict(QWEN3), config)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu, max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(LENGTHS))
    total = sum(LENGTHS)
    ids = torch.randint(0, QWEN3["vocab_size"], (1, total), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    logits = model(ids, positions, None, packed_seq_params=params)
    logits.square().sum().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _spy(monkeypatch, module, name: str, calls: list[str]) -> None:
    original = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)


def test_a_model_with_the_fusions_runs_them_and_computes_the_unfused_models_values(monkeypatch):
    """torch.compile's functions run as written (its `force_eager` stance): the fused paths are taken (the RoPE kernels for
    every packed q and k, megatron-core's SwiGLU function for every MLP) and give the same logits to the bit; the
    gradients within fp32 rounding (megatron-core's SwiGLU backward is its own formula, not autograd's)."""
    from megatron.core.fusions import fused_bias_swiglu

    calls: list[str] = []
    _spy(monkeypatch, compiled_kernels, "rope_bshd", calls)  # rope_thd's rotation; it is looked up at call time
    _spy(monkeypatch, fused_bias_swiglu.SwiGLUFunction, "apply", calls)
    with torch.compiler.set_stance("force_eager"):
        unfused_logits, unfused_grads = _packed_forward_and_grads(compiled=False)
        assert calls == []
        logits, grads = _packed_forward_and_grads(compiled=True)
    layers = QWEN3["num_hidden_layers"]
    assert calls.count("rope_bshd") == 2 * layers and calls.count("apply") == layers  # q and k; one MLP each
    assert torch.equal(logits, unfused_logits)
    assert grads.keys() == unfused_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, unfused_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_inductor_compiles_the_fusions_into_the_model():
    """The real compile (inductor's C++ backend here, Triton on CUDA): the same logits and gradients as the unfused
    model within fp32 rounding (the fused kernels keep intermediates in registers and reassociate)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    unfused_logits, unfused_grads = _packed_forward_and_grads(compiled=False)
    assert counters["stats"]["unique_graphs"] == 0
    logits, grads = _packed_forward_and_grads(compiled=True)
    assert counters["stats"]["unique_graphs"] >= 2  # the rotation and megatron-core's SwiGLU (forward, backward)
    torch.testing.assert_close(logits, unfused_logits, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, unfused_grads[name], rtol=1e-4, atol=1e-5, msg=name)
