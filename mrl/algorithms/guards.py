"""Guards a training loop applies to every step's metrics: a run whose updates keep failing stops, with the cause.

Non-finite steps. The policy skips an optimizer update whose loss or gradients are not finite on any rank
(mrl/policy/train_step.py `nonfinite_anywhere`: no update, no scheduler step, `train/nonfinite` 1), so one bad batch
costs one step and never reaches the weights. A step all of whose updates were skipped is a skipped step: the engine
is not refitted after it (its weights did not change). `policy.max_nonfinite_steps` skipped steps in a row end the
run with `NonFiniteTraining` before anything more is saved (but the run's summary.json, saying why: every guard's stop
is a `TrainingStopped`): by then the cause is the run's settings or its weights, not one batch, and the checkpoints
written so far hold only the finite weights of the last applied update.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

#: Exit status of a run stopped by `NonFiniteTraining` (mrl.cli).
NONFINITE_EXIT_CODE = 3


class TrainingStopped(RuntimeError):
    """A guard stopped the loop (this module's, or mrl.algorithms.health's `IdleTraining`); the message names the
    cause and the fix. The command still writes the run's summary.json, saying why (mrl/app/results.py)."""

    setting: str = ""
    """The key whose limit stopped the run."""


class NonFiniteTraining(TrainingStopped):
    """`policy.max_nonfinite_steps` steps in a row had a non-finite loss or gradient; the message says what to do."""

    setting = "policy.max_nonfinite_steps"


@dataclass
class NonFiniteGuard:
    """Counts the skipped steps of one loop (`observe` after each step's training) and stops the run at `limit` in a
    row."""

    limit: int
    in_a_row: list[int] = field(default_factory=list)
    total: int = 0
    _last: dict[str, float] = field(default_factory=dict)

    def observe(self, step: int, metrics: dict[str, float]) -> bool:
        """Whether step `step` was skipped (every update of it non-finite). Adds `train/nonfinite_steps` (the run's
        count so far) to `metrics`. Call `stop_if_exhausted` once the step's metrics are logged."""
        skipped = metrics.get("train/nonfinite", 0.0) >= 1.0  # the fraction of the step's updates skipped
        self.total += skipped
        self.in_a_row = [*self.in_a_row, step] if skipped else []
        self._last = metrics
        metrics["train/nonfinite_steps"] = float(self.total)
        if skipped:
            print(
                f"[mrl] step {step}: the loss or the gradients were not finite: its update was skipped "
                f"({len(self.in_a_row)} in a row; policy.max_nonfinite_steps={self.limit})",
                file=sys.stderr,
                flush=True,
            )
        return skipped

    def stop_if_exhausted(self) -> None:
        """Raise `NonFiniteTraining` when the last `limit` steps were all skipped (before the loop saves)."""
        if len(self.in_a_row) >= self.limit:
            raise NonFiniteTraining(self._message(self._last))

    def _message(self, metrics: dict[str, float]) -> str:
        first, last = self.in_a_row[0], self.in_a_row[-1]
        loss = metrics.get("train/loss", math.nan)
        return (
            f"steps {first}..{last}: the loss ({loss:g} at step {last}) or the gradients were not finite on "
            f"{len(self.in_a_row)} steps in a row (policy.max_nonfinite_steps={self.limit}). None of them was "
            "applied: the weights are those of the last finite update, and no checkpoint holds non-finite "
            "weights. Usual causes: a learning rate too high for the model (lower policy.optimizer.lr, add "
            "policy.scheduler.warmup_steps), no gradient clipping (policy.optimizer.clip_grad=1.0), or weights "
            "that were already non-finite when loaded."
        )
