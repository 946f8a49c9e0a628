"""Errors a command ends with, and their exit statuses (light: `mrl.cli` imports this before anything heavy).

    0  done, or pre-empted (`Preempted`: a SIGTERM stopped a loop, which saved; re-running the command resumes)
    1  a file or checkpoint the user named cannot be used
    2  configuration error (CONFIG_ERROR_EXIT_CODE), or a GRPO run that trained on nothing for grpo.max_idle_steps
       steps in a row (mrl.algorithms.health.IdleTraining): change the settings or the data
    3  non-finite loss or gradients on policy.max_nonfinite_steps steps in a row (mrl.algorithms.guards.NonFiniteTraining): change the settings, then re-running resumes
    4  a worker died or raised (RunFailed): re-running the command resumes
"""

from __future__ import annotations

RUN_FAILED_EXIT_CODE = 4


class CheckpointIncompatibleError(RuntimeError):
    """The newest checkpoint belongs to another model or tokenizer."""


class Preempted(RuntimeError):
    """A SIGTERM stopped a training loop before its end, after saving: exit 0 (Slurm's pre-emption), and nothing
    that needs a finished run (export, summary, the next stage of a recipe) happens."""


class RunFailed(RuntimeError):
    """A worker died or raised; the message says where the run can resume from."""


class StorageFailed(RuntimeError):
    """A checkpoint or export could not be written (disk full, permissions, read-only file system): the message
    names the folder, the reason and the free space; the controller adds where a re-run resumes (exit 4)."""
