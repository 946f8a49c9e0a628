"""HF-named full tensors from the sharded Megatron policy, in bounded whole-layer buckets (rank side).

Used by the weight refit into the rollout engines and by the HF export of a training step. Every rank of the policy
runs the same sequence of collectives; only global rank 0 ends up with the tensors.

Data flow for one Megatron parameter (rule from converters.mapping, the one source of names and layouts):
    owning pipeline stage, every TP rank:  all-gather its shard over the TP group -> full tensor
                                           (column/vocab parallel: dim 0; row parallel: dim 1; fc1: per gate/up half)
                                           (a routed expert: only on the expert-parallel rank that holds it -- the
                                           ranks of a TP group share their EP rank -- then broadcast over the EP group
                                           to every EP rank, EP rank 0 being the one in rank 0's pipeline group)
    pipeline broadcast (only the ranks with tp = cp = dp = 0, which form rank 0's pipeline group):
                                           owner stage -> every stage, shape and dtype first, then the data
    global rank 0:                         converters' rename/split (QKV per query group, fc1 -> gate/up, vocab
                                           padding stripped) -> (hf_name, tensor)

Buckets are planned before any tensor moves, from the config alone (shapes are known), so every rank agrees on
where a bucket ends without talking: a bucket is a run of whole units (embedding, one decoder layer, the final
norm, the output layer) whose HF tensors add up to at most `bucket_bytes` (a unit larger than that goes alone).
Peak extra memory on rank 0 is one bucket of full tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from converters import ModelDims, experts_per_rank, to_local_expert
from converters import transforms as T
from converters.mapping import ParamRule, expected_hf_shapes, layer_index, megatron_to_hf, param_rules
from mrl.parallel import collectives


@dataclass(frozen=True)
class StageInfo:
    """Which global layers each pipeline stage holds: stage s holds [offsets[s], offsets[s] + counts[s])."""

    offsets: tuple[int, ...]
    counts: tuple[int, ...]

    def owner(self, megatron_name: str) -> int:
        index = layer_index(megatron_name)
        if index is None:
            return 0 if megatron_name.startswith("embedding.") else len(self.offsets) - 1
        for stage, (start, count) in enumerate(zip(self.offsets, self.counts)):
            if start <= index < start + count:
                return stage
        raise ValueError(f"no pipeline stage holds layer {index} ({megatron_name})")


def _unit(rule: ParamRule) -> str:
    index = layer_index(rule.megatron)
    return f"layer{index}" if index is not None else rule.megatron.split(".")[0]


def plan_buckets(dims: ModelDims, names: str, bucket_bytes: int, element_size: int) -> list[list[ParamRule]]:
    """The Megatron parameters of each refit bucket, in model order (identical on every rank)."""
    hf_shapes = expected_hf_shapes(dims)
    units: list[list[ParamRule]] = []
    for rule in param_rules(dims, names):  # type: ignore[arg-type]
        if units and _unit(units[-1][-1]) == _unit(rule):
            units[-1].append(rule)
        else:
            units.append([rule])
    buckets: list[list[ParamRule]] = []
    size = 0
    for unit in units:
        unit_bytes = sum(torch.Size(hf_shapes[h]).numel() * element_size for r in unit for h in r.hf)
        if buckets and size + unit_bytes <= bucket_bytes:
            buckets[-1].extend(unit)
            size += unit_bytes
        else:
            buckets.append(list(unit))
            size = unit_bytes
    return buckets


class ShardedExporter:
    """Gathers full HF tensors from this rank's shards; construct on every rank (it exchanges stage layouts)."""

    def __init__(self, model: Any, dims: ModelDims, *, layer_offset: int, names: str):
        from megatron.core import parallel_state as ps

        self.dims = dims
        self.names = names
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.ep_size = ps.get_expert_model_parallel_world_size()
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.ep_group = ps.get_expert_model_parallel_group()
        self.experts_per_rank = experts_per_rank(dims, self.ep_size)
        self.in_root_pipeline = (ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
                                 and ps.get_context_parallel_rank() == 0)
        self.is_root = collectives.rank() == 0
        self.layer_offset = layer_offset
        # every stage's (first layer, layer count); gathered over a pipeline group of one too (collectives.py)
        gathered = collectives.all_gather(torch.tensor([layer_offset, len(model.decoder.layers)]), self.pp_group)
        self.stages = StageInfo(tuple(int(g[0]) for g in gathered), tuple(int(g[1]) for g in gathered))
        # parameters and persistent buffers (a router's expert bias) of this rank's unwrapped GPTModel
        self.params = {**dict(model.named_buffers()), **dict(model.named_parameters())}
        self._a_parameter = next(model.parameters())

    @property
    def device(self) -> torch.device:
        """Where this rank's parameters are now (memory offload moves them): broadcast receivers put what they
        receive there too, so every full tensor of a bucket is on one device."""
        return self._a_parameter.device

    def _local_name(self, megatron_name: str) -> str:
        """This rank's name of a parameter: its stage's layer index, its expert-parallel rank's expert index."""
        name = megatron_name
        if self.experts_per_rank:
            local = to_local_expert(name, self.ep_rank, self.experts_per_rank)
            assert local is not None, f"{name} is held by another expert-parallel rank"
            name = local
        index = layer_index(name)
        if index is None:
            return name
        return name.replace(f"decoder.layers.{index}.", f"decoder.layers.{index - self.layer_offset}.", 1)

    def _tp_gathered(self, rule: ParamRule) -> torch.Tensor:
        """The full tensor of `rule` on every TP rank of the owning stage (and expert-parallel rank)."""
        local = self.params[self._local_name(rule.megatron)].detach()
        if rule.tp_dim is None or self.tp_size == 1:
            return local.clone()
        shards = collectives.all_gather(local, self.tp_group)
        return T.tp_unshard(shards, rule.tp_dim, gated=rule.gated)

    def _stage_tensor(self, rule: ParamRule) -> torch.Tensor:
        """The full tensor of `rule` on every rank of its owning stage's EP group (without EP: its TP gather)."""
        if rule.expert is None or self.ep_size == 1:
            return self._tp_gathered(rule)
        owner = rule.expert // self.experts_per_rank
        full = self._tp_gathered(rule) if owner == self.ep_rank else None
        return collectives.broadcast_tensor(full, owner, self.ep_group, device=self.device)

    def _pp_broadcast(self, tensor: torch.Tensor | None, owner: int) -> torch.Tensor | None:
        """Owner stage -> every stage of rank 0's pipeline group. Others return None."""
        if self.pp_size == 1:
            return tensor
        if not self.in_root_pipeline:
            return None
        return collectives.broadcast_tensor(tensor, owner, self.pp_group, device=self.device)

    def _full_tensors(self, rules: list[ParamRule]) -> Iterator[tuple[str, torch.Tensor]]:
        """(Megatron name, full tensor) of each rule; the tensors only on global rank 0 (others: nothing)."""
        for rule in rules:
            owner = self.stages.owner(rule.megatron)
            full = self._stage_tensor(rule) if owner == self.pp_rank else None
            full = self._pp_broadcast(full, owner)
            if self.is_root and full is not None:
                yield rule.megatron, full

    def bucket(self, rules: list[ParamRule]) -> list[tuple[str, torch.Tensor]]:
        """HF-named tensors of one planned bucket on rank 0 (empty list elsewhere); collective on every rank."""
        full = list(self._full_tensors(rules))  # every rank runs every collective, whatever it keeps
        if not self.is_root:
            return []
        return list(megatron_to_hf(full, self.dims, require_complete=False))
