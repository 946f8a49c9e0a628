"""Pure tensor layout transforms between Hugging Face and Megatron-Core parameters.

Every function here is shape-in, shape-out, with no knowledge of names or files, so each one is unit tested on its
own (odd sizes included) and reused by import, export and the weight refit into the rollout engines.

Layouts (h = hidden, hd = head dim, nh = query heads, ng = query groups = kv heads, f = ffn hidden):
- HF q/k/v_proj.weight: [nh*hd, h], [ng*hd, h], [ng*hd, h] (biases drop the trailing h).
- Megatron linear_qkv.weight: [ng * (nh/ng + 2) * hd, h], grouped: for each query group g, the nh/ng query heads of
  g, then the key head of g, then the value head of g. Tensor parallelism splits it along dim 0 in whole groups.
- Megatron linear_fc1.weight (SwiGLU): [2f, h] = cat[gate, up]. Under tensor parallelism each rank holds
  cat[gate_r, up_r] (its own slices of both halves), NOT a contiguous dim-0 slice of the full tensor.
- Vocabulary-sized tensors ([V, h]) are padded with zero rows to a size tensor parallelism divides.
"""

from __future__ import annotations

import torch


def _check_qkv_sizes(num_heads: int, num_groups: int) -> int:
    if num_groups <= 0 or num_heads % num_groups != 0:
        raise ValueError(f"num_heads={num_heads} must be a positive multiple of num_query_groups={num_groups}")
    return num_heads // num_groups


def merge_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_groups: int, head_dim: int
) -> torch.Tensor:
    """HF q/k/v ([nh*hd, ...], [ng*hd, ...], [ng*hd, ...]) -> Megatron grouped QKV [ng*(nh/ng+2)*hd, ...].

    Works for weights ([*, h]) and biases ([*]) alike: only dim 0 is rearranged.
    """
    heads_per_group = _check_qkv_sizes(num_heads, num_groups)
    rest = tuple(q.shape[1:])
    expected = {"q": num_heads * head_dim, "k": num_groups * head_dim, "v": num_groups * head_dim}
    for label, tensor in (("q", q), ("k", k), ("v", v)):
        if tensor.shape[0] != expected[label] or tuple(tensor.shape[1:]) != rest:
            raise ValueError(
                f"{label} has shape {tuple(tensor.shape)}, expected ({expected[label]}, {', '.join(map(str, rest))})"
            )
    q_g = q.reshape(num_groups, heads_per_group * head_dim, *rest)  # [ng, nh/ng*hd, ...]
    k_g = k.reshape(num_groups, head_dim, *rest)  # [ng, hd, ...]
    v_g = v.reshape(num_groups, head_dim, *rest)  # [ng, hd, ...]
    return torch.cat([q_g, k_g, v_g], dim=1).reshape(-1, *rest)


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron grouped QKV [ng*(nh/ng+2)*hd, ...] -> HF (q [nh*hd, ...], k [ng*hd, ...], v [ng*hd, ...])."""
    heads_per_group = _check_qkv_sizes(num_heads, num_groups)
    rows = num_groups * (heads_per_group + 2) * head_dim
    if qkv.shape[0] != rows:
        raise ValueError(
            f"fused QKV has {qkv.shape[0]} rows, expected {rows} for nh={num_heads}, ng={num_groups}, "
            f"head_dim={head_dim}"
        )
    rest = tuple(qkv.shape[1:])
    grouped = qkv.reshape(num_groups, (heads_per_group + 2) * head_dim, *rest)
    q, k, v = torch.split(grouped, [heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(), v.reshape(-1, *rest).contiguous())


def merge_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF gate_proj [f, h] and up_proj [f, h] -> Megatron linear_fc1 [2f, h] = cat[gate, up]."""
    if gate.shape != up.shape:
        raise ValueError(f"gate_proj {tuple(gate.shape)} and up_proj {tuple(up.shape)} must have the same shape")
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron linear_fc1 [2f, h] -> HF (gate_proj [f, h], up_proj [f, h])."""
    if fc1.shape[0] % 2 != 0:
        raise ValueError(f"linear_fc1 has an odd number of rows ({fc1.shape[0]}); expected cat[gate, up]")
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int = 128, tp_size: int = 1) -> int:
    """Megatron's rule: round the vocabulary up to a multiple of `make_vocab_size_divisible_by * tp_size`."""
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def pad_vocab(weight: torch.Tensor, padded_size: int) -> torch.Tensor:
    """[V, h] -> [padded_size, h] with zero rows appended (they are never produced by the tokenizer)."""
    if padded_size < weight.shape[0]:
        raise ValueError(f"padded vocab size {padded_size} is smaller than the vocabulary ({weight.shape[0]})")
    pad = weight.new_zeros((padded_size - weight.shape[0], *weight.shape[1:]))
    return torch.cat([weight, pad], dim=0)


def unpad_vocab(weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V_padded, h] -> [vocab_size, h]: drop the padding rows added on import."""
    if weight.shape[0] < vocab_size:
        raise ValueError(f"vocab tensor has {weight.shape[0]} rows, fewer than the vocabulary ({vocab_size})")
    return weight[:vocab_size].contiguous()


def tp_shard(full: torch.Tensor, dim: int | None, tp_rank: int, tp_size: int, *, gated: bool = False) -> torch.Tensor:
    """The slice of `full` that tensor-parallel rank `tp_rank` holds.

    dim=None: replicated (a copy). dim=0: column-/vocab-parallel. dim=1: row-parallel. `gated=True` is the SwiGLU
    linear_fc1 layout: the rank holds cat[gate_r, up_r].
    """
    if dim is None:
        return full.clone()
    if gated:
        gate, up = split_gate_up(full)
        return torch.cat([tp_shard(gate, 0, tp_rank, tp_size), tp_shard(up, 0, tp_rank, tp_size)], dim=0)
    if full.shape[dim] % tp_size != 0:
        raise ValueError(
            f"dimension {dim} of size {full.shape[dim]} is not divisible by tensor parallel size {tp_size}"
        )
    return torch.chunk(full, tp_size, dim=dim)[tp_rank].contiguous()


def tp_unshard(shards: list[torch.Tensor], dim: int | None, *, gated: bool = False) -> torch.Tensor:
    """Inverse of `tp_shard`: the full tensor from every rank's slice, in rank order."""
    if dim is None:
        return shards[0].clone()
    if gated:
        halves = [split_gate_up(s) for s in shards]
        return torch.cat([torch.cat([g for g, _ in halves], dim=0), torch.cat([u for _, u in halves], dim=0)], dim=0)
    return torch.cat(shards, dim=dim)
