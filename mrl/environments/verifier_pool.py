"""A pool of Ray actors that score (response, answer) pairs with a per-sample deadline.

Data flow: the driver holds a queue of samples and gives each idle actor ONE sample at a time, so a sample's
deadline starts when its actor starts on it (an actor only counts as idle once its `ready()` returned, after
imports and warm-up). `ray.wait` sleeps until a result arrives or the earliest deadline passes.
- a verifier that raises: the actor catches it and returns (0, error); the actor stays;
- a verifier that hangs (sleep, endless loop, a regex or sympy call that never returns, even one holding the GIL):
  at the deadline the driver kills the actor process (the only way to stop arbitrary stuck code), scores the
  sample 0 with a timeout error, and starts a replacement that takes samples once it is ready;
- an actor that dies under a sample (killed from outside, out of memory): the actor is replaced and the sample
  scored again by the next idle actor, so a lost worker changes no reward; a sample under which actors die twice
  (a verifier that kills its process on that input) scores 0 with an error;
- an actor that dies while starting is started again, up to `MAX_START_DEATHS` deaths in a row.
So one bad sample costs at most `timeout_s` (or two actors) of the pool's time and never blocks the other actors.
A verifier returns a score, or a (score, extracted answer) pair when it can say what it read in the response.
Hazard: a replacement that never becomes ready (its import fails) would stall the queue: after `startup_timeout_s`
the pool raises with the actor's error instead, as a worker group's failure (a `WorkerError` of the group
'verifiers': the run ends with one message and where a re-run resumes, exit 4, not a traceback). The deadlines are
checked after collecting every result that has arrived: the first `score` may come minutes after the pool started
(a long generation), when every deadline has passed and every actor is long ready.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

from mrl.distributed.errors import WorkerDiedError, WorkerError, WorkerTimeoutError

#: The name the pool's failures carry (`WorkerError.group`), as a worker group's do.
GROUP = "verifiers"
#: Actors that die while starting, in a row, before the pool gives up (a killed actor is started again; a warm-up
#: that raises is not a death and fails at once).
MAX_START_DEATHS = 3
#: Actor deaths under one sample before it scores 0 (the second: the sample itself kills its verifier).
MAX_SAMPLE_DEATHS = 2

VerifyFn = Callable[[str, str], Union[float, tuple[float, Optional[str]]]]


class _VerifierActor:
    """Runs `verify_fn(response, answer)`; never raises for a verifier error."""

    def __init__(self, verify_fn: VerifyFn, warmup: Optional[Callable[[], None]]):
        from mrl.distributed import faults

        faults.register("VerifierActor")  # for a fault campaign's random kills (benchmarks/fault_campaign.py)
        self._verify_fn = verify_fn
        self._warmup = warmup

    def ready(self) -> bool:
        if self._warmup is not None:
            self._warmup()
        return True

    def verify(self, response: str, answer: str) -> tuple[float, Optional[str], Optional[str]]:
        """(score, error, extracted answer)."""
        try:
            verdict = self._verify_fn(response, answer)
            score, extracted = verdict if isinstance(verdict, tuple) else (verdict, None)
            score = float(score)
        except Exception as err:  # noqa: BLE001 any verifier failure scores 0 and is reported, by design
            return 0.0, f"{type(err).__name__}: {err}", None
        if not math.isfinite(score):
            return 0.0, f"verifier returned {score}", extracted
        return score, None, extracted


@dataclass
class ScoreResult:
    scores: list[float]
    errors: list[Optional[str]]  # None where the verifier succeeded
    extracted: list[Optional[str]] = field(default_factory=list)  # what the verifier read (None: nothing, or unsaid)
    num_restarts: int = 0

    @property
    def num_errors(self) -> int:
        return sum(e is not None for e in self.errors)


@dataclass
class _Slot:
    actor: Any
    started: float = field(default_factory=time.monotonic)


class VerifierPool:
    """`num_workers` actors scoring samples with `verify_fn`; see the module docstring for the timeout policy."""

    def __init__(
        self,
        verify_fn: VerifyFn,
        *,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        warmup: Optional[Callable[[], None]] = None,
        num_cpus: float = 0.0,
        startup_timeout_s: float = 120.0,
    ):
        import ray

        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(f"need env.num_workers >= 1 and env.timeout_s > 0, got {num_workers}, {timeout_s}")
        if not ray.is_initialized():
            raise RuntimeError("VerifierPool needs a running Ray instance (ray.init) before it is created")
        self._remote_cls = ray.remote(num_cpus=num_cpus, max_restarts=0)(_VerifierActor)
        self._args = (verify_fn, warmup)
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._starting: dict[Any, _Slot] = {}  # ready() ref -> actor
        self._idle: list[Any] = []
        self._start_deaths = 0  # actors that died while starting, in a row
        for _ in range(num_workers):
            self._start_actor()

    def _start_actor(self) -> None:
        actor: Any = self._remote_cls.remote(*self._args)  # ray types it as the class itself: no `.remote` methods
        self._starting[actor.ready.remote()] = _Slot(actor)

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> ScoreResult:
        """Scores [N] in input order; every sample gets a score, failures 0 with their error."""
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
        result = ScoreResult([0.0] * len(responses), [None] * len(responses), [None] * len(responses))
        queue = deque(range(len(responses)))
        running: dict[Any, tuple[_Slot, int]] = {}  # verify() ref -> (actor, sample index)
        deaths: dict[int, int] = {}  # sample index -> actors that died under it
        while queue or running:
            while queue and self._idle:
                i = queue.popleft()
                actor = self._idle.pop()
                running[actor.verify.remote(responses[i], answers[i])] = (_Slot(actor), i)
            for i in self._wait_and_collect(running, result):  # the samples whose actor died: again, or 0
                deaths[i] = deaths.get(i, 0) + 1
                if deaths[i] < MAX_SAMPLE_DEATHS:
                    queue.appendleft(i)
        return result

    def _wait_and_collect(self, running: dict, result: ScoreResult) -> list[int]:
        """Collect what has arrived (or wait until something does or a deadline passes); the indices of the samples
        whose actor died under them (scored 0 with the error, for the caller to queue again)."""
        import ray

        deadlines = [slot.started + self.timeout_s for slot, _ in running.values()]
        deadlines += [slot.started + self.startup_timeout_s for slot in self._starting.values()]
        wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        refs = list(running) + list(self._starting)
        done, pending = ray.wait(refs, num_returns=1, timeout=wait_s)
        if pending:  # everything else that has finished too: only what has not may miss its deadline below
            done += ray.wait(pending, num_returns=len(pending), timeout=0)[0]
        orphans = []
        for ref in done:
            if ref in self._starting:
                self._on_ready(ref)
                continue
            slot, i = running.pop(ref)
            try:
                result.scores[i], result.errors[i], result.extracted[i] = ray.get(ref)
                self._idle.append(slot.actor)
            except ray.exceptions.RayError as err:  # the actor died under this sample
                result.errors[i] = f"verifier worker died: {type(err).__name__}"
                self._replace(slot.actor, result)
                orphans.append(i)
        now = time.monotonic()
        for ref, (slot, i) in list(running.items()):
            if now >= slot.started + self.timeout_s:
                running.pop(ref)
                result.scores[i], result.errors[i] = 0.0, f"timed out after {self.timeout_s:g}s"
                self._replace(slot.actor, result)
        for slot in list(self._starting.values()):
            if now >= slot.started + self.startup_timeout_s:
                raise WorkerTimeoutError(
                    f"worker group '{GROUP}': a verifier worker did not start within {self.startup_timeout_s:g}s",
                    group=GROUP,
                    rank=0,
                    method="ready",
                )
        return orphans

    def _on_ready(self, ref: Any) -> None:
        import ray

        slot = self._starting.pop(ref)
        try:
            ray.get(ref)
        except ray.exceptions.RayError as err:  # a death, or its warm-up (import) raised
            died = isinstance(err, ray.exceptions.RayActorError)
            self._start_deaths += died
            if died and self._start_deaths < MAX_START_DEATHS:
                ray.kill(slot.actor, no_restart=True)
                self._start_actor()
                return
            cause = getattr(err, "cause", None) if isinstance(err, ray.exceptions.RayTaskError) else None
            detail = f"{type(cause).__name__}: {cause}" if cause is not None else " ".join(str(err).split())[:300]
            raise (WorkerDiedError if died else WorkerError)(
                f"worker group '{GROUP}': a verifier worker failed to start: {detail}",
                group=GROUP,
                rank=0,
                method="ready",
                cause=cause,
            ) from err
        self._start_deaths = 0
        self._idle.append(slot.actor)

    def _replace(self, actor: Any, result: ScoreResult) -> None:
        import ray

        ray.kill(actor, no_restart=True)
        result.num_restarts += 1
        self._start_actor()

    @property
    def num_workers(self) -> int:
        return len(self._idle) + len(self._starting)

    def shutdown(self) -> None:
        import ray

        for actor in self._idle + [slot.actor for slot in self._starting.values()]:
            ray.kill(actor, no_restart=True)
        self._idle, self._starting = [], {}
