"""The megatron-core 0.19.2 patches to its layer builders (`mrl.cpu.megatron_patches` registers, applies and reverts
them with the others; each takes its `Patcher`): what a build without Transformer Engine lacks, on any device (torch
norms under sequence parallelism, the HybridModel's final norm, multi-latent attention's plain down projections),
and multi-latent attention without a q LoRA built as HF's models compute it (with TE too).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mrl.cpu.megatron_patches import Patcher


def torch_norm_allows_sequence_parallel(patch: Patcher) -> None:
    """`WrappedTorchNorm` (the local spec's norm) accepts `sequence_parallel=True`.

    Breaks: 0.19.2 asserts "sequence parallel not supported by torch LayerNorm". Under sequence parallelism
    each TP rank normalises its own slice of the sequence with replicated norm weights, so the weight
    gradients are partial sums; TE/Apex norms mark their weights `sequence_parallel=True` so that
    `finalize_model_grads` all-reduces them over the TP group. This patch builds the same torch norm
    (original constructor, run on a config copy with the flag off) and sets that attribute, which is
    exactly what makes SP correct.
    """
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        unflagged = copy.copy(config)
        unflagged.sequence_parallel = False
        norm = original_new(cls, unflagged, hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm

    patch.set(torch_norm.WrappedTorchNorm, "__new__", staticmethod(__new__))


def hybrid_final_norm_without_te(patch: Patcher) -> None:
    """`HybridStack` (the HybridModel's decoder) builds its final norm from Megatron's local norm when TE is absent.

    Breaks: 0.19.2's `HybridStack.__init__` builds `final_norm` as `TENorm` whatever its spec says (its layers take
    their norms from the spec; the last one does not), and `TENorm` without Transformer Engine raises "Transformer
    Engine is not installed". Right because `TransformerBlock` (GPTModel's decoder) builds the same final norm from
    `LayerNormImpl`, the local norm (Apex's fused one, else torch's), and TE's norm computes the same function.
    """
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.transformer import transformer_block

    patch.set(hybrid_block, "TENorm", transformer_block.LayerNormImpl)


def mla_accepts_plain_linear_without_te(patch: Patcher) -> None:
    """Multi-latent attention accepts a replicated plain `Linear` as its down projections when TE is absent.

    Breaks: `multi_latent_attention` (0.19.2) imports `post_training.modelopt.layers.Linear` only `if HAVE_TE` and
    sets the name to None otherwise, then admits a down projection only if it is one of `TELinear`, `Linear`,
    `TEColumnParallelLinear`, `ColumnParallelLinear` -> "ValueError: Unsupported linear_q_down_proj" for the replicated
    `Linear` that mrl's local spec uses (`mrl.parallel.attention.gpt_layer_spec` says why: exact TP gradients of the
    shared rotary key). That `Linear` needs nothing from TE (a torch linear with Megatron's constructor), and the
    branch it then takes (`gather_output=False`) is the one the TE spec's replicated projection gets.
    """
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer import multi_latent_attention

    if multi_latent_attention.Linear is None:
        patch.set(multi_latent_attention, "Linear", Linear)


def mla_q_proj_without_norm(patch: Patcher) -> None:
    """Multi-latent attention without a q LoRA projects q with the spec's plain linear, as HF's models do.

    Breaks: megatron-core 0.19.2's `QKNormConfigResolver._resolve_mla_qk_layernorm` (transformer/mla_qk_norm_config.py)
    turns `linear_q_proj` into a fused norm+linear whenever `qk_layernorm` is set and `q_lora_rank` is None. HF's
    DeepSeek-V2/V3 without a q LoRA have no q norm (`q = q_proj(hidden_states)`); `qk_layernorm` is set for the kv
    latent's norm (`kv_a_layernorm`). With TE that adds a norm HF lacks (`linear_q_proj.layer_norm_weight`, a
    parameter no checkpoint has); without TE there is no fused module and building raises "qk_layernorm requires
    TransformerEngine". 0.16.1 built the spec's linear. The replacement resolves q as the spec says (its
    `linear_q_proj`, no q norm) and kv as megatron-core does; with a q LoRA, or a spec that asks for the fused q
    projection, megatron-core's own resolution runs.
    """
    from megatron.core.transformer import mla_qk_norm_config
    from megatron.core.transformer.identity_op import IdentityOp

    resolver = mla_qk_norm_config.QKNormConfigResolver
    original = resolver._resolve_mla_qk_layernorm

    def _resolve_mla_qk_layernorm(self):
        if self.has_q_lora or self._is_fused_norm_linear(self.submodules.linear_q_proj):
            return original(self)
        kv_norm = self.submodules.kv_layernorm or IdentityOp
        kv_up = self.submodules.linear_kv_up_proj
        if self._is_trivial(kv_norm):
            kv_up = self._mla_fused_linear_or_default(kv_up, "linear_kv_up_proj")
        else:
            kv_up = self._non_fused_or_default(kv_up, "linear_kv_up_proj")
        return self._result(
            linear_q_proj=self.submodules.linear_q_proj or self.linear_impl,
            linear_q_up_proj=IdentityOp,
            linear_kv_up_proj=kv_up,
            q_layernorm=IdentityOp,
            kv_layernorm=kv_norm,
        )

    patch.set(resolver, "_resolve_mla_qk_layernorm", _resolve_mla_qk_layernorm)
