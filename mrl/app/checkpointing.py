"""Saving and resuming a training loop: what goes into `<checkpointing.dir>/step_N/` and how a run picks it up.

    step_N/model/, rng/      the policy's distributed checkpoint (every rank writes its shards; reshardable)
    step_N/critic/           PPO's value model, the same way (model/, rng/: weights, optimizer, LR schedule)
    step_N/hf/               config.json, tokenizer, generation config: `mrl convert megatron-to-hf` reads them
    step_N/config.yaml       the run's resolved config
    step_N/train_state.pt    step, data loader position, controller RNG states, metric history, model record
    step_N/COMPLETE          written last by CheckpointManager.commit; a folder without it is never loaded

Resume (`checkpointing.resume=true`, the default): the newest complete step is loaded; a checkpoint of another
model or tokenizer is refused with the reason; another parallel layout is fine (reshard on load). A SIGTERM
(Slurm pre-emption) sets a flag: the loop saves after the step in flight and exits 0.
`checkpointing.enabled=false`: nothing is written and nothing is resumed (the run's final export still is).
A save that storage refuses (disk full, quota, permissions) removes its partial folder and ends the run with the
folder, the reason and the free space (mrl/app/storage.py); a re-run resumes from the newest complete step.
A complete step_N/ is also a Megatron checkpoint folder that any command starts from (`policy.model_name`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from mrl.app.errors import RUN_FAILED_EXIT_CODE, CheckpointIncompatibleError, Preempted
from mrl.app.runtime import Runtime
from mrl.app.storage import storage_guard
from mrl.config import to_yaml
from mrl.config.schema import MrlConfig

log = logging.getLogger(__name__)


def _say(message: str) -> None:
    print(f"[mrl] {message}", file=sys.stderr, flush=True)


CRITIC_SUBDIR = "critic"


def resume_padded_vocab(cfg: MrlConfig, part: str = "") -> Optional[int]:
    """The padded vocabulary of the checkpoint a run will resume from (None: no resume; `part`: a subfolder such as
    the critic's). The model must be built with it: Megatron pads the vocabulary to a multiple of 128 * tp, so a
    checkpoint from another TP size has another embedding shape."""
    from mrl.checkpoint.manager import CheckpointManager
    from mrl.checkpoint.megatron import MODEL_SUBDIR, checkpoint_padded_vocab

    if not _resumes(cfg):
        return None
    latest = CheckpointManager(cfg.checkpointing.dir, keep_last=cfg.checkpointing.keep_last).latest()
    if latest is None or not (latest / part / MODEL_SUBDIR).is_dir():
        return None
    return checkpoint_padded_vocab(latest / part / MODEL_SUBDIR)


def _damaged(path: Path, why: str) -> CheckpointIncompatibleError:
    """The error of a step that cannot be loaded (a file missing or cut short): the fix names the step, since a plain
    re-run would meet it again."""
    return CheckpointIncompatibleError(
        f"cannot resume from {path}: {why}\n(if the step is damaged, remove {path}: the run then resumes from the "
        "step before it; or set checkpointing.resume=false or another checkpointing.dir to start fresh)"
    )


def _resumes(cfg: MrlConfig) -> bool:
    return cfg.checkpointing.enabled and cfg.checkpointing.resume


# How long after a SIGTERM the controller watches whether Ray's GCS still serves (it stops within a second of the
# same signal).
RAY_WATCH_AFTER_SIGTERM_S = 10.0


class RunCheckpoints:
    """The checkpoints of one training loop (GRPO or SFT): `mrl.algorithms.interfaces.LoopCheckpoints`."""

    def __init__(self, cfg: MrlConfig, runtime: Runtime) -> None:
        from mrl.checkpoint.manager import CheckpointManager

        ck = cfg.checkpointing
        self.cfg, self.runtime = cfg, runtime
        self.manager = CheckpointManager(
            ck.dir,
            keep_last=ck.keep_last,
            keep_best=ck.keep_best,
            metric=ck.metric if ck.keep_best else None,
            higher_is_better=ck.higher_is_better,
        )
        self.stop_requested = False
        self.interrupted_at: Optional[int] = None  # the step after which a SIGTERM stopped an unfinished loop
        self._previous_handler: Any = None
        self._left = threading.Event()  # set when the loop's context ends (Ray is shut down after it, on purpose)

    def _record(self) -> dict[str, Any]:
        from converters.hf_io import load_hf_config
        from mrl.checkpoint.manager import model_record

        return model_record(
            load_hf_config(self.runtime.model_dir),
            tokenizer_dir=self.runtime.model_dir,
            precision=self.cfg.policy.precision,
        )

    # ---------------------------------------------------------------------------------------------------- save
    def due(self, step: int, last_step: int, *, final: bool = False) -> bool:
        """Every `save_every` steps, after the last step, and after a SIGTERM; never when checkpointing is off."""
        ck = self.cfg.checkpointing
        return ck.enabled and (step % ck.save_every == 0 or step == last_step or final or self.stop_requested)

    def save(self, step: int, state: dict[str, Any], metrics: dict[str, float]) -> Path:
        """Write step `step` (policy shards + controller state) and commit it atomically."""
        from converters.hf_io import copy_model_metadata
        from mrl.checkpoint.manager import capture_rng_state, save_train_state
        from mrl.checkpoint.megatron import HF_SUBDIR

        start = time.perf_counter()
        tmp: Optional[Path] = None

        def discard() -> None:
            if tmp is not None:
                self.manager.discard(tmp)

        with storage_guard(f"checkpoint step {step}", self.manager.root, discard):
            tmp = self.manager.begin(step)
            assert self.runtime.policy is not None  # checkpoints belong to the training commands, which start one
            self.runtime.policy.save(str(tmp))
            if self.runtime.critic is not None:
                self.runtime.critic.save(str(tmp / CRITIC_SUBDIR))
            copy_model_metadata(self.runtime.model_dir, tmp / HF_SUBDIR)
            (tmp / "config.yaml").write_text(to_yaml(self.cfg))
            save_train_state(tmp, {**state, "step": step, "rng": capture_rng_state(), "model_record": self._record()})
            path = self.manager.commit(step, tmp, metrics)
        _say(f"saved checkpoint {path} ({time.perf_counter() - start:.1f} s)")
        return path

    def stops_after(self, step: int, *, done: bool) -> bool:
        """The loop ends after `step` when it is done or a SIGTERM arrived (then `interrupted_at` is set)."""
        if self.stop_requested and not done:
            self.interrupted_at = step
        return done or self.stop_requested

    def end_if_interrupted(self) -> None:
        """Raise `Preempted` when a SIGTERM stopped the loop before its end: no export, no summary, no next stage."""
        if self.interrupted_at is not None:
            saved = self.manager.latest() if self.cfg.checkpointing.enabled else None
            raise Preempted(
                f"stopped by SIGTERM after step {self.interrupted_at}; "
                + (
                    f"saved {saved}: re-running the same command resumes from it"
                    if saved
                    else "checkpointing is off, so nothing was saved"
                )
            )

    # -------------------------------------------------------------------------------------------------- resume
    def newest(self) -> Optional[Path]:
        if not _resumes(self.cfg):
            return None
        self.manager.clean_stale()
        return self.manager.latest()

    def resume_newest(self, last_step: Optional[int] = None, steps_key: str = "") -> Optional[dict[str, Any]]:
        """Resume from the newest complete checkpoint (see `resume`); None when the run starts fresh. A checkpoint
        at or past `last_step` (the run's `steps_key`) leaves nothing to train, which is said."""
        path = self.newest()
        state = None if path is None else self.resume(path)
        if state is not None and last_step is not None and int(state["step"]) >= last_step:
            _say(
                f"nothing left to train: the checkpoint is at step {state['step']}, {steps_key}={last_step}; raise "
                f"{steps_key} to train on from it, or set checkpointing.resume=false to start fresh"
            )
        return state

    def resume(self, path: Path) -> dict[str, Any]:
        """Load step folder `path` into the policy and return the controller's training state (RNG restored)."""
        from mrl.checkpoint.manager import check_compatible, load_train_state, restore_rng_state

        try:
            state = load_train_state(path)
        except Exception as error:  # any unreadable file: the step is damaged
            raise _damaged(path, f"its controller state cannot be read ({type(error).__name__}: {error})") from error
        reasons = check_compatible(state.get("model_record", {}), self._record())
        if reasons:
            raise CheckpointIncompatibleError(
                f"cannot resume from {path}:\n- "
                + "\n- ".join(reasons)
                + "\n(set checkpointing.resume=false or another checkpointing.dir to start fresh)"
            )
        assert self.runtime.policy is not None  # checkpoints belong to the training commands, which start one
        from mrl.distributed import WorkerDiedError, WorkerError

        try:
            reports = self.runtime.policy.load(str(path))
        except WorkerError as error:
            if isinstance(error, WorkerDiedError):  # a death is no sign of a damaged step
                raise
            first = str(error).split("\n--- remote traceback ---")[0]
            raise _damaged(path, f"the policy's workers could not load it: {first[:600]}") from error
        if self.runtime.critic is not None:
            if not (path / CRITIC_SUBDIR).is_dir():
                raise CheckpointIncompatibleError(
                    f"cannot resume from {path}: it holds no critic ({CRITIC_SUBDIR}/), and this run trains one "
                    "(grpo.advantage_estimator=gae)\n(set checkpointing.resume=false or another checkpointing.dir "
                    "to start fresh)"
                )
            reports += self.runtime.critic.load(str(path / CRITIC_SUBDIR))
        restore_rng_state(state["rng"])
        _say(f"resuming from {path} (step {state['step']})")
        notes = sorted({r.note for r in reports if not r.rng_restored and r.note})
        if notes:
            _say("worker RNG states not restored: " + "; ".join(notes))
        return state

    # -------------------------------------------------------------------------------------------------- SIGTERM
    def __enter__(self) -> "RunCheckpoints":
        def on_sigterm(signum: int, frame: Any) -> None:
            _say("SIGTERM: saving a checkpoint after the current step, then exiting")
            if not self.stop_requested:
                threading.Thread(target=self._end_if_ray_was_stopped_too, daemon=True).start()
            self.stop_requested = True

        self._previous_handler = signal.signal(signal.SIGTERM, on_sigterm)
        return self

    def __exit__(self, *exc: object) -> None:
        self._left.set()
        signal.signal(signal.SIGTERM, self._previous_handler or signal.SIG_DFL)

    def _end_if_ray_was_stopped_too(self) -> None:
        """A SIGTERM sent to the whole process group or job (`kill -TERM -<pgid>`, a plain `scancel`, systemd) also
        stops Ray's own processes: nothing can be saved then, and Ray's driver would wait a minute for its GCS
        before ending the process. Said at once, with where a re-run resumes; the process ends with
        status 4 (a worker died)."""
        from mrl.distributed.cluster import ray_gcs_refuses

        deadline = time.monotonic() + RAY_WATCH_AFTER_SIGTERM_S
        while time.monotonic() < deadline and not self._left.is_set():
            gcs = ray_gcs_refuses()
            if gcs and not self._left.is_set():
                saved = self.manager.latest() if self.cfg.checkpointing.enabled else None
                print(
                    f"mrl: run failed: the SIGTERM reached Ray's own processes too (its GCS at {gcs} stopped "
                    "serving): the whole process group or job was signalled, so no checkpoint could be saved. "
                    + (f"Re-running the same command resumes from {saved}. " if saved else "Nothing was saved. ")
                    + "To stop a run after a save, signal the mrl process alone: kill -TERM <pid of mrl>; under "
                    "Slurm, scancel --batch --signal=TERM <job> (the launcher's --signal=B:TERM does so before the "
                    "time limit)",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(RUN_FAILED_EXIT_CODE)
            time.sleep(0.2)
