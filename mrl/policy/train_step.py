"""One optimizer step and one logprob pass over a rank's data, through Megatron's pipeline schedules.

Data contract (what a rank receives; the controller shards over data-parallel ranks, every TP/PP/CP rank of a
data-parallel group receives the same shard):
    `RankBatch.input_ids`  [N, T] right-padded token ids
    `RankBatch.loss_mask`  [N, T] 1 on the tokens whose logprob enters the loss (the response tokens)
    `RankBatch.token_data` name -> [N, T] tensors aligned with the tokens (advantages, old/ref/engine logprobs)
    `RankBatch.seq_data`   name -> [N] tensors (one value per sequence)

Loss normalisation (why the gradient does not depend on micro-batching or sharding): the loss function receives the
GLOBAL number of valid tokens (or sequences) of the whole step, over every micro-batch and data-parallel rank, and
returns `sum over its tokens / global_count`. Summing those pieces over micro-batches and DP ranks gives the loss of
the whole batch. Megatron's schedule multiplies each returned loss by cp/num_microbatches and DDP averages gradients
over the dp*cp ranks, so the value handed to Megatron is scaled by num_microbatches * dp to turn that average back
into the sum.

Alignment: position t of the model predicts token t+1. Inside this module everything is shifted to "predicting
position" space (mask and per-token data rolled by one) before the context-parallel split, so a CP rank's slice of
logits lines up with its slice of targets, mask and data; logprobs returned to callers are shifted back to token
positions (`mrl.policy.logprobs` convention).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Literal, Protocol

import torch

from mrl.policy.logprobs import (merge_from_context_parallel, next_token_targets, shift_to_token_positions,
                                 split_for_context_parallel, vocab_parallel_logprobs)


class PolicyLoss(Protocol):
    """A loss evaluated per micro-batch and normalised by the global count of the step."""

    level: Literal["token", "sequence"]

    def __call__(self, logprobs: torch.Tensor, batch: dict[str, torch.Tensor],
                 global_count: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """logprobs [b, T'] of the target tokens; `batch` holds `loss_mask` [b, T'], the token data [b, T'], the
        sequence data [b] and `seq_num_tokens` [b] (valid tokens per whole sequence, also under CP).
        Returns (scalar loss = sum over this micro-batch / global_count, additive metrics)."""


@dataclass
class RankBatch:
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    token_data: dict[str, torch.Tensor] = field(default_factory=dict)
    seq_data: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, start: int, stop: int) -> "RankBatch":
        return RankBatch(self.input_ids[start:stop], self.loss_mask[start:stop],
                         {k: v[start:stop] for k, v in self.token_data.items()},
                         {k: v[start:stop] for k, v in self.seq_data.items()})

    def micro_batches(self, size: int) -> list["RankBatch"]:
        if len(self) % size:
            # Pipeline schedules send fixed-shape activations between stages: every micro-batch has `size` rows.
            raise ValueError(f"{len(self)} sequences on this rank do not split into micro-batches of {size}")
        return [self.slice(i, i + size) for i in range(0, len(self), size)]


@dataclass(frozen=True)
class StepContext:
    """The parallel facts a step needs, passed in rather than read from global state inside the loss."""

    dp_size: int
    cp_rank: int
    cp_size: int
    cp_group: object
    is_last_stage: bool
    vocab_size: int | None = None  # real vocabulary (without Megatron's padding)
    temperature: float = 1.0


def global_count(loss_mask: torch.Tensor, level: str) -> float:
    """Valid tokens (token level) or sequences with at least one valid token (sequence level) in a whole step."""
    if level == "token":
        return float(loss_mask[:, 1:].sum())
    return float((loss_mask[:, 1:].sum(dim=1) > 0).sum())


def _prepare(mb: RankBatch, ctx: StepContext) -> dict[str, torch.Tensor]:
    """Shift to predicting positions, then keep this CP rank's chunks. All tensors [b, T / cp]."""
    shift = lambda t: torch.roll(t, shifts=-1, dims=1)  # noqa: E731  (data of token t+1 sits at position t)
    mask = shift(mb.loss_mask).clone()
    mask[:, -1] = 0
    positions = torch.arange(mb.input_ids.shape[1]).unsqueeze(0).expand_as(mb.input_ids)
    full = {"input_ids": mb.input_ids, "position_ids": positions, "targets": next_token_targets(mb.input_ids),
            "loss_mask": mask, **{k: shift(v) for k, v in mb.token_data.items()}}
    out = {k: split_for_context_parallel(v, ctx.cp_rank, ctx.cp_size) for k, v in full.items()}
    out.update(mb.seq_data)
    out["seq_num_tokens"] = mask.sum(dim=1)
    return out


def _forward(model, data: dict[str, torch.Tensor]) -> torch.Tensor:
    # attention_mask=None: causal attention; right padding cannot affect earlier (real) tokens.
    return model(data["input_ids"], data["position_ids"], None)


def train_on_batch(model: list, optimizer, scheduler, batch: RankBatch, *, loss_fn: PolicyLoss, count: float,
                   micro_batch_size: int, ctx: StepContext) -> dict[str, float]:
    """Forward/backward over every micro-batch, then one optimizer step. Returns this rank's metric sums
    (only meaningful on the last pipeline stage; reduce them over data-parallel ranks)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    mbs = batch.micro_batches(micro_batch_size)
    scale = len(mbs) * ctx.dp_size

    def forward_step(data_iter: Iterator[dict], chunk):
        data = next(data_iter)
        logits = _forward(chunk, data)

        def loss_func(output: torch.Tensor):
            logprobs = vocab_parallel_logprobs(output, data["targets"], ctx.temperature, ctx.vocab_size)
            loss, metrics = loss_fn(logprobs, data, count)
            reported = {"loss": loss.detach().clone(), **{k: v.detach().float() for k, v in metrics.items()}}
            return loss * scale, reported

        return logits, loss_func

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([_prepare(mb, ctx) for mb in mbs]), model=model,
        num_microbatches=len(mbs), seq_length=batch.input_ids.shape[1], micro_batch_size=micro_batch_size,
        forward_only=False)
    ok, grad_norm, _ = optimizer.step()
    if not ok:
        raise FloatingPointError("optimizer step skipped: non-finite gradients")
    scheduler.step(increment=1)
    metrics = _sum_metrics(outputs)
    metrics.update({"grad_norm": float(grad_norm or 0.0), "lr": optimizer.param_groups[0]["lr"]})
    return metrics


def _sum_metrics(outputs: list[dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    for record in outputs or []:
        for k, v in record.items():
            out[k] = out.get(k, 0.0) + float(v.sum())
    return out


@torch.no_grad()
def logprobs_of_batch(model: list, batch: RankBatch, *, micro_batch_size: int, ctx: StepContext) -> torch.Tensor | None:
    """[N, T] logprobs at token positions (position 0 is 0); None on ranks that are not the last pipeline stage."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    mbs = batch.micro_batches(micro_batch_size)
    collected: list[torch.Tensor] = []

    def forward_step(data_iter: Iterator[dict], chunk):
        data = next(data_iter)
        logits = _forward(chunk, data)

        def collect(output: torch.Tensor):
            lp = vocab_parallel_logprobs(output, data["targets"], ctx.temperature, ctx.vocab_size)  # [b, T/cp]
            collected.append(lp)
            return output.new_zeros(()), {}

        return logits, collect

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([_prepare(mb, ctx) for mb in mbs]), model=model,
        num_microbatches=len(mbs), seq_length=batch.input_ids.shape[1], micro_batch_size=micro_batch_size,
        forward_only=True)
    if not ctx.is_last_stage:
        return None
    merged = [merge_from_context_parallel(lp, ctx.cp_group) for lp in collected]
    return shift_to_token_positions(torch.cat(merged, dim=0))

