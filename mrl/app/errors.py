"""Errors a command ends with, and their exit statuses (light: `mrl.cli` imports this before anything heavy).

    0  done          2  configuration error (CONFIG_ERROR_EXIT_CODE)     3  command not implemented yet
    1  a file or checkpoint the user named cannot be used                4  a worker died or raised (RunFailed):
                                                                            re-running the command resumes
"""

from __future__ import annotations

NOT_IMPLEMENTED_EXIT_CODE = 3
RUN_FAILED_EXIT_CODE = 4


class CheckpointIncompatibleError(RuntimeError):
    """The newest checkpoint belongs to another model or tokenizer."""


class RunFailed(RuntimeError):
    """A worker died or raised; the message says where the run can resume from."""
