"""What the loops are given: the started workers (`Workers`) and the checkpoints of the run (`LoopCheckpoints`).

The application layer (mrl/app) starts Ray and the workers, wires checkpoints and SIGTERM, and hands the loops
objects of these shapes; the loops never see ranks, devices, Ray or files of a checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from mrl.inference.interface import RolloutEngine
from mrl.inference.refit import RefitStats
from mrl.policy.interface import TrainablePolicy

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Workers(Protocol):
    """The started parts of a run (`mrl.app.runtime.Runtime`); a loop uses only those its command started."""

    tokenizer: "PreTrainedTokenizerBase"
    policy: TrainablePolicy
    engine: RolloutEngine
    engine_restarts: int
    """Engines replaced after a death so far (mrl/app/engine_restarts.py)."""
    critic: Optional[TrainablePolicy]
    """PPO's value model (grpo.advantage_estimator: gae; its `logprobs` are its score at every token), else None."""
    teacher: Optional[TrainablePolicy]
    """Distillation's frozen teacher (a `distillation` section; `logprobs` only), else None."""

    def refit(self, on_sent: Optional[Callable[[], None]] = None) -> RefitStats:
        """Stream the policy's current weights into the engine; `on_sent` is called once the policy has sent them all
        (it may train from then on while the engine still loads them)."""
        ...


class LoopCheckpoints(Protocol):
    """Saving and resuming a training loop (`mrl.app.checkpointing.RunCheckpoints`)."""

    stop_requested: bool
    """A SIGTERM arrived: save after the step in flight, then stop."""

    def resume_newest(self, last_step: Optional[int] = None, steps_key: str = "") -> Optional[dict[str, Any]]:
        """Load the newest complete checkpoint into the policy; its controller state, or None to start fresh (one at
        or past `last_step`, the run's `steps_key`, leaves nothing to train: said)."""
        ...

    def due(self, step: int, last_step: int, *, final: bool = False) -> bool:
        """Whether to save after `step` (`final`: the loop ends after it)."""
        ...

    def save(self, step: int, state: dict[str, Any], metrics: dict[str, float]) -> Path:
        """Write step `step`: the policy's shards and the controller `state`."""
        ...

    def stops_after(self, step: int, *, done: bool) -> bool:
        """Whether the loop ends after `step`: it is `done`, or a SIGTERM arrived (the run is then interrupted,
        not finished: nothing after the loop may treat it as complete)."""
        ...
