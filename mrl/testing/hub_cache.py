"""A huggingface_hub cache written by a test exactly as `hf download` leaves one, without a hub:

    <cache>/models--org--name/            (datasets--org--name/ for a dataset)
        blobs/<etag>                      each file's bytes, stored once: named by the sha256 of the content for a
                                          large (LFS) file, by its git blob sha1 for any other
        snapshots/<commit>/<path>         a relative symlink to ../../blobs/<sha256> (nested paths: more ../)
        refs/<revision>                   the commit a branch or tag points at (no newline, as huggingface_hub writes)

`place` writes one commit of a repo; placing another commit under the same revision moves the ref, as a later
download of a moved branch does.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Mapping


def place(
    cache: Path,
    repo_id: str,
    files: Mapping[str, bytes],
    *,
    repo_type: str = "model",
    revision: str = "main",
    commit: str | None = None,
) -> str:
    """Write `files` (repo path -> bytes) as commit `commit` (default: derived from the content) of `repo_id` and point
    refs/<revision> at it; returns the commit."""
    repo = Path(cache) / f"{repo_type}s--{repo_id.replace('/', '--')}"
    commit = commit or hashlib.sha1(b"".join(name.encode() + data for name, data in sorted(files.items()))).hexdigest()
    for name, data in files.items():
        blob = repo / "blobs" / _etag(name, data)
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return commit


LFS_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt", ".parquet", ".arrow")


def _etag(name: str, data: bytes) -> str:
    if name.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def folder_files(folder: Path) -> dict[str, bytes]:
    """Every file of a folder (a model saved by transformers), by its path inside it."""
    folder = Path(folder)
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
