"""`mrl convert`'s folder arguments checked before anything heavy is imported: a mistyped path is answered at once,
not after the seconds torch and megatron-core take to import.

Each check raises a `ConfigError` naming the flag, what was found and the fix (exit 2). What needs the checkpoint's
own files (its metadata, its marker) is checked where they are read, in `mrl.app.convert`.
"""

from __future__ import annotations

import os
from pathlib import Path

from mrl.config.errors import ConfigError


def _not_a_folder(folder: Path) -> str:
    """Why `folder` is not an existing folder ("" when it is one)."""
    return "there is no such folder" if not folder.exists() else "it is a file" if not folder.is_dir() else ""


def check_hf_argument(value: str) -> None:
    """--hf is a hub id (resolved by the caller) or an existing folder with a config.json: a local path that does
    not exist is said to be one, not looked up on the hub or read as a file."""
    from mrl.data.hub import parse_hub_id

    folder = Path(value)
    if parse_hub_id(value) is not None or (folder / "config.json").is_file():
        return
    held = ", ".join(sorted(p.name for p in folder.iterdir())[:8]) if folder.is_dir() else ""
    found = _not_a_folder(folder) or f"the folder has no config.json (it holds {held})"
    raise ConfigError(
        f"not an HF model folder: {found}",
        key="--hf",
        given=value,
        fix="pass an HF model folder (config.json + *.safetensors) or a hub id (org/name[@revision])",
    )


#: What each source flag of megatron-to-hf takes.
SOURCE_FIXES = {
    "--megatron": "pass the folder `mrl convert hf-to-megatron` wrote",
    "--checkpoint": "pass a <checkpointing.dir>/step_N folder",
}


def check_source_folder(value: str, key: str) -> None:
    """--megatron and --checkpoint name a folder that exists (what it must hold is checked when it is read)."""
    found = _not_a_folder(Path(value))
    if found:
        raise ConfigError(f"not a folder to convert: {found}", key=key, given=value, fix=SOURCE_FIXES[key])


def check_out_argument(out: str, source: str, *, empty: bool) -> None:
    """--out names a folder to write, not a file, nor the folder converted (`source`); `empty`: nor a folder that
    holds anything (an HF export would overwrite or mix with its files; hf-to-megatron checks its own sub-folder)."""
    folder, found = Path(out), ""
    if folder.exists() and not folder.is_dir():
        found = "it is a file"
    elif folder.resolve() == Path(source).resolve():
        found = "it is the folder converted"
    elif empty and os.environ.get("RANK", "0") == "0" and folder.is_dir() and any(folder.iterdir()):  # rank 0 writes
        held = ", ".join(sorted(p.name for p in folder.iterdir())[:6])
        found = f"the folder is not empty (it holds {held}): converting into it would overwrite or mix files"
    if found:
        raise ConfigError(
            f"not a folder to write the conversion into: {found}",
            key="--out",
            given=out,
            fix="choose a new --out folder",
        )
