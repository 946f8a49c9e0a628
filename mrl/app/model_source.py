"""What a command starts from: an HF model folder or a Megatron checkpoint folder (`classify_model_path`). A hub id
was resolved to its snapshot folder, an HF folder, before this is asked (mrl/app/hub_ids.py).

    HF folder         config.json + model.safetensors (or shards + model.safetensors.index.json) + tokenizer files
    Megatron folder   model/metadata.json (a torch_dist distributed checkpoint) + hf/config.json + tokenizer in hf/:
                      the --out of `mrl convert hf-to-megatron`, a training checkpoint <checkpointing.dir>/step_N/
                      (complete: with its COMPLETE marker), or a run's final_megatron/ (run.final_format=megatron)

Why a Megatron folder is taken as it is: converting a large model to HF and back costs hours, and a torch_dist
checkpoint stores global shapes, so every policy rank reads its own slices in any TP/PP/EP layout (reshard on load).
The HF config and the tokenizer come from hf/; the rollout engine starts from hf/ alone (random weights) and gets the
policy's weights by refit before its first generation (mrl/app/runtime.py), so no HF safetensors are written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from mrl.checkpoint.manager import MARKER_FILE, TRAIN_STATE_FILE
from mrl.checkpoint.megatron import HF_SUBDIR, MODEL_SUBDIR
from mrl.config.errors import ConfigError

_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
_CHECKPOINT_METADATA = "metadata.json"  # written last by dist_checkpointing.save: the model/ part is complete


@dataclass(frozen=True)
class ModelSource:
    """Where a model's config, tokenizer and weights are."""

    config_dir: Path
    """config.json and the tokenizer files: the HF folder itself, or a Megatron folder's hf/."""
    megatron_dir: Optional[Path] = None
    """The Megatron checkpoint folder whose model/ holds the weights; None: the weights are config_dir's
    safetensors."""

    @property
    def is_megatron(self) -> bool:
        return self.megatron_dir is not None


def classify_model_path(path: str | Path, *, key: str = "policy.model_name") -> ModelSource:
    """The kind of model folder `path` is (see the module docstring); a `ConfigError` naming `key`, what the folder
    holds and the fix when it is neither kind."""
    folder = Path(path)
    if _is_hf_folder(folder):
        _check_family(folder, key, path)
        return ModelSource(config_dir=folder)
    if _is_megatron_folder(folder) and not _unfinished_training_step(folder):
        _check_family(folder / HF_SUBDIR, key, path)
        return ModelSource(config_dir=folder / HF_SUBDIR, megatron_dir=folder)
    raise ConfigError(
        f"neither an HF model folder nor a Megatron checkpoint folder: {_found(folder)}",
        key=key,
        given=str(path),
        fix=_fix(folder),
    )


def _check_family(config_dir: Path, key: str, given: str | Path) -> None:
    """The model is of a family mrl builds in Megatron (else the workers would find out after start-up)."""
    from converters.hf_io import load_hf_config
    from converters.spec import detect_family

    try:
        config = load_hf_config(config_dir)
        detect_family(config if isinstance(config, dict) else {})
    except ValueError as error:  # JSON that does not parse, or a family mrl has no mapping for (ConversionError)
        raise ConfigError(
            f"{config_dir / 'config.json'}: {error}",
            key=key,
            given=str(given),
            fix="start from a model of a supported family (its config.json's architectures name it)",
        ) from error


def _is_hf_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any((folder / name).is_file() for name in _HF_WEIGHTS)


def _is_megatron_folder(folder: Path) -> bool:
    return (folder / MODEL_SUBDIR / _CHECKPOINT_METADATA).is_file() and (folder / HF_SUBDIR / "config.json").is_file()


def _unfinished_training_step(folder: Path) -> bool:
    """A training checkpoint is committed by its marker, written after every other file (CheckpointManager)."""
    return (folder / TRAIN_STATE_FILE).is_file() and not (folder / MARKER_FILE).is_file()


def _step_folders(folder: Path) -> list[str]:
    """The step_N folders of a checkpointing.dir, oldest first."""
    steps = [p.name for p in folder.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(steps, key=lambda name: int(name[5:]))


def _found(folder: Path) -> str:
    """What `folder` holds, in the words of the two layouts."""
    if not folder.exists():
        return "there is no such folder"
    if not folder.is_dir():
        return "it is a file"
    if _is_megatron_folder(folder):
        return f"a training checkpoint without its {MARKER_FILE} marker (its write did not finish)"
    if (folder / "config.json").is_file():
        other = sorted(p.name for p in folder.glob("*.bin"))
        return "config.json but no *.safetensors weights" + (f" ({', '.join(other)}: not read)" if other else "")
    if (folder / MODEL_SUBDIR).is_dir():
        hf = "hf/config.json" if (folder / HF_SUBDIR / "config.json").is_file() else "no hf/config.json"
        metadata = (
            f"{MODEL_SUBDIR}/{_CHECKPOINT_METADATA}"
            if (folder / MODEL_SUBDIR / _CHECKPOINT_METADATA).is_file()
            else f"{MODEL_SUBDIR}/ without {_CHECKPOINT_METADATA}"
        )
        return f"{metadata} and {hf}"
    if _step_folders(folder):
        return f"checkpoint folders {', '.join(_step_folders(folder)[-3:])} (a checkpointing.dir)"
    entries = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    return f"it holds {', '.join(entries[:8])}{', ...' if len(entries) > 8 else ''}" if entries else "it is empty"


def _fix(folder: Path) -> str:
    if folder.is_dir() and _step_folders(folder):
        return f"pass one complete step folder, e.g. the newest, {folder / _step_folders(folder)[-1]}"
    if folder.name == HF_SUBDIR and _is_megatron_folder(folder.parent):
        return f"pass the Megatron checkpoint folder {folder.parent} (its hf/ holds the config, model/ the weights)"
    return (
        "pass an HF folder (config.json + *.safetensors + tokenizer), a hub id (org/name[@revision]), the --out "
        "folder of `mrl convert hf-to-megatron`, or a complete training checkpoint <checkpointing.dir>/step_N"
    )
