"""Errors a command ends with, and their exit statuses (light: `mrl.cli` imports this before anything heavy).

0  done, or pre-empted (`Preempted`: a SIGTERM stopped a loop, which saved; re-running the command resumes)
1  a file or checkpoint the user named cannot be used
2  configuration error (CONFIG_ERROR_EXIT_CODE), also one a worker met (`configuration_failure`: re-running
   would meet it again), or a GRPO run that trained on nothing for grpo.max_idle_steps steps in a row
   (mrl.algorithms.health.IdleTraining): change the settings or the data
3  non-finite loss or gradients on policy.max_nonfinite_steps steps in a row (mrl.algorithms.guards.NonFiniteTraining):
   change the settings, then re-running resumes
4  a worker died or raised (RunFailed), or an environment's reward failed on more of a step's samples than
   grpo.max_env_error_fraction allows (mrl.algorithms.health.EnvironmentFailing): re-running the command resumes
5  `mrl check`: a figure of the run missed the bound its recipe's expect: block sets (mrl.app.check)
130 interrupted by Ctrl-C (SIGINT), without saving: re-running resumes from the newest checkpoint there is
"""

from __future__ import annotations

from typing import Optional

from mrl.config.errors import ConfigError

RUN_FAILED_EXIT_CODE = 4
INTERRUPTED_EXIT_CODE = 130  # the shell's status for a command SIGINT ended
INTERRUPTED = (
    "interrupted (Ctrl-C): nothing was saved since the newest checkpoint, from which re-running the command "
    "resumes; to stop a run after saving a checkpoint, send SIGTERM instead (kill -TERM <pid of mrl>)"
)

#: Failures inside a worker that come from the configuration, not from chance, as (what the worker's message holds,
#: the key to change, the fix): a re-run meets them again, so their message is a configuration error's, with the fix,
#: never the advice to re-run. Each is refused before any worker starts where mrl can tell (mrl/app/preflight.py);
#: this is the net for the cases it cannot.
CONFIGURATION_FAILURES = (
    (
        "Unsupported CPU attention configuration",
        "policy.model_name",
        (
            "a model whose attention head size vLLM's CPU attention serves (mrl.inference.vllm_backend."
            "CPU_ATTENTION_HEAD_SIZES: 32, 64, 80, 96, 112, 128, ...), generation.backend=megatron, or GPUs"
        ),
    ),
)


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


def configuration_failure(error: BaseException) -> Optional[ConfigError]:
    """The `ConfigError` for a worker's failure that re-running cannot cure: the worker raised a ConfigError, or the
    failure is one of `CONFIGURATION_FAILURES`; None for any other (`error`: a `WorkerError`, read by its `cause` and
    message so that this module stays free of Ray)."""
    if getattr(error, "group", None) is None:  # not a worker's failure
        return None
    cause = getattr(error, "cause", None)
    if isinstance(cause, ConfigError):
        return cause
    message = str(error).split("\n--- remote traceback ---")[0]
    for text, key, fix in CONFIGURATION_FAILURES:
        if text in message:
            return ConfigError(
                f"{message}\n    this comes from the configuration: a re-run fails the same way", key=key, fix=fix
            )
    return None
