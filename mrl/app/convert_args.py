"""`mrl convert`'s folder arguments checked before anything heavy is imported: a mistyped path is answered at once,
not after the seconds torch and megatron-core take to import.

Each check raises a `ConfigError` naming the flag, what was found and the fix (exit 2): a folder that is not there or
not of the kind the flag takes (an HF folder without a tokenizer, an HF folder given as a Megatron checkpoint), and an
--out that a conversion is already in. What needs the checkpoint's own files (its metadata, its marker) is checked
where they are read, in `mrl.app.convert`.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from mrl.config.errors import ConfigError

MODEL_SUBDIR = "model"  # mrl.checkpoint.megatron's (which imports torch): a converted folder's weights


def _not_a_folder(folder: Path) -> str:
    """Why `folder` is not an existing folder ("" when it is one)."""
    return "there is no such folder" if not folder.exists() else "it is a file" if not folder.is_dir() else ""


def _holds(folder: Path, most: int = 8) -> str:
    """What `folder` holds, for a message: "it holds a, b, ..." or "it is empty"."""
    names = sorted(p.name for p in folder.iterdir())
    return f"it holds {', '.join(names[:most])}{', ...' if len(names) > most else ''}" if names else "it is empty"


def check_hf_argument(value: str) -> None:
    """--hf is a hub id (resolved by the caller) or an existing folder with a config.json and a tokenizer: a local
    path that does not exist is said to be one, not looked up on the hub or read as a file. Without a tokenizer the
    converted folder could not be used as a model (its hf/ carries the source's tokenizer files), so the conversion
    is refused before it starts."""
    from mrl.data.hub import parse_hub_id

    folder = Path(value)
    if parse_hub_id(value) is not None:
        return
    if (folder / "config.json").is_file():
        return _check_tokenizer(folder, value)
    found = _not_a_folder(folder) or f"the folder has no config.json ({_holds(folder)})"
    raise ConfigError(
        f"not an HF model folder: {found}",
        key="--hf",
        given=value,
        fix="pass an HF model folder (config.json + *.safetensors) or a hub id (org/name[@revision])",
    )


def _check_tokenizer(folder: Path, value: str) -> None:
    from mrl.data.tokenizers import vocabulary_files

    if vocabulary_files(folder):
        return
    raise ConfigError(
        f"the HF model folder holds no tokenizer: none of tokenizer.json, vocab.json, vocab.txt, *.model, *.tiktoken "
        f"({_holds(folder)}); the converted folder would have none either, and commands refuse a model without one",
        key="--hf",
        given=value,
        fix=f"copy the tokenizer files of the model it came from (tokenizer.json, tokenizer_config.json, ...) into "
        f"{value}, then convert again",
    )


#: What each source flag of megatron-to-hf takes.
SOURCE_FIXES = {
    "--megatron": "pass the folder `mrl convert hf-to-megatron` wrote",
    "--checkpoint": "pass a <checkpointing.dir>/step_N folder",
}


def check_source_folder(value: str, key: str) -> None:
    """--megatron and --checkpoint name a folder that exists, and not an HF model folder (the other direction's
    input); what it must hold is checked when it is read."""
    folder = Path(value)
    found = _not_a_folder(folder)
    if found:
        raise ConfigError(f"not a folder to convert: {found}", key=key, given=value, fix=SOURCE_FIXES[key])
    if _is_hf_folder(folder):
        raise ConfigError(
            "not a Megatron checkpoint: it is an HF model folder (config.json + safetensors, no metadata.json)",
            key=key,
            given=value,
            fix=f"it is HF already: to make a Megatron checkpoint of it, mrl convert hf-to-megatron --hf {value} "
            f"--out DIR; to convert a Megatron checkpoint, {SOURCE_FIXES[key]}",
        )


def _is_hf_folder(folder: Path) -> bool:
    """An HF model folder and no Megatron checkpoint (whose weights are a metadata.json and *.distcp files, in the
    folder or its model/)."""
    megatron = (folder / "metadata.json").is_file() or (folder / MODEL_SUBDIR / "metadata.json").is_file()
    return not megatron and (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def check_out_argument(out: str, source: str, *, empty: bool) -> None:
    """--out names a folder to write, not a file, nor the folder converted (`source`); `empty`: nor a folder that
    holds anything (an HF export would overwrite or mix with its files); else (hf-to-megatron) nor one whose model/
    holds a conversion already."""
    folder, found, fix = Path(out), "", "choose a new --out folder"
    if folder.exists() and not folder.is_dir():
        found = "it is a file"
    elif folder.resolve() == Path(source).resolve():
        found = "it is the folder converted"
    elif empty and os.environ.get("RANK", "0") == "0" and folder.is_dir() and any(folder.iterdir()):  # rank 0 writes
        found = f"the folder is not empty ({_holds(folder, 6)}): converting into it would overwrite or mix files"
        fix += f", or remove {out} first (rm -r {shlex.quote(out)})"
    elif not empty and (folder / MODEL_SUBDIR).is_dir() and any((folder / MODEL_SUBDIR).iterdir()):
        found = f"it holds a converted model already ({folder / MODEL_SUBDIR} is not empty)"
        fix += f", or remove {out} first to convert into it again (rm -r {shlex.quote(out)})"
    if found:
        raise ConfigError(f"not a folder to write the conversion into: {found}", key="--out", given=out, fix=fix)
