"""Writes that fail for want of storage: a checkpoint or an export meeting a full disk, a quota, a read-only file
system or a folder it may not write, said in one message that names the folder, the reason and the free space.

Nothing earlier is lost: a checkpoint is written under a temporary name and made visible by one rename once complete
(mrl/checkpoint/manager.py), and so is the final export (mrl/app/commands.py `export_final`), so a failed write
leaves only its temporary folder, which `storage_guard` removes to give the space back. The run then ends
(`StorageFailed`, exit 4 with where a re-run resumes: mrl/app/commands.py `explained_failures`).

The failure may come from the controller (an OSError here) or from a policy rank (a `WorkerError` whose remote
exception or traceback holds the OSError: torch's distributed checkpoint writer collects each rank's failure into
one CheckpointException), so both the exception chain and its text are read; and since torch's zip writer reports
a full disk without its errno, a write that fails on an all-but-full file system counts as a full disk too. A folder
that cannot be made at all (a file in its path, a file system that takes no new folders) is said the same way: the
up-front check (mrl/app/preflight.py `check_output_folders`) cannot rule out a change after the run started.
"""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

from mrl.app.errors import StorageFailed

#: The errors of a write that storage refused (as opposed to a bug): their errno and their text in a traceback.
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG)
_TEXTS = tuple(os.strerror(code) for code in STORAGE_ERRNOS)
#: A write that failed, whatever its error, while less than this fraction of its file system was free: a full disk.
FULL_FRACTION = 0.01


def storage_reason(error: BaseException) -> Optional[str]:
    """The reason ("No space left on device", ...) when `error` is, wraps or reports a refused write; else None."""
    seen: set[int] = set()
    stack: list[Optional[BaseException]] = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return os.strerror(e.errno)
        text = f"{e} {getattr(e, 'remote_traceback', '') or ''}"
        found = next((reason for reason in _TEXTS if reason in text), None)
        if found is not None:
            return found
        cause = getattr(e, "cause", None)  # a WorkerError's remote exception
        stack.extend([e.__cause__, e.__context__, cause if isinstance(cause, BaseException) else None])
    return None


def free_space(folder: Path) -> str:
    """'<free> free of <total>' on the file system that holds `folder` (or its nearest existing parent)."""
    usage = shutil.disk_usage(_existing(folder))
    return f"{_size(usage.free)} free of {_size(usage.total)}"


def _full(folder: Path) -> Optional[str]:
    """A reason when `folder`'s file system is (all but) full at the failure, whatever the error said. torch's
    checkpoint writer reports a full disk as "[enforce fail at inline_container.cc] unexpected pos N vs M" (its zip
    writer checks the position, not the errno: measured with torch 2.13 and megatron-core 0.16.1 on a full tmpfs).
    megatron-core 0.19.2 still writes every checkpoint tensor through that zip writer: its
    `FileSystemWriterAsync.write_preloaded_data` hands each one to torch.distributed.checkpoint's `_write_item` in
    the TORCH_SAVE format, which calls `torch.save`."""
    usage = shutil.disk_usage(_existing(folder))
    if usage.free < FULL_FRACTION * usage.total:
        return f"{os.strerror(errno.ENOSPC)} (the file system had {_size(usage.free)} free when the write failed)"
    return None


def _unmade(error: BaseException, folder: Path) -> Optional[str]:
    """A reason when `error` is the failure to make `folder` or one of its parents (whatever its errno: a file in
    the way, a path under /proc); None for any other error."""
    if not isinstance(error, OSError) or error.filename is None:
        return None
    failed, target = Path(os.fsdecode(error.filename)).absolute(), Path(folder).absolute()
    if failed != target and failed not in target.parents:
        return None
    existing = _existing(target)
    if not existing.is_dir():
        return f"the folder cannot be made: {existing} is a file"
    return f"the folder cannot be made in {existing} ({error.strerror or error})"


def _existing(folder: Path) -> Path:
    """`folder` or its nearest parent that exists (a write may fail before it created its folder)."""
    probe = Path(folder).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


@contextmanager
def storage_guard(what: str, folder: Path, cleanup: Callable[[], None]) -> Iterator[None]:
    """Run a write of `what` under `folder`; a refused write calls `cleanup` (remove the partial write) and becomes
    `StorageFailed` naming the folder, the reason and the free space after the clean-up. Other errors pass."""
    try:
        yield
    except Exception as error:
        reason = storage_reason(error) or _unmade(error, folder) or _full(folder)
        if reason is None:
            raise
        cleanup()
        raise StorageFailed(
            f"could not write {what} under {folder}: {reason}. That file system now has {free_space(folder)}. "
            "The partial write was removed; every earlier checkpoint is untouched (a checkpoint becomes visible "
            "only once complete). Free some space (or fix the folder's permissions, or point checkpointing.dir / "
            "run.output_dir elsewhere)"
        ) from error
