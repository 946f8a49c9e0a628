"""The preference pairs of a DPO or reward-model run, and their batches as the policy takes them.

    data.arith set     -> the synthetic addition task: chosen = the right sum, rejected = a near miss (a+b +-1/2),
                          training pairs from the training operands, validation pairs from the held-out ones
    data.train / .val  -> preference files (mrl/data/preferences.py: plain, UltraFeedback, HH-RLHF, sharegpt rows)
A pair whose prompt leaves no room for a response in `policy.max_total_sequence_length` is dropped and counted.

Batch layout (`RankBatch`, `group_size=2`): row 2i = pair i's chosen response, row 2i+1 its rejected one, with
sequence data `pair_id` [2P] (the pair's index in the batch), `chosen` [2P] (1/0) and `score_index` [2P] (position
of the last real token, where a reward model reads its score).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from mrl.algorithms.guards import NonFiniteGuard
from mrl.algorithms.health import ZeroLoss
from mrl.algorithms.loop import end_step
from mrl.config.errors import ConfigError
from mrl.config.schema import MrlConfig
from mrl.data.preferences import (
    PreferencePair,
    build_preference_batch,
    encode_prompt_messages,
    load_preferences,
    prompt_fits,
)
from mrl.data.templates import PromptTemplate
from mrl.objectives.preference import CHOSEN, PAIR_ID, SCORE_INDEX
from mrl.policy.interface import RankBatch

if TYPE_CHECKING:
    from mrl.algorithms.interfaces import LoopCheckpoints, Workers
    from mrl.config.schema import DPOConfig, RMConfig
    from mrl.logging.metrics import MetricsLogger

log = logging.getLogger(__name__)


@dataclass
class EncodedPair:
    """A pair with its prompt already tokenised (prompts are encoded once, at load)."""

    prompt_ids: list[int]
    chosen: str
    rejected: str


@dataclass
class PairData:
    train: list[EncodedPair]
    val: list[EncodedPair]
    template: PromptTemplate
    skipped: dict[str, int] = field(default_factory=dict)


def _arith_pairs(cfg: MrlConfig) -> tuple[list[PreferencePair], list[PreferencePair]]:
    from mrl.data.arith import ArithTask

    task = ArithTask.from_config(cfg.data.arith, cfg.run.seed)

    def as_pairs(triples):
        return [PreferencePair(({"role": "user", "content": p},), c, r, i) for i, (p, c, r) in enumerate(triples)]

    return (
        as_pairs(task.preference_triples(task.train_pairs, cfg.run.seed + 2)),
        as_pairs(task.preference_triples(task.heldout_pairs, cfg.run.seed + 3)),
    )


def _no_room(source: str) -> str:
    """The `skipped` key of `source`'s pairs whose prompt leaves no room for a response."""
    return f"{source}:prompt leaves no room in policy.max_total_sequence_length"


def _encode(
    pairs: Sequence[PreferencePair],
    tokenizer: Any,
    template: PromptTemplate,
    max_length: int,
    skipped: dict[str, int],
    source: str,
) -> list[EncodedPair]:
    out, reason = [], _no_room(source)
    for pair in pairs:
        ids = encode_prompt_messages(list(pair.prompt), tokenizer, template)
        if prompt_fits(ids, max_length):
            out.append(EncodedPair(ids, pair.chosen, pair.rejected))
        else:
            skipped[reason] = skipped.get(reason, 0) + 1
    return out


def load_pair_data(cfg: MrlConfig, tokenizer: Any) -> PairData:
    """Training and validation pairs of the run, prompts tokenised (see the module docstring); a `ConfigError` when no
    training pair fits."""
    max_length = cfg.policy.max_total_sequence_length
    skipped: dict[str, int] = {}
    parts: dict[str, list[EncodedPair]] = {}
    if cfg.data.arith is not None:
        template, train_source = PromptTemplate("plain", ""), "arith"
        for name, pairs in zip(("train", "val"), _arith_pairs(cfg)):
            parts[name] = _encode(pairs, tokenizer, template, max_length, skipped, train_source)
    elif not cfg.data.train:
        raise ConfigError(
            "no preference data",
            key="data.train",
            fix="set data.train (and optionally data.val) to a jsonl/json/parquet file of "
            "prompt/chosen/rejected rows, or data.arith for the synthetic task",
        )
    else:
        template, train_source = PromptTemplate(cfg.data.prompt_template, ""), cfg.data.train
        for name, source in (("train", cfg.data.train), ("val", cfg.data.val)):
            if source:
                loaded = load_preferences(source, split="train" if name == "train" else "test", key=f"data.{name}")
                skipped.update({f"{source}:{reason}": n for reason, n in loaded.skipped.items()})
                parts[name] = _encode(loaded.pairs, tokenizer, template, max_length, skipped, source)
    if not parts["train"]:
        raise ConfigError(
            f"no preference pair of {train_source} fits: the prompts of "
            f"{skipped.get(_no_room(train_source), 0)} leave no room for a response",
            key="policy.max_total_sequence_length",
            given=max_length,
            fix="raise policy.max_total_sequence_length, or shorten the prompts",
        )
    if skipped and cfg.data.arith is None:
        log.warning("preference pairs skipped: %s", skipped)
    return PairData(parts["train"], parts.get("val", []), template, skipped)


def pair_batch(
    pairs: Sequence[EncodedPair], tokenizer: Any, template: PromptTemplate, max_length: int, *, turn_end: bool = True
) -> RankBatch:
    """The policy's batch of `pairs` (layout in the module docstring); `turn_end=False` leaves the end-of-turn token
    off the responses (reward models score the answer's last token)."""
    built = build_preference_batch(
        [p.prompt_ids for p in pairs],
        [p.chosen for p in pairs],
        [p.rejected for p in pairs],
        tokenizer,
        template,
        max_length=max_length,
        turn_end=turn_end,
    )
    n = len(pairs)
    seq = {
        PAIR_ID: torch.arange(n).repeat_interleave(2),
        CHOSEN: torch.tensor([1, 0] * n),
        SCORE_INDEX: built.lengths - 1,
    }
    return RankBatch(built.input_ids, built.loss_mask, seq_data=seq, lengths=built.lengths, group_size=2)


def padded_pairs(pairs: Sequence[EncodedPair], multiple: int) -> tuple[list[EncodedPair], int]:
    """`pairs` repeated cyclically up to a multiple of `multiple` pairs (every data-parallel rank needs whole pairs),
    and the number of real ones (the repeats are dropped from every metric)."""
    extra = -len(pairs) % multiple
    return list(pairs) + [pairs[i % len(pairs)] for i in range(extra)], len(pairs)


def pairs_per_step(cfg: MrlConfig) -> int:
    """Pairs of one optimizer step: `policy.train_global_batch_size` counts sequences, two per pair."""
    size = cfg.policy.train_global_batch_size
    if size % 2:
        from mrl.config.errors import ConfigError

        raise ConfigError(
            "a preference step trains whole pairs (chosen + rejected)",
            key="policy.train_global_batch_size",
            given=size,
            allowed="an even number",
        )
    return size // 2


def validation_chunks(
    pairs: Sequence[EncodedPair], data_parallel: int, per_call: int
) -> list[tuple[list[EncodedPair], int]]:
    """The validation pairs in calls of at most `per_call` pairs, each padded to whole pairs on every data-parallel
    rank: (pairs, number of real ones)."""
    return [padded_pairs(pairs[i : i + per_call], data_parallel) for i in range(0, len(pairs), per_call)]


def masked_batch_dict(batch: RankBatch, rows: int) -> dict[str, torch.Tensor]:
    """The loss-side view of the first `rows` rows of `batch` at token positions (mask, sequence data, counts), for
    computing a loss's metrics on the controller from returned logprobs or scores."""
    mask = batch.loss_mask[:rows]
    return {"loss_mask": mask, "seq_num_tokens": mask.sum(dim=1), **{k: v[:rows] for k, v in batch.seq_data.items()}}


def train_on_pairs(
    cfg: MrlConfig,
    section: "DPOConfig | RMConfig",
    workers: "Workers",
    data: PairData,
    logger: "MetricsLogger",
    ckpt: "LoopCheckpoints",
    *,
    step_fn: Callable[[RankBatch], dict[str, float]],
    validate: Callable[[], dict[str, float]],
    command: str,
    turn_end: bool = True,
) -> dict[str, float]:
    """The loop DPO and reward models share: a batch of pairs per step -> `step_fn` (one optimizer step; its
    metrics) -> validation (before the first step, every `section.val_every` steps and after the last) -> log ->
    checkpoint. Resumes from the newest checkpoint (the pair stream's position included). Returns the last metrics."""
    from mrl.data.dataloader import PromptDataLoader

    stream = PromptDataLoader(data.train, pairs_per_step(cfg), seed=cfg.run.seed)  # filled: preflight checked
    last = section.max_num_steps
    if not data.val:
        print("[mrl] no validation pairs (data.val): validation is skipped", file=sys.stderr)
    state: Optional[dict] = ckpt.resume_newest(last, f"{command}.max_num_steps")
    if state:
        stream.load_state_dict(state["pairs"])
    else:  # the starting model's validation metrics, the baseline the run is judged against
        logger.log(validate(), step=0)
    final: dict[str, float] = {}
    guard = NonFiniteGuard(cfg.policy.max_nonfinite_steps)
    zero = ZeroLoss(command)

    def position() -> dict:  # the controller state a checkpoint keeps
        return {"pairs": stream.state_dict()}

    for step in range(int(state["step"]) + 1 if state else 1, last + 1):
        t0 = time.perf_counter()
        metrics = step_fn(
            pair_batch(
                next(stream), workers.tokenizer, data.template, cfg.policy.max_total_sequence_length, turn_end=turn_end
            )
        )
        done = step == last or stream.passes_done(section.max_num_epochs)
        if done or (section.val_every and step % section.val_every == 0):
            metrics.update(validate())
        guard.observe(step, metrics)
        zero.observe(step, metrics)
        final = metrics
        if end_step(
            step, last, metrics, started=t0, done=done, logger=logger, ckpt=ckpt, stops=[guard], state=position
        ):
            break
    return final
