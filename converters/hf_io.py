"""Reading and writing Hugging Face checkpoint folders (config.json + safetensors, sharded or not).

Errors a user can cause (a missing or corrupt file, an index naming a tensor its shard lacks) are ConversionError
messages naming the file or tensor. Writing streams (hf_name, tensor) pairs into shards of bounded size, so an
export never holds more than one shard beyond its input.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from converters.family import ConversionError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: Files of a model folder that are weights (not copied as "metadata" beside a converted checkpoint).
_WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".msgpack",
    ".h5",
    ".safetensors.index.json",
    ".bin.index.json",
)
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def load_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    """config.json of an HF model folder as a dict."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConversionError(f"{path} not found: pass a Hugging Face model folder (with config.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConversionError(f"{path} is not valid JSON: {err}") from err


def _read_safetensors(path: Path, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ConversionError(f"weight file {path} not found")
    try:
        with safe_open(str(path), framework="pt") as handle:
            available = set(handle.keys())
            wanted = list(handle.keys()) if names is None else list(names)  # file order: deterministic
            absent = [n for n in wanted if n not in available]
            if absent:
                raise ConversionError(f"{path} lacks tensor(s) {absent[:8]} listed in {INDEX_FILE}")
            return {n: handle.get_tensor(n) for n in wanted}
    except ConversionError:
        raise
    except Exception as err:  # safetensors raises several types for truncated / garbled files
        raise ConversionError(f"cannot read {path} (corrupt or not safetensors): {err}") from err


def load_hf_state(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF model folder: model.safetensors, or the shards listed in the index file."""
    folder = Path(hf_dir)
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise ConversionError(f"{index_path} is not a valid safetensors index: {err}") from err
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(file, []).append(name)
        state: dict[str, torch.Tensor] = {}
        for file, names in sorted(by_file.items()):
            state.update(_read_safetensors(folder / file, names))
        return state
    if (folder / SINGLE_FILE).is_file():
        return _read_safetensors(folder / SINGLE_FILE)
    raise ConversionError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {folder}: only safetensors checkpoints are "
        f"supported (re-save with save_pretrained(..., safe_serialization=True))"
    )


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor owning its storage: safetensors refuses views that share memory (e.g. split QKV)."""
    tensor = tensor.detach().contiguous()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def _write_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})


def save_hf_state(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | Path,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    log: Any = print,
) -> list[Path]:
    """Write tensors as model.safetensors, or, above `max_shard_bytes`, as model-0000i-of-0000N.safetensors
    shards plus model.safetensors.index.json (the layout transformers and vLLM read). Returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, total = 0, 0
    parts: list[Path] = []
    for name, tensor in named_tensors:
        tensor = _owned(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            parts.append(out / f".part-{len(parts)}.safetensors")
            _write_shard(shards[-1], parts[-1])
            log(f"wrote shard {len(parts)} ({size / 2**20:.1f} MiB)")
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
        total += nbytes
    if not parts:
        _write_shard(shards[-1], out / SINGLE_FILE)
        return [out / SINGLE_FILE]
    parts.append(out / f".part-{len(parts)}.safetensors")
    _write_shard(shards[-1], parts[-1])
    return _name_shards(parts, out, total)


def _name_shards(parts: list[Path], out: Path, total_bytes: int) -> list[Path]:
    """Rename temporary parts to HF shard names (N is known only at the end) and write the index."""
    weight_map: dict[str, str] = {}
    final = []
    for i, part in enumerate(parts):
        name = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        with safe_open(str(part), framework="pt") as handle:
            weight_map.update({key: name for key in handle.keys()})
        part.rename(out / name)
        final.append(out / name)
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return final


PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"


def save_peft_adapter(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | Path,
    *,
    rank: int,
    alpha: float,
    dropout: float,
    base_model: str,
    task_type: str = "CAUSAL_LM",
) -> list[str]:
    """A LoRA adapter folder as HF PEFT writes one (adapter_config.json + adapter_model.safetensors, tensors named
    `base_model.model.<module>.lora_{A,B}.weight`), which `peft.PeftModel.from_pretrained(<base>, out_dir)` and
    vLLM's LoRA loader read. Its target modules are those the tensors name. Returns them."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: _owned(tensor) for name, tensor in named_tensors}
    modules = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in tensors})
    config = {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }
    _write_shard(tensors, out / PEFT_WEIGHTS)
    (out / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return modules


def copy_model_metadata(src_dir: str | Path, dst_dir: str | Path) -> list[str]:
    """Copy everything of an HF folder that is not weights (config, generation config, tokenizer, template)."""
    src, dst = Path(src_dir), Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in sorted(src.iterdir()):
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, dst / path.name)
            copied.append(path.name)
    return copied
