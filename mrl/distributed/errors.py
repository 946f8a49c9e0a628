"""Errors raised by the Ray cluster and worker groups: each names the group, the rank and where it ran."""

from __future__ import annotations

from typing import Optional


class ClusterResourceError(RuntimeError):
    """A placement asked for more CPUs/GPUs than the Ray cluster has (or has free); the message says what exists."""


class WorkerError(RuntimeError):
    """A worker method raised. `cause` is the original exception as raised inside the worker (when Ray could
    rebuild it), so callers can inspect it; the message carries the remote traceback (also `remote_traceback`)."""

    def __init__(
        self,
        message: str,
        *,
        group: str,
        rank: int,
        cause: Optional[BaseException] = None,
        method: str = "",
        remote_traceback: str = "",
    ):
        super().__init__(message)
        self.group = group
        self.rank = rank
        self.cause = cause
        self.method = method
        self.remote_traceback = remote_traceback


class WorkerDiedError(WorkerError):
    """A worker process is gone (crash, os._exit, killed, node lost). The group cannot continue: its collective
    peers may now block forever, so the caller should `shutdown()` the group and restart from a checkpoint."""


class WorkerTimeoutError(WorkerError):
    """A call did not finish within the timeout the caller gave; the workers are alive but still running."""
