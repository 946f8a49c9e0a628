"""`mrl plan`'s verdict: the problems that keep a layout from fitting its GPUs, and the settings that would mend
each (the training phase, the colocated generation phase, an engine whose KV cache holds no sequence or whose
weights fit no share of its GPUs); the GPUs the plan knows. mrl/app/plan.py makes the plan and prints it."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from converters.spec import ModelDims
from mrl.app.plan_memory import GiB, engine_stage_bytes, engine_stage_layers, kv_bytes_per_token
from mrl.config import MrlConfig

if TYPE_CHECKING:
    from mrl.app.plan import EnginePlan, Plan, StagePlan

#: Memory the driver reports as the GPU's total (nvidia-smi's "MiB" figure), by the names `--gpu` takes.
GPUS: dict[str, int] = {
    "h100-80gb": 81559 * 2**20,
    "h200-141gb": 143771 * 2**20,
    "a100-80gb": 81920 * 2**20,
    "a100-40gb": 40960 * 2**20,
    "b200-180gb": 183359 * 2**20,
}

#: The largest share of a GPU a vLLM engine is offered here (generation.vllm.gpu_memory_utilization): the rest is the
#: CUDA context's and what the other processes on the GPU keep.
MAX_UTILIZATION = 0.95


def gib(value: int) -> str:
    return f"{value / GiB:.1f} GiB"


def engine_layout(engine: EnginePlan, cfg: MrlConfig) -> str:
    tp = engine.gpus // engine.stages
    if engine.stages == 1:
        return f"TP {tp}"
    nodes = -(-engine.gpus // cfg.cluster.devices_per_node)
    return f"TP {tp} x PP {engine.stages} ({engine.gpus} GPUs, {nodes} node{'s' if nodes > 1 else ''})"


def judge(cfg: MrlConfig, plan: Plan) -> None:
    """The problems that keep the layout from fitting and the settings that would mend each."""
    total = plan.gpu_bytes
    if plan.stages:
        worst_train = max(plan.stages, key=lambda s: s.train_phase)
        if worst_train.train_phase > total:
            plan.problems.append(
                f"training needs {gib(worst_train.train_phase)} on a stage-"
                f"{worst_train.states.stage} GPU, more than its {gib(total)}"
            )
            plan.fixes += _train_fixes(cfg, worst_train, total)
        worst_generate = max(plan.stages, key=lambda s: s.generate_phase)
        if worst_generate.generate_phase > total:
            plan.problems.append(
                f"generation needs {gib(worst_generate.generate_phase)} on a colocated GPU (the "
                f"engine's {cfg.generation.vllm.gpu_memory_utilization:g} of it and what the policy "
                f"keeps), more than its {gib(total)}"
            )
            plan.fixes.append(
                "lower generation.vllm.gpu_memory_utilization, or offload more while generating "
                "(policy.offload_when_generating.weights=true)"
            )
    if plan.engine is not None and plan.engine.sequences < 1:
        _judge_engine(cfg, plan)


def _engine_need(dims: ModelDims, tp: int, pp: int, sequence_tokens: int, overhead: int) -> int:
    """Bytes the fullest GPU of an engine of TP `tp` x PP `pp` needs to hold one sequence: its pipeline stage's
    weights, vLLM's own (`overhead`) and the sequence's KV cache on that stage's layers."""
    stages = zip(engine_stage_bytes(dims, tp, pp), engine_stage_layers(dims.num_layers, pp))
    return max(
        weights + overhead + kv_bytes_per_token(dims, tp, layers=last - first) * sequence_tokens
        for weights, (first, last) in stages
    )


def _judge_engine(cfg: MrlConfig, plan: Plan) -> None:
    """An engine whose KV cache holds no sequence: either its share of the GPU is too small (a larger
    gpu_memory_utilization mends it) or its weights cannot fit its GPUs at any share (more engine parallelism, or a
    bigger GPU, does)."""
    engine, vllm, total = plan.engine, cfg.generation.vllm, plan.gpu_bytes
    assert engine is not None
    overhead = int(plan.assumptions["engine_overhead_gib"].value * GiB)
    need = _engine_need(
        plan.dims, vllm.tensor_parallel_size, vllm.pipeline_parallel_size, engine.sequence_tokens, overhead
    )
    if need <= MAX_UTILIZATION * total:
        plan.problems.append(
            f"the engine's KV cache ({gib(engine.kv_bytes)}) holds no {engine.sequence_tokens}-token "
            f"sequence: generation.vllm.gpu_memory_utilization={vllm.gpu_memory_utilization:g} "
            f"gives it {gib(engine.budget)} of the GPU, its weights take {gib(engine.weights)}"
        )
        plan.fixes.append(
            f"generation.vllm.gpu_memory_utilization={math.ceil(need / total * 100) / 100:g} or more "
            f"(weights, vLLM's {gib(overhead)} and one sequence's KV cache: {gib(need)} of "
            f"{gib(total)}), or more engine parallelism (generation.vllm.tensor_parallel_size)"
        )
        return
    layout = f"an engine of {engine_layout(engine, cfg)} puts {gib(engine.weights)} of weights on each GPU"
    if engine.weights > total:
        why = f"more than the GPU's {gib(total)} ({gib(need)} with vLLM's {gib(overhead)} and one sequence's KV cache)"
    else:
        why = (
            f"which with vLLM's {gib(overhead)} and one sequence's KV cache need {gib(need)}, more than the "
            f"{MAX_UTILIZATION:g} of the GPU's {gib(total)} an engine can be given"
        )
    plan.problems.append(
        f"the engine's weights do not fit its GPUs: {layout}, {why}; no "
        "generation.vllm.gpu_memory_utilization can hold them"
    )
    plan.fixes += _engine_fixes(cfg, plan, overhead)


def _engine_fixes(cfg: MrlConfig, plan: Plan, overhead: int) -> list[str]:
    """Engine layouts (more TP within a node, else pipeline stages over nodes) and GPUs that hold an engine's
    weights and one sequence, at the configured gpu_memory_utilization (the bigger GPUs: at the most offered)."""
    vllm, dims = cfg.generation.vllm, plan.dims
    assert plan.engine is not None  # only _judge_engine asks, for a plan with an engine
    tokens = plan.engine.sequence_tokens
    share = vllm.gpu_memory_utilization * plan.gpu_bytes
    tp, pp = vllm.tensor_parallel_size, vllm.pipeline_parallel_size
    sizes = [
        t for t in (tp * 2**k for k in range(1, 8)) if t <= cfg.cluster.devices_per_node and dims.num_heads % t == 0
    ]
    fixes = []
    wider = next((t for t in sizes if _engine_need(dims, t, pp, tokens, overhead) <= share), None)
    if wider is not None:
        fixes.append(
            f"more tensor parallelism for the engine: generation.vllm.tensor_parallel_size={wider} "
            f"({gib(max(engine_stage_bytes(dims, wider, pp)))} of weights a GPU)"
        )
    else:
        node_tp = max([tp, *sizes])
        stages = next(
            (
                p
                for p in range(pp + 1, dims.num_layers + 1)
                if _engine_need(dims, node_tp, p, tokens, overhead) <= share
            ),
            None,
        )
        if stages is not None:
            fixes.append(
                f"an engine over several nodes: generation.vllm.tensor_parallel_size={node_tp} and "
                f"generation.vllm.pipeline_parallel_size={stages} ({node_tp * stages} GPUs an engine, "
                f"{gib(max(engine_stage_bytes(dims, node_tp, stages)))} of weights a GPU)"
            )
    need = _engine_need(dims, tp, pp, tokens, overhead)
    bigger = [
        name
        for name, size in sorted(GPUS.items(), key=lambda item: item[1])
        if size > plan.gpu_bytes and need <= MAX_UTILIZATION * size
    ]
    if bigger:
        size = GPUS[bigger[0]]
        fixes.append(
            f"a bigger GPU for this engine layout: {' or '.join(bigger)} (`--gpu {bigger[0]}`), with "
            f"generation.vllm.gpu_memory_utilization={math.ceil(need / size * 100) / 100:g} or more"
        )
    else:
        fixes.append(
            f"no GPU the plan knows ({', '.join(GPUS)}) holds {gib(need)} for one GPU of this engine "
            "layout: more engine parallelism is the way"
        )
    return fixes


def _train_fixes(cfg: MrlConfig, stage: StagePlan, total: int) -> list[str]:
    fixes = []
    if not cfg.policy.optimizer.use_distributed_optimizer and cfg.policy_world_size > 1:
        fixes.append(
            "policy.optimizer.use_distributed_optimizer=true (shards the optimizer states over the data-parallel ranks)"
        )
    if not cfg.policy.activation_checkpointing:
        fixes.append("policy.activation_checkpointing=true")
    if stage.activations.train_peak > total // 4:
        fixes.append(
            "fewer tokens per micro-batch (policy.sequence_packing.tokens_per_microbatch or "
            "policy.train_micro_batch_size), or policy.parallel.context_parallel_size"
        )
    if stage.activations.logprob_peak > max(stage.activations.train_peak, total // 4):
        fixes.append(
            "fewer tokens per logprob micro-batch (policy.sequence_packing.logprob_tokens_per_microbatch or "
            "policy.logprob_micro_batch_size)"
        )
    fixes.append(
        "more model parallelism: policy.parallel.tensor_parallel_size, pipeline_parallel_size or (MoE) "
        "expert_parallel_size, on more GPUs"
    )
    return fixes
