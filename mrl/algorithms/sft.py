"""Supervised fine-tuning: minimise the NLL of the response tokens (and EOS) given the prompt,
    L = -sum_{b,t} m_bt log pi(y_bt | y_b<t) / N_tokens        (token level; NLLLoss normalises globally)
with the same policy workers, optimizer and logging as GRPO. Used as the warm-up stage of the embedded recipe.

Data: with `data.arith`, every step draws `policy.train_global_batch_size` fresh training pairs whose labels are
near misses with probability `data.arith.near_miss_fraction` (the task's point: the SFT policy ends up only partly
right, leaving GRPO something to fix); otherwise the problem/answer rows of `data.train`, answer as the response.
"""

from __future__ import annotations

import random
import time

from mrl.algorithms.checkpointing import RunCheckpoints
from mrl.algorithms.loss import NLLLoss
from mrl.algorithms.runtime import Runtime
from mrl.config.schema import MrlConfig
from mrl.data.dataloader import PromptDataLoader
from mrl.data.sft import build_sft_batch
from mrl.data.tasks import TaskData
from mrl.logging.metrics import MetricsLogger
from mrl.policy.train_step import RankBatch

KEY_METRICS = ("train/loss", "train/grad_norm")


class _Examples:
    """Endless (prompt, target) batches with a saveable position."""

    def __init__(self, cfg: MrlConfig, data: TaskData) -> None:
        self.batch_size = cfg.policy.train_global_batch_size
        self.arith = data.arith
        self.rng = random.Random(cfg.run.seed + 1)
        self.loader = None if self.arith else PromptDataLoader(data.train, self.batch_size, seed=cfg.run.seed)

    def next(self) -> tuple[list[str], list[str]]:
        if self.arith is not None:
            examples = self.arith.sft_examples(self.rng, self.batch_size)
            return [e.prompt for e in examples], [e.target for e in examples]
        problems = next(self.loader)  # type: ignore[arg-type]
        return [p.problem for p in problems], [p.answer for p in problems]

    def state_dict(self) -> dict:
        version, internal, gauss = self.rng.getstate()
        return {"rng": [version, list(internal), gauss], "loader": self.loader.state_dict() if self.loader else None}

    def load_state_dict(self, state: dict) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        if self.loader is not None:
            self.loader.load_state_dict(state["loader"])


def sft_train(cfg: MrlConfig, runtime: Runtime, data: TaskData, logger: MetricsLogger) -> dict[str, float]:
    """The whole SFT run (resumes from the newest checkpoint when there is one). Returns the last step's metrics."""
    examples = _Examples(cfg, data)
    loss_fn = NLLLoss(level="token")
    last = cfg.sft.max_num_steps
    final: dict[str, float] = {}
    with RunCheckpoints(cfg, runtime) as ckpt:
        state = ckpt.resume_newest()
        start = int(state["step"]) if state else 0
        if state:
            examples.load_state_dict(state["examples"])
        for step in range(start + 1, last + 1):
            t0 = time.perf_counter()
            prompts, targets = examples.next()
            sft = build_sft_batch(prompts, targets, runtime.tokenizer, data.template)
            metrics = runtime.policy.train(RankBatch(sft.input_ids, sft.loss_mask), loss_fn)
            final = {f"train/{k}": v for k, v in metrics.items()}
            final["timing/step"] = time.perf_counter() - t0
            logger.log(final, step=step)
            if ckpt.due(step, last):
                ckpt.save(step, {"examples": examples.state_dict()}, final)
            if ckpt.stop_requested:
                break
    return final
