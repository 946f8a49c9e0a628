"""File-level conversions behind `mrl convert hf-to-megatron` and `mrl convert megatron-to-hf`.

Megatron checkpoint folder written by `hf_to_megatron` (and read by `megatron_to_hf`):
    <out>/model/            Megatron distributed checkpoint (dist_checkpointing, torch_dist format)
    <out>/hf/               config.json, generation_config.json, tokenizer and chat-template files of the source
    <out>/conversion.json   family, padded vocabulary size, layer-spec naming used when writing

Why this is TP/PP-agnostic: a torch_dist checkpoint stores each tensor with its global shape, and every model
rank asks for its own slice on load, so a checkpoint written under one layout loads under any other (the
reshard happens in dist_checkpointing). Only the padded vocabulary is fixed at conversion: `--tp` picks
Megatron's padding (a multiple of 128 * tp), and a later run needs a TP size that divides it.

How to run: in one process (the whole model is built on this machine at TP=1, PP=1), or under
`torchrun --nproc-per-node tp*pp` to spread the memory (each rank builds and writes only its shard; a world that
is a multiple of tp*pp adds data-parallel replicas, which dist_checkpointing does not write twice).
`megatron_to_hf` runs in one process: it loads the full model and streams it out as safetensors shards.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import torch

from converters.hf_io import (DEFAULT_MAX_SHARD_BYTES, copy_model_metadata, load_hf_config, load_hf_state,
                              save_hf_state)
from converters.mapping import megatron_to_hf as map_megatron_to_hf
from converters.mapping import resolve_padded_vocab
from converters.spec import ConversionError, model_dims

MODEL_SUBDIR, HF_SUBDIR, META_FILE = "model", "hf", "conversion.json"
_EMBEDDING_KEY = "embedding.word_embeddings.weight"


def _log(message: str) -> None:
    print(f"[convert] {message}", flush=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_parallel(tp: int, pp: int, *, allow_data_parallel: bool = False) -> None:
    """Process group (gloo on CPU, NCCL on GPU; world of 1 when not launched by torchrun) + Megatron groups.

    The world must be tp*pp ranks, or a multiple of it with `allow_data_parallel` (replicas doing the same work).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not torch.cuda.is_available():
        from mrl.parallel import cpu_compat

        cpu_compat.apply()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, rank=rank, world_size=world)
    world = dist.get_world_size()
    if world != tp * pp and not (allow_data_parallel and world % (tp * pp) == 0):
        raise ConversionError(f"running with {dist.get_world_size()} process(es) but tp*pp = {tp * pp}: run in one "
                              f"process or under torchrun --nproc-per-node {tp * pp}")
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(0)


def _build(hf_config: dict[str, Any], padded_vocab: int, tp: int, pp: int) -> Any:
    from mrl.policy.model import build_gpt_model, transformer_config_from_hf

    config = transformer_config_from_hf(hf_config, tensor_parallel=tp, pipeline_parallel=pp)
    return build_gpt_model(hf_config, config, padded_vocab=padded_vocab)


def hf_to_megatron(hf_dir: str | Path, out_dir: str | Path, tp: int = 1, pp: int = 1) -> Path:
    """Convert an HF folder into a Megatron distributed checkpoint folder (layout in the module docstring)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from mrl.policy.model import load_hf_weights

    hf_dir, out = Path(hf_dir), Path(out_dir)
    hf_config = load_hf_config(hf_dir)
    dims = model_dims(hf_config)
    padded = resolve_padded_vocab(dims, tp, None)
    world = int(os.environ.get("WORLD_SIZE", 1))
    build_tp, build_pp = (tp, pp) if world > 1 else (1, 1)
    init_parallel(build_tp, build_pp, allow_data_parallel=True)  # extra ranks are replicas; they save nothing twice
    if (out / MODEL_SUBDIR).exists() and any((out / MODEL_SUBDIR).iterdir()):
        raise ConversionError(f"{out / MODEL_SUBDIR} is not empty: choose a new --out folder")
    _log(f"{dims.family}: {dims.num_layers} layers, hidden {dims.hidden_size}, vocab {dims.vocab_size} -> "
         f"padded {padded}; reading {hf_dir}")
    hf_state = load_hf_state(hf_dir)
    model = _build(hf_config, padded, build_tp, build_pp)
    load_hf_weights(model, hf_state, hf_config)
    del hf_state
    if dist.get_rank() == 0:
        (out / MODEL_SUBDIR).mkdir(parents=True, exist_ok=True)
        copy_model_metadata(hf_dir, out / HF_SUBDIR)
        meta = {"family": dims.family, "padded_vocab_size": padded, "written_with": {"tp": build_tp, "pp": build_pp}}
        (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    dist.barrier()
    _log(f"saving distributed checkpoint to {out / MODEL_SUBDIR}")
    dist_checkpointing.save(model.sharded_state_dict(), str(out / MODEL_SUBDIR))
    dist.barrier()
    _log("done")
    return out


def checkpoint_padded_vocab(model_dir: str | Path) -> int:
    """The padded vocabulary of a distributed checkpoint, read from its tensor metadata (global shapes)."""
    from megatron.core import dist_checkpointing

    metadata = dist_checkpointing.load_tensors_metadata(str(model_dir))
    if _EMBEDDING_KEY in metadata:
        return int(metadata[_EMBEDDING_KEY].global_shape[0])
    if "output_layer.weight" in metadata:
        return int(metadata["output_layer.weight"].global_shape[0])
    raise ConversionError(f"{model_dir} holds no {_EMBEDDING_KEY}: not a GPT model checkpoint")


def load_megatron_checkpoint(model: Any, model_dir: str | Path) -> None:
    """Load a distributed checkpoint into a (TP/PP-sharded) model, resharding as needed; strict on weights."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(model.sharded_state_dict(), str(model_dir))
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    unexpected = [k for k in result.unexpected_keys if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ConversionError(f"checkpoint {model_dir} does not match the model: missing {missing[:8]}, "
                              f"unexpected {unexpected[:8]}")


def _resolve_dirs(megatron_dir: Path, hf_config_dir: str | Path | None) -> tuple[Path, Path]:
    model_dir = megatron_dir / MODEL_SUBDIR if (megatron_dir / MODEL_SUBDIR).is_dir() else megatron_dir
    if not (model_dir / "metadata.json").is_file():
        raise ConversionError(f"no distributed checkpoint (metadata.json) in {model_dir}")
    config_dir = Path(hf_config_dir) if hf_config_dir else megatron_dir / HF_SUBDIR
    if not (config_dir / "config.json").is_file():
        raise ConversionError(f"no config.json in {config_dir}: pass the HF folder the checkpoint came from")
    return model_dir, config_dir


def megatron_to_hf(
    megatron_dir: str | Path, out_dir: str | Path, *, hf_config_dir: str | Path | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Convert a Megatron checkpoint folder into an HF folder: safetensors (sharded above `max_shard_bytes`, with
    the index), config.json, generation_config.json and the tokenizer files saved at import time."""
    model_dir, config_dir = _resolve_dirs(Path(megatron_dir), hf_config_dir)
    out = Path(out_dir)
    hf_config = load_hf_config(config_dir)
    dims = model_dims(hf_config)
    init_parallel(1, 1, allow_data_parallel=True)  # under torchrun every rank loads the full model; rank 0 writes
    padded = checkpoint_padded_vocab(model_dir)
    _log(f"{dims.family}: loading {model_dir} (padded vocab {padded})")
    model = _build(hf_config, padded, 1, 1)
    load_megatron_checkpoint(model, model_dir)
    if torch.distributed.get_rank() == 0:
        files = save_hf_state(map_megatron_to_hf(model.state_dict(), dims), out, max_shard_bytes=max_shard_bytes,
                              log=_log)
        copy_model_metadata(config_dir, out)
        _log(f"wrote {len(files)} safetensors file(s) and {', '.join(sorted(p.name for p in out.glob('*.json')))}")
    torch.distributed.barrier()
    return out
