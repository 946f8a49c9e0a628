"""Checkpoint folders on the controller: atomic commits, retention, resume lookup, training state, compatibility.

Pure Python (no Megatron, no process groups): the controller owns the folder life cycle, the policy workers only
write into the folder they are given (`mrl.checkpoint.megatron`).

Life cycle of one checkpoint (the data flow of a save):
    tmp = manager.begin(step)                  # root/.tmp-step_N-<uuid>/, invisible to latest()
    workers: save_megatron_state(tmp, ...)     # tmp/model/ (dist checkpoint), tmp/rng/ (per-rank RNG)
    controller: save_train_state(tmp, state)   # tmp/train_state.pt; config.yaml, hf/ (config + tokenizer) ...
    manager.commit(step, tmp, metrics)         # fsync, marker, rename to root/step_N, fsync root, retention

Why a crash can never leave a checkpoint that looks complete:
- everything is written under a temporary name that `latest()`/`steps()` ignore;
- the completeness marker (`COMPLETE`, holding step and metrics) is written, renamed into place and fsynced only
  after every other file and folder of the checkpoint has been fsynced; a folder without it is never returned;
- `step_N` appears by one `os.rename` of the finished folder (atomic on POSIX within one file system), and the
  root folder is fsynced so the rename itself survives a power loss;
- deletions (retention, replacing an older `step_N`) first rename the folder to a hidden name and only then remove
  it, so a crash in the middle of a recursive delete never leaves a half-deleted `step_N` behind its marker.
Stale hidden folders of crashed writes are cleaned by the next `commit` (or `clean_stale()`).

The root must be on a file system every worker and the controller see (a shared file system on clusters); the
workers fsync their own files (dist_checkpointing's writer does), the controller fsyncs again before the marker.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

MARKER_FILE = "COMPLETE"
TRAIN_STATE_FILE = "train_state.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX, _TRASH_PREFIX, _OLD_PREFIX = ".tmp-", ".trash-", ".old-"


class CheckpointError(RuntimeError):
    """A checkpoint folder is missing, incomplete or unusable; the message says which and what to do."""


# ------------------------------------------------------------------------------------------------ file system helpers
def _fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory fsync makes the names inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file, then every directory bottom-up, so names and contents are both on disk."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            file = Path(dirpath) / name
            if not file.is_symlink():
                _fsync_path(file)
        _fsync_path(Path(dirpath))


def write_atomic(target: Path, write: Any) -> None:
    """Write `target` through a temporary sibling: `write(file_object)`, flush, fsync, rename, fsync the folder."""
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_path(target.parent)


def _remove_dir(path: Path, root: Path) -> None:
    """Delete a folder of `root` atomically from the reader's view: rename it to a hidden name, then delete."""
    trash = root / f"{_TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
    os.rename(path, trash)
    _fsync_path(root)
    shutil.rmtree(trash, ignore_errors=True)


def _read_marker(folder: Path) -> dict | None:
    """The marker's record ({"step", "metrics"}) if `folder` is a complete checkpoint, else None."""
    try:
        record = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    match = _STEP_DIR.match(folder.name)
    if not isinstance(record, dict) or match is None or record.get("step") != int(match.group(1)):
        return None
    return record


# ------------------------------------------------------------------------------------------------------- the manager
class CheckpointManager:
    """The `step_N/` folders under `root`: create, commit atomically, find the newest/best, apply retention.

    keep_last: the newest N complete checkpoints are always kept (N >= 1: the newest is what a resume needs).
    keep_best: additionally keep the best N by `metric` (a key of the metrics given to `commit`); checkpoints
        whose metrics lack the key, or hold a non-finite value, never count as best.
    higher_is_better: direction of `metric`.
    One controller writes a root at a time; temporary folders opened by this manager and not yet committed are
    never cleaned, so a save may stay open while an older one commits.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        keep_last: int,
        keep_best: int = 0,
        metric: str | None = None,
        higher_is_better: bool = True,
    ) -> None:
        if not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(
                f"keep_last must be an integer >= 1 (the newest checkpoint is needed to resume), got {keep_last!r}"
            )
        if not isinstance(keep_best, int) or keep_best < 0:
            raise ValueError(f"keep_best must be an integer >= 0, got {keep_best!r}")
        if keep_best and not metric:
            raise ValueError("keep_best > 0 needs `metric`: the name of the metric that ranks checkpoints")
        self.root = Path(root)
        self.keep_last, self.keep_best = keep_last, keep_best
        self.metric, self.higher_is_better = metric, higher_is_better
        self._open: set[Path] = set()

    # -- writing
    def begin(self, step: int) -> Path:
        """A fresh, empty temporary folder for step `step` (inside root, so the final rename stays atomic)."""
        _check_step(step)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{_TMP_PREFIX}step_{step}-{uuid.uuid4().hex}"
        tmp.mkdir()
        self._open.add(tmp)
        return tmp

    def commit(self, step: int, tmp: str | os.PathLike, metrics: Mapping[str, Any] | None = None) -> Path:
        """Make the checkpoint in `tmp` durable and visible as `root/step_N`; then retention and cleanup.

        An existing complete `step_N` (a re-run of a step after resuming from an earlier one) is replaced only
        after the new folder is complete. Returns the final path.
        """
        _check_step(step)
        tmp = Path(tmp)
        if tmp.parent.resolve() != self.root.resolve() or not tmp.name.startswith(f"{_TMP_PREFIX}step_{step}-"):
            raise CheckpointError(
                f"{tmp} is not a temporary folder of step {step} under {self.root}: "
                "pass the folder returned by begin(step)"
            )
        if not tmp.is_dir():
            raise CheckpointError(f"{tmp} does not exist (already committed, or cleaned as stale?)")
        record = {"step": step, "metrics": _json_metrics(metrics or {})}
        _fsync_tree(tmp)  # every file the workers and the controller wrote, before the marker exists
        write_atomic(tmp / MARKER_FILE, lambda f: f.write(json.dumps(record, indent=2).encode() + b"\n"))
        final = self.root / f"step_{step}"
        old = None
        if final.exists():
            old = self.root / f"{_OLD_PREFIX}step_{step}-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)  # a crash from here to the next rename is repaired by clean_stale()
        os.rename(tmp, final)
        _fsync_path(self.root)
        self._open.discard(tmp)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self._apply_retention()
        self.clean_stale()
        return final

    def discard(self, tmp: str | os.PathLike) -> None:
        """Remove an uncommitted temporary folder of `begin` (a failed write: its space back, nothing visible
        changes; best effort, what remains is cleaned as stale later)."""
        tmp = Path(tmp)
        self._open.discard(tmp)
        shutil.rmtree(tmp, ignore_errors=True)

    # -- reading
    def steps(self) -> list[int]:
        """Steps with a complete checkpoint, ascending."""
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and child.is_dir() and _read_marker(child) is not None:
                found.append(int(match.group(1)))
        return sorted(found)

    def path(self, step: int) -> Path:
        """Folder of a complete checkpoint; raises CheckpointError when step `step` has none."""
        folder = self.root / f"step_{step}"
        if _read_marker(folder) is None:
            raise CheckpointError(
                f"no complete checkpoint for step {step} in {self.root} (complete steps: {self.steps()})"
            )
        return folder

    def metrics(self, step: int) -> dict[str, Any]:
        """The metrics committed with step `step`."""
        record = _read_marker(self.path(step))
        assert record is not None
        return dict(record.get("metrics") or {})

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None: the folder to resume from."""
        steps = self.steps()
        return self.root / f"step_{steps[-1]}" if steps else None

    def best(self) -> Path | None:
        """The complete checkpoint with the best `metric` (ties: the newer step), or None."""
        ranked = self._ranked_by_metric()
        return self.root / f"step_{ranked[0]}" if ranked else None

    # -- retention and cleanup
    def _ranked_by_metric(self) -> list[int]:
        if not self.metric:
            return []
        scored = []
        for step in self.steps():
            value = self.metrics(step).get(self.metric)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value):
                scored.append((value if self.higher_is_better else -value, step))
        return [step for _, step in sorted(scored, reverse=True)]

    def _apply_retention(self) -> None:
        steps = self.steps()
        keep = set(steps[-self.keep_last :]) | set(self._ranked_by_metric()[: self.keep_best])
        for step in steps:
            if step not in keep:
                _remove_dir(self.root / f"step_{step}", self.root)

    def clean_stale(self) -> None:
        """Remove what crashed writes left: temporary folders not open in this manager and half-deleted folders.
        A replaced `step_N` whose successor never arrived (crash between the two renames) is restored.
        A `step_N` without a marker is left alone (this manager never creates one; it is never returned)."""
        if not self.root.is_dir():
            return
        for child in list(self.root.iterdir()):
            name = child.name
            if not child.is_dir() or child in self._open:
                continue
            if name.startswith(_OLD_PREFIX):
                original = self.root / name[len(_OLD_PREFIX) :].rsplit("-", 1)[0]
                if not original.exists() and (child / MARKER_FILE).is_file():
                    os.rename(child, original)
                    _fsync_path(self.root)
                else:
                    shutil.rmtree(child, ignore_errors=True)
            elif name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
                shutil.rmtree(child, ignore_errors=True)


def _check_step(step: int) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")


def _json_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Metrics as JSON values (numpy/torch scalars become Python numbers); anything else is an error."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, (np.generic, torch.Tensor)):
            value = value.item()
        if not isinstance(value, (int, float, str, bool)) and value is not None:
            raise TypeError(f"metric {key!r} has type {type(value).__name__}: commit() takes scalar metrics")
        out[str(key)] = value
    return out


# ------------------------------------------------------------------------------------------------ training state
def capture_rng_state() -> dict[str, Any]:
    """The process's RNG states: Python `random`, numpy's global generator, torch CPU (and CUDA when present)."""
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        # numpy's MT19937 key as a list of ints: loadable with torch.load(weights_only=True)
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": np_state["state"]["key"].tolist(),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what `capture_rng_state` captured (CUDA states only when saved and CUDA is present)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    saved = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": saved["bit_generator"],
            "state": {"key": np.asarray(saved["key"], dtype=np.uint32), "pos": saved["pos"]},
            "has_gauss": saved["has_gauss"],
            "gauss": saved["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


_ALLOWED_LEAVES = (str, int, float, bool, type(None), torch.Tensor)


def _check_storable(value: Any, where: str) -> Any:
    """`value` with numpy scalars turned into Python numbers; raises TypeError naming the first other leaf
    that `torch.load(weights_only=True)` could not read back."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {k: _check_storable(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_check_storable(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, _ALLOWED_LEAVES):
        return value
    raise TypeError(
        f"training state {where} has type {type(value).__name__}: store tensors, numbers, strings, "
        "None and dicts/lists/tuples of them (e.g. convert numpy arrays with torch.from_numpy)"
    )


def save_train_state(path: str | os.PathLike, state: Mapping[str, Any]) -> Path:
    """Write the controller's training state into checkpoint folder `path` (as `train_state.pt`), atomically.

    Typical keys: step, consumed_samples, dataloader (its state_dict), logger/metrics history, best_metric and
    rng (`capture_rng_state()`). Values: tensors, numbers, strings, None, and dicts/lists/tuples of them, so the
    file loads with `torch.load(weights_only=True)` (loading a checkpoint never runs pickled code).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist: pass the folder from begin(step)")
    storable = _check_storable(dict(state), "state")
    target = folder / TRAIN_STATE_FILE
    write_atomic(target, lambda f: torch.save(storable, f))
    return target


def load_train_state(path: str | os.PathLike) -> dict[str, Any]:
    """The training state saved in checkpoint folder `path`."""
    target = Path(path) / TRAIN_STATE_FILE
    if not target.is_file():
        raise CheckpointError(f"{target} is missing: {path} is not an mrl checkpoint folder (or is incomplete)")
    return torch.load(target, weights_only=True)


# ----------------------------------------------------------------------------------------------- compatibility
#: HF config keys that change the weights' meaning or shapes. Max context length and the like may differ.
ARCHITECTURE_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "attention_bias",
    "mlp_bias",
    "num_experts",
    "num_local_experts",
    "moe_intermediate_size",
    "num_experts_per_tok",
)


def tokenizer_fingerprint(tokenizer_dir: str | os.PathLike) -> str:
    """sha256 of what defines a tokenizer's ids: `tokenizer.json`'s model and added tokens, else the vocab files.

    Chat template and other `tokenizer_config.json` settings are left out: they do not change token ids.
    """
    folder = Path(tokenizer_dir)
    digest = hashlib.sha256()
    fast = folder / "tokenizer.json"
    if fast.is_file():
        spec = json.loads(fast.read_text())
        digest.update(
            json.dumps({"model": spec.get("model"), "added_tokens": spec.get("added_tokens")}, sort_keys=True).encode()
        )
        return digest.hexdigest()
    files = [f for f in ("vocab.json", "merges.txt", "tokenizer.model", "vocab.txt") if (folder / f).is_file()]
    if not files:
        raise CheckpointError(f"no tokenizer files (tokenizer.json, vocab.json, tokenizer.model, ...) in {folder}")
    for name in files:
        digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
    return digest.hexdigest()


def model_record(
    hf_config: Mapping[str, Any],
    *,
    tokenizer_dir: str | os.PathLike | None = None,
    precision: str | None = None,
    parallel: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What `check_compatible` compares, recorded by the controller at save time (e.g. in the train state).

    `hf_config`: the model's config.json dict; `precision`: the parameter dtype name; `parallel`: the layout it
    was written with (informational: layouts may differ, the checkpoint reshards).
    """
    record: dict[str, Any] = {"model": {k: hf_config[k] for k in ARCHITECTURE_KEYS if k in hf_config}}
    if tokenizer_dir is not None:
        record["tokenizer"] = tokenizer_fingerprint(tokenizer_dir)
    if precision is not None:
        record["precision"] = precision
    if parallel is not None:
        record["parallel"] = dict(parallel)
    return record


def check_compatible(saved_config: Mapping[str, Any], current_config: Mapping[str, Any]) -> list[str]:
    """Reasons the checkpoint recorded as `saved_config` cannot be resumed under `current_config` ([] = fine).

    Both are `model_record(...)` dicts. Another architecture, size, vocabulary or tokenizer is a reason; so is
    another parameter precision (the optimizer state layout differs). The parallel layout may differ.
    A key recorded on one side only is not compared (older checkpoints may record less).
    """
    reasons = []
    saved_model, current_model = saved_config.get("model") or {}, current_config.get("model") or {}
    for key in ARCHITECTURE_KEYS:
        if key in saved_model and key in current_model and saved_model[key] != current_model[key]:
            reasons.append(
                f"model {key}: the checkpoint has {saved_model[key]!r}, the current model "
                f"{current_model[key]!r} (another model: start a new run, or point policy.model_name "
                "at the checkpoint's model)"
            )
    if (
        saved_config.get("tokenizer")
        and current_config.get("tokenizer")
        and saved_config["tokenizer"] != current_config["tokenizer"]
    ):
        reasons.append(
            "tokenizer: the checkpoint was trained with another vocabulary (fingerprints differ); "
            "set policy.tokenizer to the checkpoint's tokenizer (its hf/ folder)"
        )
    if (
        saved_config.get("precision")
        and current_config.get("precision")
        and saved_config["precision"] != current_config["precision"]
    ):
        reasons.append(
            f"precision: the checkpoint was written in {saved_config['precision']}, the current run "
            f"uses {current_config['precision']}; set policy.precision={saved_config['precision']} to "
            "resume (export to HF to change it)"
        )
    return reasons
