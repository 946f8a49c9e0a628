"""A GRPO step's time on a named GPU, an estimate (`mrl plan`): each phase from the work it does and one rate, the
rates being assumptions a user replaces with measurements (`--assume key=value`).

    generation  sequences = prompts x samples, spread over the engines (policy GPUs / engine TP x PP when
                colocated, else the engine GPUs / TP x PP); an engine decodes as many at once as its KV cache holds,
                in waves. A decode step reads the engine's weights and the batch's KV cache once: (weights + batch x
                mean context x KV bytes per token) / (HBM bandwidth x decode_efficiency) per GPU of a TP group, the
                whole model over TP (pipeline stages each read their part, one micro-batch after another, so PP
                adds GPUs, not speed, to one step); a synchronous step waits for its longest response
                (max_new_tokens steps per wave). Prefill: 2 x active parameters x prompt tokens at the train MFU
                over the engine's GPUs.
    logprobs    one forward pass over the step's tokens for the old policy's log-probabilities, another for the
                reference (loss.kl_beta > 0): (2 x active parameters + attention) FLOPs per token.
    train       (6 x active parameters + 3 x attention) FLOPs per token, 8 x with full recompute (the forward again),
                over every policy GPU at peak x mfu.
    refit       every HF tensor (bf16) broadcast from the policy's rank 0 (to every policy rank colocated: CUDA IPC
                opens them on each GPU; to the engines' actors otherwise) at node_broadcast_gib_per_s when the ranks
                fit one node, else cluster_broadcast_gib_per_s (none with one GPU in all), then each engine GPU's
                weights loaded at refit_gib_per_s; the two one after the other (an upper bound: buckets overlap).
Attention FLOPs per token: 2 x layers x heads x head_dim x mean sequence length (the causal half of QK^T and AV).
Active parameters: the dense ones and, of the routed experts, top-k of each MoE layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from converters.spec import ModelDims
from mrl.app.plan_memory import GiB, engine_weight_bytes, kv_bytes_per_token, total_params

#: Dense bf16 tensor-core peak (FLOP/s) and HBM bandwidth (B/s) of each GPU `--gpu` names: NVIDIA's data sheets
#: (SXM parts; dense, without sparsity).
GPU_RATES: dict[str, tuple[float, float]] = {
    "h100-80gb": (989e12, 3.35e12),
    "h200-141gb": (989e12, 4.8e12),
    "a100-80gb": (312e12, 2.04e12),
    "a100-40gb": (312e12, 1.56e12),
    "b200-180gb": (2250e12, 8.0e12),
}


@dataclass(frozen=True)
class StepTime:
    """Seconds of each phase of one GRPO step."""

    generation: float
    logprobs: float
    train: float
    refit: float

    @property
    def total(self) -> float:
        return self.generation + self.logprobs + self.train + self.refit


def active_params(dims: ModelDims) -> int:
    """Parameters one token goes through: all but the routed experts it is not sent to."""
    total = total_params(dims)
    moe = dims.moe
    if moe is None:
        return total
    per_expert = 3 * dims.hidden_size * moe.ffn_hidden_size
    idle = (moe.num_experts - moe.topk) * per_expert * sum(moe.layers)
    return total - idle


def attention_flops_per_token(dims: ModelDims, mean_length: float) -> float:
    head_dim = dims.mla.qk_head_dim if dims.mla is not None else dims.head_dim
    return 2.0 * dims.num_layers * dims.num_heads * head_dim * mean_length


def step_time(
    cfg: Any,
    dims: ModelDims,
    gpu: str,
    assume: Mapping[str, float],
    *,
    kv_tokens: int,
    engine_weights: int,
    refit_bytes: int = 0,
) -> StepTime:
    """The estimate for `cfg` on `gpu` (module docstring); `assume` holds the plan's assumptions by key."""
    peak, bandwidth = GPU_RATES[gpu]
    mfu = assume["mfu"]
    sequences = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    prompt = assume["mean_prompt_tokens"]
    response = assume["mean_response_fraction"] * cfg.generation.max_new_tokens
    mean_length = prompt + response
    tokens = sequences * mean_length
    active = active_params(dims)
    attention = attention_flops_per_token(dims, mean_length)
    world = cfg.policy_world_size
    passes = 1 + (cfg.loss.kl_beta > 0)
    logprobs = passes * tokens * (2 * active + attention) / (world * peak * mfu)
    per_token = (8 if cfg.policy.activation_checkpointing else 6) * active + (
        4 if cfg.policy.activation_checkpointing else 3
    ) * attention
    train = tokens * per_token / (world * peak * mfu)
    engine_tp = cfg.generation.vllm.tensor_parallel_size
    engine_size = engine_tp * cfg.generation.vllm.pipeline_parallel_size
    engine_gpus = world if cfg.generation.colocated else (cfg.generation.num_devices or world)
    engines = max(engine_gpus // engine_size, 1)
    generation = _generation(
        cfg,
        dims,
        sequences,
        engines,
        engine_tp,
        engine_size,
        kv_tokens,
        engine_weight_bytes(dims, engine_tp),
        prompt,
        mean_length,
        active,
        bandwidth * assume["decode_efficiency"],
        peak * mfu,
    )
    refit = engine_weights / (assume["refit_gib_per_s"] * GiB) + refit_bytes / _broadcast_rate(cfg, assume)
    return StepTime(generation, logprobs, train, refit)


def _broadcast_rate(cfg: Any, assume: Mapping[str, float]) -> float:
    """Bytes a second of the refit's broadcast from the policy's rank 0 (module docstring); inf: no broadcast."""
    gen = cfg.generation
    gpus = cfg.policy_world_size + (0 if gen.colocated else (gen.num_devices or 0))
    if gpus <= 1:
        return float("inf")
    one_node = gpus <= cfg.cluster.devices_per_node
    return assume["node_broadcast_gib_per_s" if one_node else "cluster_broadcast_gib_per_s"] * GiB


def _generation(
    cfg: Any,
    dims: ModelDims,
    sequences: int,
    engines: int,
    engine_tp: int,
    engine_size: int,
    kv_tokens: int,
    engine_weights: int,
    prompt: float,
    mean_length: float,
    active: int,
    bandwidth: float,
    flops: float,
) -> float:
    per_engine = -(-sequences // engines)
    longest = prompt + cfg.generation.max_new_tokens
    if kv_tokens < longest:
        return float("inf")  # the engine does not fit: no estimate
    concurrent = min(per_engine, int(kv_tokens // longest))
    waves = -(-per_engine // concurrent)
    kv_read = concurrent * mean_length * kv_bytes_per_token(dims, engine_tp)
    decode_step = (engine_weights + kv_read) / bandwidth
    prefill = per_engine * prompt * 2 * active / (engine_size * flops)
    return waves * cfg.generation.max_new_tokens * decode_step + prefill
