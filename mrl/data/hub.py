"""Models and datasets by hub id (`org/name`, optionally `org/name@revision`), resolved into huggingface_hub's cache.

    spec "org/name@rev"  (any place that takes a model folder or a data file, when no such local path exists)
      -> HubRef(repo_id, revision)                       `parse_hub_id`
      -> the commit: a pinned one (a recorded resolution, or a 40-hex revision)
                     | refs/<rev> in the cache (HF_HUB_OFFLINE=1)
                     | the hub's answer (online)
      -> snapshot_download(revision=commit, only the files mrl reads) into HF_HUB_CACHE (HF_HOME/hub), a progress bar
         per file on stderr; offline nothing is fetched and the cached snapshot is used as it is
      -> <cache>/models--org--name/snapshots/<commit>/  read like any local folder (`Resolved.path`)

What is fetched. A model: the top-level config, safetensors, tokenizer and generation-config files (MODEL_PATTERNS);
never `*.bin` / `*.pth` duplicates of the weights, nor `original/` (a second copy in another format) nor any other
subfolder. A dataset: its README.md (for a `configs:` block naming each split's files) and the data files of the
asked split only (`split_files`, the layouts the hub's dataset viewer reads: README `configs: data_files`, else file
or folder names starting with the split's name such as `data/train-00000-of-00001.parquet` or `test.jsonl`, else
every data file is the train split).

Errors are `ConfigError`s naming the config key, the id and the fix (`mrl download ...` on a machine with network, a
local folder, `hf auth login` for a gated repo): a run never starts on a model it cannot read.

Why not the `datasets` package: mrl reads rows, not Arrow tables, and the hub's data files are parquet/jsonl/json
files that pyarrow and json read directly; `datasets` would add a dependency tree (and its own cache of converted
Arrow files, a second copy of every dataset) for what `split_files` does in 60 lines, and its offline mode needs that
second cache filled on the node that runs.
"""

from __future__ import annotations

import fnmatch
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

from mrl.config.errors import ConfigError
from mrl.data.code import HUMAN_EVAL

MODEL_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
"""The files mrl reads from a model repo (config, generation config, weights, safetensors index, tokenizer files,
chat template); top-level only (NOT_TOP_LEVEL)."""
NOT_TOP_LEVEL = ["*/*"]
DATA_SUFFIXES = (".parquet", ".jsonl", ".json", ".ndjson")
README = "README.md"
SPLIT_NAMES = {  # the split asked -> the names its files go by (as the hub's dataset viewer reads them)
    "train": ("train", "training"),
    "test": ("test", "testing", "eval", "evaluation"),
    "validation": ("validation", "valid", "val", "dev"),
}
SPLIT_FALLBACKS = {"test": ("validation",), "validation": ("test",)}  # read for held-out data when the asked is absent
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_SNAPSHOT = re.compile(r"(models|datasets)--(.+?)--(.+)/snapshots/([0-9a-f]{40})/?$")


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    revision: Optional[str] = None  # a branch, tag or commit; None: main

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class Resolved:
    """What a hub id was resolved to: recorded with the run so that a resumed or repeated run reads the same files."""

    id: str
    revision: str
    commit: str
    repo_type: str  # model | dataset
    path: str  # the snapshot folder


def parse_hub_id(spec: str) -> Optional[HubRef]:
    """`org/name` or `org/name@revision` when `spec` reads as a hub id and is no local path; else None."""
    if not spec or spec == HUMAN_EVAL or Path(spec).exists() or spec.startswith((".", "/", "~")):
        return None  # (`human-eval` names a packaged data set, mrl/data/code.py)
    repo_id, _, revision = spec.partition("@")
    if not _HUB_ID.match(repo_id) or repo_id.lower().endswith(DATA_SUFFIXES) or "@" in revision:
        return None
    return HubRef(repo_id, revision or None)


def cache_dir() -> Path:
    """huggingface_hub's cache (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub), as it reads it."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


def repo_folder(ref: HubRef, repo_type: str) -> Path:
    return cache_dir() / f"{repo_type}s--{ref.repo_id.replace('/', '--')}"


def cached_commit(ref: HubRef, repo_type: str) -> Optional[str]:
    """The commit `ref.revision` points at in the cache (refs/<revision>, written by every download), if any."""
    revision = ref.revision or "main"
    if _COMMIT.match(revision):
        return revision
    ref_file = repo_folder(ref, repo_type) / "refs" / revision
    return ref_file.read_text().strip() if ref_file.is_file() else None


def current_commit(ref: HubRef, repo_type: str) -> Optional[str]:
    """The commit `ref.revision` points at now: the hub's answer online, the cache's refs/<revision> offline or when
    the hub is out of reach."""
    if not offline():
        try:
            return _hub_commit(ref, repo_type)
        except Exception:  # noqa: BLE001 (out of reach, or gone): the cache's answer is the best there is
            pass
    return cached_commit(ref, repo_type)


# The key `mrl download` names in its errors: its positional argument.
DOWNLOAD_ARGUMENT = "MODEL_OR_DATASET"


def download_command(ref: HubRef, repo_type: str) -> str:
    revision = f" --revision {ref.revision}" if ref.revision else ""
    return f"mrl download {ref.repo_id}{revision}{' --dataset' if repo_type == 'dataset' else ''}"


def resolve(
    ref: HubRef, *, repo_type: str, key: str, split: Optional[str] = None, pinned: Optional[str] = None
) -> Resolved:
    """The snapshot of `ref` in the cache, fetched first when online (see the module docstring); `pinned`: the commit
    an earlier resolution recorded, used whatever the revision points at now; `split`: a dataset's split to fetch.
    Online with the hub out of reach, a cached snapshot is used (with a line saying so)."""
    revision = ref.revision or "main"
    if offline():
        folder = cached_snapshot(ref, repo_type, pinned)
        if folder is None:
            raise _not_cached(ref, repo_type, key, pinned or cached_commit(ref, repo_type))
        return Resolved(ref.repo_id, revision, folder.name, repo_type, str(folder))
    path = _download(ref, repo_type, key, split, pinned)
    return Resolved(ref.repo_id, revision, Path(path).name, repo_type, path)


def cached_snapshot(ref: HubRef, repo_type: str, pinned: Optional[str] = None) -> Optional[Path]:
    """The cache's snapshot folder of `ref` (at `pinned`, else the commit its revision points at), None when absent."""
    commit = pinned or cached_commit(ref, repo_type)
    folder = repo_folder(ref, repo_type) / "snapshots" / (commit or "")
    return folder if commit is not None and folder.is_dir() else None


def _download(
    ref: HubRef, repo_type: str, key: str, split: Optional[str], pinned: Optional[str], cache: Optional[Path] = None
) -> str:
    """snapshot_download of the files mrl reads; by the branch or tag name when not pinned, so that the cache's
    refs/<revision> is written for a later offline run."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        commit = pinned or _hub_commit(ref, repo_type)
        if repo_type == "model":
            patterns, ignore = MODEL_PATTERNS, NOT_TOP_LEVEL
        else:
            patterns, ignore = _dataset_patterns(ref, commit, split, key), None
        print(
            f"[mrl] {key}: fetching {ref} ({repo_type}, commit {commit[:12]}) into {cache or cache_dir()}",
            file=sys.stderr,
            flush=True,
        )
        return snapshot_download(
            ref.repo_id,
            repo_type=repo_type,
            revision=pinned or ref.revision or "main",
            allow_patterns=patterns,
            ignore_patterns=ignore,
            cache_dir=cache,
        )
    except ConfigError:
        raise
    except ValueError as error:  # split_files: no such split; huggingface_hub: not a valid repo id
        raise ConfigError(
            str(error),
            key=key,
            given=str(ref),
            fix="check the id (org/name[@revision]); for a dataset, name one with the split it reads, "
            "or download its files and pass the file to read",
        ) from error
    except Exception as error:  # the hub's errors: gated, missing repo or revision, unreachable
        answered = isinstance(error, (RepositoryNotFoundError, RevisionNotFoundError))  # gated is one too
        cached = None if answered else cached_snapshot(ref, repo_type, pinned)
        if cached is None:
            raise _hub_error(error, ref, repo_type, key) from error
        print(
            f"[mrl] {key}: the hub is out of reach ({type(error).__name__}); using the cached commit {cached.name}",
            file=sys.stderr,
            flush=True,
        )
        return str(cached)


def _hub_commit(ref: HubRef, repo_type: str) -> str:
    from huggingface_hub import HfApi

    sha = HfApi().repo_info(ref.repo_id, repo_type=repo_type, revision=ref.revision or "main").sha
    assert sha is not None  # typed optional for the hub's listings; one repo's info at a revision always has it
    return sha


def _dataset_patterns(ref: HubRef, commit: str, split: Optional[str], key: str) -> list[str]:
    """The README and the asked split's data files (every data file when `split` is None) of a dataset repo at
    `commit`, as exact paths."""
    from huggingface_hub import HfApi, hf_hub_download

    files = HfApi().list_repo_files(ref.repo_id, repo_type="dataset", revision=commit)
    readme = (
        Path(hf_hub_download(ref.repo_id, README, repo_type="dataset", revision=commit)).read_text(
            encoding="utf-8", errors="replace"
        )
        if README in files
        else ""
    )
    chosen = (
        split_files(files, split, readme, source=f"{key}={ref}")[1]
        if split
        else [f for f in files if f.lower().endswith(DATA_SUFFIXES)]
    )
    return [README, *(_escape(name) for name in chosen)] if README in files else [_escape(n) for n in chosen]


def _escape(name: str) -> str:
    """A file name as an fnmatch pattern that matches only itself."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def _hub_error(error: Exception, ref: HubRef, repo_type: str, key: str) -> ConfigError:
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    kind = "dataset" if repo_type == "dataset" else "model"
    if isinstance(error, GatedRepoError):
        return ConfigError(
            f"the {kind} {ref.repo_id} is gated: its terms must be accepted on the hub first",
            key=key,
            given=str(ref),
            fix=f"accept them on https://huggingface.co/{'datasets/' if kind == 'dataset' else ''}"
            f"{ref.repo_id}, then `hf auth login` (or set HF_TOKEN) and re-run",
        )
    if isinstance(error, RevisionNotFoundError):
        return ConfigError(
            f"the {kind} {ref.repo_id} has no revision {ref.revision!r}",
            key=key,
            given=str(ref),
            fix="name a branch, tag or commit it has (org/name@revision), or drop @revision for main",
        )
    if isinstance(error, RepositoryNotFoundError):
        return ConfigError(
            f"no {kind} {ref.repo_id} on the hub (misspelt, private, or a local path that does not exist)",
            key=key,
            given=str(ref),
            fix="check the id on https://huggingface.co, `hf auth login` for a private repo, or pass "
            "an existing local folder",
        )
    reason = f"{type(error).__name__}: {str(error)[:300]}"
    if key == DOWNLOAD_ARGUMENT:  # `mrl download` itself: only the network can help
        return ConfigError(
            f"{ref} could not be fetched from the hub ({reason}) and is not in the cache {cache_dir()}",
            key=key,
            given=str(ref),
            fix="run it on a machine that reaches https://huggingface.co and shares this HF_HOME, or reach the hub "
            "through a proxy (HTTPS_PROXY) or a mirror (HF_ENDPOINT)",
        )
    return ConfigError(
        f"{ref} could not be fetched from the hub ({reason}) and is not in the "
        f"cache; nor is there a local folder {Path(ref.repo_id).absolute()}",
        key=key,
        given=str(ref),
        fix=f"a local path? check it (relative paths start from {Path.cwd()}); a hub id? run "
        f"`{download_command(ref, repo_type)}` on a machine with network (the same HF_HOME), then re-run here "
        "with HF_HUB_OFFLINE=1",
    )


def _not_cached(ref: HubRef, repo_type: str, key: str, commit: Optional[str]) -> ConfigError:
    what = f"commit {commit}" if commit else f"revision {ref.revision or 'main'}"
    return ConfigError(
        f"{ref} ({repo_type}, {what}) is not in the hub cache {cache_dir()}, and HF_HUB_OFFLINE=1 "
        "forbids fetching it (or it is neither a hub id nor an existing local path)",
        key=key,
        given=str(ref),
        fix=f"run `{download_command(ref, repo_type)}` on a machine with network (the same HF_HOME), "
        "or pass a local folder",
    )


def split_files(files: Iterable[str], split: str, readme: str = "", *, source: str = "") -> tuple[str, list[str]]:
    """The split (its name, its data files) of a dataset repo's `files` to read for `split` (see the module
    docstring): the asked split, or the only one the repo has (a benchmark shipped as `train` only, read for
    validation); a repo with several splits and not the asked one is an error listing them."""
    data = data_files(files)
    splits = _readme_splits(readme, data) or _named_splits(data) or ({"train": data} if data else {})
    for name in (split, *SPLIT_FALLBACKS.get(split, ())):
        if name in splits:
            return name, splits[name]
    if len(splits) == 1:
        only = next(iter(splits))
        print(
            f"[mrl] {source or 'dataset'}: no {split!r} split; reading its only split {only!r}",
            file=sys.stderr,
            flush=True,
        )
        return only, splits[only]
    raise ValueError(
        f"{source or 'dataset'}: no {split!r} split"
        + (f"; it has {', '.join(sorted(splits))}" if splits else f" and no data file ({', '.join(DATA_SUFFIXES)})")
    )


def data_files(files: Iterable[str]) -> list[str]:
    return sorted(f for f in files if f.lower().endswith(DATA_SUFFIXES) and not f.startswith("."))


def local_split(folder: Path, split: str, *, source: str = "") -> list[Path]:
    """The data files of `split` in a dataset folder laid out as a hub repo (a snapshot, or a cloned repo)."""
    files = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    readme = folder / README
    text = readme.read_text(encoding="utf-8", errors="replace") if readme.is_file() else ""
    return [folder / name for name in split_files(files, split, text, source=source or str(folder))[1]]


def _readme_splits(readme: str, files: list[str]) -> dict[str, list[str]]:
    """Splits from the README's `configs:` block (its default config, else its first)."""
    config = _default_config(readme)
    if config is None:
        return {}
    data_files = config.get("data_files")
    entries = (
        [{"split": "train", "path": data_files}]
        if isinstance(data_files, (str, list))
        and not (isinstance(data_files, list) and data_files and isinstance(data_files[0], dict))
        else data_files or []
    )
    out: dict[str, list[str]] = {}
    for entry in entries:
        if isinstance(entry, dict) and "split" in entry:
            patterns = entry.get("path") or []
            patterns = [patterns] if isinstance(patterns, str) else patterns
            out[str(entry["split"])] = [f for f in files if any(fnmatch.fnmatch(f, p) for p in patterns)]
    return {name: matched for name, matched in out.items() if matched}


def _default_config(readme: str) -> Optional[dict[str, Any]]:
    import yaml

    if not readme.startswith("---"):
        return None
    try:
        meta = yaml.safe_load(readme.split("---", 2)[1]) or {}
    except (yaml.YAMLError, IndexError):
        return None
    configs = meta.get("configs") if isinstance(meta, dict) else None
    if not isinstance(configs, list) or not configs:
        return None
    configs = [c for c in configs if isinstance(c, dict)]
    default = [c for c in configs if c.get("default") or c.get("config_name") == "default"]
    return (default or configs or [None])[0]


def _named_splits(files: list[str]) -> dict[str, list[str]]:
    """Files whose name or a folder of whose path starts with a split's name (`data/train-0000.parquet`,
    `test.jsonl`, `validation/part-1.json`)."""
    out: dict[str, list[str]] = {}
    for name, aliases in SPLIT_NAMES.items():
        matched = [f for f in files if any(_starts_with_split(part, aliases) for part in _parts(f))]
        if matched:
            out[name] = matched
    return out


def _parts(path: str) -> list[str]:
    parts = path.lower().split("/")
    return [*parts[:-1], parts[-1].rsplit(".", 1)[0]]


def _starts_with_split(part: str, aliases: tuple[str, ...]) -> bool:
    return any(re.match(rf"{alias}(?:[-._ 0-9]|$)", part) for alias in aliases)


def is_snapshot(path: str) -> bool:
    """Whether `path` is a snapshot folder of a hub cache (models--org--name/snapshots/<commit>)."""
    return _SNAPSHOT.search(str(path)) is not None


def ensure_model_snapshot(path: str) -> str:
    """On a node about to start workers: the model snapshot `path` (the controller's resolution), fetched by its
    commit into the same cache folder when this node lacks it (a cache that is not shared between nodes); a no-op
    otherwise. Returns what happened, for the log."""
    if Path(path).is_dir():
        return "present"
    match = _SNAPSHOT.search(path)
    if match is None:
        raise FileNotFoundError(f"model folder {path} is missing on this node and is no hub cache snapshot")
    kind, org, name, commit = match.groups()
    if offline():
        raise FileNotFoundError(
            f"model snapshot {path} is missing on this node and HF_HUB_OFFLINE=1: fill this "
            f"node's cache (`mrl download {org}/{name} --revision {commit}`) or share HF_HOME"
        )
    cache = Path(path[: match.start()])
    _download(HubRef(f"{org}/{name}", commit), kind[:-1], "model", None, commit, cache=cache)
    return f"fetched {org}/{name}@{commit[:12]} into {cache}"


def as_record(resolved: Resolved) -> dict[str, str]:
    return asdict(resolved)
