"""A refused write is told apart from a bug, from the controller's OSError, a worker's report of one, or a full disk."""

from __future__ import annotations

import errno
import os
import shutil
from collections import namedtuple

import pytest

from mrl.app import storage
from mrl.app.errors import StorageFailed
from mrl.distributed.errors import WorkerError


def test_the_reason_is_found_in_the_chain_in_a_workers_report_and_never_in_a_bug():
    assert storage.storage_reason(OSError(errno.ENOSPC, "x")) == os.strerror(errno.ENOSPC)
    try:
        try:
            raise PermissionError(errno.EACCES, "denied", "/ck/step_2")
        except OSError as inner:
            raise RuntimeError("save failed") from inner
    except RuntimeError as outer:
        assert storage.storage_reason(outer) == os.strerror(errno.EACCES)
    remote = WorkerError("worker group 'policy' rank 1 raised CheckpointException in 'save'", group="policy", rank=1,
                         method="save", remote_traceback="OSError: [Errno 122] Disk quota exceeded: '/ck/x.distcp'")
    assert storage.storage_reason(remote) == os.strerror(errno.EDQUOT)
    assert storage.storage_reason(ValueError("bad shape")) is None
    assert storage.storage_reason(FileNotFoundError(errno.ENOENT, "no such file")) is None


def test_a_failed_write_is_a_full_disk_only_when_the_disk_is_all_but_full(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    cleaned = []
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1000 * 10**6, 995 * 10**6, 5 * 10**6))
    with pytest.raises(StorageFailed) as raised:
        with storage.storage_guard("checkpoint step 4", tmp_path / "ck", lambda: cleaned.append(True)):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    text = str(raised.value)
    assert f"checkpoint step 4 under {tmp_path / 'ck'}: No space left on device" in text
    assert "5.0 MB free of 1.0 GB" in text and cleaned == [True]
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1000 * 10**6, 500 * 10**6, 500 * 10**6))
    with pytest.raises(RuntimeError, match="unexpected pos"):  # room left: a bug, passed on as it is
        with storage.storage_guard("checkpoint step 4", tmp_path / "ck", lambda: cleaned.append(True)):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert cleaned == [True]


def test_a_folder_that_cannot_be_made_is_a_refused_write_and_another_missing_file_a_bug(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [(a_file / "ck", NotADirectoryError(errno.ENOTDIR, "Not a directory", str(a_file / "ck")),
              f"the folder cannot be made: {a_file} is a file"),
             (tmp_path / "ro" / "ck", FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(tmp_path / "ro")),
              f"the folder cannot be made in {tmp_path} ({os.strerror(errno.ENOENT)})")]  # as under /proc
    for folder, error, reason in cases:
        with pytest.raises(StorageFailed) as raised:
            with storage.storage_guard("checkpoint step 1", folder, lambda: None):
                raise error
        assert f"could not write checkpoint step 1 under {folder}: {reason}. That file system now has" in str(
            raised.value)
    with pytest.raises(FileNotFoundError):  # a file missing inside the folder: a bug, passed on as it is
        with storage.storage_guard("checkpoint step 1", tmp_path / "ck", lambda: None):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(tmp_path / "ck" / "x" / "y"))
