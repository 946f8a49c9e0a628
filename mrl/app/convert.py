"""`mrl convert`: file-level conversions between HF folders and Megatron distributed checkpoints.

Megatron checkpoint folder written by `hf_to_megatron` (and read by `megatron_to_hf`):
    <out>/model/            Megatron distributed checkpoint (dist_checkpointing, torch_dist format)
    <out>/hf/               config.json, generation_config.json, tokenizer and chat-template files of the source
    <out>/conversion.json   family, padded vocabulary size, layer-spec naming used when writing

Why this is TP/PP-agnostic: a torch_dist checkpoint stores each tensor with its global shape, and every model
rank asks for its own slice on load, so a checkpoint written under one layout loads under any other (the
reshard happens in dist_checkpointing). Only the padded vocabulary is fixed at conversion: `--tp` picks
Megatron's padding (a multiple of 128 * tp), and a later run needs a TP size that divides it.

How to run: in one process (the whole model is built on this machine at TP=1, PP=1), or under
`torchrun --nproc-per-node tp*pp*ep` to spread the memory (each rank builds and writes only its shard, its experts
with --ep; a world that is a multiple of tp*pp adds data-parallel replicas, which dist_checkpointing does not write
twice).
`megatron_to_hf` runs in one process: it loads the full model and streams it out as safetensors shards.

The flags are checked as the config tree checks policy.parallel, before anything is built (`layout_problems`, a
`ConfigError` naming the flag: exit 2); the folder arguments are checked before this module is imported
(`mrl.app.convert_args`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from converters import ConversionError, ModelDims, model_dims, resolve_padded_vocab
from converters.hf_io import DEFAULT_MAX_SHARD_BYTES, copy_model_metadata, load_hf_config, load_hf_state, save_hf_state
from converters.mapping import megatron_to_hf as map_megatron_to_hf
from mrl.checkpoint.megatron import (
    HF_SUBDIR,
    MODEL_SUBDIR,
    checkpoint_padded_vocab,
    load_megatron_checkpoint,
    save_sharded,
)
from mrl.config.errors import ConfigError
from mrl.model.build import build_model, load_hf_weights, router_settings, transformer_config_from_hf
from mrl.model.hybrid import gpt_state_dict
from mrl.parallel import collectives
from mrl.parallel.groups import init_process_groups, world_from_launcher
from mrl.parallel.layout import ParallelDims, ParallelLayoutError

META_FILE = "conversion.json"


def _log(message: str) -> None:
    print(f"[convert] {message}", flush=True)


def init_parallel(tp: int, pp: int, ep: int = 1) -> None:
    """Process groups for a conversion of tp x pp ranks, experts over ep of them (mrl.parallel.groups; a world of
    1 when not launched by torchrun). A world that is a multiple of tp*pp adds data-parallel replicas doing the same
    work (expert parallelism splits the experts over those)."""
    try:
        dims = ParallelDims(tp=tp, pp=pp, ep=ep, world_size=world_from_launcher())
    except ParallelLayoutError as err:
        raise ConversionError(
            f"running with {world_from_launcher()} process(es) cannot lay out tp={tp}, pp={pp}, "
            f"ep={ep}: run in one process or under torchrun --nproc-per-node {tp * pp * ep}"
        ) from err
    init_process_groups(dims, seed=0)


def _build(hf_config: dict[str, Any], padded_vocab: int, tp: int, pp: int, ep: int = 1) -> Any:
    """The model of this rank; mixture-of-experts and MLA models are built sequence parallel under TP (Megatron
    requires it for experts; it changes no weight)."""
    dims = model_dims(hf_config)
    sequence_parallel = tp > 1 and (dims.moe is not None or dims.mla is not None)
    config = transformer_config_from_hf(
        hf_config,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        sequence_parallel=sequence_parallel,
        **router_settings(dims, expert_parallel=ep),
    )
    return build_model(hf_config, config, padded_vocab=padded_vocab)


def layout_problems(dims: ModelDims, tp: int, pp: int, ep: int) -> list[ConfigError]:
    """--tp, --pp and --ep against the model, the rules of policy.parallel (mrl/config/checks.py): otherwise a TP
    that does not divide the heads is accepted in one process (which builds at TP 1 and records it) and fails only
    when a run loads the checkpoint, and a size below 1 fails on the vocabulary."""
    sizes = {"--tp": tp, "--pp": pp, "--ep": ep}
    small = [
        ConfigError("must be 1 or more", key=flag, given=size, allowed="1, 2, ...")
        for flag, size in sizes.items()
        if size < 1
    ]
    if small:
        return small
    out = []
    for heads, what in ((dims.num_heads, "attention heads"), (dims.num_kv_heads, "key/value heads")):
        if heads % tp:
            out.append(
                ConfigError(
                    f"does not divide the model's {heads} {what}",
                    key="--tp",
                    given=tp,
                    allowed=f"a divisor of {heads}: {_divisors(heads)}",
                )
            )
            break
    if dims.num_layers % pp:
        out.append(
            ConfigError(
                f"the model's {dims.num_layers} layers do not split evenly over {pp} pipeline stages",
                key="--pp",
                given=pp,
                allowed=f"a divisor of {dims.num_layers}: {_divisors(dims.num_layers)}",
            )
        )
    experts = dims.moe.num_experts if dims.moe is not None else None
    if ep > 1 and (experts is None or experts % ep):
        out.append(
            ConfigError(
                "expert parallelism needs a mixture-of-experts model; this one is dense"
                if experts is None
                else f"does not divide the model's {experts} experts",
                key="--ep",
                given=ep,
                allowed="1" if experts is None else f"a divisor of {experts}: {_divisors(experts)}",
            )
        )
    return out


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def hf_to_megatron(hf_dir: str | Path, out_dir: str | Path, tp: int = 1, pp: int = 1, ep: int = 1) -> Path:
    """Convert an HF folder into a Megatron distributed checkpoint folder (layout in the module docstring)."""
    hf_dir, out = Path(hf_dir), Path(out_dir)
    hf_config = load_hf_config(hf_dir)
    dims = model_dims(hf_config)
    problems = layout_problems(dims, tp, pp, ep)
    if problems:
        raise problems[0] if len(problems) == 1 else ConfigError("", problems=problems)
    padded = resolve_padded_vocab(dims, tp, None)
    build_tp, build_pp, build_ep = (tp, pp, ep) if world_from_launcher() > 1 else (1, 1, 1)
    init_parallel(build_tp, build_pp, build_ep)  # extra ranks are data-parallel replicas; they save nothing twice
    if (out / MODEL_SUBDIR).exists() and any((out / MODEL_SUBDIR).iterdir()):  # the command line checked it first
        raise ConfigError(
            f"not a folder to write the conversion into: it holds a converted model already ({out / MODEL_SUBDIR} "
            "is not empty)",
            key="--out",
            given=str(out_dir),
            fix=f"choose a new --out folder, or remove {out} first to convert into it again",
        )
    _log(
        f"{dims.family}: {dims.num_layers} layers, hidden {dims.hidden_size}, vocab {dims.vocab_size} -> "
        f"padded {padded}; reading {hf_dir}"
    )
    hf_state = load_hf_state(hf_dir)
    model = _build(hf_config, padded, build_tp, build_pp, build_ep)
    load_hf_weights(model, hf_state, hf_config)
    del hf_state
    if collectives.rank() == 0:
        (out / MODEL_SUBDIR).mkdir(parents=True, exist_ok=True)
        copy_model_metadata(hf_dir, out / HF_SUBDIR)
        meta = {
            "family": dims.family,
            "padded_vocab_size": padded,
            "written_with": {"tp": build_tp, "pp": build_pp, "ep": build_ep},
        }
        (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    collectives.barrier()
    _log(f"saving distributed checkpoint to {out / MODEL_SUBDIR}")
    save_sharded(model.sharded_state_dict(), out / MODEL_SUBDIR)
    collectives.barrier()
    _log("done")
    return out


def _resolve_dirs(megatron_dir: Path, hf_config_dir: str | Path | None) -> tuple[Path, Path]:
    model_dir = megatron_dir / MODEL_SUBDIR if (megatron_dir / MODEL_SUBDIR).is_dir() else megatron_dir
    if not (model_dir / "metadata.json").is_file():
        raise ConversionError(f"no distributed checkpoint (metadata.json) in {model_dir}")
    config_dir = Path(hf_config_dir) if hf_config_dir else megatron_dir / HF_SUBDIR
    if not (config_dir / "config.json").is_file():
        raise ConversionError(f"no config.json in {config_dir}: pass the HF folder the checkpoint came from")
    return model_dir, config_dir


def _load_whole_model(model_dir: Path, hf_config: dict[str, Any]) -> Any:
    """The whole model (TP1, PP1; process groups made) holding a distributed checkpoint's weights."""
    padded = checkpoint_padded_vocab(model_dir)
    _log(f"{model_dims(hf_config).family}: loading {model_dir} (padded vocab {padded})")
    model = _build(hf_config, padded, 1, 1)
    load_megatron_checkpoint(model, model_dir)
    return model


def megatron_hf_state(megatron_dir: str | Path) -> dict[str, torch.Tensor]:
    """A Megatron checkpoint folder's weights as HF-named tensors in this process's memory, nothing written: for
    what needs the whole model in the controller (`mrl rm` making a reward model of a language model). The process
    groups of a world of one are made for it and destroyed after."""
    from mrl.parallel.groups import destroy_process_groups

    model_dir, config_dir = _resolve_dirs(Path(megatron_dir), None)
    hf_config = load_hf_config(config_dir)
    init_parallel(1, 1)
    try:
        model = _load_whole_model(model_dir, hf_config)
        return dict(map_megatron_to_hf(gpt_state_dict(model), model_dims(hf_config)))
    finally:
        destroy_process_groups()


def megatron_to_hf(
    megatron_dir: str | Path,
    out_dir: str | Path,
    *,
    hf_config_dir: str | Path | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Convert a Megatron checkpoint folder into an HF folder: safetensors (sharded above `max_shard_bytes`, with
    the index), config.json, generation_config.json and the tokenizer files saved at import time."""
    model_dir, config_dir = _resolve_dirs(Path(megatron_dir), hf_config_dir)
    out = Path(out_dir)
    hf_config = load_hf_config(config_dir)
    dims = model_dims(hf_config)
    init_parallel(1, 1)  # under torchrun every rank loads the full model; rank 0 writes
    model = _load_whole_model(model_dir, hf_config)
    if collectives.rank() == 0:
        files = save_hf_state(
            map_megatron_to_hf(gpt_state_dict(model), dims), out, max_shard_bytes=max_shard_bytes, log=_log
        )
        copy_model_metadata(config_dir, out)
        _log(f"wrote {len(files)} safetensors file(s) and {', '.join(sorted(p.name for p in out.glob('*.json')))}")
    collectives.barrier()
    return out
