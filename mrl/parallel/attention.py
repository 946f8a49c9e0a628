"""Pure-torch core attention for Megatron's local layer spec: context parallelism, packed sequences, GQA.

Megatron's local `DotProductAttention` (the only core attention without Transformer Engine, i.e. on CPU)
refuses context parallelism and has no THD (packed-sequence) support. `TorchCoreAttention` replaces it in
the local spec (same constructor, same forward contract) and handles both:

- Context parallelism (CP): Megatron's load-balanced layout splits every sequence into 2*CP chunks and gives
  rank r chunks r and 2*CP-1-r (`get_batch_on_this_cp_rank`; for THD every sequence of the pack is split
  this way). This module all-gathers K/V over the CP group (backward: reduce-scatter of their gradients)
  and masks with the tokens' *global* positions, so every query sees exactly the keys it would see
  without CP. Communication is O(sequence) per layer: right for CPU tests, not a ring-attention kernel.
- Packed sequences (`PackedSeqParams(qkv_format="thd", cu_seqlens_q=..., ...)`): block-diagonal causal
  attention, no token attends to another sequence of the pack; computed one sequence at a time, so a pack costs
  the sum of its sequences' len^2 scores, not L^2.
- GQA: each group of K/V heads is repeated for the query heads it serves (Megatron orders query heads
  group by group).

- Long sequences: causal attention without an explicit mask or dropout goes through torch's CPU flash kernel
  (`mrl.cpu.flash_attention`), O(sequence) memory in forward and backward: a 24K-token sequence needs no
  [sq, sk] scores. The dense path below (which materialises them) serves explicit masks, attention dropout and
  non-CPU tensors.
- KV-cached decode steps (`no_mask`: each new token sees every cached key) go through one SDPA call with the K/V
  groups shared inside the kernel, on every device: per layer and token, nothing is built on the host (on a GPU a
  mask copied from pageable host memory waits for the device's whole queue) and the cache is not copied per
  query head.
- GPUs without Transformer Engine (the GPU tier's machine): the same causal case without context parallelism goes
  through torch's `scaled_dot_product_attention`, which picks its flash or memory-efficient CUDA kernel: again
  no [sq, sk] scores. A pack in bf16 or fp16 goes through torch's variable-length flash kernel
  (`torch.nn.attention.varlen.varlen_attn`) in one call over the whole pack, with the offsets on the device: no
  loop over its sequences and no host synchronisation (`varlen_causal`); fp32 packs (the kernel has no fp32) and
  heads of unequal size loop over the sequences with SDPA. CP on such a GPU keeps the dense path (its chunks need the
  lower-right causal rectangle
  that `mrl.cpu.flash_attention` builds from the CPU kernel).

Every case reduces to one rule: a query attends to a key iff both belong to the same sequence and (when
causal) the key's position is not after the query's. The module computes a (sequence id, position) pair
for every local query and every gathered key and builds that mask.

What callers must pass for packed sequences (checked against megatron-core 0.19.2, local path):
- `cu_seqlens_q/kv` (int32, [n_seqs + 1]) over the pack; with CP, every sequence must be padded to a multiple
  of 2*CP and `cu_seqlens_q_padded/kv_padded` describe the padded layout (the one tokens are laid out in).
- `max_seqlen_q/kv` = the longest (padded) single sequence. `position_ids` are not used by RoPE on this
  path: `_apply_rotary_pos_emb_thd` gives every sequence positions 0..len-1, except when the frequency
  table is as long as the whole pack, where it uses each sequence's pack offset instead. Both give the same
  attention (RoPE scores depend only on q_pos - k_pos, so a constant per-sequence shift cancels);
  `tests/unit/parallel/test_parallel_attention.py` checks packed logits equal per-sequence logits.
- Megatron's SelfAttention squeezes the dummy batch dim for THD: this module gets q [t, np, hn], k/v
  [t, ng, hn] and returns [t, np * hn].

Shapes in the default (sbhd) layout: q [sq, b, np, hn], k/v [sk, b, ng, hn] -> [sq, b, np * hn].
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from mrl.cpu.flash_attention import causal_attention, flash_available, padded_pack_attention

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)


def load_balanced_positions(local_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions of the `local_len` tokens a CP rank holds of one sequence: chunks r and 2cp-1-r."""
    if local_len % 2:
        raise ValueError(f"a context-parallel rank must hold an even number of tokens per sequence, got {local_len}")
    chunk = local_len // 2
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)
    return torch.cat([first, second])


def token_layout(seq_lens: list[int], cp_size: int, cp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence id, global position) of every token a CP rank holds of a pack of `seq_lens`; each [t_local].

    With cp_size 1 this is the plain packed layout; with CP each sequence contributes its two load-balanced
    chunks, in pack order.
    """
    ids, positions = [], []
    for seq_id, seq_len in enumerate(seq_lens):
        if cp_size == 1:
            pos = torch.arange(seq_len)
        else:
            if seq_len % (2 * cp_size):
                raise ValueError(
                    f"packed sequence {seq_id} has length {seq_len}, not a multiple of 2*context_parallel_size "
                    f"= {2 * cp_size}: pad every sequence (and pass cu_seqlens_*_padded)"
                )
            pos = load_balanced_positions(seq_len // cp_size, cp_size, cp_rank)
        positions.append(pos)
        ids.append(torch.full_like(pos, seq_id))
    return torch.cat(ids), torch.cat(positions)


def _packed_seq_lens(params: PackedSeqParams, which: str) -> list[int]:
    padded = getattr(params, f"cu_seqlens_{which}_padded")
    cu = padded if padded is not None else getattr(params, f"cu_seqlens_{which}")
    if cu is None:
        raise ValueError(f"PackedSeqParams(qkv_format='thd') needs cu_seqlens_{which}")
    return (cu[1:] - cu[:-1]).tolist()


class TorchCoreAttention(MegatronModule):
    """Core attention (softmax(QK^T * scale + mask) V) in plain torch, with CP, THD packing and GQA.

    Constructor matches megatron-core 0.19.2 `DotProductAttention`, so it drops into
    `ModuleSpec(SelfAttention).submodules.core_attention`, and takes what multi-latent attention passes as well
    (`k_channels` for the query/key head dim, `v_channels` for the value head dim, `softmax_scale` with YaRN's
    mscale): heads of any width work, the output has the value heads' width.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.cp_group = cp_group or parallel_state.get_context_parallel_group(check_initialized=False)

    def _cp(self) -> tuple[int, int]:
        if self.cp_group is None:
            return 1, 0
        return self.cp_group.size(), self.cp_group.rank()

    def _gather_kv(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All-gather K/V along the token dim (dim 0) over the CP group; the backward reduce-scatters."""
        if self._cp()[0] == 1:
            return key, value
        gather = lambda t: gather_from_sequence_parallel_region(t, True, group=self.cp_group)  # noqa: E731
        return gather(key), gather(value)

    def _allowed(self, q_layout, k_layout, mask_type: AttnMaskType) -> torch.Tensor:
        """[sq, sk] bool, True where a query may attend to a key (same sequence, not in its future)."""
        (q_ids, q_pos), (k_ids, k_pos) = q_layout, k_layout
        allowed = q_ids[:, None] == k_ids[None, :]
        if mask_type in _CAUSAL_TYPES:
            allowed &= k_pos[None, :] <= q_pos[:, None]
        return allowed

    def _layouts(self, n_query: int, n_key_local: int, packed: Optional[PackedSeqParams]):
        """(ids, positions) of the local queries and of the gathered keys (rank order)."""
        cp_size, cp_rank = self._cp()
        if packed is None:
            q_lens, k_lens = [n_query * cp_size], [n_key_local * cp_size]
        else:
            q_lens, k_lens = _packed_seq_lens(packed, "q"), _packed_seq_lens(packed, "kv")
        q_layout = token_layout(q_lens, cp_size, cp_rank)
        per_rank = [token_layout(k_lens, cp_size, r) for r in range(cp_size)]
        k_layout = (torch.cat([ids for ids, _ in per_rank]), torch.cat([pos for _, pos in per_rank]))
        if len(q_layout[0]) != n_query or len(per_rank[cp_rank][0]) != n_key_local:
            raise ValueError(
                f"cu_seqlens describe {len(q_layout[0])} local query / {len(per_rank[cp_rank][0])} key tokens "
                f"but the tensors hold {n_query} / {n_key_local} (context_parallel_size={cp_size})"
            )
        return q_layout, k_layout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("TorchCoreAttention does not support attention_bias")
        packed = packed_seq_params if packed_seq_params is not None and packed_seq_params.qkv_format == "thd" else None
        if packed is not None:  # [t, heads, hn] -> [t, 1, heads, hn]: the pack is one batch row
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        n_key_local = key.shape[0]
        key, value = self._gather_kv(key, value)  # [sk, b, ng, hn]
        # Megatron passes the mask type per call: static inference's KV-cached decode steps pass `no_mask` (the one
        # query is the newest token and sees every cached key; a causal layout would place it at position 0).
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if attention_mask is not None and (self._cp()[0] > 1 or packed is not None):
            raise NotImplementedError("an explicit attention_mask is not supported with CP or packing")
        heads, groups = query.shape[2], key.shape[2]
        if self._unmasked_applies(mask_type, attention_mask, packed, query, value):
            return self._attend_unmasked(query, key, value)
        if heads != groups:  # GQA: query heads of group g are [g * heads/groups, (g+1) * heads/groups)
            key = key.repeat_interleave(heads // groups, dim=2)
            value = value.repeat_interleave(heads // groups, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, np, s, hn]
        out = self._attend(q, k, v, n_key_local, packed, mask_type, attention_mask)  # [b, np, sq, hn_v]
        b, np_, sq, hn = out.shape
        out = out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)  # [sq, b, np * hn]
        return out.squeeze(1) if packed is not None else out

    def _attend(self, q, k, v, n_key_local: int, packed, mask_type: AttnMaskType, attention_mask) -> torch.Tensor:
        """The attention path of a call: on a GPU, torch's SDPA per sequence; on CPU a pack without CP as one padded
        batch, else the flash kernel per sequence; else the dense masked product (per sequence for a pack).
        q [b, np, sq, hn], k/v [b, np, sk, hn]."""
        if self._sdpa_applies(mask_type, attention_mask, q, k):
            return self._attend_sdpa(q, k, v, packed)
        flash = self._flash_applies(mask_type, attention_mask, q, k, v)
        if flash and packed is not None and self._cp()[0] == 1:
            seq_lens = _packed_seq_lens(packed, "q")
            if sum(seq_lens) != q.shape[2]:
                raise ValueError(f"cu_seqlens describe {sum(seq_lens)} tokens but the pack holds {q.shape[2]}")
            out = padded_pack_attention(q, k, v, seq_lens, self.softmax_scale)
            if out is not None:
                return out
        q_layout, k_layout = self._layouts(q.shape[2], n_key_local, packed)
        if flash:
            return self._attend_flash(q, k, v, q_layout, k_layout)
        if packed is not None:
            return self._attend_per_sequence(q, k, v, q_layout, k_layout, mask_type)
        allowed = self._allowed(q_layout, k_layout, mask_type).to(q.device)  # [sq, sk]
        if attention_mask is not None:
            allowed = allowed & ~attention_mask  # [b or 1, 1 or np, sq, sk], True = masked
        return self._attend_dense(q, k, v, allowed)

    def _unmasked_applies(self, mask_type: AttnMaskType, attention_mask, packed, q, v: torch.Tensor) -> bool:
        """Every query sees every key (`no_mask`: the KV-cached decode steps of Megatron's static loop), without an
        explicit mask, packing, CP or live dropout, and with value heads the size of the query heads."""
        dropout = self.training and self.dropout_p > 0
        return (
            mask_type == AttnMaskType.no_mask
            and attention_mask is None
            and packed is None
            and not dropout
            and self._cp()[0] == 1
            and q.shape[-1] == v.shape[-1]
            and q.shape[2] % v.shape[2] == 0
        )

    def _attend_unmasked(self, query, key, value) -> torch.Tensor:
        """softmax(q k^T * scale) v in one SDPA call, the K/V groups shared by their query heads inside the kernel
        (`enable_gqa`): no copy of the KV cache per query head, no mask built on the host and copied to the device.
        query [sq, b, np, hn], key/value [sk, b, ng, hn] -> [sq, b, np * hn]."""
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        gqa = q.shape[1] != k.shape[1]
        out = F.scaled_dot_product_attention(q, k, v, scale=self.softmax_scale, enable_gqa=gqa)  # [b, np, sq, hn]
        b, np_, sq, hn = out.shape
        return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)

    def _flash_applies(self, mask_type: AttnMaskType, attention_mask, *tensors: torch.Tensor) -> bool:
        """Causal attention without an explicit mask or live dropout, on CPU: the flash kernel's case."""
        dropout = self.training and self.dropout_p > 0
        return mask_type in _CAUSAL_TYPES and attention_mask is None and not dropout and flash_available(*tensors)

    def _sdpa_applies(self, mask_type: AttnMaskType, attention_mask, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Causal self-attention without an explicit mask, live dropout or CP, on a GPU (`sdpa_device`)."""
        dropout = self.training and self.dropout_p > 0
        return (
            sdpa_device(q)
            and mask_type in _CAUSAL_TYPES
            and attention_mask is None
            and not dropout
            and self._cp()[0] == 1
            and q.shape[2] == k.shape[2]
        )

    def _attend_sdpa(self, q, k, v, packed: Optional[PackedSeqParams]) -> torch.Tensor:
        """Top-left causal SDPA over the whole batch, or over each sequence of a pack (queries and keys are the
        same tokens without CP), a half-precision pack in one variable-length flash call.
        q [b, np, s, hn], k/v [b, np, s, hn(_v)]."""
        if packed is not None and varlen_applies(q, k, v, self.softmax_scale):
            cu = packed.cu_seqlens_q_padded if packed.cu_seqlens_q_padded is not None else packed.cu_seqlens_q
            longest = packed.max_seqlen_q

            def thd(x):  # [1, np, t, hn] -> [t, np, hn]
                return x[0].transpose(0, 1)

            out = varlen_causal(thd(q), thd(k), thd(v), cu, longest, self.softmax_scale)  # [t, np, hn]
            return out.transpose(0, 1).unsqueeze(0)

        def attend(a: int, b: int) -> torch.Tensor:
            return F.scaled_dot_product_attention(
                q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=self.softmax_scale
            )

        if packed is None:
            return attend(0, q.shape[2])
        bounds = [0]
        for length in _packed_seq_lens(packed, "q"):
            bounds.append(bounds[-1] + length)
        if bounds[-1] != q.shape[2]:
            raise ValueError(f"cu_seqlens describe {bounds[-1]} tokens but the pack holds {q.shape[2]}")
        outs = [attend(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
        return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]

    def _attend_flash(self, q, k, v, q_layout, k_layout) -> torch.Tensor:
        """Each sequence's local queries over its keys, put in position order (CP gathers them in rank order),
        with O(sequence) memory (`mrl.cpu.flash_attention`). q [b, np, sq, hn], k/v [b, np, sk, hn]."""
        (q_ids, q_pos), (k_ids, k_pos) = q_layout, k_layout
        outs = []
        for seq_id in torch.unique_consecutive(q_ids).tolist():
            qi = (q_ids == seq_id).nonzero().squeeze(1)  # contiguous: token_layout keeps a sequence together
            ki = (k_ids == seq_id).nonzero().squeeze(1)
            ki = ki[k_pos[ki].argsort()].to(k.device)  # key j of the sequence at position j
            q_seq = q[:, :, int(qi[0]) : int(qi[-1]) + 1]
            outs.append(causal_attention(q_seq, k[:, :, ki], v[:, :, ki], q_pos[qi], self.softmax_scale))
        return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]

    def _attend_per_sequence(self, q, k, v, q_layout, k_layout, mask_type: AttnMaskType) -> torch.Tensor:
        """Block-diagonal attention of a pack, one sequence at a time: sum of len^2 scores instead of the pack's
        L^2 (most of which the mask would discard). q [1, np, sq, hn], k/v [1, np, sk, hn] -> [1, np, sq, hn].
        token_layout keeps each sequence's local queries contiguous and in pack order, so outputs concatenate."""
        (q_ids, q_pos), (k_ids, k_pos) = q_layout, k_layout
        outs = []
        for seq_id in torch.unique_consecutive(q_ids).tolist():
            qi, ki = (q_ids == seq_id).nonzero().squeeze(1), (k_ids == seq_id).nonzero().squeeze(1)
            allowed = self._allowed((q_ids[qi], q_pos[qi]), (k_ids[ki], k_pos[ki]), mask_type).to(q.device)
            qi, ki = qi.to(q.device), ki.to(q.device)
            outs.append(self._attend_dense(q[:, :, qi], k[:, :, ki], v[:, :, ki], allowed))
        return torch.cat(outs, dim=2) if outs else q.new_zeros(q.shape[:3] + (v.shape[-1],))

    def _attend_dense(self, q, k, v, allowed: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T * scale, masked) v, with attention dropout under the model-parallel RNG."""
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.softmax_scale  # [b, np, sq, sk]
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        if self.training and self.dropout_p > 0:
            # Megatron forks the model-parallel RNG so TP ranks drop different heads' entries.
            with get_cuda_rng_tracker().fork():
                probs = F.dropout(probs, p=self.dropout_p)
        return torch.matmul(probs.to(v.dtype), v)


def sdpa_device(tensor: torch.Tensor) -> bool:
    """Whether causal attention on `tensor`'s device goes through torch's SDPA: on GPUs (CUDA); the CPU has its own
    flash path (`mrl.cpu.flash_attention`)."""
    return tensor.is_cuda


def _varlen_parameters() -> frozenset[str]:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return frozenset()
    import inspect

    return frozenset(inspect.signature(varlen_attn).parameters)


_VARLEN = _varlen_parameters()


def varlen_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> bool:
    """Whether torch's variable-length flash kernel takes this pack: CUDA, bf16 or fp16 (flash has no fp32), one head
    size for q, k and v that flash supports, and a softmax scale it can be given."""
    head = q.shape[-1]
    return (
        bool(_VARLEN)
        and q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
        and k.shape[-1] == head
        and v.shape[-1] == head
        and head % 8 == 0
        and head <= 256
        and ("scale" in _VARLEN or math.isclose(scale, head**-0.5))
    )


def varlen_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float
) -> torch.Tensor:
    """Block-diagonal causal attention of a pack in one flash call. q/k/v [t, heads, hn] (k/v heads already repeated
    for GQA), `cu_seqlens` int32 [n + 1] on the device, `max_seqlen` a Python int -> [t, heads, hn].
    torch 2.10 took `is_causal=True`; 2.11 on replaced it with `window_size=(-1, 0)` (no left or right limit but
    the diagonal), read from the signature."""
    from torch.nn.attention.varlen import varlen_attn

    extra: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in _VARLEN else {"is_causal": True}
    if "scale" in _VARLEN:
        extra["scale"] = scale
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    out = varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **extra)
    assert isinstance(out, torch.Tensor)  # no return_aux: the output alone, without the logsumexp
    return out


def transformer_engine_available() -> bool:
    """True when CUDA is present and Transformer Engine imports (GPU installs); the local spec is the CPU route."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001 an ImportError, or an OSError from CUDA libraries it cannot load
        return False
    return True


def gpt_layer_spec(config: TransformerConfig, use_te: Optional[bool] = None):
    """The GPT layer spec for `config`: Transformer Engine's when TE is importable, else the local spec with
    `TorchCoreAttention` in place of `DotProductAttention` (needed for CP and packed sequences on CPU).

    Mixture-of-experts and multi-latent-attention models get a per-layer block spec (dense and MoE layers differ:
    `config.moe_layer_freq`), of this pipeline stage's layers.

    Multi-latent attention on the local spec: megatron-core (0.16.1 to 0.19.2) builds the q/kv down projections as
    column-parallel linears, then gathers their outputs over TP; the rotary key head taken from that gathered output
    is shared by the heads of every TP rank, but the gather's backward only splits, so under TP each rank's k_pe
    gradient lacks the other ranks' heads (measured: TP2 gradients off by 2e-2). The down projections are made
    replicated plain linears here instead (`Linear`, parameters marked sequence-parallel), the layout the
    Transformer Engine spec has: Megatron then gathers k_pe over the sequence-parallel region, whose backward sums
    over TP. That is exact with sequence parallelism, which tensor parallelism of such models requires
    (`mrl.config.checks`).
    """
    from megatron.core.models.gpt import gpt_layer_specs

    use_te = transformer_engine_available() if use_te is None else use_te
    if config.num_moe_experts or config.multi_latent_attention:
        block = gpt_layer_specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization=config.normalization
        )
        if not use_te:
            for layer in block.layer_specs:
                attention = layer.submodules.self_attention.submodules
                attention.core_attention = TorchCoreAttention
                if config.multi_latent_attention:
                    from megatron.core.post_training.modelopt.layers import Linear
                    from megatron.core.transformer.identity_op import IdentityOp

                    attention.linear_q_down_proj = attention.linear_kv_down_proj = Linear
                    if config.q_lora_rank is None:
                        # Without q LoRA there is no q norm (HF's DeepSeek: q_proj alone); megatron-core 0.19's
                        # local spec still gives one and its MLA constructor refuses it ("q_layernorm ... is
                        # non-trivial, but q_lora_rank is None").
                        attention.q_layernorm = IdentityOp
        return block
    common = dict(qk_layernorm=config.qk_layernorm)
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**common)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(**common, normalization=config.normalization)
    spec.submodules.self_attention.submodules.core_attention = TorchCoreAttention
    return spec
