"""Supervised fine-tuning: minimise the NLL of the response tokens (and EOS) given the prompt,
    L = -sum_{b,t} m_bt log pi(y_bt | y_b<t) / N_tokens        (token level; NLLLoss normalises globally)
with the same policy workers, optimizer and logging as GRPO. Used as the warm-up stage of the embedded recipe.

Data: with `data.arith`, every step draws `policy.train_global_batch_size` fresh training pairs whose labels are
near misses with probability `data.arith.near_miss_fraction` (the task's point: the SFT policy ends up only partly
right, leaving GRPO something to fix), an endless stream (sft.max_num_epochs does not apply); otherwise the
problem/answer rows of `data.train`, answer as the response, for at most sft.max_num_epochs passes.
A row longer than policy.max_total_sequence_length keeps its first tokens (`train/rows_truncated` counts them); rows
that cannot train are caught before any worker starts (mrl/algorithms/health.py, `check_sft_rows`).
Validation (every sft.val_every steps and after the last): `val/loss`, the same token-level NLL over the
validation problems with their gold answers (data.val, or the arith task's held-out pairs), no update.
"""

from __future__ import annotations

import random
import sys
import time
from typing import Optional

from mrl.algorithms.guards import NonFiniteGuard
from mrl.algorithms.health import ZeroLoss
from mrl.algorithms.interfaces import LoopCheckpoints, Workers
from mrl.algorithms.loop import end_step
from mrl.config.schema import MrlConfig
from mrl.data.dataloader import PromptDataLoader
from mrl.data.sft import build_sft_batch
from mrl.data.tasks import TaskData
from mrl.logging.metrics import MetricsLogger
from mrl.objectives.loss import NLLLoss
from mrl.policy.interface import RankBatch

KEY_METRICS = ("train/loss", "train/grad_norm", "val/loss")
#: Validation rows per logprobs call.
VAL_ROWS_PER_CALL = 256


class _Examples:
    """(prompt, target) batches with a saveable position."""

    def __init__(self, cfg: MrlConfig, data: TaskData) -> None:
        self.batch_size = cfg.policy.train_global_batch_size
        self.arith = data.arith
        self.rng = random.Random(cfg.run.seed + 1)
        self.loader = None if self.arith else PromptDataLoader(data.train, self.batch_size, seed=cfg.run.seed)

    def next(self) -> tuple[list[str], list[str]]:
        if self.arith is not None:
            examples = self.arith.sft_examples(self.rng, self.batch_size)
            return [e.prompt for e in examples], [e.target for e in examples]
        assert self.loader is not None  # every task but arith has one (__init__)
        problems = next(self.loader)
        return [p.problem for p in problems], [p.answer for p in problems]

    def passes_done(self, max_epochs: int) -> bool:
        """Whether the data has been seen `max_epochs` times (never for the endless arith stream)."""
        return self.loader is not None and self.loader.passes_done(max_epochs)

    def state_dict(self) -> dict:
        version, internal, gauss = self.rng.getstate()
        return {"rng": [version, list(internal), gauss], "loader": self.loader.state_dict() if self.loader else None}

    def load_state_dict(self, state: dict) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        if self.loader is not None:
            self.loader.load_state_dict(state["loader"])


def validation_loss(workers: Workers, data: TaskData, max_length: int) -> dict[str, float]:
    """`val/loss`: token-level NLL of the validation answers (no update; rows cut to `max_length` like the training
    rows); {} without validation problems."""
    if not data.val:
        return {}
    dp = workers.policy.data_parallel_size
    total = count = 0.0
    for start in range(0, len(data.val), VAL_ROWS_PER_CALL):
        chunk = data.val[start : start + VAL_ROWS_PER_CALL]
        sft = build_sft_batch(
            [p.problem for p in chunk], [p.answer for p in chunk], workers.tokenizer, data.template, max_length
        )
        rows = list(range(len(chunk))) + [0] * (-len(chunk) % dp)  # every data-parallel rank needs rows
        mask = sft.loss_mask[rows].clone()
        mask[len(chunk) :] = 0  # the repeated rows count for nothing
        logprobs = workers.policy.logprobs(RankBatch(sft.input_ids[rows], mask, lengths=sft.lengths[rows]))
        total -= float((logprobs.double() * mask).sum())
        count += float(mask.sum())
    return {"val/loss": total / count} if count else {}


def _validation_due(cfg: MrlConfig, step: int, done: bool) -> bool:
    return done or bool(cfg.sft.val_every and step % cfg.sft.val_every == 0)


def sft_train(
    cfg: MrlConfig, workers: Workers, data: TaskData, logger: MetricsLogger, ckpt: LoopCheckpoints
) -> dict[str, float]:
    """The whole SFT run (resumes from the newest checkpoint when there is one). Returns the last step's metrics."""
    examples = _Examples(cfg, data)
    loss_fn = NLLLoss(level="token")
    last = cfg.sft.max_num_steps
    if not data.val:
        print("[mrl] no validation problems (data.val): validation is skipped", file=sys.stderr)
    state: Optional[dict] = ckpt.resume_newest(last, "sft.max_num_steps")
    if state:
        examples.load_state_dict(state["examples"])
    final: dict[str, float] = {}
    guard = NonFiniteGuard(cfg.policy.max_nonfinite_steps)
    zero = ZeroLoss("sft")

    def position() -> dict:  # the controller state a checkpoint keeps
        return {"examples": examples.state_dict()}

    for step in range(int(state["step"]) + 1 if state else 1, last + 1):
        t0 = time.perf_counter()
        prompts, targets = examples.next()
        sft = build_sft_batch(prompts, targets, workers.tokenizer, data.template, cfg.policy.max_total_sequence_length)
        metrics = {
            f"train/{k}": v for k, v in workers.policy.train(RankBatch(sft.input_ids, sft.loss_mask), loss_fn).items()
        }
        metrics["train/rows_truncated"] = float(sft.num_truncated)
        done = step == last or examples.passes_done(cfg.sft.max_num_epochs)
        if _validation_due(cfg, step, done):
            metrics.update(validation_loss(workers, data, cfg.policy.max_total_sequence_length))
        guard.observe(step, metrics)
        zero.observe(step, metrics)
        final = metrics
        if end_step(
            step, last, metrics, started=t0, done=done, logger=logger, ckpt=ckpt, stops=[guard], state=position
        ):
            break
    return final
