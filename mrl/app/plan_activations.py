"""Activation memory of one policy rank's micro-batch, an estimate (`mrl plan`): the tensors autograd keeps per token
and layer, after Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", sec. 4:
tensor and sequence parallelism divide every one of them by TP), for attention kernels that keep no [s, s] scores
(flash / SDPA / Transformer Engine's fused attention) and SwiGLU MLPs. Bytes per token of one layer, 16-bit:

    attention   2h (norm input) + 2h (QKV input) + 2(q + k + v) (queries, keys, values) + 2 nh hd (attention
                output, which is also the projection's input)
    dense MLP   2h (norm input) + 2h (fc1 input) + 4f (fc1 output, gate and up) + 2f (SwiGLU output = fc2 input)
    MoE MLP     2h (norm input) + 4E (router logits and probabilities, fp32) + topk x (2h + 4fe + 2fe) (each routed
                copy of the token through its expert) + the shared expert as a dense MLP of its size

With full recompute (policy.activation_checkpointing: megatron-core's uniform method, one layer per checkpoint) only
each layer's input stays (2h per token), plus one layer's whole set while it is recomputed. Context parallelism
divides the tokens. The output layer's logits, bf16, [tokens, vocabulary / TP], stay for the backward, and the
log-softmax holds `policy.logprob_chunk_tokens` tokens of fp32 logits at once, twice (values and softmax). The
logprob pass keeps no activations: one layer's set and the logits of its micro-batch.

Not yet checked against measured peaks on CPU (issue #40's 15% bound); treat it as an estimate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from converters.spec import ModelDims


@dataclass(frozen=True)
class Activations:
    """Bytes of one rank's activations for one micro-batch (training) and the logprob pass's peak."""

    tokens: int        # tokens of the training micro-batch on this rank (after CP)
    layers: int        # kept for the backward
    working: int       # one layer's whole set (recompute) or 0
    logits: int        # the last stage's logits and log-softmax chunks (0 on the other stages)
    logprob_peak: int  # the logprob pass: one layer's set and the logits

    @property
    def train_peak(self) -> int:
        return self.layers + self.working + self.logits


def layer_bytes_per_token(dims: ModelDims, layer: int) -> int:
    """One layer's activations per token, 16-bit (module docstring), before TP."""
    h = dims.hidden_size
    if dims.mla is not None:  # per head: a key of qk_head_dim, a value of v_head_dim
        q = k = dims.num_heads * dims.mla.qk_head_dim
        v = out = dims.num_heads * dims.mla.v_head_dim
    else:
        q = out = dims.num_heads * dims.head_dim
        k = v = dims.num_kv_heads * dims.head_dim
    attention = 2 * h + 2 * h + 2 * (q + k + v) + 2 * out
    moe = dims.moe
    if moe is None or not moe.layers[layer]:
        return attention + _dense_mlp(h, dims.ffn_hidden_size)
    routed = moe.topk * (2 * h + 6 * moe.ffn_hidden_size)
    shared = _dense_mlp(h, moe.shared_ffn_hidden_size) - 2 * h if moe.shared_ffn_hidden_size else 0
    return attention + 2 * h + 4 * moe.num_experts + routed + shared


def _dense_mlp(h: int, f: int) -> int:
    return 2 * h + 2 * h + 4 * f + 2 * f


def micro_batch_tokens(cfg: Any, *, logprob: bool = False) -> int:
    """Tokens of one micro-batch on one data-parallel rank: the packed budget with packing, else sequences x the
    sequence length."""
    policy = cfg.policy
    if policy.sequence_packing.enabled:
        return policy.sequence_packing.tokens_per_microbatch
    sequences = policy.logprob_micro_batch_size if logprob else policy.train_micro_batch_size
    return sequences * policy.max_total_sequence_length


def stage_activations(cfg: Any, dims: ModelDims, layers: tuple[int, int], *, last_stage: bool,
                      padded_vocab: int) -> Activations:
    """The estimate for one rank of the stage holding decoder layers [first, last)."""
    par = cfg.policy.parallel
    tp, cp = par.tensor_parallel_size, par.context_parallel_size
    tokens = micro_batch_tokens(cfg) // cp
    per_layer = [layer_bytes_per_token(dims, i) * tokens // tp for i in range(*layers)]
    biggest = max(per_layer, default=0)
    if cfg.policy.activation_checkpointing:
        kept, working = (layers[1] - layers[0]) * 2 * dims.hidden_size * tokens // tp, biggest
    else:
        kept, working = sum(per_layer), 0
    logprob_tokens = micro_batch_tokens(cfg, logprob=True) // cp
    logits = _logits(cfg, tokens, padded_vocab // tp) if last_stage else 0
    lp_logits = _logits(cfg, logprob_tokens, padded_vocab // tp) if last_stage else 0
    lp_layer = biggest * logprob_tokens // max(tokens, 1)
    return Activations(tokens, kept, working, logits, lp_layer + lp_logits)


def _logits(cfg: Any, tokens: int, vocab: int) -> int:
    chunk = min(cfg.policy.logprob_chunk_tokens, tokens)
    return tokens * vocab * 2 + 2 * chunk * vocab * 4
