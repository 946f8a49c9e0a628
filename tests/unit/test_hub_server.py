"""The loopback Hub (mrl/testing/hub_server.py) against the real huggingface_hub client: pattern-filtered snapshots,
the cache layout `hf download` leaves, pinned revisions, dataset repos, the Hub's errors, repo info, and the cache
read back offline once the server is gone.

The client runs in a subprocess (two in all: one online, one offline) because HF_ENDPOINT and HF_HUB_OFFLINE are read
when huggingface_hub.constants is imported, and this suite's conftest sets HF_HUB_OFFLINE=1 for its own process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mrl.testing.hub_server import client_env, gate, git_blob_oid, publish, serve_hub

pytestmark = pytest.mark.unit

KEEP = ["*.json", "*.safetensors", "tokenizer*"]
MAIN = {"config.json": b'{"hidden_size": 8}', "model.safetensors": b"\x00" * 64, "tokenizer.json": b'{"v": 1}',
        "tokenizer_config.json": b'{"eos": "</s>"}', "pytorch_model.bin": b"pickle", "README.md": b"# tiny",
        "original/consolidated.00.pth": b"torch", "original/tokenizer.model": b"spm", "original/params.json": b"{}"}
V1 = {"config.json": b'{"hidden_size": 4}', "model.safetensors": b"\x01" * 32, "tokenizer.json": b'{"v": 0}'}
OLD = {"config.json": b'{"hidden_size": 2}', "model.safetensors": b"\x02" * 16}
DATA = {"data/train.jsonl": b'{"q": "1+1", "a": "2"}\n', "README.md": b"# data"}

CLIENT = r"""
import json, sys
from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download

KEEP, old = json.loads(sys.argv[1]), sys.argv[2]

def attempt(call):
    try:
        return call()
    except Exception as error:
        return type(error).__name__

out = {"offline": constants.HF_HUB_OFFLINE, "main": attempt(lambda: snapshot_download("org/tiny", allow_patterns=KEEP))}
if not constants.HF_HUB_OFFLINE:
    out["tag"] = snapshot_download("org/tiny", revision="v1", allow_patterns=KEEP)
    out["commit"] = snapshot_download("org/tiny", revision=old)
    out["file"] = hf_hub_download("org/tiny", "config.json", revision="v1")
    out["dataset"] = snapshot_download("org/data", repo_type="dataset")
    out["missing_repo"] = attempt(lambda: snapshot_download("org/nope"))
    out["missing_dataset"] = attempt(lambda: hf_hub_download("org/tiny", "README.md", repo_type="dataset"))
    out["gated"] = attempt(lambda: snapshot_download("org/gated"))
    out["gated_file"] = attempt(lambda: hf_hub_download("org/gated", "config.json"))
    out["missing_revision"] = attempt(lambda: snapshot_download("org/tiny", revision="v9"))
    out["missing_file"] = attempt(lambda: hf_hub_download("org/tiny", "nope.json"))
    api = HfApi()
    for name, info in [("info", api.model_info("org/tiny", files_metadata=False)),
                       ("info_v1_blobs", api.model_info("org/tiny", revision="v1", files_metadata=True)),
                       ("dataset_info", api.dataset_info("org/data")), ("gated_info", api.model_info("org/gated"))]:
        out[name] = {"sha": info.sha, "gated": info.gated, "siblings": {s.rfilename: s.size for s in info.siblings}}
else:
    out["file"] = attempt(lambda: hf_hub_download("org/tiny", "config.json"))
    out["all_files"] = attempt(lambda: snapshot_download("org/tiny"))
    out["never_fetched"] = attempt(lambda: snapshot_download("org/gated"))
print(json.dumps(out))
"""


def run_client(url: str | None, hf_home: Path, old: str, *, offline: bool) -> dict:
    done = subprocess.run([sys.executable, "-c", CLIENT, json.dumps(KEEP), old], check=False, capture_output=True,
                          text=True, env=client_env(url, hf_home, offline=offline), timeout=60)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    shas = {"main": publish(root, "org/tiny", MAIN), "v1": publish(root, "org/tiny", V1, revision="v1"),
            "old": publish(root, "org/tiny", OLD, revision=None),
            "data": publish(root, "org/data", DATA, repo_type="dataset"),
            "gated": publish(root, "org/gated", {"config.json": b"{}"})}
    gate(root, "org/gated")
    with serve_hub(root) as server:
        server.shas = shas
        server.hf_home = tmp_path_factory.mktemp("hf_home")
        yield server


@pytest.fixture(scope="module")
def online(hub):
    return run_client(hub.url, hub.hf_home, hub.shas["old"], offline=False)


@pytest.fixture(scope="module")
def offline(hub, online):
    hub.stop()
    return run_client(None, hub.hf_home, hub.shas["old"], offline=True)


def files_under(folder: str | Path) -> dict[str, bytes]:
    folder = Path(folder)
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_allow_patterns_fetch_only_the_matching_files(hub, online):
    # fnmatch's `*` crosses '/': "*.json" keeps original/params.json; "tokenizer*" does not reach into original/
    kept = {name: data for name, data in MAIN.items() if name.endswith((".json", ".safetensors"))}
    assert files_under(online["main"]) == kept and "original/params.json" in kept
    left_out = ("pytorch_model.bin", "original/consolidated.00.pth", "original/tokenizer.model", "tiny/README.md")
    assert not [path for path in hub.requests if path.endswith(left_out)]
    assert hub.requests["/api/models/org/tiny/revision/main"] == 1
    assert hub.requests[f"/cdn/models/org/tiny/{hub.shas['main']}/model.safetensors"] == 1


def test_the_cache_is_laid_out_as_hf_download_leaves_it(hub, online):
    repo = hub.hf_home / "hub" / "models--org--tiny"
    assert online["main"] == str(repo / "snapshots" / hub.shas["main"])
    assert (repo / "refs" / "main").read_text() == hub.shas["main"]
    config = repo / "snapshots" / hub.shas["main"] / "config.json"
    assert config.is_symlink() and os.readlink(config) == f"../../blobs/{git_blob_oid(MAIN['config.json'])}"
    weights = (repo / "snapshots" / hub.shas["main"] / "model.safetensors").resolve()
    assert weights.parent == repo / "blobs" and len(weights.name) == 64  # LFS blobs go by sha256
    assert (repo / "trees" / f"{hub.shas['main']}.json").is_file()


def test_a_pinned_tag_or_commit_gets_its_own_snapshot(hub, online):
    snapshots = hub.hf_home / "hub" / "models--org--tiny" / "snapshots"
    assert online["tag"] == str(snapshots / hub.shas["v1"]) and files_under(online["tag"]) == V1
    assert (snapshots.parent / "refs" / "v1").read_text() == hub.shas["v1"]
    assert online["file"] == str(snapshots / hub.shas["v1"] / "config.json")
    assert online["commit"] == str(snapshots / hub.shas["old"]) and files_under(online["commit"]) == OLD
    assert sorted(p.name for p in (snapshots.parent / "refs").iterdir()) == ["main", "v1"]


def test_a_dataset_repo_downloads_to_its_own_folder(hub, online):
    folder = hub.hf_home / "hub" / "datasets--org--data" / "snapshots" / hub.shas["data"]
    assert online["dataset"] == str(folder) and files_under(folder) == DATA
    assert hub.requests[f"/datasets/org/data/resolve/{hub.shas['data']}/data/train.jsonl"] == 2  # HEAD, GET


def test_missing_and_gated_repos_and_revisions_raise_as_from_the_hub(online):
    assert online["missing_repo"] == online["missing_dataset"] == "RepositoryNotFoundError"
    assert online["gated"] == online["gated_file"] == "GatedRepoError"
    assert online["missing_revision"] == "RevisionNotFoundError"
    assert online["missing_file"] == "RemoteEntryNotFoundError"


def test_repo_info_lists_siblings_and_sha(hub, online):
    assert online["info"] == {"sha": hub.shas["main"], "gated": False, "siblings": dict.fromkeys(sorted(MAIN))}
    assert online["info_v1_blobs"]["siblings"] == {name: len(data) for name, data in V1.items()}
    assert online["dataset_info"]["sha"] == hub.shas["data"] and set(online["dataset_info"]["siblings"]) == set(DATA)
    assert online["gated_info"]["gated"] == "manual"


def test_offline_the_cache_answers_with_the_server_gone(hub, online, offline):
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", int(hub.url.rsplit(":", 1)[1])), timeout=2).close()
    assert offline["offline"] is True and offline["main"] == online["main"]
    assert offline["file"] == str(Path(online["main"]) / "config.json")
    assert offline["all_files"] == "IncompleteSnapshotError"  # the cached tree lists files the patterns left out
    assert offline["never_fetched"] == "LocalEntryNotFoundError"
