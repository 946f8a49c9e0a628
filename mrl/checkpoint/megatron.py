"""Rank side of a checkpoint: the Megatron model, optimizer, LR schedule and per-rank RNG states.

Called inside every policy worker process (all ranks of the policy together: these are collective calls), on the
folder the controller got from `CheckpointManager.begin(step)`:
    <step folder>/model/      dist_checkpointing (torch_dist): the model weights, as `mrl.app.convert` writes them
    <step folder>/optimizer/  dist_checkpointing (torch_dist): optimizer state and the LR schedule
    <step folder>/rng/        rank_<global rank>.pt: RNG states of each rank; layout.json: the layout that wrote them

Resharding: torch_dist stores every tensor with its global shape and each rank reads its own slice, so a checkpoint
written at one TP/PP/DP layout loads at another. The distributed optimizer's state is written in the
`fully_reshardable` format (gathered into per-parameter tensors at save), so it loads with or without the
distributed optimizer at any DP size.
Switching between the distributed and the regular optimizer is refused with a clear error (their states differ
in structure). The padded vocabulary is part of the tensor shapes: build the model
with the checkpoint's (`checkpoint_padded_vocab(<step folder>/model)`).

Exact resume needs, beyond weights and Adam moments: Adam's step count (bias correction), the LR scheduler's step,
and every RNG a rank draws from (torch CPU/CUDA, Megatron's model-parallel tracker for dropout/init, Python and
numpy). RNG states are per rank and only meaningful for the same layout: under another layout they are skipped
(the report says so) and the run continues with the freshly seeded generators.

The folder layout matches `mrl.app.convert` (model/, and hf/ when the controller copies the HF config and
tokenizer there), so `mrl convert megatron-to-hf <step folder>` exports a checkpoint directly.
"""

from __future__ import annotations

import json
import queue
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mrl.checkpoint.manager import CheckpointError, capture_rng_state, restore_rng_state, write_atomic
from mrl.parallel import collectives

MODEL_SUBDIR, TRAINING_SUBDIR, RNG_SUBDIR, LAYOUT_FILE = "model", "optimizer", "rng", "layout.json"
#: The HF config, generation config and tokenizer beside a checkpoint's model/ (what reads it needs the config).
HF_SUBDIR = "hf"
_EMBEDDING_KEY = "embedding.word_embeddings.weight"
#: The distributed optimizer's state as one tensor per parameter, loadable under any layout.
_SHARDED_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


@dataclass(frozen=True)
class MegatronLoadReport:
    """What `load_megatron_state` restored on this rank."""

    optimizer_loaded: bool
    rng_restored: bool
    note: str = ""  # why something was not restored


def _parallel_layout() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "world_size": collectives.world_size(),
    }


def _model_sharded_state_dict(model_chunks: list, *, gpt_checkpoint: bool = False) -> dict:
    """The model's sharded state dict, flat: with one chunk exactly what `mrl.app.convert` writes and reads.

    Virtual-pipeline chunks get their dict keys prefixed by the chunk index (dict keys must be unique); the
    checkpoint keys inside the ShardedTensors carry global layer indices, so the files do not depend on it.
    `gpt_checkpoint`: the keys pointed at a checkpoint GPTModel wrote (`_written_by_gpt_model`).
    """
    from megatron.core.utils import unwrap_model

    modules = unwrap_model(list(model_chunks))
    dicts = [m.sharded_state_dict() for m in modules]
    if gpt_checkpoint:
        for module, sharded in zip(modules, dicts):
            _point_at_gpt_checkpoint(sharded, module)
    if len(modules) == 1:
        return dicts[0]
    return {f"chunk{i}.{k}": v for i, sharded in enumerate(dicts) for k, v in sharded.items()}


def _written_by_gpt_model(model_dir: Path) -> bool:
    """Whether a model checkpoint was written by a GPTModel (mrl before its models became HybridModels): its final
    norm is `decoder.final_layernorm`, the HybridModel's `decoder.final_norm`."""
    from megatron.core import dist_checkpointing

    keys = dist_checkpointing.load_tensors_metadata(str(model_dir))
    return any(key.endswith("decoder.final_layernorm.weight") for key in keys)


def _point_at_gpt_checkpoint(sharded: dict, module: Any) -> None:
    """Retarget a HybridModel's sharded state dict (or its optimizer's) at a GPTModel checkpoint's keys, in place:
    megatron-core's own GPT -> hybrid interoperation (`dist_checkpointing.gpt_checkpoint_interop`), which reads
    GPTModel's homogeneous layer format. It refuses a model that mixes dense and expert layers (DeepSeek-V3's
    first dense layers): such a GPT checkpoint was written layer by layer, a format it does not read."""
    from megatron.core.dist_checkpointing.gpt_checkpoint_interop import (
        gpt_compatible_layer_maps,
        retarget_sharded_state_dict_to_gpt_checkpoint,
    )

    try:
        maps = gpt_compatible_layer_maps(module.hybrid_layer_pattern)
    except ValueError as error:
        raise CheckpointError(
            f"this checkpoint was written by mrl's earlier GPTModel, which megatron-core reads into a HybridModel "
            f"only for a model whose layers are all dense or all experts ({error}); convert it from the HF "
            "checkpoint again (mrl convert)"
        ) from error
    retarget_sharded_state_dict_to_gpt_checkpoint(sharded, maps)


def _training_sharded_state_dict(model_sd: dict, optimizer: Any, scheduler: Any, *, is_loading: bool) -> dict:
    """Optimizer (sharded by the model's sharded tensors) and the LR schedule (a plain dict: the checkpoint's common
    state)."""
    state: dict[str, Any] = {}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=dict(_SHARDED_METADATA)
        )
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    return state


def save_sharded(sharded_state_dict: dict, folder: str | Path, **kwargs: Any) -> None:
    """`dist_checkpointing.save`, without the process megatron-core 0.19.2 starts for the first save of a process.

    Its torch_dist writer (`FileSystemWriterAsync`, also for synchronous saves) returns the write results through a
    queue made once per process by a `multiprocessing.Manager` of the "spawn" context (`get_write_results_queue` in
    strategies/filesystem_async.py, which keeps it in the module's `_results_queue`): a new Python interpreter,
    measured at 2.3 s on the first save of a 1M-parameter model against 0.1 s for every later one (with 0.16.1,
    which made the queue the same way). That queue only has to outlive an asynchronous save's worker process; a
    synchronous save (the only kind here: `execute_sync`) puts and gets the results in this process, so a plain
    in-process queue serves, set before the first save.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    dist_checkpointing.save(sharded_state_dict, str(folder), **kwargs)


def save_megatron_state(path: str | Path, model_chunks: list, optimizer: Any, scheduler: Any) -> None:
    """Write this rank's part of the model, optimizer, LR schedule and RNG into `path` (optimizer and scheduler
    None: weights only).

    Collective: every rank of the policy calls it with the same `path`. Returns after all ranks finished.
    """
    folder = Path(path)
    model_dir, train_dir, rng_dir = folder / MODEL_SUBDIR, folder / TRAINING_SUBDIR, folder / RNG_SUBDIR
    rng = _rank_rng_state()  # before anything below could draw random numbers
    training_state = optimizer is not None or scheduler is not None
    if collectives.rank() == 0:
        for subdir in (model_dir, rng_dir, *([train_dir] if training_state else [])):
            subdir.mkdir(parents=True, exist_ok=False)
    collectives.barrier()
    # dist_checkpointing.save/load consume the sharded dict they get (factories applied in place), and the
    # optimizer's sharded dict maps its state to the model's ShardedTensors: each call gets its own model dict.
    save_sharded(_model_sharded_state_dict(model_chunks), model_dir)
    if training_state:
        training = _training_sharded_state_dict(
            _model_sharded_state_dict(model_chunks), optimizer, scheduler, is_loading=False
        )
        content = {**_SHARDED_METADATA, "distributed_optimizer": _is_distributed(optimizer)}
        save_sharded(training, train_dir, content_metadata=content)
    write_atomic(rng_dir / f"rank_{collectives.rank():05d}.pt", lambda f: torch.save(rng, f))
    if collectives.rank() == 0:
        layout = json.dumps(_parallel_layout(), indent=2).encode() + b"\n"
        write_atomic(rng_dir / LAYOUT_FILE, lambda f: f.write(layout))
    collectives.barrier()


def load_megatron_state(
    path: str | Path, model_chunks: list, optimizer: Any, scheduler: Any, *, load_optimizer: bool = True
) -> MegatronLoadReport:
    """Load a checkpoint written by `save_megatron_state` (any parallel layout) into this rank's model.

    load_optimizer=False loads the weights only (optimizer and schedule keep their fresh state; e.g. starting
    a new stage from a checkpoint). RNG states are restored only when resuming (load_optimizer=True) under the
    layout that wrote them. Collective: every rank of the policy calls it.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model

    folder = Path(path)
    model_dir, train_dir = folder / MODEL_SUBDIR, folder / TRAINING_SUBDIR
    if not (model_dir / "metadata.json").is_file():
        raise CheckpointError(
            f"no Megatron distributed checkpoint in {model_dir} (metadata.json missing): "
            "pass a complete step folder (CheckpointManager.latest())"
        )
    resume = load_optimizer and (optimizer is not None or scheduler is not None)
    if resume and not (train_dir / "metadata.json").is_file():
        raise CheckpointError(f"{folder} holds weights only ({train_dir} missing): load with load_optimizer=False")
    if resume and optimizer is not None:
        _check_same_optimizer_kind(train_dir, optimizer)
        _init_distributed_optimizer_state(optimizer)  # before the sharded state dicts are built from its state
    gpt = _written_by_gpt_model(model_dir)
    training_sd = _training_sharded_state_dict(
        _model_sharded_state_dict(model_chunks),  # own dict: see save
        optimizer if load_optimizer else None,
        scheduler if load_optimizer else None,
        is_loading=True,
    )
    if gpt and "optimizer" in training_sd:  # its entries carry the model's keys (the model-space format)
        _point_at_gpt_checkpoint(training_sd["optimizer"], unwrap_model(list(model_chunks))[0])
    loaded_model = dist_checkpointing.load(_model_sharded_state_dict(model_chunks, gpt_checkpoint=gpt), str(model_dir))
    modules = unwrap_model(list(model_chunks))
    for i, module in enumerate(modules):
        prefix = "" if len(modules) == 1 else f"chunk{i}."
        own = {k[len(prefix) :]: v for k, v in loaded_model.items() if k.startswith(prefix)}
        _load_model_strict(module, own, model_dir)
    if not resume:
        return MegatronLoadReport(optimizer_loaded=False, rng_restored=False, note="weights only")
    loaded = dist_checkpointing.load(training_sd, str(train_dir))
    missing = [
        name
        for name, obj in (("optimizer", optimizer), ("scheduler", scheduler))
        if obj is not None and name not in loaded
    ]
    if missing:
        raise CheckpointError(
            f"{train_dir} holds no {' or '.join(missing)} state: pass None for it, or load with load_optimizer=False"
        )
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(loaded["scheduler"])
    restored, note = _restore_rank_rng(folder / RNG_SUBDIR)
    return MegatronLoadReport(optimizer_loaded=optimizer is not None, rng_restored=restored, note=note)


def _is_distributed(optimizer: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in getattr(optimizer, "chained_optimizers", [optimizer]))


def _check_same_optimizer_kind(train_dir: Path, optimizer: Any) -> None:
    """Megatron's distributed and regular optimizers write differently structured states, so one cannot load the
    other's (megatron-core 0.19.2: the distributed one keeps its parameter state under `param_state` with a
    `param_state_sharding_type`, the regular one the torch optimizer's own `state`, beside `fp32_from_fp16_params`
    under bf16); both reshard across layouts on their own."""
    from megatron.core import dist_checkpointing

    saved = (dist_checkpointing.load_content_metadata(str(train_dir)) or {}).get("distributed_optimizer")
    current = _is_distributed(optimizer)
    if saved is not None and saved != current:
        raise CheckpointError(
            f"the optimizer state in {train_dir} was written with use_distributed_optimizer={saved}, this run "
            f"uses {current}: set policy.optimizer.use_distributed_optimizer={saved} to resume (the parallel "
            "layout may differ), or load the weights only (load_optimizer=False)"
        )


def _init_distributed_optimizer_state(optimizer: Any) -> None:
    """Torch Adam creates its state at the first step; the distributed optimizer's load copies into existing
    state tensors, so a fresh one gets dummy state first (overwritten by the load). The non-distributed optimizer
    does this itself in `sharded_state_dict(is_loading=True)`."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(inner, DistributedOptimizer) and not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()


def checkpoint_padded_vocab(model_dir: str | Path) -> int:
    """The padded vocabulary of a distributed checkpoint, read from its tensor metadata (global shapes)."""
    from megatron.core import dist_checkpointing

    metadata = dist_checkpointing.load_tensors_metadata(str(model_dir))
    for key in (_EMBEDDING_KEY, "output_layer.weight"):
        if key in metadata:
            return int(metadata[key].global_shape[0])
    raise CheckpointError(f"{model_dir} holds no {_EMBEDDING_KEY}: not a GPT model checkpoint")


def load_megatron_checkpoint(model: Any, model_dir: str | Path) -> None:
    """Load the weights of a distributed checkpoint into a (TP/PP-sharded) model, resharding as needed; strict."""
    from megatron.core import dist_checkpointing

    sharded = model.sharded_state_dict()
    if _written_by_gpt_model(Path(model_dir)):
        _point_at_gpt_checkpoint(sharded, model)
    _load_model_strict(model, dist_checkpointing.load(sharded, str(model_dir)), Path(model_dir))


def _load_model_strict(module: Any, state: dict, model_dir: Path) -> None:
    result = module.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    unexpected = [k for k in result.unexpected_keys if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {model_dir} does not match the model: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )


def _rank_rng_state() -> dict[str, Any]:
    """This rank's generators: Python/numpy/torch (CPU, CUDA) plus Megatron's model-parallel tracker."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    return {"process": capture_rng_state(), "tracker": {k: v.clone() for k, v in tracker.get_states().items()}}


def _restore_rank_rng(rng_dir: Path) -> tuple[bool, str]:
    """Restore this rank's generators if the checkpoint was written under this very layout (same on all ranks)."""
    from megatron.core import tensor_parallel

    layout = _parallel_layout()
    try:
        saved = json.loads((rng_dir / LAYOUT_FILE).read_text())
    except (OSError, ValueError):
        return False, f"RNG states not restored: {rng_dir / LAYOUT_FILE} is missing or unreadable"
    if saved != layout:
        return False, f"RNG states not restored: written under {json.dumps(saved)}, running under {json.dumps(layout)}"
    state = torch.load(rng_dir / f"rank_{collectives.rank():05d}.pt", weights_only=True)
    restore_rng_state(state["process"])
    tensor_parallel.get_cuda_rng_tracker().set_states(dict(state["tracker"]))
    return True, ""
