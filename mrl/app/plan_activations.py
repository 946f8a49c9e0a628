"""Activation memory of one policy rank's micro-batch, an estimate (`mrl plan`): the bytes autograd keeps per token
and layer, after Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", sec. 4),
for attention kernels that keep no [s, s] scores and SwiGLU MLPs (`layer_bytes`). Two kernel sets:

- "te" (what the plan prints: GPUs with Transformer Engine): a norm fused into the next linear keeps its bf16 input,
  its bf16 output and 1/rms (Qwen3's per-head q/k norms: their bf16 input and 1/rms); attention keeps queries, keys
  and values (grouped-query: the KV heads only), its output (the projection's input) and the log-sum-exp; the fused
  SwiGLU keeps fc1's output, fc2 its input;
- "local" (megatron-core's local spec with mrl's torch attention: CPU, and GPUs without TE): torch's RMSNorm keeps
  two fp32 copies, keys and values are repeated per query head, the unfused SwiGLU keeps SiLU's output and the
  product's operands besides, and each layer keeps RoPE's cos and sin and the positions. With the compiled fusions
  (`policy.speed.compiled_fusions`, on by default on GPUs without TE) SwiGLU and RoPE keep less (docs/guides/gpus.md):
  this set is then an upper bound.

Tensor parallelism divides the heads' and the MLP's share; the norms' and the linears' inputs only with sequence
parallelism. With full recompute (policy.activation_checkpointing: megatron-core's uniform method, one layer per
checkpoint) each layer keeps only its input, plus the rotary table once, and one layer's whole set exists while it is
recomputed. Context parallelism divides the tokens. The output layer's share is in `_logits`.

Checked against the bytes autograd saves in megatron-core's own forward on CPU ("local"), tiny dense models, several
lengths, TP 1 and 2 with sequence parallelism, recompute on and off: tests/unit/app/test_app_plan_activations.py; and
on an H100 without TE against the saved bytes and the caching allocator's growth: tests/gpu/test_gpu_plan.py. The
"te" set differs only in the named terms. Not measured: MoE layers (the dispatcher's buffers are an estimate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from converters.spec import ModelDims

Kernels = Literal["te", "local"]


@dataclass(frozen=True)
class Activations:
    """Bytes of one rank's activations for one micro-batch (training) and the logprob pass's peak."""

    tokens: int  # tokens of the training micro-batch on this rank (after CP)
    layers: int  # kept for the backward
    working: int  # one layer's whole set while it is recomputed (0 without recompute), and the gathered input
    # of sequence parallelism (`gather_buffer_bytes`)
    logits: int  # the last stage's logits and log-softmax chunks (0 on the other stages)
    logprob_peak: int  # the logprob pass: one layer's set and the logits

    @property
    def train_peak(self) -> int:
        return self.layers + self.working + self.logits


@dataclass(frozen=True)
class LayerBytes:
    """One layer's saved bytes per token, by how tensor parallelism divides them."""

    by_tp: int  # heads and MLP columns: divided by TP
    by_sp: int  # norms and the linears' inputs: divided by TP with sequence parallelism only
    replicated: int  # rotary tables and positions: on every TP rank whole

    def on_rank(self, tokens: int, tp: int, sequence_parallel: bool) -> int:
        return (
            (self.by_tp * tokens) // tp
            + (self.by_sp * tokens) // (tp if sequence_parallel else 1)
            + self.replicated * tokens
        )

    @property
    def total(self) -> int:
        return self.by_tp + self.by_sp + self.replicated


def layer_bytes(dims: ModelDims, layer: int, kernels: Kernels = "te") -> LayerBytes:
    """One layer's saved activations per token, 16-bit (module docstring), for Transformer Engine's kernels ("te",
    GPUs) or megatron-core's local spec with mrl's torch attention ("local": CPU, and GPUs without TE)."""
    h = dims.hidden_size
    te = kernels == "te"
    norm = _norm(h, te)
    if dims.mla is not None:  # per head: a key of qk_head_dim, a value of v_head_dim; the latents' up-projections
        mla = dims.mla
        q = k = dims.num_heads * mla.qk_head_dim
        v = out = dims.num_heads * mla.v_head_dim
        latents = 2 * ((mla.q_lora_rank or 0) + mla.kv_lora_rank + mla.qk_rope_head_dim)
    else:
        q = out = dims.num_heads * dims.head_dim
        k = v = (dims.num_kv_heads if te else dims.num_heads) * dims.head_dim  # local: K/V repeated per query head
        latents = _qk_norms(dims, te) if dims.qk_norm else 0
    heads = 2 * (q + k + v) + 2 * out + 4 * dims.num_heads  # queries, keys, values, output, the log-sum-exp
    replicated = 0 if te else 8 * dims.head_dim + 8  # local: cos and sin of queries and keys, the positions
    moe = dims.moe
    if moe is None or not moe.layers[layer]:
        f = dims.ffn_hidden_size
        return LayerBytes(heads + latents + _mlp(f, te), 2 * norm, replicated)
    routed = moe.topk * (2 * h + _mlp(moe.ffn_hidden_size, te) + 2 * h + 2 * h)  # in, expert, out
    shared = 2 * h + _mlp(moe.shared_ffn_hidden_size, te) if moe.shared_ffn_hidden_size else 0
    router = 8 * moe.num_experts  # logits and probabilities, fp32
    return LayerBytes(heads + latents + shared, norm + (norm - 2 * h) + router + routed, replicated)


def _qk_norms(dims: ModelDims, te: bool) -> int:
    """Per-head RMSNorms of queries and keys (Qwen3): their input (TE: bf16; local: two fp32 copies less the bf16
    input the linear already kept) and 1/rms per head."""
    width = dims.head_dim * (dims.num_heads + dims.num_kv_heads)
    return (2 if te else 8) * width + 4 * (dims.num_heads + dims.num_kv_heads)


def _norm(h: int, te: bool) -> int:
    """A norm and the linear after it: TE keeps the input and the normalized input (bf16) and 1/rms; the local
    torch RMSNorm two fp32 copies and 1/rms, then the linear its bf16 input."""
    return 2 * h + 2 * h + 4 if te else 8 * h + 4 + 2 * h


def _mlp(f: int, te: bool) -> int:
    """A SwiGLU MLP past its input: fc1's output (gate and up) and fc2's input; without fusion (local) SiLU's output
    and the product's second operand besides."""
    return 4 * f + 2 * f if te else 4 * f + 2 * f + 2 * f + 2 * f


def rotary_table_bytes(dims: ModelDims) -> int:
    """Per position of the longest sequence: the rotary frequencies (fp32) a recomputed model keeps once for all its
    layers and sequences."""
    return 0 if dims.mla is not None else 4 * dims.head_dim


def decoder_activations(
    dims: ModelDims,
    layers: tuple[int, int],
    *,
    tokens: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: bool = False,
    kernels: Kernels = "te",
    sequence_length: int | None = None,
) -> tuple[int, int]:
    """(bytes the decoder layers [first, last) keep for the backward, one layer's whole set while recomputed) on one
    rank, for `tokens` tokens of the micro-batch on that rank, in sequences of `sequence_length` (default: one)."""
    per_layer = [layer_bytes(dims, i, kernels).on_rank(tokens, tp, sequence_parallel) for i in range(*layers)]
    biggest = max(per_layer, default=0)
    if not recompute:
        return sum(per_layer), 0
    inputs = 2 * dims.hidden_size * tokens // (tp if sequence_parallel else 1)
    return (layers[1] - layers[0]) * inputs + rotary_table_bytes(dims) * (sequence_length or tokens), biggest


def gather_buffer_bytes(dims: ModelDims, *, tokens: int, tp: int, sequence_parallel: bool) -> int:
    """Sequence parallelism's all-gathered layer input, [tokens, hidden] bf16 on every TP rank: megatron-core's
    local linears gather into its global memory buffer ("mpu"), which stays allocated (Transformer Engine gathers
    into a buffer of the same size per linear, freed after it). Not an activation autograd saves, but at the peak:
    the GPU tier measured it (tests/gpu/test_gpu_plan.py). 0 without sequence parallelism."""
    return 2 * dims.hidden_size * tokens if tp > 1 and sequence_parallel else 0


def micro_batch_tokens(cfg: Any, *, logprob: bool = False) -> int:
    """Tokens of one micro-batch on one data-parallel rank: the token budget with packing or dynamic batching (a
    logprob pass's where one is set), else sequences x the sequence length."""
    policy = cfg.policy
    for section in (policy.sequence_packing, policy.dynamic_batching):
        if section.enabled:
            return section.budget(logprob=logprob)[1]
    sequences = policy.logprob_micro_batch_size if logprob else policy.train_micro_batch_size
    return sequences * policy.max_total_sequence_length


def stage_activations(
    cfg: Any, dims: ModelDims, layers: tuple[int, int], *, last_stage: bool, padded_vocab: int, kernels: Kernels = "te"
) -> Activations:
    """The estimate for one rank of the stage holding decoder layers [first, last)."""
    par = cfg.policy.parallel
    tp, cp = par.tensor_parallel_size, par.context_parallel_size
    tokens = micro_batch_tokens(cfg) // cp
    kept, working = decoder_activations(
        dims,
        layers,
        tokens=tokens,
        tp=tp,
        sequence_parallel=par.sequence_parallel,
        recompute=cfg.policy.activation_checkpointing,
        kernels=kernels,
        sequence_length=min(tokens, cfg.policy.max_total_sequence_length),
    )
    logprob_tokens = micro_batch_tokens(cfg, logprob=True) // cp
    _, one_layer = decoder_activations(
        dims,
        (layers[0], min(layers[0] + 1, layers[1])),
        tokens=logprob_tokens,
        tp=tp,
        sequence_parallel=par.sequence_parallel,
        recompute=True,
        kernels=kernels,
    )
    logits = _logits(cfg, tokens, padded_vocab // tp, train=True) if last_stage else 0
    lp_logits = _logits(cfg, logprob_tokens, padded_vocab // tp, train=False) if last_stage else 0
    gather = gather_buffer_bytes(dims, tokens=tokens, tp=tp, sequence_parallel=par.sequence_parallel)
    lp_gather = gather_buffer_bytes(dims, tokens=logprob_tokens, tp=tp, sequence_parallel=par.sequence_parallel)
    return Activations(tokens, kept, working + gather, logits, one_layer + lp_logits + lp_gather)


def _logits(cfg: Any, tokens: int, vocab: int, *, train: bool) -> int:
    """The output layer's share: its bf16 logits [tokens, vocabulary / TP]; training adds their gradient and holds
    one and a half chunks of fp32 log-softmax at once, the logprob pass one (benchmarks/logprob_memory.py measured
    both on CPU for 8192 tokens x 151,936: 3.42 GB and 0.62 GB above the logits, these formulas 3.42 and 0.62)."""
    chunk = min(cfg.policy.logprob_chunk_tokens, tokens) * vocab * 4
    return tokens * vocab * 2 * (2 if train else 1) + (chunk * 3 // 2 if train else chunk)
