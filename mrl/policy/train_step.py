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

Token-budget micro-batches (optional, `packing=` / `dynamic_batching=`): instead of `micro_batch_size` rows of T
tokens, micro-batches are planned from the sequences' real lengths (`mrl.data.packing`):
- packing: a micro-batch is ONE row holding several sequences back to back (THD layout, [1, L]); Megatron gets
  `PackedSeqParams(qkv_format="thd")` with the sequences' offsets, so attention is block-diagonal causal and RoPE
  restarts at every sequence. Each sequence is rounded up to a multiple of tp (sequence parallel) and 2*cp (context
  parallel: each CP rank holds chunks r and 2cp-1-r of EVERY sequence of the pack). With pipeline parallelism every
  pack is padded to the full budget (stages exchange fixed-shape activations; the filler is one extra padding
  sequence). After the forward, the [1, L] logprobs are gathered back into one row per sequence ([b, W]) and the
  unchanged loss function sees the padded layout it always sees, so token- and sequence-level losses need nothing
  new and the global-count normalisation stays exact.
- dynamic batching: padded micro-batches of similar lengths, `rows * longest <= budget` (not with pipeline
  parallelism, whose schedule needs equal shapes: use packing there).
Logprobs come back [N, T] in the original order either way; positions past a sequence's length are 0.

Reward models (`StepContext.head == "score"`): the model's output is one value per position (its score head,
`mrl.policy.logprobs.score_values`) instead of logits; the loss receives those values [b, T'] in place of logprobs
(position t = the hidden state of token t, so a sequence's score sits at position length - 1), and a logprob pass
returns them unshifted.

Whole-sequence losses under context parallelism (DPO, the reward model: a loss of each sequence's sum of logprobs or
of its last position's score): such a loss gives its additive part per row (`row_sums`, of the rank's chunks), the
step adds the CP ranks' parts with a sum whose backward sums again (`collectives.summed_with_grad`), and every CP rank
computes the same loss from the whole sums, of which each reports and differentiates 1/cp (`_whole_sequence_loss`).

Groups (`RankBatch.group_size`, e.g. 2 for a DPO or reward-model pair): consecutive rows that one loss term
couples stay in one micro-batch and one pack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch.nn.utils.rnn import pad_sequence

from mrl.data.packing import MicroBatchPlan, dynamic_batches, local_token_positions, pack_sequences
from mrl.model.router_replay import no_route
from mrl.objectives.loss import (
    LOSS_MASK,
    PREV_LOGPROBS,
    SEQ_LOG_RATIO_SUM,
    TOKEN_COLUMN,
    TOKEN_ENTROPY,
    sequence_log_ratio_sums,
)
from mrl.parallel import collectives
from mrl.parallel.layout import length_multiple, micro_batching_violations
from mrl.policy.interface import PolicyLoss, RankBatch, WholeSequenceLoss, pad_routing
from mrl.policy.logprobs import (
    LOGPROB_CHUNK_TOKENS,
    merge_from_context_parallel,
    next_token_targets,
    score_values,
    shift_to_token_positions,
    split_for_context_parallel,
    vocab_parallel_logprobs,
)

if TYPE_CHECKING:
    from mrl.config.schema import DynamicBatchingConfig, PackingConfig


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
    head: str = "lm"  # "lm": logprobs of the next tokens; "score": a reward model's value per position
    logprob_chunk_tokens: int = LOGPROB_CHUNK_TOKENS  # rows of fp32 logits at once (mrl.policy.logprobs)
    routing: Any = None  # mrl.model.router_replay.RoutingReplay of the model's routers (MoE), or None

    def to_token_positions(self, values: torch.Tensor) -> torch.Tensor:
        """[N, T] results at predicting positions -> at token positions (logprobs move by one; scores stay)."""
        return values if self.head == "score" else shift_to_token_positions(values)


def _prepare(mb: RankBatch, ctx: StepContext) -> dict[str, torch.Tensor]:
    """Shift to predicting positions, then keep this CP rank's chunks. All tensors [b, T / cp]."""
    shift = lambda t: torch.roll(t, shifts=-1, dims=1)  # noqa: E731  (data of token t+1 sits at position t)
    mask = shift(mb.loss_mask).clone()
    mask[:, -1] = 0
    positions = torch.arange(mb.input_ids.shape[1]).unsqueeze(0).expand_as(mb.input_ids)
    full = {
        "input_ids": mb.input_ids,
        "position_ids": positions,
        "targets": next_token_targets(mb.input_ids),
        "loss_mask": mask,
        **{k: shift(v) for k, v in mb.token_data.items()},
    }
    if mb.routing is not None:  # the router at position t routes token t: not shifted
        full["routing"] = mb.routing
    out = {k: split_for_context_parallel(v, ctx.cp_rank, ctx.cp_size) for k, v in full.items()}
    out[TOKEN_COLUMN] = out["position_ids"]  # the loss layout is the input's: a column's position is its own
    out.update(mb.seq_data)
    out["seq_num_tokens"] = mask.sum(dim=1)
    return out


def _forward(model, data: dict[str, torch.Tensor], ctx: StepContext, training: bool) -> torch.Tensor:
    if ctx.routing is not None:  # this chunk's routers take the micro-batch's engine routing (router replay)
        ctx.routing.begin(model, data.get("routing"), training=training)
    # attention_mask=None: causal attention; right padding cannot affect earlier (real) tokens.
    if "packed_seq_params" in data:  # one THD row: block-diagonal causal attention, RoPE restarts per sequence
        return model(data["input_ids"], data["position_ids"], None, packed_seq_params=data["packed_seq_params"])
    return model(data["input_ids"], data["position_ids"], None)


def _target_logprobs(output: torch.Tensor, data: dict, ctx: StepContext) -> torch.Tensor:
    """[b, T'] logprobs of a micro-batch's targets. A pack's [1, L] row is gathered back into one row per sequence
    (zeros past each sequence's own tokens), the layout losses and the logprob merge expect."""
    if ctx.head == "score":
        return _unpacked(score_values(output), data)
    return _unpacked(
        vocab_parallel_logprobs(output, data["targets"], ctx.temperature, ctx.vocab_size, ctx.logprob_chunk_tokens),
        data,
    )


def _train_inputs(output: torch.Tensor, data: dict, ctx: StepContext) -> tuple[torch.Tensor, dict]:
    """(logprobs as `_target_logprobs`, the micro-batch for the loss): a language model's micro-batch gains the
    entropy of its next-token distribution at every position (`TOKEN_ENTROPY`, no gradient) from the same chunked
    pass, which losses may report."""
    if ctx.head == "score":
        return _target_logprobs(output, data, ctx), data
    logprobs, entropy = vocab_parallel_logprobs(
        output, data["targets"], ctx.temperature, ctx.vocab_size, ctx.logprob_chunk_tokens, entropy=True
    )
    return _unpacked(logprobs, data), {**data, TOKEN_ENTROPY: _unpacked(entropy, data)}


def _whole_sequence_log_ratio(logprobs: torch.Tensor, inputs: dict, ctx: StepContext) -> torch.Tensor:
    """[b] sum over each whole sequence's loss tokens of (logprob - prev_logprob), no gradient. Sharding contract:
    under CP each rank's rows hold its chunks of the same sequences, in the same order on every CP rank (padded and
    packed micro-batches alike), so one all-reduce over the CP group sums each sequence's chunks."""
    local = sequence_log_ratio_sums(logprobs, inputs.get(PREV_LOGPROBS, logprobs), inputs[LOSS_MASK])
    collectives.all_reduce(local, group=ctx.cp_group)
    return local


def _whole_sequence_loss(
    loss_fn: WholeSequenceLoss, values: torch.Tensor, inputs: dict, count: float, ctx: StepContext
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A loss of whole sequences' sums (`row_sums` -> `from_row_sums`) on a CP rank. Sharding contract: every CP rank
    holds its chunks of the same sequences in the same row order (padded and packed micro-batches alike), so the sum
    of the ranks' row sums is each whole sequence's. Every CP rank then computes the same loss and metrics; each
    returns 1/cp of them, so their sum over the CP group (the policy's metric reduction, Megatron's gradient
    reduction) counts them once, and the sum's backward hands each rank the whole gradient of its chunks' part."""
    sums = collectives.summed_with_grad(loss_fn.row_sums(values, inputs), ctx.cp_group)
    loss, metrics = loss_fn.from_row_sums(sums, inputs, count)
    return loss / ctx.cp_size, {name: value / ctx.cp_size for name, value in metrics.items()}


def _unpacked(values: torch.Tensor, data: dict) -> torch.Tensor:
    if "unpack_index" not in data:
        return values
    rows = values[0][data["unpack_index"]]  # [b, W]; differentiable gather
    return torch.where(data["unpack_valid"], rows, torch.zeros_like(rows))


# ------------------------------------------------------------------------------------ token-budget micro-batches
def sequence_lengths(batch: RankBatch) -> torch.Tensor:
    """[N] real token counts: `batch.lengths`, or, when not given, up to each sequence's last loss-mask token (at
    least 1). Tokens past a sequence's length are padding: they never enter the loss, and token-budget micro-batches
    do not compute them at all."""
    n, t = batch.input_ids.shape
    valid = batch.loss_mask != 0
    if batch.lengths is None:
        return (valid * torch.arange(1, t + 1, device=valid.device)).amax(dim=1).clamp(min=1)  # 1 + last loss token
    lengths = batch.lengths.long()
    if lengths.shape != (n,) or bool((lengths < 1).any()) or bool((lengths > t).any()):
        raise ValueError(
            f"RankBatch.lengths must be [{n}] token counts in 1..{t} (the padded width), "
            f"got shape {tuple(lengths.shape)}, range {int(lengths.min())}..{int(lengths.max())}"
        )
    beyond = (valid & (torch.arange(t, device=valid.device)[None, :] >= lengths[:, None])).any(dim=1)
    if bool(beyond.any()):
        j = int(beyond.nonzero()[0])
        raise ValueError(
            f"sequence {j}: loss_mask marks tokens past its length {int(lengths[j])}; RankBatch.lengths "
            "must count the prompt and the response tokens"
        )
    return lengths


def _model_layout(model: list) -> tuple[int, bool, int]:
    """(tensor-parallel size, sequence parallel, pipeline size) of the model."""
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0])
    return config.tensor_model_parallel_size, config.sequence_parallel, config.pipeline_model_parallel_size


def plan_micro_batches(
    batch: RankBatch,
    model: list,
    ctx: StepContext,
    *,
    packing: "PackingConfig | None" = None,
    dynamic_batching: "DynamicBatchingConfig | None" = None,
    logprob: bool = False,
) -> MicroBatchPlan | None:
    """The token-budget plan of this rank's batch (a logprob pass's budget with `logprob`), or None for fixed
    `micro_batch_size` rows. Deterministic in the lengths, so every TP/PP/CP rank of a data-parallel group (same
    data) agrees on the number of micro-batches."""
    use_packing = packing is not None and packing.enabled
    use_dynamic = dynamic_batching is not None and dynamic_batching.enabled
    if not (use_packing or use_dynamic):
        return None
    tp, sequence_parallel, pp = _model_layout(model)
    multiple = length_multiple(tp, ctx.cp_size, sequence_parallel=sequence_parallel)
    chosen = packing if use_packing else dynamic_batching
    assert chosen is not None  # enabled, so given (checked above)
    key, budget = chosen.budget(logprob=logprob)
    problems = micro_batching_violations(
        packing=use_packing,
        dynamic_batching=use_dynamic,
        tokens_per_microbatch=budget,
        pp=pp,
        multiple=multiple,
        budget_key=key,
    )
    if problems:
        raise ValueError(str(problems[0]))
    lengths = sequence_lengths(batch).tolist()
    if use_dynamic:
        return dynamic_batches(lengths, budget, multiple=multiple, group_size=batch.group_size, key=key)
    return pack_sequences(lengths, budget, multiple=multiple, group_size=batch.group_size, key=key)


def _predicting_space(batch: RankBatch, width: int) -> dict[str, torch.Tensor]:
    """Every [N, T] tensor right-padded to [N, width]; all but input_ids shifted to predicting positions (position t
    holds the target / mask / data of token t+1, the last position none), as `_prepare` does before its CP split."""
    pad = lambda x: torch.nn.functional.pad(x, (0, width - x.shape[1]))  # noqa: E731

    def shift(x: torch.Tensor) -> torch.Tensor:
        out = torch.roll(pad(x), shifts=-1, dims=1)
        out[:, -1] = 0
        return out

    out = {
        "input_ids": pad(batch.input_ids),
        "targets": shift(batch.input_ids),
        "loss_mask": shift(batch.loss_mask),
        **{k: shift(v) for k, v in batch.token_data.items()},
    }
    if batch.routing is not None:  # aligned with input_ids: not shifted
        out["routing"] = pad_routing(batch.routing, width)
    return out


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-built index or offset tensor on `device`: on a GPU through pinned memory without blocking, so building
    a micro-batch makes the host wait for nothing (from pageable memory each copy would)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _packed_seq_params(plan: MicroBatchPlan, index: int, filler: int, cp_group, device: torch.device):
    """THD offsets of pack `index`: real lengths in cu_seqlens (what TE attends over on GPU), rounded lengths in the
    *_padded offsets (the layout tokens sit in; Megatron's RoPE and our CPU attention read these). The filler that
    pads a pack to the budget is one more sequence of padding (0 real tokens)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    seqs = plan.bins[index]
    padded = [plan.padded_lengths[j] for j in seqs] + ([filler] if filler else [])
    real = [plan.lengths[j] for j in seqs] + ([0] if filler else [])
    cu = lambda sizes: _to_device(torch.tensor([0] + sizes).cumsum(0).to(torch.int32), device)  # noqa: E731  [n + 1]
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu(real),
        cu_seqlens_kv=cu(real),
        cu_seqlens_q_padded=cu(padded),
        cu_seqlens_kv_padded=cu(padded),
        max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
        cp_group=cp_group,
    )


@dataclass(frozen=True)
class _PackIndex:
    """Where pack `index`'s tokens come from, built on the host and moved to the device once (one gather a tensor
    instead of one indexing per sequence). b sequences, W = the longest one's local token count."""

    rows: torch.Tensor  # [t] the batch row of each packed token (t = the pack's tokens without the filler)
    cols: torch.Tensor  # [t] its column
    seqs: torch.Tensor  # [b] the pack's batch rows
    grid_cols: torch.Tensor  # [b, W] each sequence's token columns, 0 past its end
    valid: torch.Tensor  # [b, W] within the sequence
    unpack: torch.Tensor  # [b, W] the packed position of each (sequence, step), 0 past the end
    positions: torch.Tensor  # [1, L / cp] position ids, the filler's 0


def _pack_index(seqs: list[int], local: list[torch.Tensor], filler: int, device: torch.device) -> _PackIndex:
    sizes = torch.tensor([len(pos) for pos in local])
    width = int(sizes.max())
    valid = torch.arange(width)[None, :] < sizes[:, None]
    starts = torch.cumsum(sizes, 0) - sizes
    host = dict(
        rows=torch.repeat_interleave(torch.tensor(seqs), sizes),
        cols=torch.cat(local),
        seqs=torch.tensor(seqs),
        grid_cols=pad_sequence(local, batch_first=True),
        valid=valid,
        unpack=torch.where(valid, starts[:, None] + torch.arange(width)[None, :], 0),
        positions=torch.cat(local + [torch.zeros(filler, dtype=torch.long)])[None],
    )
    return _PackIndex(**{name: _to_device(t, device) for name, t in host.items()})


def _packed_micro_batch(
    full: dict[str, torch.Tensor],
    batch: RankBatch,
    plan: MicroBatchPlan,
    index: int,
    ctx: StepContext,
    fixed_size: bool,
) -> dict:
    """Pack `index` on this CP rank: model inputs in THD layout [1, L / cp] (each sequence's local chunks, back to
    back), loss data in per-sequence rows [b, W] (W = the longest sequence's local token count), and the
    `unpack_index` [b, W] that gathers the pack's per-token results into those rows."""
    seqs = plan.bins[index]
    local = [local_token_positions(plan.padded_lengths[j], ctx.cp_size, ctx.cp_rank) for j in seqs]
    filler = plan.budget - sum(plan.padded_lengths[j] for j in seqs) if fixed_size else 0
    device = full["input_ids"].device
    at = _pack_index(seqs, local, filler // ctx.cp_size, device)

    def pack(x: torch.Tensor, fill: int = 0) -> torch.Tensor:  # [N, width, ...] -> [1, L / cp, ...]
        pad = x.new_full((filler // ctx.cp_size, *x.shape[2:]), fill)
        return torch.cat([x[at.rows, at.cols], pad])[None]

    data = {
        "input_ids": pack(full["input_ids"]),
        "targets": pack(full["targets"]),
        "position_ids": at.positions,
        "packed_seq_params": _packed_seq_params(plan, index, filler, ctx.cp_group, device),
        "unpack_index": at.unpack,
        "unpack_valid": at.valid,
        TOKEN_COLUMN: at.grid_cols,
    }
    if "routing" in full:  # the filler routes freshly
        data["routing"] = pack(full["routing"], fill=no_route(full["routing"].dtype))
    for name in ("loss_mask", *batch.token_data):  # [b, W], 0 past each sequence's end
        values = full[name][at.seqs[:, None], at.grid_cols]
        data[name] = torch.where(at.valid, values, torch.zeros((), dtype=values.dtype, device=values.device))
    data.update({k: v[at.seqs.to(v.device)] for k, v in batch.seq_data.items()})
    data["seq_num_tokens"] = full["loss_mask"][at.seqs].sum(dim=1)  # whole sequences, also under CP
    return data


def _micro_batches(
    batch: RankBatch, plan: MicroBatchPlan | None, micro_batch_size: int, model: list, ctx: StepContext
) -> tuple[list[dict], int, int]:
    """Every micro-batch's inputs, and the (seq_length, micro_batch_size) a pipeline schedule sends per micro-batch."""
    if plan is None:
        mbs = [_prepare(mb, ctx) for mb in batch.micro_batches(micro_batch_size)]
        return mbs, batch.input_ids.shape[1], micro_batch_size
    width = max(batch.input_ids.shape[1], max(plan.padded_lengths))
    if not plan.packed:  # rows of similar length, cut to the longest (rounded) one; no pipeline (checked)
        return (
            [_prepare(batch.select(seqs, max(plan.padded_lengths[j] for j in seqs)), ctx) for seqs in plan.bins],
            width,
            1,
        )
    full = _predicting_space(batch, width)
    fixed_size = _model_layout(model)[2] > 1  # pipeline parallel: every pack has the budget's shape
    return (
        [_packed_micro_batch(full, batch, plan, i, ctx, fixed_size) for i in range(plan.num_micro_batches)],
        plan.budget,
        1,
    )


def _token_counts(batch: RankBatch, mbs: list[dict], ctx: StepContext) -> dict[str, float]:
    """Real tokens and tokens the model computed (padding included) on this rank; both add over ranks, and
    real / computed is `train/packing_efficiency` (the same ratio for padded micro-batches)."""
    computed = sum(mb["input_ids"].numel() for mb in mbs) * ctx.cp_size
    return {"packing_real_tokens": float(sequence_lengths(batch).sum()), "packing_computed_tokens": float(computed)}


def _merge_rows(rows: torch.Tensor, plan: MicroBatchPlan, index: int, ctx: StepContext) -> torch.Tensor:
    """A micro-batch's logprob rows of this CP rank ([b, W / cp] or a pack's [b, W]) -> whole sequences [b, width]."""
    if not plan.packed:
        return merge_from_context_parallel(rows, ctx.cp_group)
    if ctx.cp_size == 1:
        return rows
    gathered = collectives.all_gather(rows, ctx.cp_group)
    seqs = plan.bins[index]
    out = rows.new_zeros(len(seqs), max(plan.padded_lengths[j] for j in seqs))
    for rank, piece in enumerate(gathered):
        for row, j in enumerate(seqs):
            pos = local_token_positions(plan.padded_lengths[j], ctx.cp_size, rank)
            out[row, pos] = piece[row, : len(pos)]
    return out


def _restore_order(
    collected: list[torch.Tensor], plan: MicroBatchPlan, batch: RankBatch, ctx: StepContext
) -> torch.Tensor:
    """Per-micro-batch logprob rows (processing order, predicting positions) -> [N, T] at token positions in the
    original order, 0 past each sequence's length."""
    n, t = batch.input_ids.shape
    out = torch.zeros(n, max(t, max(plan.padded_lengths)), device=batch.input_ids.device)
    for index, rows in enumerate(collected):
        merged = _merge_rows(rows, plan, index, ctx)
        out[plan.bins[index], : merged.shape[1]] = merged
    out = ctx.to_token_positions(out)[:, :t]
    beyond = torch.arange(t, device=out.device)[None, :] >= torch.tensor(plan.lengths, device=out.device)[:, None]
    return out.masked_fill(beyond, 0.0)


def train_on_batch(
    model: list,
    optimizer,
    scheduler,
    batch: RankBatch,
    *,
    loss_fn: PolicyLoss,
    count: float,
    micro_batch_size: int,
    ctx: StepContext,
    packing: "PackingConfig | None" = None,
    dynamic_batching: "DynamicBatchingConfig | None" = None,
) -> dict[str, float]:
    """Forward/backward over every micro-batch, then one optimizer step. Returns this rank's metric sums
    (only meaningful on the last pipeline stage; reduce them over data- and context-parallel ranks,
    `get_data_parallel_group(with_context_parallel=True)`: a CP rank sums only its chunks of each sequence).
    With `packing` or `dynamic_batching` enabled, micro-batches follow a token budget and `micro_batch_size` is
    not used (see the module docstring). A step whose gradients or loss are not finite on any rank is skipped on
    every rank (no update, no scheduler step; `nonfinite` 1 in the metrics, `grad_norm` NaN)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    plan = plan_micro_batches(batch, model, ctx, packing=packing, dynamic_batching=dynamic_batching)
    mbs, seq_length, mb_rows = _micro_batches(batch, plan, micro_batch_size, model, ctx)
    scale = len(mbs) * ctx.dp_size

    def forward_step(data_iter: Iterator[dict], chunk):
        data = next(data_iter)
        logits = _forward(chunk, data, ctx, training=True)

        def loss_func(output: torch.Tensor):
            logprobs, inputs = _train_inputs(output, data, ctx)  # [b, T']
            if getattr(loss_fn, "needs_sequence_log_ratio", False) and ctx.cp_size > 1:
                inputs = {**inputs, SEQ_LOG_RATIO_SUM: _whole_sequence_log_ratio(logprobs, inputs, ctx)}
            if ctx.cp_size > 1 and isinstance(loss_fn, WholeSequenceLoss):
                loss, metrics = _whole_sequence_loss(loss_fn, logprobs, inputs, count, ctx)
            else:
                loss, metrics = loss_fn(logprobs, inputs, count)
            reported = {"loss": loss.detach().clone(), **{k: v.detach().float() for k, v in metrics.items()}}
            return loss * scale, reported

        return logits, loss_func

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(mbs),
        model=model,
        num_microbatches=len(mbs),
        seq_length=seq_length,
        micro_batch_size=mb_rows,
        forward_only=False,
    )
    lr = optimizer.param_groups[0]["lr"]  # the rate this step uses (the scheduler moves it for the next one below)
    metrics = _sum_metrics(outputs)
    metrics.update(_token_counts(batch, mbs, ctx))
    ok, grad_norm = False, float("nan")
    if not nonfinite_anywhere(model, metrics.get("loss", 0.0)):
        ok, grad_norm, _ = optimizer.step()  # False: the mixed-precision scaler found inf after unscaling
    if not ok:  # skipped on every rank alike: no update, the scheduler stays (as Megatron's trainer does)
        optimizer.zero_grad()
        metrics.update({"grad_norm": float("nan"), "lr": lr, "nonfinite": 1.0})
        return metrics
    scheduler.step(increment=1)
    metrics.update({"grad_norm": float(grad_norm or 0.0), "lr": lr, "nonfinite": 0.0})
    return metrics


def nonfinite_anywhere(model: list, loss: float) -> bool:
    """Whether any rank's gradients or loss hold inf or NaN after the backward, the same answer on every rank (a MAX
    over the default group, which every rank of the step's train call belongs to). The optimizer must then not step:
    Megatron's fp32 optimizer has no such check (FP32Optimizer.step always returns success; with clip_grad, a NaN
    norm makes the clip coefficient NaN, `clip_coeff < 1.0` is false, and Adam applies the NaN gradients), and one
    such update poisons every later step. One reduction per contiguous gradient buffer (`_gradients`)."""
    local = [g.isfinite().all() for g in _gradients(model) if g.numel()]
    bad = torch.stack(local).logical_not().any().float() if local else torch.zeros(())
    flag = (bad + (0.0 if torch.isfinite(torch.tensor(float(loss))) else 1.0)).reshape(1)
    if collectives.is_initialized():
        collectives.all_reduce(flag, op="max")
    return bool(flag.item() > 0)


def _gradients(model: list) -> Iterator[torch.Tensor]:
    """Every gradient of `model`: Megatron DDP's contiguous buffers (`grad_data`, dense and expert, which every
    parameter's `main_grad` views), else each parameter's `main_grad` or `.grad`."""
    for chunk in model:
        buffers = getattr(chunk, "expert_parallel_buffers", None)
        if isinstance(buffers, list) and isinstance(getattr(chunk, "buffers", None), list):
            yield from (buffer.grad_data for buffer in [*chunk.buffers, *buffers])
            continue
        for p in chunk.parameters():
            grad = getattr(p, "main_grad", None)
            grad = p.grad if grad is None else grad
            if grad is not None:
                yield grad


def _sum_metrics(outputs: list[dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    for record in outputs or []:
        for k, v in record.items():
            out[k] = out.get(k, 0.0) + float(v.sum())
    return out


@torch.no_grad()
def logprobs_of_batch(
    model: list,
    batch: RankBatch,
    *,
    micro_batch_size: int,
    ctx: StepContext,
    packing: "PackingConfig | None" = None,
    dynamic_batching: "DynamicBatchingConfig | None" = None,
) -> torch.Tensor | None:
    """[N, T] logprobs at token positions (position 0 is 0), in the original row order; None on ranks that are not
    the last pipeline stage. Token-budget micro-batches as in `train_on_batch`, of the logprob budget where one is
    set (0 past each sequence's length)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    plan = plan_micro_batches(batch, model, ctx, packing=packing, dynamic_batching=dynamic_batching, logprob=True)
    mbs, seq_length, mb_rows = _micro_batches(batch, plan, micro_batch_size, model, ctx)
    collected: list[torch.Tensor] = []

    def forward_step(data_iter: Iterator[dict], chunk):
        data = next(data_iter)
        logits = _forward(chunk, data, ctx, training=False)

        def collect(output: torch.Tensor):
            collected.append(_target_logprobs(output, data, ctx))  # [b, T/cp], or a pack's rows [b, W]
            return output.new_zeros(()), {}

        return logits, collect

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(mbs),
        model=model,
        num_microbatches=len(mbs),
        seq_length=seq_length,
        micro_batch_size=mb_rows,
        forward_only=True,
    )
    if not ctx.is_last_stage:
        return None
    if plan is not None:
        return _restore_order(collected, plan, batch, ctx)
    merged = [merge_from_context_parallel(lp, ctx.cp_group) for lp in collected]
    return ctx.to_token_positions(torch.cat(merged, dim=0))
