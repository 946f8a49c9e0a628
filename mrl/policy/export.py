"""HF-named full tensors from the sharded Megatron policy, in bounded buckets (rank side).

Used by the weight refit into the rollout engines and by the HF export of a training step. Every rank of the policy
runs the same sequence of collectives; only global rank 0 ends up with the tensors (the default), or, with
`bucket(..., local=True)`, the first rank of the bucket's owning pipeline stage (tp = cp = dp = 0 of that stage):
the collective refit transport with one sender per stage, where each stage sends its own layers and nothing crosses
the pipeline group.

Data flow for one Megatron parameter (rule from converters.mapping, the one source of names and layouts):
    owning pipeline stage, every TP rank:  all-gather its shard over the TP group -> full tensor
                                           (column/vocab parallel: dim 0; row parallel: dim 1; fc1: per gate/up half)
                                           (a routed expert: only on the expert-parallel rank that holds it -- the
                                           ranks of a TP group share their EP rank -- then broadcast over the EP group,
                                           EP rank 0 being the one in rank 0's pipeline group, together with the
                                           bucket's other experts of that rank (one broadcast of their concatenation);
                                           the other EP ranks drop them once converted)
    pipeline broadcast (only the ranks with tp = cp = dp = 0, which form rank 0's pipeline group; skipped with
                        `local=True`):
                                           owner stage -> every stage, shape and dtype first, then the data
    global rank 0 (`local=True`: the owner stage's first rank):
                                           converters' rename/split (QKV per query group, fc1 -> gate/up, vocab
                                           padding stripped) -> (hf_name, tensor); the Megatron tensor is dropped
                                           before the next parameter is gathered
A layer with a LoRA adapter (`policy.lora`) is read as its merged shard, W + s * B @ A (mrl/model/lora.py), so the
engine receives the adapted model's weights.
A bucket packed in parts (`bucket_part`: one pipeline stage, a transport that joins parts, shared-memory files): a
routed expert is gathered only over its own EP rank's TP group and converted by that EP rank's first rank, which
packs its experts of the bucket itself; rank 0 converts the rest. Nothing crosses the EP group and the EP ranks
convert side by side (the tiny MoE of benchmarks/policy_refit.py on 2 cores: EP2's refit from 1441 ms to
1109-1188 ms, EP1's 1135-1268; rank 0's export 1.05 s -> 0.52 s, EP1's 0.73 s).

Parameters are gathered one at a time, and only those of the bucket asked for (experts too: a bucket holding half of
a layer's experts gathers that half), so no rank ever holds more than one bucket of full tensors plus the one
parameter in flight.

Buckets are planned before any tensor moves, from the config alone (shapes are known), so every rank agrees on
where a bucket ends without talking. A bucket is a run of whole units (embedding, one decoder layer, the final norm,
the output layer) whose HF tensors add up to at most `bucket_bytes`, all of one pipeline stage when the plan is given
the stages (`stages=`: a bucket never spans two stages, so one stage's first rank can hold and send it alone;
`bucket_stage` names its owner). A unit larger than that:
    split_units=False (default): goes alone, a bucket of one unit, whatever its size (a DeepSeek-V3 MoE layer:
        ~22.5 GB in bf16), so the bound only holds for models whose layers fit in it;
    split_units=True: is cut at tensor granularity into buckets of at most `bucket_bytes`: each Megatron parameter
        whole where it fits (q/k/v, gate/up and a weight stay together), a parameter larger than the bound cut
        between its HF tensors (gathered once per bucket that carries part of it, each bucket keeping its part),
        and a single HF tensor larger than the bound alone in its bucket (the one case a bucket exceeds it: e.g.
        DeepSeek-V3's embedding, 1.85 GB in bf16).

What a split bucket requires of the receiver (vLLM 0.32, vllm/model_executor/model_loader/reload/):
    `Worker.reload_weights(weights_iterator, is_checkpoint_format=True)` (gpu_model_runner.py:5287 ->
    reload/inplace.py:92-96) runs initialize_layerwise_reload + model.load_weights + finalize_layerwise_reload in
    EACH call. The unit of completeness is a vLLM module with parameters (qkv_proj fusing q/k/v, gate_up_proj,
    `mlp.experts`: a FusedMoE holding w13/w2 of ALL the layer's local experts): its loaders buffer what arrives
    (layerwise.py:185) and process the module once its elements are all in (layerwise.py:217-219,
    `load_numel >= load_numel_total`). The call's finalize (layerwise.py:226-284) keeps the old weights of a module
    that got nothing (`_place_kernel_tensors`, L256-267), but processes a module that got part of its elements as
    "Delayed processing" (L273-275): materialised fresh (meta.py:145-153, torch.empty_strided at meta.py:53), only
    the arrived part loaded, the whole copied over the live weights -- the rest is garbage. So with one
    reload_weights call per bucket a bucket must not split a vLLM module: a split unit (split_units=True) is only
    safe if the receiver keeps ONE layerwise session open over the buckets, as vLLM's own chunked weight transfer
    does (vllm/distributed/weight_transfer/nccl_engine.py:159-173 and ipc_engine.py:160-174:
    initialize_layerwise_reload in start_weight_update, model.load_weights per chunk (nccl_engine.py:227,
    ipc_engine.py:245), finalize_layerwise_reload in finish_weight_update; the per-module count
    `LayerReloadingInfo.load_numel`, reload/types.py, carries over between load_weights calls). In such a session
    the tensors of a module that is not complete yet stay referenced by vLLM (`info.loaded_weights`,
    layerwise.py:185: the checkpoint tensor as passed, before the TP narrow) until its last tensor arrives: the
    receiver must not reuse or free a buffer whose views it passed for a module still incomplete (copy them, or
    keep the buffer), and it holds up to one module's checkpoint tensors (all routed experts of a layer, on every
    vLLM worker) until the module is processed.

Memory bound (measured on the tiny Qwen3-MoE at EP2, fp32, bound 160,000 bytes < one MoE layer of 264,832:
tests/functional/policy/test_policy_export_memory.py, the CPU allocator's peak per bucket): on every rank the exporter
holds at most one bucket of HF tensors (its planned bytes: <= `bucket_bytes`, unless it is a single larger HF tensor)
plus the working copies of the one parameter in flight -- its full Megatron tensor while it is converted (q/k/v and
gate/up are copied out of it), under TP its gathered shards while they are concatenated (the gated fc1: its gate and
up halves concatenated separately first), and for a parameter cut between buckets the HF parts that other buckets
carry. Slack: <= 2 x the largest Megatron parameter of the bucket (1 x for one kept whole, outside a gated TP
concatenation), 3 x for a parameter cut between buckets under TP: its gathered shards, the concatenated tensor and the
HF parts of the other buckets can be alive at once (a clean CI run measured 147,456 = 3 x 49,152 bytes for the k part
of the tiny model's fused q/k/v at TP2). Measured: rank 0 peaks at 174,720 bytes with split buckets, 264,832 with
whole-layer ones; rank 1 (EP rank 1, which sends its experts and keeps nothing) at 131,072: its experts of the bucket,
sent together (a bucket's experts of one EP rank are one buffer, within the bucket's bytes). The other EP ranks
receive them (a broadcast over the EP group) and drop them once converted. `ShardedExporter.peak_bytes` counts the
same on rank 0 (not the TP shard list). The transport's slots (the packed payload, two when double-buffered) come on
top, on rank 0 (with `local=True`: on each stage's first rank, which then holds its own stage's buckets only).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from converters import ModelDims, experts_per_rank, to_local_expert
from converters import transforms as T
from converters.layers import SpecNames
from converters.mapping import ParamRule, expected_hf_shapes, hf_parts, layer_index, megatron_to_hf, param_rules
from mrl.model.hybrid import stage_gpt_layers, to_gpt
from mrl.model.lora import LoraSettings, adapters, is_adapted, merged_weights
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


@dataclass(frozen=True)
class Piece:
    """One Megatron parameter of a bucket and the HF tensors of it the bucket carries: all of them, unless the
    parameter is larger than the bound and cut between its HF tensors (then every bucket with a part gathers it)."""

    rule: ParamRule
    hf: tuple[str, ...]


#: The plan of one bucket: its pieces in model order.
Bucket = list[Piece]


def _unit(rule: ParamRule) -> str:
    index = layer_index(rule.megatron)
    return f"layer{index}" if index is not None else rule.megatron.split(".")[0]


def _units(dims: ModelDims, names: SpecNames) -> list[list[ParamRule]]:
    units: list[list[ParamRule]] = []
    for rule in param_rules(dims, names):
        if units and _unit(units[-1][-1]) == _unit(rule):
            units[-1].append(rule)
        else:
            units.append([rule])
    return units


def plan_buckets(
    dims: ModelDims,
    names: SpecNames,
    bucket_bytes: int,
    element_size: int,
    *,
    split_units: bool = False,
    stages: StageInfo | None = None,
) -> list[Bucket]:
    """The pieces of each refit bucket, in model order (identical on every rank): whole units packed up to
    `bucket_bytes` of HF tensors; a larger unit alone (`split_units=False`) or cut at tensor granularity into
    buckets of at most `bucket_bytes` (`split_units=True`; the receiver must then keep one layerwise reload
    session over the buckets: module docstring). Only a single HF tensor larger than the bound makes a bucket exceed
    it, alone in that bucket. With `stages`, a unit of another pipeline stage than the previous one starts a new
    bucket (`bucket_stage` of every bucket is then defined)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must be >= 1")
    hf_bytes = {name: torch.Size(shape).numel() * element_size for name, shape in expected_hf_shapes(dims).items()}
    buckets: list[Bucket] = []
    size = 0
    stage = None  # the pipeline stage of the last unit planned

    def add(piece: Piece, piece_bytes: int) -> None:
        """`piece` into the last bucket if it is empty or the piece fits (merged with the previous piece of the same
        parameter), else into a new bucket."""
        nonlocal size
        if buckets and (not buckets[-1] or size + piece_bytes <= bucket_bytes):
            last = buckets[-1][-1] if buckets[-1] else None
            if last is not None and last.rule == piece.rule:  # the next HF tensors of a parameter cut in two
                buckets[-1][-1] = Piece(piece.rule, last.hf + piece.hf)
            else:
                buckets[-1].append(piece)
            size += piece_bytes
        else:
            buckets.append([piece])
            size = piece_bytes

    for unit in _units(dims, names):
        unit_bytes = sum(hf_bytes[h] for rule in unit for h in rule.hf)
        unit_stage = stages.owner(unit[0].megatron) if stages is not None else None
        same_stage, stage = unit_stage == stage, unit_stage
        if unit_bytes <= bucket_bytes or not split_units:  # whole: with the previous units if it fits, else alone
            if not (buckets and same_stage and size + unit_bytes <= bucket_bytes):
                buckets.append([])
                size = 0
            buckets[-1].extend(Piece(rule, rule.hf) for rule in unit)
            size += unit_bytes
            continue
        buckets.append([])  # a unit larger than the bound, cut at tensor granularity from a bucket of its own
        size = 0
        for rule in unit:
            rule_bytes = sum(hf_bytes[h] for h in rule.hf)
            if rule_bytes <= bucket_bytes:  # a parameter's HF tensors together where they fit
                add(Piece(rule, rule.hf), rule_bytes)
            else:
                for h in rule.hf:  # a single HF tensor larger than the bound ends up alone
                    add(Piece(rule, (h,)), hf_bytes[h])
    return buckets


def bucket_stage(bucket: Bucket, stages: StageInfo) -> int:
    """The pipeline stage that holds every parameter of `bucket` (a plan made with `stages=`); ValueError if the
    bucket spans two stages."""
    owners = {stages.owner(piece.rule.megatron) for piece in bucket}
    if len(owners) != 1:
        raise ValueError(f"a bucket spans pipeline stages {sorted(owners)}: plan it with plan_buckets(stages=...)")
    return owners.pop()


def bucket_names(bucket: Bucket) -> list[str]:
    """The HF tensor names a planned bucket carries, in order."""
    return [h for piece in bucket for h in piece.hf]


class ShardedExporter:
    """Gathers full HF tensors from this rank's shards; construct on every rank (it exchanges stage layouts).

    `bucket(pieces)` ends on global rank 0 (every stage's tensors broadcast over rank 0's pipeline group);
    `bucket(pieces, local=True)` (a bucket of one stage) ends on that stage's first rank (`is_stage_first`) and
    nothing crosses the pipeline group: the ranks of other stages take no part at all.

    `peak_bytes`: the most bytes of full tensors it held at once on this rank since construction (or the last
    `reset_peak`): the bucket's HF tensors so far plus the parameter in flight (its full Megatron tensor and its HF
    parts while it is converted); the TP all-gather's shard list, concatenated right away, is not counted (it is
    measured with the CPU allocator in tests/functional/policy/test_policy_export_memory.py)."""

    def __init__(self, model: Any, dims: ModelDims, *, layer_offset: int, names: SpecNames):
        from megatron.core import parallel_state as ps

        self.dims = dims
        self.names = names
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.ep_size = ps.get_expert_model_parallel_world_size()
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.ep_group = ps.get_expert_model_parallel_group()
        self.experts_per_rank = experts_per_rank(dims, self.ep_size)
        self.in_root_tp_group = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
        """cp = dp = 0: this stage's TP group that gathers the dense parameters for rank 0 (other TP groups hold
        replicas or another sequence chunk's view of them and gather nothing)."""
        self.in_root_pipeline = self.in_root_tp_group and ps.get_tensor_model_parallel_rank() == 0
        """tp = cp = dp = 0 (hence EP rank 0): the first rank of this stage, in rank 0's pipeline group."""
        self.in_expert_root = ps.get_expert_data_parallel_rank() == 0
        """Expert-data-parallel rank 0: the TP group of this EP rank that gathers its experts for a bucket packed in
        parts (`bucket_part`); its TP rank 0 packs them. Global rank 0 is EP rank 0's."""
        self.is_root = collectives.rank() == 0
        self.layer_offset = layer_offset
        # every stage's (first layer, layer count); gathered over a pipeline group of one too (collectives.py)
        gathered = collectives.all_gather(torch.tensor(stage_gpt_layers(model)), self.pp_group)
        self.stages = StageInfo(tuple(int(g[0]) for g in gathered), tuple(int(g[1]) for g in gathered))
        # parameters and persistent buffers (a router's expert bias) of this rank's unwrapped model, under GPT's
        # stage-local names (the converters' rules name GPT layers; `mrl.model.hybrid`)
        self.params = _gpt_named({**dict(model.named_buffers()), **dict(model.named_parameters())})
        self._merged = _gpt_named(merged_weights(model))  # LoRA: the wrapped layers' weights, adapters merged
        self._adapters = _gpt_named(adapters(model))
        self.lora: LoraSettings | None = getattr(model, "lora_settings", None)
        self._a_parameter = next(model.parameters())
        self.peak_bytes = 0
        self._experts: dict[str, torch.Tensor] = {}  # routed experts received together, not yet converted
        self._experts_bytes = 0

    def reset_peak(self) -> None:
        self.peak_bytes = 0

    def _held(self, nbytes: int) -> None:
        self.peak_bytes = max(self.peak_bytes, nbytes)

    @property
    def device(self) -> torch.device:
        """Where this rank's parameters are now (memory offload moves them): broadcast receivers put what they
        receive there too, so every full tensor of a bucket is on one device."""
        return self._a_parameter.device

    def _local_name(self, megatron_name: str, ep_rank: int | None = None) -> str:
        """This rank's name of a parameter: its stage's layer index, its expert-parallel rank's expert index (with
        `ep_rank`: the name expert-parallel rank `ep_rank` holds it under, which this rank has a parameter of the
        same shape under)."""
        name = megatron_name
        if self.experts_per_rank:
            local = to_local_expert(name, self.ep_rank if ep_rank is None else ep_rank, self.experts_per_rank)
            assert local is not None, f"{name} is held by another expert-parallel rank"
            name = local
        index = layer_index(name)
        if index is None:
            return name
        return name.replace(f"decoder.layers.{index}.", f"decoder.layers.{index - self.layer_offset}.", 1)

    def _tp_gathered(self, rule: ParamRule) -> torch.Tensor:
        """The full tensor of `rule` on every TP rank of the owning stage (and expert-parallel rank)."""
        name = self._local_name(rule.megatron)
        local = self._merged[name]() if name in self._merged else self.params[name].detach()
        if rule.tp_dim is None or self.tp_size == 1:
            return local.clone()
        shards = collectives.all_gather(local, self.tp_group)
        return T.tp_unshard(shards, rule.tp_dim, gated=rule.gated)

    def _stage_tensor(self, rule: ParamRule) -> torch.Tensor:
        """The full tensor of `rule` on every rank of its owning stage's EP group (without EP: its TP gather; a
        routed expert received with others by `_receive_experts`: from there)."""
        if rule.expert is None or self.ep_size == 1:
            return self._tp_gathered(rule)
        received = self._experts.pop(rule.megatron, None)
        if received is not None:
            self._experts_bytes -= _nbytes(received)
            return received
        owner = rule.expert // self.experts_per_rank
        full = self._tp_gathered(rule) if owner == self.ep_rank else None
        return collectives.broadcast_tensor(full, owner, self.ep_group, device=self.device)

    def _expert_run(self, pieces: list[Piece], start: int) -> list[ParamRule]:
        """The routed-expert parameters from `pieces[start]` on that one expert-parallel rank holds, each carried
        whole by this bucket, of one dtype, on this rank's stage: what `_receive_experts` moves in one broadcast."""
        first = pieces[start].rule
        if (
            self.ep_size == 1
            or first.expert is None
            or first.megatron in self._experts
            or self.stages.owner(first.megatron) != self.pp_rank
        ):
            return []
        owner = first.expert // self.experts_per_rank
        dtype = self.params[self._local_name(first.megatron, owner)].dtype
        run = []
        for piece in pieces[start:]:
            rule = piece.rule
            if (
                rule.expert is None
                or rule.expert // self.experts_per_rank != owner
                or len(piece.hf) != len(rule.hf)
                or self.params[self._local_name(rule.megatron, owner)].dtype != dtype
            ):
                break
            run.append(rule)
        return run

    def _receive_experts(self, rules: list[ParamRule]) -> None:
        """The full tensors of `rules` (routed experts of one expert-parallel rank) on every rank of the EP group in
        one broadcast of their concatenation (shapes are known everywhere: each rank holds experts of the same
        shapes), kept as views of it until `_stage_tensor` takes them (their HF tensors are views too, so they
        count once, as the bucket's). A bucket's experts then cost one collective per holding rank instead of two per
        parameter: on the tiny MoE of benchmarks/policy_refit.py (16 experts of 3 MiB a layer, 16 MiB buckets, EP2
        on 2 CPU ranks) rank 0's export of the model went from 1.21-1.25 s to 0.62-0.67 s (EP1: 0.44-0.53 s; the
        rest is the other rank's experts crossing gloo)."""
        expert = rules[0].expert
        assert expert is not None, "`_expert_run` gives routed experts only"
        owner = expert // self.experts_per_rank
        shapes = [self._full_shape(rule, owner) for rule in rules]
        dtype = self.params[self._local_name(rules[0].megatron, owner)].dtype
        flat = torch.empty(sum(shape.numel() for shape in shapes), dtype=dtype, device=self.device)
        parts = torch.split(flat, [shape.numel() for shape in shapes])
        if owner == self.ep_rank:  # one gathered parameter at a time beside the buffer
            for rule, part in zip(rules, parts):
                part.copy_(self._tp_gathered(rule).reshape(-1))
        collectives.broadcast(flat, owner, self.ep_group)
        for rule, shape, part in zip(rules, shapes, parts):
            self._experts[rule.megatron] = part.view(shape)
        self._experts_bytes += _nbytes(flat)

    def _full_shape(self, rule: ParamRule, owner: int) -> torch.Size:
        """The full (TP-gathered) shape of routed-expert parameter `rule`, from this rank's parameter of the same
        local index."""
        shape = list(self.params[self._local_name(rule.megatron, owner)].shape)
        if rule.tp_dim is not None and self.tp_size > 1:
            shape[rule.tp_dim] *= self.tp_size
        return torch.Size(shape)

    def _pp_broadcast(self, tensor: torch.Tensor | None, owner: int) -> torch.Tensor | None:
        """Owner stage -> every stage of rank 0's pipeline group. Others return None."""
        if self.pp_size == 1:
            return tensor
        if not self.in_root_pipeline:
            return None
        return collectives.broadcast_tensor(tensor, owner, self.pp_group, device=self.device)

    def is_stage_first(self, stage: int) -> bool:
        """Whether this rank is the first rank (tp = cp = dp = 0) of pipeline stage `stage`."""
        return self.in_root_pipeline and self.pp_rank == stage

    def _gathers(self, rule: ParamRule) -> bool:
        """Whether this rank of the owning stage takes part in gathering `rule` for rank 0 (or the stage's first rank):
        a routed expert under EP travels over the EP group (every rank); otherwise only rank 0's TP group gathers, and
        of it only the first rank when there is nothing to all-gather (a replica's copy would be dropped unused)."""
        if rule.expert is not None and self.ep_size > 1:
            return True
        if not self.in_root_tp_group:
            return False
        return self.in_root_pipeline or (rule.tp_dim is not None and self.tp_size > 1)

    def _full_tensor(self, rule: ParamRule, local: bool = False) -> torch.Tensor | None:
        """The full Megatron tensor of `rule` on global rank 0, or with `local` on the owner stage's first rank (None
        elsewhere; the ranks that hold a part run the collectives, with `local` only the owner stage's)."""
        owner = self.stages.owner(rule.megatron)
        full = self._stage_tensor(rule) if owner == self.pp_rank and self._gathers(rule) else None
        if local:
            return full if self.is_stage_first(owner) else None
        full = self._pp_broadcast(full, owner)
        return full if self.is_root else None

    def _full_tensors(self, pieces: list[Piece], local: bool) -> Iterator[tuple[Piece, torch.Tensor | None]]:
        """Each piece with its full Megatron tensor on rank 0 (with `local`: on the owner stage's first rank), None
        elsewhere; a bucket's routed experts of one EP rank travel together (`_receive_experts`)."""
        for index, piece in enumerate(pieces):
            run = self._expert_run(pieces, index)
            if run:
                self._receive_experts(run)
            yield piece, self._full_tensor(piece.rule, local)

    def _own_parts(self, pieces: list[Piece]) -> Iterator[tuple[Piece, torch.Tensor | None]]:
        """Each piece with its full Megatron tensor where `bucket_part` packs it: a routed expert on its own EP
        rank's packer (gathered over that rank's TP group), anything else on rank 0; None elsewhere."""
        for piece in pieces:
            rule = piece.rule
            if rule.expert is None or self.ep_size == 1:
                yield piece, self._full_tensor(rule)
                continue
            own = rule.expert // self.experts_per_rank == self.ep_rank and self.in_expert_root
            full = self._tp_gathered(rule) if own else None
            yield piece, full if own and self.tp_rank == 0 else None

    def _hf_tensors(self, fulls: Iterator[tuple[Piece, torch.Tensor | None]]) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, tensor) of each piece whose full tensor this rank holds, one parameter converted at a time."""
        held = 0  # bytes of the HF tensors of earlier pieces (the caller keeps them)
        for piece, full in fulls:
            if full is None:  # off the holder: the received tensor is dropped before the next one is gathered
                continue
            base, in_flight, kept, tensor = full.untyped_storage().data_ptr(), _nbytes(full), 0, None
            in_flight += self._experts_bytes  # the run's experts still to convert (their HF tensors are views)
            for hf_name, tensor in megatron_to_hf([(piece.rule.megatron, full)], self.dims, require_complete=False):
                if tensor.untyped_storage().data_ptr() != base:  # a converted copy (q/k/v, gate/up, vocab cut)
                    in_flight += _nbytes(tensor)
                self._held(held + in_flight)
                if hf_name in piece.hf:
                    kept += _nbytes(tensor)
                    yield hf_name, tensor
            held += kept
            del full, tensor  # neither kept past its piece (a part another bucket carries is dropped here)

    def bucket(self, pieces: list[Piece], local: bool = False) -> list[tuple[str, torch.Tensor]]:
        """HF-named tensors of one planned bucket on rank 0 (empty list elsewhere); collective on every rank.
        `local` (a bucket of one stage: `plan_buckets(stages=...)`): on the owner stage's first rank instead, without
        the pipeline broadcast (collective on the owner stage's ranks only)."""
        if local and len({self.stages.owner(piece.rule.megatron) for piece in pieces}) > 1:
            raise ValueError("a local export needs a bucket of one pipeline stage: plan_buckets(stages=...)")
        return list(self._hf_tensors(self._full_tensors(pieces, local)))

    def bucket_part(self, pieces: list[Piece]) -> list[tuple[str, torch.Tensor]]:
        """This rank's part of a bucket packed by several ranks (one pipeline stage): global rank 0 gets the bucket's
        tensors other than routed experts, and under EP each expert-parallel rank's first rank (its TP rank 0 of
        expert-data-parallel rank 0) its own routed experts, converted where they live: nothing crosses the EP
        group, and the EP ranks convert their experts side by side. The parts, taken together, are `bucket(pieces)`.
        Collective over rank 0's TP group and each EP rank's gathering TP group only."""
        if self.pp_size > 1:
            raise ValueError("a bucket packed in parts needs one pipeline stage (pipeline_model_parallel_size=1)")
        return list(self._hf_tensors(self._own_parts(pieces)))

    def adapter_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The LoRA adapters as a PEFT adapter folder names them (`base_model.model.<HF module>.lora_A.weight` [r, in],
        `.lora_B.weight` [out, r]) on global rank 0, an empty list elsewhere; collective on every rank. Per adapted
        layer: its split factor (a column layer's B, a row layer's A) all-gathered over the TP group on the base
        weight's axis (a gated fc1's B per gate/up half), its replicated factor taken from TP rank 0, both sent over
        rank 0's pipeline group from the owning stage; on rank 0 a fused layer's B is cut into its HF modules' B as
        the weight is (q/k/v per query group, gate/up), and they share A. Adapters are small (r x (in + out) a layer),
        so the whole set is held at once."""
        if self.lora is None:
            raise ValueError("the policy has no LoRA adapters (policy.lora)")
        out: list[tuple[str, torch.Tensor]] = []
        for rule in param_rules(self.dims, self.names):
            if not is_adapted(rule.megatron, self.lora):
                continue
            if rule.expert is not None:
                raise ValueError(
                    "routed experts' adapters have no PEFT folder here (transformers holds a layer's experts as one "
                    "fused parameter); the merged model carries them"
                )
            factors = self._adapter_factors(rule)
            if factors is not None and self.is_root:
                out += _peft_names(rule, *factors, self.dims)
        return out

    def _adapter_factors(self, rule: ParamRule) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A, B) of the layer whose weight is `rule`, whole, on rank 0's pipeline group; None elsewhere."""
        owner = self.stages.owner(rule.megatron)
        a: torch.Tensor | None = None
        b: torch.Tensor | None = None
        if owner == self.pp_rank and self.in_root_tp_group:
            lora = self._adapters[self._local_name(rule.megatron)]
            pair = (lora.lora_b, lora.lora_a) if lora.kind == "column" else (lora.lora_a, lora.lora_b)
            split, whole = pair[0].detach(), pair[1].detach()
            if self.tp_size > 1:
                split = T.tp_unshard(collectives.all_gather(split, self.tp_group), rule.tp_dim, gated=rule.gated)
            a, b = (whole, split) if lora.kind == "column" else (split, whole)
        if not self.in_root_pipeline:
            return None
        a, b = self._pp_broadcast(a, owner), self._pp_broadcast(b, owner)
        assert a is not None and b is not None, "rank 0's pipeline group receives every stage's adapters"
        return a.clone(), b.clone()


def _peft_names(rule: ParamRule, a: torch.Tensor, b: torch.Tensor, dims: ModelDims) -> list[tuple[str, torch.Tensor]]:
    """PEFT's tensors of one adapted Megatron layer: B cut into the HF modules the weight is cut into, A shared."""
    out = []
    for hf_name, b_part in hf_parts(rule, b, dims):
        module = "base_model.model." + hf_name.removesuffix(".weight")
        out += [(f"{module}.lora_A.weight", a.clone()), (f"{module}.lora_B.weight", b_part)]  # own storage each
    return out


def _gpt_named(by_name: dict[str, Any]) -> dict[str, Any]:
    """A dict keyed by the model's own (hybrid) names, keyed by GPT's names instead."""
    return {to_gpt(name): value for name, value in by_name.items()}


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
