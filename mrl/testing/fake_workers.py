"""Fakes of what the training loops are given (mrl/algorithms/interfaces.py), so each control path of `grpo_train`,
`sft_train` and the DPO / reward-model loop runs in milliseconds: no Ray, no Megatron, no vLLM, no processes.

    FakeWorkers      `Workers`: the arith task's character tokenizer, a FakePolicy, a FakeEngine; `refit` moves the
                     policy's weights (a version number) into the engine
    FakePolicy       `TrainablePolicy`: `train` is one update (the version + 1) unless the test makes it report a
                     non-finite loss (no update, `nonfinite` 1, like mrl/policy/train_step.py)
    FakeEngine       `RolloutEngine`: each sample is `respond(step, prompt, sample_index)`, a function the test gives,
                     so the rewards are the test's choice (the step comes from the sampling seed; None: validation)
    FakeCheckpoints  `LoopCheckpoints` with the rules of mrl/app/checkpointing.py (`due`, `stops_after`); a saved
                     controller state goes through torch.save and torch.load(weights_only=True), as a real one does

Every fake appends what it was asked to one `Events` list, so a test asserts the order and count of a run's calls.
The fakes hold the loops to the protocols' contracts where a loop could break them: a batch's rows are a multiple of
the data-parallel size and its tensors aligned, an engine generates only once prepared for it (its life cycle is the
real `EngineLifecycle`), loads a refit only with its weights awake, and `on_sent` comes before a refit returns.
"""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, Sequence

import torch

from mrl.config.schema import MrlConfig
from mrl.data.arith import build_arith_tokenizer
from mrl.inference.factory import STEP_SEED_STRIDE
from mrl.inference.interface import FinishReason, GeneratedSample, GenerationOutput, RolloutEngine, SamplingConfig
from mrl.inference.lifecycle import EngineLifecycle
from mrl.inference.refit import RefitStats
from mrl.inference.transports.base import Payload
from mrl.policy.interface import PolicyLoss, RankBatch, TrainablePolicy

if TYPE_CHECKING:
    from mrl.algorithms.interfaces import LoopCheckpoints, Workers

#: respond(training step or None for validation, prompt text, sample index) -> the response's text
Respond = Callable[[Optional[int], str, int], str]
#: nonfinite(update) -> whether the policy's `update`-th train call (1-based) reports a non-finite loss
NonFinite = Callable[[int], bool]
#: The logprob the fakes give every response token (engine and policy alike: no train/inference mismatch).
TOKEN_LOGPROB = -0.5


@dataclass(frozen=True)
class Event:
    """One call a loop made."""

    kind: str
    """generate (a training step's samples), validate (validation samples), logprobs, train, refit, save, resume."""
    step: Optional[int] = None
    """The training step, where the fake knows it (generate: from the sampling seed; save: its argument)."""
    version: int = 0
    """The weights' version: the engine's (generate, validate), the policy's after the call (train, refit, save)."""
    detail: tuple[str, ...] = ()
    """generate / validate: the prompts; logprobs: ("reference",) for the reference's; train: ("nonfinite",)."""


class Events:
    """The calls of one run, in order (appended from the loop's thread and the rollouts-ahead thread alike)."""

    def __init__(self) -> None:
        self._events: list[Event] = []
        self._lock = threading.Lock()

    def add(self, kind: str, **fields: Any) -> None:
        with self._lock:
            self._events.append(Event(kind, **fields))

    def all(self) -> list[Event]:
        with self._lock:
            return list(self._events)

    def kinds(self) -> list[str]:
        return [e.kind for e in self.all()]

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.all() if e.kind == kind]


def check_batch(batch: RankBatch, data_parallel_size: int) -> None:
    """What `TrainablePolicy` requires of a batch (mrl/policy/interface.py): [N, T] tensors aligned, rows a multiple
    of the data-parallel size in whole groups."""
    rows, width = batch.input_ids.shape
    if batch.loss_mask.shape != (rows, width):
        raise AssertionError(f"loss_mask {list(batch.loss_mask.shape)} against input_ids {[rows, width]}")
    for name, tensor in batch.token_data.items():
        if tensor.shape != (rows, width):
            raise AssertionError(f"token_data[{name!r}] {list(tensor.shape)} against input_ids {[rows, width]}")
    for name, tensor in batch.seq_data.items():
        if tensor.shape[0] != rows:
            raise AssertionError(f"seq_data[{name!r}] has {tensor.shape[0]} rows, the batch {rows}")
    if rows == 0 or rows % data_parallel_size or rows % batch.group_size:
        raise AssertionError(
            f"{rows} rows for {data_parallel_size} data-parallel ranks in groups of {batch.group_size}"
        )


class FakePolicy:
    """`TrainablePolicy` whose weights are a version number: each applied update adds one."""

    def __init__(
        self,
        events: Events,
        *,
        data_parallel_size: int = 1,
        nonfinite: NonFinite = lambda update: False,
        name: str = "",
        token_logprob: float = TOKEN_LOGPROB,
    ):
        self.events = events
        self.token_logprob = token_logprob
        """What `logprobs` gives every loss token (a teacher's differ from the student's)."""
        self.name = name
        """The events' prefix: "" for the policy, "critic." or "teacher." for the groups beside it."""
        self.nonfinite = nonfinite
        self.on_train: Optional[Callable[[int], None]] = None
        """Called with the update's number after each train call (a test raises SIGTERM's flag from here)."""
        self.version = 0
        """Updates applied so far: the identity of the weights."""
        self.updates = 0
        """Train calls so far, applied or not."""
        self.trained: list[RankBatch] = []
        """Every batch `train` was given."""
        self._dp = data_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return self._dp

    def logprobs(self, batch: RankBatch, *, temperature: float = 1.0, reference: bool = False) -> torch.Tensor:
        """[B, T]: `token_logprob` on every loss token, 0 elsewhere (position 0 included, as the contract says)."""
        check_batch(batch, self._dp)
        self.events.add(self.name + "logprobs", version=self.version, detail=("reference",) if reference else ())
        out = batch.loss_mask.float() * self.token_logprob
        out[:, 0] = 0.0
        return out

    def train(self, batch: RankBatch, loss_fn: PolicyLoss, *, temperature: float = 1.0) -> dict[str, float]:
        """One update, or none when `nonfinite` says this one's loss is not finite; the metrics a real step reports."""
        check_batch(batch, self._dp)
        self.updates += 1
        skipped = self.nonfinite(self.updates)
        self.version += not skipped
        self.trained.append(batch)
        self.events.add(self.name + "train", version=self.version, detail=("nonfinite",) if skipped else ())
        if self.on_train is not None:
            self.on_train(self.updates)
        bad = float("nan")
        return {
            "loss": bad if skipped else 0.25,
            "grad_norm": bad if skipped else 1.0,
            "lr": 1e-3,
            "nonfinite": 1.0 * skipped,
        }

    def save(self, path: str, *, weights_only: bool = False) -> None:
        pass  # FakeCheckpoints keeps the version in the saved state

    def load(self, path: str, *, load_optimizer: bool = True) -> list[Any]:
        return []  # FakeCheckpoints sets the version back

    def export_state(self) -> dict[str, torch.Tensor]:
        return {"version": torch.tensor(self.version)}

    def shutdown(self) -> None:
        pass


class FakeEngine:
    """`RolloutEngine` whose samples the test chooses (`respond`); it holds the policy version of its last refit."""

    def __init__(self, events: Events, tokenizer: Any, respond: Respond, *, run_seed: int):
        self.events, self.tokenizer, self.respond, self.run_seed = events, tokenizer, respond, run_seed
        self.version = 0
        """The policy version whose weights the engine holds (0: the initial model)."""
        self.expected_names: Optional[frozenset[str]] = None
        self._lifecycle = EngineLifecycle("fake engine", sleeps=True)
        self._loading: Optional[int] = None

    @property
    def lifecycle(self) -> EngineLifecycle:
        return self._lifecycle

    def training_step(self, seed: Optional[int]) -> Optional[int]:
        """The GRPO step whose sampling seed this is (mrl.inference.factory.sampling_config); None: validation."""
        offset = None if seed is None else seed - self.run_seed
        return None if offset is None or offset % STEP_SEED_STRIDE else offset // STEP_SEED_STRIDE

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> GenerationOutput:
        self._lifecycle.check_generate()
        step = self.training_step(sampling.seed)
        texts = [self.tokenizer.decode(list(p)) for p in prompts]
        kind = "validate" if step is None else "generate"
        self.events.add(kind, step=step, version=self.version, detail=tuple(texts))
        samples = [
            self._sample(i, k, list(prompt), self.respond(step, texts[i], k), sampling)
            for i, prompt in enumerate(prompts)
            for k in range(sampling.n)
        ]
        return GenerationOutput(samples, len(prompts), sampling.n)

    def _sample(self, i: int, k: int, prompt: list[int], text: str, sampling: SamplingConfig) -> GeneratedSample:
        """`text` then EOS, cut at max_new_tokens (finish reason LENGTH then)."""
        ids = [*self.tokenizer(text, add_special_tokens=False)["input_ids"], self.tokenizer.eos_token_id]
        cut = len(ids) > sampling.max_new_tokens
        ids = ids[: sampling.max_new_tokens]
        reason = FinishReason.LENGTH if cut else FinishReason.STOP
        return GeneratedSample(i, k, prompt, ids, [TOKEN_LOGPROB] * len(ids), reason)

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> RefitStats:
        """Loads a `FakePolicy.export_state()` (its "version")."""
        tensors = dict(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        self.prepare_for_refit()
        self.load_payload({"version": int(tensors["version"])})
        self.finish_refit()
        return RefitStats(len(tensors), 1, 8, 8, 0.0)

    def prepare_for_generation(self) -> None:
        self._lifecycle.wake_all()

    def finish_generation(self, refit_follows: bool = False) -> None:
        self._lifecycle.sleep(refit_follows)

    def prepare_for_refit(self) -> None:
        self._lifecycle.wake_weights()

    def load_payload(self, payload: Payload) -> None:
        self._lifecycle.check_load()
        self._loading = int(payload["version"])

    def finish_refit(self, complete: bool = True) -> None:
        if complete and self._loading is not None:
            self.version = self._loading
            self._lifecycle.refitted()
        self._loading = None

    def shutdown(self) -> None:
        pass


class FakeWorkers:
    """`Workers`: the arith character tokenizer (mrl.data.arith), a FakePolicy and a FakeEngine sharing `events`."""

    def __init__(
        self,
        cfg: MrlConfig,
        respond: Respond = lambda step, prompt, k: "",
        *,
        data_parallel_size: int = 1,
        nonfinite: NonFinite = lambda update: False,
        critic: bool = False,
        teacher: Optional[float] = None,
    ):
        self.events = Events()
        self.tokenizer = build_arith_tokenizer()
        self.fake_policy = FakePolicy(self.events, data_parallel_size=data_parallel_size, nonfinite=nonfinite)
        self.fake_engine = FakeEngine(self.events, self.tokenizer, respond, run_seed=cfg.run.seed)
        # The same objects as the protocols' types: `Workers` declares them settable, so the types must be its own.
        self.policy: TrainablePolicy = self.fake_policy
        self.engine: RolloutEngine = self.fake_engine
        self.engine_restarts = 0
        # PPO's critic and distillation's teacher (`teacher`: its logprob of every token): FakePolicy groups whose
        # events say which they are
        self.critic: Optional[TrainablePolicy] = FakePolicy(self.events, name="critic.") if critic else None
        self.teacher: Optional[TrainablePolicy] = (
            None if teacher is None else FakePolicy(self.events, name="teacher.", token_logprob=teacher)
        )

    def refit(self, on_sent: Optional[Callable[[], None]] = None) -> RefitStats:
        """The policy's version into the engine, in one bucket; `on_sent` once it is sent, before the engine loads."""
        version = self.fake_policy.version
        self.events.add("refit", version=version)
        self.engine.prepare_for_refit()
        if on_sent is not None:
            on_sent()
        self.engine.load_payload({"version": version})
        self.engine.finish_refit()
        return RefitStats(1, 1, 8, 8, 0.0)


class FakeCheckpoints:
    """`LoopCheckpoints` in memory, with the rules of `mrl.app.checkpointing.RunCheckpoints`: save every
    checkpointing.save_every steps, after the last step and after a SIGTERM (never when checkpointing is off); the
    loop stops after a SIGTERM, `interrupted_at` the step it stopped after when it was not done. `resume`: a state
    `saved` by an earlier run's FakeCheckpoints (its policy version comes back into the policy)."""

    def __init__(self, cfg: MrlConfig, workers: FakeWorkers, *, resume: Optional[dict[str, Any]] = None):
        self.cfg, self.workers, self._resume = cfg, workers, resume
        self.stop_requested = False
        self.interrupted_at: Optional[int] = None
        self.saved: dict[int, dict[str, Any]] = {}
        """step -> the controller state as a resume reads it back (with "step" and the policy's "weights_version")."""

    def resume_newest(self, last_step: Optional[int] = None, steps_key: str = "") -> Optional[dict[str, Any]]:
        self.workers.events.add("resume", step=None if self._resume is None else int(self._resume["step"]))
        if self._resume is None:
            return None
        state = _through_a_file(self._resume)
        self.workers.fake_policy.load(f"step_{state['step']}")
        self.workers.fake_policy.version = int(state["weights_version"])  # the policy's shards, as the real load does
        return state

    def due(self, step: int, last_step: int, *, final: bool = False) -> bool:
        ck = self.cfg.checkpointing
        return ck.enabled and (step % ck.save_every == 0 or step == last_step or final or self.stop_requested)

    def save(self, step: int, state: dict[str, Any], metrics: dict[str, float]) -> Path:
        version = self.workers.fake_policy.version
        self.workers.fake_policy.save(f"step_{step}")
        self.workers.events.add("save", step=step, version=version)
        self.saved[step] = _through_a_file({**state, "step": step, "weights_version": version})
        return Path(f"step_{step}")

    def stops_after(self, step: int, *, done: bool) -> bool:
        if self.stop_requested and not done:
            self.interrupted_at = step
        return done or self.stop_requested

    def newest(self) -> dict[str, Any]:
        """The newest saved state (to resume a next run from)."""
        return self.saved[max(self.saved)]


def _through_a_file(state: dict[str, Any]) -> dict[str, Any]:
    """`state` saved and read back as a checkpoint's train state is (weights_only: tensors, numbers, strings)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


if TYPE_CHECKING:  # the fakes implement the protocols the loops are given (mypy holds them to it)

    def _workers(fake: FakeWorkers) -> Workers:
        return fake

    def _policy(fake: FakePolicy) -> TrainablePolicy:
        return fake

    def _engine(fake: FakeEngine) -> RolloutEngine:
        return fake

    def _checkpoints(fake: FakeCheckpoints) -> LoopCheckpoints:
        return fake
