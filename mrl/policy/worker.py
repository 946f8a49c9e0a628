"""The Megatron policy on one rank: a plain class that `mrl.distributed.WorkerGroup` runs in one Ray actor per rank.

Each rank builds its shard of the model (TP/PP/CP from `policy.parallel`, data parallel = the rest of the world),
loads the weights it owns (HF safetensors, or its slices of a Megatron checkpoint), wraps the model in Megatron's
DDP and builds Megatron's optimizer and LR schedule.
The controller (`mrl.policy.group.Policy`) shards batches over data-parallel ranks; every TP/PP/CP rank of a
data-parallel group receives the same `RankBatch` and runs the same Megatron schedule.

Leaders: the rank with tp = cp = 0 on the last pipeline stage of each data-parallel group returns the group's
results (logprobs, metrics); the other ranks return None.

Sequence-length rule (`mrl.parallel.layout.length_multiple`, the one the config check applies): the worker
right-pads the batch to that multiple (pad tokens are masked out of every loss) and cuts returned logprobs back.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from mrl.config.schema import PolicyConfig
from mrl.inference.transports.base import SenderLayout
from mrl.model.router_replay import disagreement_metrics
from mrl.parallel import collectives
from mrl.parallel.devices import current_device
from mrl.policy.construction import (
    add_adapters,
    build_policy_module,
    build_reference,
    initial_weights,
    parallel_dims,
    read_model_config,
    routing_replay,
    speed_settings,
    start_process_groups,
    transformer_config,
    transformer_overrides,
    wrap_for_training,
)
from mrl.policy.expert_load import ExpertLoad
from mrl.policy.interface import PolicyLoss, RankBatch, pad_routing
from mrl.policy.memory import PARTS, HostOffload, PhasePeaks
from mrl.policy.speed import gather_weights
from mrl.policy.train_step import StepContext, logprobs_of_batch, train_on_batch

if TYPE_CHECKING:
    from converters.layers import SpecNames
    from mrl.inference.transports import CollectiveTransport, WeightTransport
    from mrl.policy.export import ShardedExporter


def _refuse_nonfinite_weights(model: list, path: str) -> None:
    """Raise on every rank alike (a MAX over the default group) when any rank's weights hold inf or NaN: no
    checkpoint or export is ever written with them (a skipped non-finite step leaves the weights finite; this is the
    last line should anything else put them there)."""
    bad = next((name for chunk in model for name, p in chunk.named_parameters() if not bool(p.isfinite().all())), None)
    flag = torch.tensor([0.0 if bad is None else 1.0])
    collectives.all_reduce(flag, op="max")
    if flag.item() > 0:
        where = f"parameter {bad} holds" if bad else "another rank's parameters hold"
        raise FloatingPointError(
            f"refusing to write {path}: {where} inf or NaN, and no checkpoint or export is "
            "written with non-finite weights"
        )


@dataclass(frozen=True)
class PolicySpec:
    """What every rank needs to build the policy (replicated to all ranks)."""

    hf_dir: str
    """HF folder: config.json and the tokenizer, and the weights (safetensors) unless `megatron_dir` is set."""
    policy: PolicyConfig
    seed: int
    total_steps: int
    """Optimizer steps of the run (sets the LR schedule's decay length)."""
    with_reference: bool = False
    """Also keep a frozen copy of the initial weights for KL logprobs."""
    trainable: bool = True
    """False: a frozen model that only scores or computes logprobs (a reward model serving GRPO): no optimizer."""
    padded_vocab: Optional[int] = None
    """Padded vocabulary of a checkpoint to load (another TP size pads differently); None = this TP's rule."""
    megatron_dir: Optional[str] = None
    """A Megatron checkpoint folder whose model/ holds the starting weights (mrl/app/model_source.py): every rank
    reads its slices of them, in any layout; None = the HF folder's safetensors."""


def _pad_to_multiple(batch: RankBatch, multiple: int) -> RankBatch:
    """Right-pad every [N, T] tensor to T' = ceil(T / multiple) * multiple (pad id 0, mask 0, data 0)."""
    extra = -batch.input_ids.shape[1] % multiple
    if extra == 0:
        return batch
    pad = lambda t: torch.nn.functional.pad(t, (0, extra))  # noqa: E731  ([N, T] -> [N, T + extra])
    routing = None if batch.routing is None else pad_routing(batch.routing, batch.input_ids.shape[1] + extra)
    return RankBatch(
        pad(batch.input_ids),
        pad(batch.loss_mask),
        {k: pad(v) for k, v in batch.token_data.items()},
        dict(batch.seq_data),
        lengths=batch.lengths,
        group_size=batch.group_size,
        routing=routing,
    )


def _micro_batch_size(wanted: int, rows: int, group_size: int = 1) -> int:
    """The largest micro-batch size <= `wanted` (but at least one group) that divides `rows` and is a multiple of
    `group_size` (pipeline schedules need equal micro-batches; a preference pair stays in one)."""
    size = max(group_size, min(wanted, rows))
    while rows % size or size % group_size:
        size -= 1
    return size


class PolicyWorker:
    """One rank of the policy (see the module docstring)."""

    @staticmethod
    def preload() -> None:
        """Import what building a rank needs (megatron-core, the model builder, the optimizer: ~2 s on CPU) without
        touching a device: the group runs it while the rank waits for a colocated engine to sleep."""
        import megatron.core.distributed  # noqa: F401

        import mrl.model.build
        import mrl.policy.optim  # noqa: F401

    def __init__(self, spec: PolicySpec) -> None:
        """Build this rank's policy in named steps (mrl/policy/construction.py says what each needs and makes)."""
        self.preload()  # the imports first: megatron-core loads before start_process_groups patches it for the CPU
        self.spec = spec
        cfg = spec.policy
        self.dims = parallel_dims(cfg.parallel, world_size=int(os.environ["WORLD_SIZE"]))
        self.ps = start_process_groups(self.dims, seed=spec.seed)  # and the seeds and this rank's device
        self.hf_config, self.model_dims = read_model_config(spec.hf_dir)
        self.speed = speed_settings(cfg, data_parallel=self.ps.get_data_parallel_world_size(with_context_parallel=True))
        overrides = transformer_overrides(cfg, self.model_dims, self.speed, trainable=spec.trainable)
        self.tconfig = transformer_config(self.hf_config, overrides)
        load_initial_weights = initial_weights(spec, self.hf_config)  # holds the HF state for both models
        self.module, self.layer_offset = build_policy_module(
            self.hf_config, self.tconfig, spec, self.speed, load_initial_weights
        )
        add_adapters(self.module, spec, score_head=self.model_dims.score_head)  # LoRA: before DDP sees the params
        self.model, self.optimizer, self.scheduler = wrap_for_training(self.module, self.tconfig, spec, self.speed)
        self.reference = build_reference(self.hf_config, self.tconfig, spec, self.speed, load_initial_weights)
        del load_initial_weights  # the HF state it holds
        # On CUDA the hand-over moves what `policy.offload_when_generating` names; on CPU it only keeps the flag.
        self.memory = HostOffload(
            self.model, self.optimizer, cfg.offload_when_generating, active=torch.cuda.is_available()
        )
        self.peaks = PhasePeaks(active=torch.cuda.is_available())
        self.expert_load = ExpertLoad([self.module])
        # Measures the engine/trainer routing disagreement of a MoE policy; replays with router_replay (None: dense).
        self.routing = routing_replay(self.model, cfg, self.model_dims, self.ps)
        self._measure_routing = True  # the engine holds the initial weights (or gets a refit before it samples)
        self._exporter: Optional[ShardedExporter] = None  # made once, by `_ready_exporter`
        self._bucket_plan: list = []
        self._bucket_owners: list[int] = []

    # ------------------------------------------------------------------------------------------------- layout
    def data_parallel_layout(self) -> tuple[int, bool]:
        """(data-parallel rank, is this rank its group's leader)."""
        ps = self.ps
        leader = (
            ps.is_pipeline_last_stage()
            and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0
        )
        return ps.get_data_parallel_rank(), leader

    def _is_leader(self) -> bool:
        return self.data_parallel_layout()[1]

    def _context(self, temperature: float) -> StepContext:
        ps = self.ps
        return StepContext(
            dp_size=ps.get_data_parallel_world_size(),
            cp_rank=ps.get_context_parallel_rank(),
            cp_size=ps.get_context_parallel_world_size(),
            cp_group=ps.get_context_parallel_group(),
            is_last_stage=ps.is_pipeline_last_stage(),
            vocab_size=self.model_dims.vocab_size,
            temperature=temperature,
            head="score" if self.model_dims.score_head else "lm",
            logprob_chunk_tokens=self.spec.policy.logprob_chunk_tokens,
            routing=self.routing,
        )

    # ------------------------------------------------------------------------------------------------ compute
    def logprobs(self, shard: RankBatch, temperature: float = 1.0, reference: bool = False) -> Optional[torch.Tensor]:
        """[n, T] logprobs of the shard's tokens (token-position convention of mrl.policy.logprobs), or a reward
        model's score at every token; leaders only."""
        if reference and self.reference is None:
            raise RuntimeError("reference logprobs asked for, but the policy was built without a reference model")
        self.peaks.start()
        self.memory.reclaim(("weights",))  # a logprob pass reads the weights alone
        width = shard.input_ids.shape[1]
        batch = _pad_to_multiple(shard.to(current_device()), self.dims.length_multiple)
        frozen = self.reference if reference else None  # the reference model when it computes (checked above)
        model = [frozen] if frozen is not None else self.model
        # the frozen copy lives in host memory between uses (GPU memory goes to the policy and engine)
        offload = self.spec.policy.offload_reference and torch.cuda.is_available()
        if frozen is not None and offload:
            frozen.cuda()
        for chunk in model:
            chunk.eval()
        size = _micro_batch_size(self.spec.policy.logprob_micro_batch_size, len(batch), batch.group_size)
        self._route_counting(not reference and shard.routing is not None)
        out = logprobs_of_batch(
            model,
            batch,
            micro_batch_size=size,
            ctx=self._context(temperature),
            packing=self.spec.policy.sequence_packing,
            dynamic_batching=self.spec.policy.dynamic_batching,
        )
        for chunk in model:
            chunk.train(not reference)
        self.peaks.logprob_done()  # before the frozen copy leaves
        if frozen is not None and offload:
            frozen.cpu()
        return out[:, :width].cpu() if out is not None and self._is_leader() else None

    def train(
        self, shard: RankBatch, loss_fn: PolicyLoss, global_count: float, temperature: float = 1.0
    ) -> Optional[dict[str, float]]:
        """One optimizer step on this data-parallel rank's shard; `global_count` is the whole step's count of valid
        tokens (or sequences) over all ranks. Returns the step's metrics (summed over data-parallel ranks) on
        leaders."""
        start = time.perf_counter()
        self.peaks.start()
        self.memory.reclaim()
        batch = _pad_to_multiple(shard.to(current_device()), self.dims.length_multiple)
        size = _micro_batch_size(self.spec.policy.train_micro_batch_size, len(batch), batch.group_size)
        for chunk in self.model:
            chunk.train()
        self.expert_load.reset()  # logprob passes route tokens too: count this step's only
        self._route_counting(shard.routing is not None)
        metrics = train_on_batch(
            self.model,
            self.optimizer,
            self.scheduler,
            batch,
            loss_fn=loss_fn,
            count=global_count,
            micro_batch_size=size,
            ctx=self._context(temperature),
            packing=self.spec.policy.sequence_packing,
            dynamic_batching=self.spec.policy.dynamic_batching,
        )
        scalars = {k: metrics.pop(k) for k in ("grad_norm", "lr", "nonfinite")}  # the same on every rank
        scalars.update(self.peaks.train_metrics(lambda peaks: collectives.all_reduce(peaks, op="max")))
        scalars.update(self._expert_load() or {})
        scalars.update(self._routing_disagreement())
        metrics = self._sum_over_data_parallel(metrics)
        if not self._is_leader():
            return None
        metrics.update(scalars)
        computed = metrics.pop("packing_computed_tokens", 0.0)
        real = metrics.pop("packing_real_tokens", 0.0)
        metrics["packing_efficiency"] = real / computed if computed else 1.0  # real tokens / tokens computed
        metrics["time_s"] = time.perf_counter() - start
        return metrics

    def _expert_load(self) -> Optional[dict[str, float]]:
        """The step's expert load (mrl/policy/expert_load.py), summed over the ranks that routed other tokens."""
        groups = [self.ps.get_data_parallel_group(with_context_parallel=True)]
        if self.dims.sequence_parallel:
            groups.append(self.ps.get_tensor_model_parallel_group())
        return self.expert_load.report(groups, self.ps.get_pipeline_model_parallel_group())

    def _route_counting(self, policy_pass: bool) -> None:
        """Count routing disagreements in this pass if it is the policy's first with an engine's routing since its
        weights went to the engine (the prev-logprob pass, else the first optimizer step's forward): later
        minibatches of a step route with weights the engine never had, and their disagreement is the update's."""
        if self.routing is not None:
            self.routing.counting = policy_pass and self._measure_routing
            if policy_pass and self._measure_routing:
                self._measure_routing = False

    def _routing_disagreement(self) -> dict[str, float]:
        """Per MoE layer, the fraction of tokens the trainer routes apart from the engine, from the pass that
        compared them with the engine's weights (`_route_counting`); {} when no pass counted, without routing data,
        or for a dense model."""
        return {} if self.routing is None else disagreement_metrics(self._take_routing_counts())

    def routing_counts(self) -> torch.Tensor:
        """[2, layers] tokens routed apart from the engine and tokens with an engine routing, per layer, of the
        passes since the last call (a collective: every rank calls it); the next pass counts again (`mrl score`
        asks after each batch of rows)."""
        counts = self._take_routing_counts()
        self._measure_routing = True
        return counts

    def _take_routing_counts(self) -> torch.Tensor:
        """The counts so far, summed over the ranks that routed other tokens (data and context parallel ranks, TP
        ranks under sequence parallelism, and the pipeline stages, which hold other layers), then reset."""
        if self.routing is None:
            return torch.zeros(2, self.model_dims.num_layers, dtype=torch.float64)
        counts = self.routing.counts(self.model_dims.num_layers)
        self.routing.reset()
        groups = [
            self.ps.get_data_parallel_group(with_context_parallel=True),
            self.ps.get_pipeline_model_parallel_group(),
        ]
        if self.dims.sequence_parallel:
            groups.append(self.ps.get_tensor_model_parallel_group())
        for group in groups:  # reduced over groups of one too: once a step (collectives.py)
            collectives.all_reduce(counts, group=group)
        return counts

    def _sum_over_data_parallel(self, sums: dict[str, float]) -> dict[str, float]:
        """Metric sums of every data-parallel (and context-parallel) rank's micro-batches, on the last stage."""
        if not self.ps.is_pipeline_last_stage():
            return sums
        keys = sorted(sums)
        # NCCL reduces device tensors only
        values = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=current_device())
        group = self.ps.get_data_parallel_group(with_context_parallel=True)
        if collectives.world_size(group) > 1:
            collectives.all_reduce(values, group=group)
        return dict(zip(keys, values.tolist()))

    # ------------------------------------------------------------------------------------- memory hand-over
    def release_memory(self) -> dict[str, float]:
        """Before a colocated engine wakes: optimizer states, gradient buffers and (when configured) the weights off
        the device, then gc + empty_cache (mrl/policy/memory.py). Idempotent; every call that needs a part back
        reclaims it first. Returns the GB moved per part and the CUDA memory reserved before and after."""
        return self.memory.release()

    def reclaim_memory(self) -> None:
        """Everything `release_memory` moved back on the device (train, load and a full save do it themselves)."""
        self.memory.reclaim()

    def memory_released(self) -> bool:
        """Whether `release_memory` ran and no full reclaim since (also on CPU ranks, where nothing moves)."""
        return self.memory.released

    # ------------------------------------------------------------------------------------------------- export
    def plan_export(self, bucket_bytes: int) -> int:
        """Prepare a weight export in buckets of at most `bucket_bytes`, each of one pipeline stage (its owner,
        `bucket_owners`); returns the number of buckets."""
        from mrl.policy.export import bucket_stage, plan_buckets

        exporter = self._ready_exporter()
        element = next(self.module.parameters()).element_size()
        # A layer larger than the bucket is cut (bounded memory for any model): every sink takes part-layers, vLLM's
        # workers in one reload session per refit (vllm_extension.begin_refit), the Megatron engine whole states.
        self._bucket_plan = plan_buckets(
            self.model_dims, exporter.names, bucket_bytes, element, split_units=True, stages=exporter.stages
        )
        self._bucket_owners = [bucket_stage(bucket, exporter.stages) for bucket in self._bucket_plan]
        return len(self._bucket_plan)

    def bucket_owners(self) -> list[int]:
        """The pipeline stage that owns each bucket of the plan (`plan_export` first); the same on every rank."""
        return list(self._bucket_owners)

    def sender_layout(self) -> SenderLayout:
        """What a transport's sender strategy depends on (`WeightTransport.sending`)."""
        return SenderLayout(pipeline_stages=self.dims.pp, expert_parallel=self.dims.ep)

    def export_bucket(self, index: int, transport: WeightTransport) -> Optional[dict]:
        """Gather bucket `index` of the plan and pack it as `transport.sending` says (mrl/inference/transports/base.py
        `Sending`); the ranks that pack return their payload or part (with the tensor names and bytes), the others
        None, and the controller joins them with `transport.merge`:
        - stages (the collective transport made with `Policy.refit_addresses`): the owner stage's ranks gather it,
          its first rank converts it and packs it as sender `owner` (no pipeline broadcast; other stages take no part);
        - expert_parts (shared-memory files under expert parallelism, one pipeline stage): rank 0 packs the dense
          tensors and its experts, each other EP rank's first rank its own experts (`ShardedExporter.bucket_part`);
        - every_rank (CUDA IPC): every rank takes part, rank 0's bucket reaches every rank in `pack_on_ranks`, each
          exports for the engine worker on its GPU;
        - rank0: every rank takes part, rank 0 packs.
        A shared-memory payload is released by the controller once the engines loaded it; a collective one was
        broadcast to the engines while packing."""
        self.memory.reclaim(("weights",))  # the optimizer states stay on the host while the engine is awake
        self._measure_routing = True  # the engine gets these weights: the next pass compares routings with them
        exporter = self._exporter
        assert exporter is not None, "plan_export first"
        sending = transport.sending(self.sender_layout())
        if sending == "stages":
            owner = self._bucket_owners[index]
            tensors = exporter.bucket(self._bucket_plan[index], local=True)
            return transport.pack(tensors, sender=owner) if exporter.is_stage_first(owner) else None
        if sending == "expert_parts":
            part = exporter.bucket_part(self._bucket_plan[index])
            return transport.pack(part) if part else None
        tensors = exporter.bucket(self._bucket_plan[index])
        if sending == "every_rank":
            return transport.pack_on_ranks(tensors if collectives.rank() == 0 else None)
        return transport.pack(tensors) if collectives.rank() == 0 else None

    def refit_stage(self) -> Optional[int]:
        """This rank's pipeline stage if it is the stage's first rank (tp = cp = dp = 0: a refit sender), else None."""
        ps = self.ps
        first = (
            ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0
        )
        return ps.get_pipeline_model_parallel_rank() if first else None

    def refit_port(self) -> Optional[int]:
        """A free port on this rank's node if it is a stage's first rank (it hosts its stage's refit sub-group's
        store), else None."""
        from mrl.parallel.ports import free_port

        return free_port() if self.refit_stage() is not None else None

    def join_refit_group(self, transport: CollectiveTransport) -> None:
        """The senders join the refit broadcast group: each stage's first rank as sender `stage` of a transport with
        one sender per stage (`sending` "stages"), else rank 0 alone as member 0; the other ranks take no part."""
        stage = self.refit_stage()
        if transport.sending(self.sender_layout()) == "stages":
            if stage is not None:
                transport.join_sender(stage)
        elif collectives.rank() == 0:
            transport.join(0)

    def export_state(self) -> Optional[dict[str, torch.Tensor]]:
        """The whole model as HF-named tensors on rank 0 (None elsewhere): for HF exports of small models."""
        buckets = self.plan_export(1 << 62)  # one bucket per pipeline stage
        exporter = self._exporter
        assert exporter is not None, "plan_export made it"
        self.memory.reclaim(("weights",))
        state: dict[str, torch.Tensor] = {}
        for index in range(buckets):
            state.update(exporter.bucket(self._bucket_plan[index]))
        return state if collectives.rank() == 0 else None

    def _ready_exporter(self) -> "ShardedExporter":
        """The exporter (made once: it exchanges the stages' layouts), with this rank's weights on the device and
        whole (an overlapped step left the other shards to the next forward)."""
        from mrl.policy.export import ShardedExporter

        self.memory.reclaim(("weights",))
        gather_weights(self.speed, self.model)
        if self._exporter is None:
            names: SpecNames = (
                "te" if any(k.endswith("layer_norm_weight") for k in self.module.state_dict()) else "local"
            )
            self._exporter = ShardedExporter(self.module, self.model_dims, layer_offset=self.layer_offset, names=names)
        return self._exporter

    def export_adapters(self) -> Optional[list[tuple[str, torch.Tensor]]]:
        """The LoRA adapters as PEFT-named tensors on rank 0 (None elsewhere; `ShardedExporter.adapter_tensors`)."""
        tensors = self._ready_exporter().adapter_tensors()
        return tensors if collectives.rank() == 0 else None

    # --------------------------------------------------------------------------------------------- checkpoint
    def save(self, path: str, weights_only: bool = False) -> None:
        """Model, optimizer, scheduler and RNG states as a reshardable distributed checkpoint under `path`
        (`weights_only`: the model and RNG states, a folder to start from rather than to resume)."""
        from mrl.checkpoint.megatron import save_megatron_state

        self.memory.reclaim(("weights",) if weights_only else PARTS)
        gather_weights(self.speed, self.model)
        _refuse_nonfinite_weights(self.model, path)
        training = (None, None) if weights_only else (self.optimizer, self.scheduler)
        save_megatron_state(Path(path), self.model, *training)

    def state_bytes(self) -> int:
        """This rank's bytes of a checkpoint: its parameters and, per parameter, Adam's two fp32 moments and an fp32
        main copy (what a save writes; an upper bound for fp32 parameters and the distributed optimizer)."""
        return sum(p.numel() * (p.element_size() + 12) for chunk in self.model for p in chunk.parameters())

    def load(self, path: str, load_optimizer: bool = True) -> Any:
        """Load a checkpoint written under any parallel layout; returns this rank's `MegatronLoadReport`."""
        from mrl.checkpoint.megatron import load_megatron_state

        self.memory.reclaim()  # the load writes into every tensor
        return load_megatron_state(
            Path(path), self.model, self.optimizer, self.scheduler, load_optimizer=load_optimizer
        )

    def shutdown(self) -> None:
        from mrl.parallel.groups import destroy_process_groups

        destroy_process_groups()
