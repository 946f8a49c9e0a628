"""Hub ids in a run's config, resolved before anything starts, and recorded with the run.

    cfg (as the user wrote it: policy.model_name: org/name@rev, data.train: org/dataset, ...)
      -> every place that takes a model or a data source (MODEL_KEYS, DATA_KEYS) whose value is a hub id
         (`mrl.data.hub.parse_hub_id`: no such local path, reads as org/name[@revision])
      -> mrl.data.hub.resolve: the snapshot folder in huggingface_hub's cache (fetched first when online)
      -> a copy of cfg with those values replaced by the snapshot folders (every later reader sees local folders:
         the controller, each worker, the engine), and <run.output_dir>/hub.json: per key the id, the revision, the
         commit and the folder (also in summary.json as `hub`)

A repeated or resumed run in the same run.output_dir reads hub.json first and uses the commits recorded there, for the
same id and revision, whatever the revision points at now; when it now names another commit (on the hub, or in the
cache's refs/<revision> offline) it says so, and how to take the new one. A hub id that cannot be resolved is a
ConfigError naming the key (exit 2).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

from mrl.config.schema import MrlConfig
from mrl.data import hub

RECORD_FILE = "hub.json"
MODEL_KEYS = (
    "policy.model_name",
    "policy.tokenizer",
    "env.reward_model.model",
    "distillation.teacher",
    "ppo.critic.model_name",
)
DATA_KEYS = {"data.train": "train", "data.val": "test", "eval.data": "test"}  # key -> the split it reads


def resolve_hub_ids(cfg: MrlConfig) -> tuple[MrlConfig, dict[str, dict[str, str]]]:
    """`cfg` with its hub ids replaced by their snapshot folders, and what each resolved to (see the module
    docstring); `cfg` itself when it names none."""
    out = Path(cfg.run.output_dir)
    recorded = read_records(out)
    new = cfg.model_copy(deep=True)
    resolved = {}
    for key, result in _resolve_all(cfg, recorded, out):
        _set(new, key, result.path)
        resolved[key] = hub.as_record(result)
    if not resolved:
        return cfg, {}
    out.mkdir(parents=True, exist_ok=True)
    (out / RECORD_FILE).write_text(json.dumps({**recorded, **resolved}, indent=2) + "\n")
    return new, resolved


def fetch_hub_ids(cfg: MrlConfig, *, dry_run: bool = False) -> list[str]:
    """`mrl submit` on a login node: every hub id of `cfg` fetched into the cache the job will read (an error before
    anything is queued when one cannot be); the keys fetched. Nothing is recorded: the run records what it reads.
    `dry_run`: fetch nothing, say per id whether the cache holds it."""
    if dry_run:
        for key, repo_type, _ in _places():
            value = _get(cfg, key)
            ref = hub.parse_hub_id(value) if isinstance(value, str) else None
            if ref is not None:
                commit = hub.cached_commit(ref, repo_type)
                state = (
                    f"in the hub cache (commit {commit})" if commit else "not in the hub cache: submitting fetches it"
                )
                print(f"[mrl] {key}: {ref} {state}", file=sys.stderr, flush=True)
        return []
    return [key for key, _ in _resolve_all(cfg, {}, Path(cfg.run.output_dir))]


def _resolve_all(cfg: MrlConfig, recorded: dict[str, dict[str, str]], out: Path) -> Iterator[tuple[str, hub.Resolved]]:
    for key, repo_type, split in _places():
        value = _get(cfg, key)
        ref = hub.parse_hub_id(value) if isinstance(value, str) else None
        if ref is None:
            continue
        pinned = _pinned(recorded.get(key), ref, repo_type, key, out)
        result = hub.resolve(ref, repo_type=repo_type, key=key, split=split, pinned=pinned)
        print(f"[mrl] {key}: {ref} -> commit {result.commit} ({result.path})", file=sys.stderr, flush=True)
        yield key, result


def resolve_model_argument(value: str, key: str) -> str:
    """A command-line model (`mrl score --model`, `mrl convert --hf`): a local folder as given, a hub id as its
    snapshot folder."""
    ref = hub.parse_hub_id(value)
    if ref is None:
        return value
    result = hub.resolve(ref, repo_type="model", key=key)
    print(f"[mrl] {key}: {ref} -> commit {result.commit} ({result.path})", file=sys.stderr, flush=True)
    return result.path


def read_records(out: Path) -> dict[str, dict[str, str]]:
    path = out / RECORD_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def _places() -> Iterator[tuple[str, str, Optional[str]]]:
    for key in MODEL_KEYS:
        yield key, "model", None
    for key, split in DATA_KEYS.items():
        yield key, "dataset", split


def _pinned(record: Optional[dict[str, str]], ref: hub.HubRef, repo_type: str, key: str, out: Path) -> Optional[str]:
    """The commit recorded for this key when it names the same id and revision; a line when the cache's ref has
    moved on since."""
    if (
        not record
        or record.get("id") != ref.repo_id
        or record.get("revision") != (ref.revision or "main")
        or record.get("repo_type") != repo_type
    ):
        return None
    commit = record["commit"]
    now = hub.current_commit(ref, repo_type)
    if now is not None and now != commit:
        print(
            f"[mrl] {key}: {ref} now points at commit {now}; this run keeps the commit it "
            f"recorded, {commit} ({out / RECORD_FILE}). To take the new one, start a new run.output_dir or name "
            f"it ({ref.repo_id}@{now})",
            file=sys.stderr,
            flush=True,
        )
    return commit


def _get(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = getattr(node, part, None)
        if node is None:
            return None
    return node


def _set(cfg: Any, key: str, value: str) -> None:
    *parents, last = key.split(".")
    node = cfg
    for part in parents:
        node = getattr(node, part)
    setattr(node, last, value)
