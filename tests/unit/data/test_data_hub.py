"""Hub ids (mrl/data/hub.py, mrl/app/hub_ids.py) against a huggingface_hub cache written as `hf download` leaves one
(mrl/testing/hub_cache.py), offline: which strings are ids, which files make a split, which snapshot a revision
picks, what a run records and pins, and the errors."""

from __future__ import annotations

import json

import pytest

from mrl.app.hub_ids import RECORD_FILE, resolve_hub_ids
from mrl.config import load_config
from mrl.config.errors import ConfigError
from mrl.data import hub
from mrl.data.datasets import load_problems
from mrl.testing.hub_cache import place

pytestmark = pytest.mark.unit

MODEL_FILES = {"config.json": b'{"model_type": "qwen2"}', "model.safetensors": b"weights"}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty hub cache, huggingface_hub pointed at it, offline."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


@pytest.mark.parametrize("spec, expected", [
    ("org/name", ("org/name", None)), ("org/name@v1.0", ("org/name", "v1.0")), ("gpt2", ("gpt2", None)),
    ("Qwen/Qwen2.5-1.5B-Instruct@" + "a" * 40, ("Qwen/Qwen2.5-1.5B-Instruct", "a" * 40)),
    ("data/train.jsonl", None), ("./org/name", None), ("/abs/org/name", None), ("a/b/c", None), ("", None),
    ("org/name@x@y", None)])
def test_which_strings_are_hub_ids(spec, expected):
    ref = hub.parse_hub_id(spec)
    assert (None if ref is None else (ref.repo_id, ref.revision)) == expected


def test_an_existing_local_path_is_never_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub.parse_hub_id("org/name") is None


@pytest.mark.parametrize("files, split, expected", [
    (["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet", "data/test-00000-of-00001.parquet"],
     "train", ("train", ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet"])),
    (["train.jsonl", "test.jsonl", "README.md"], "test", ("test", ["test.jsonl"])),
    (["train.jsonl", "validation.jsonl"], "test", ("validation", ["validation.jsonl"])),
    (["deepscaler.json", "README.md"], "train", ("train", ["deepscaler.json"])),
    (["data/train-00000-of-00001.parquet"], "test", ("train", ["data/train-00000-of-00001.parquet"])),
    (["training/part-0.json", "eval/part-0.json"], "test", ("test", ["eval/part-0.json"])),
    (["trainer_notes.jsonl", "x.jsonl"], "train", ("train", ["trainer_notes.jsonl", "x.jsonl"])),
])
def test_split_files_follow_the_hub_layouts(files, split, expected):
    assert hub.split_files(files, split) == expected


def test_a_readme_configs_block_names_the_split_files():
    readme = ("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: raw/a_*.jsonl\n"
              "  - split: test\n    path: [raw/held.jsonl]\n---\n# x\n")
    files = ["raw/a_1.jsonl", "raw/a_2.jsonl", "raw/held.jsonl", "train.jsonl"]
    assert hub.split_files(files, "train", readme) == ("train", ["raw/a_1.jsonl", "raw/a_2.jsonl"])
    assert hub.split_files(files, "test", readme) == ("test", ["raw/held.jsonl"])


def test_an_absent_split_among_several_is_an_error_listing_them():
    with pytest.raises(ValueError, match="no 'test' split; it has other, train"):
        hub.split_files(["train.jsonl", "other.jsonl"], "test",
                        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: train.jsonl\n"
                        "  - split: other\n    path: other.jsonl\n---\n")


def test_a_revision_picks_its_snapshot_offline(cache):
    old = place(cache, "org/model", MODEL_FILES)
    tagged = place(cache, "org/model", {**MODEL_FILES, "model.safetensors": b"v1"}, revision="v1")
    new = place(cache, "org/model", {**MODEL_FILES, "model.safetensors": b"new"})  # main moved on
    for spec, commit in [("org/model", new), ("org/model@v1", tagged), (f"org/model@{old}", old)]:
        resolved = hub.resolve(hub.parse_hub_id(spec), repo_type="model", key="policy.model_name")
        assert resolved.commit == commit and resolved.path == str(cache / "models--org--model" / "snapshots" / commit)
    pinned = hub.resolve(hub.parse_hub_id("org/model"), repo_type="model", key="k", pinned=old)
    assert pinned.commit == old and pinned.revision == "main"


def test_an_uncached_id_or_revision_is_a_config_error_with_the_download_command(cache):
    place(cache, "org/model", MODEL_FILES)
    for spec, fix in [("org/absent", "mrl download org/absent"), ("org/model@v2", "mrl download org/model --revision v2")]:
        with pytest.raises(ConfigError) as error:
            hub.resolve(hub.parse_hub_id(spec), repo_type="model", key="env.reward_model.model")
        rendered = error.value.render()
        assert "env.reward_model.model" in rendered and spec in rendered and fix in rendered
    with pytest.raises(ConfigError, match="mrl download org/data --dataset"):
        hub.resolve(hub.parse_hub_id("org/data"), repo_type="dataset", key="data.train")


def test_rows_of_a_dataset_snapshot_come_from_the_asked_split(cache):
    rows = [{"problem": f"p{i}", "answer": str(i)} for i in range(3)]
    place(cache, "org/data", {"train.json": json.dumps(rows).encode(),  # one JSON array
                              "test.jsonl": b'{"problem": "q", "answer": "1"}\n{"problem": ""}\nnot json\n'},
          repo_type="dataset")
    folder = hub.resolve(hub.parse_hub_id("org/data"), repo_type="dataset", key="data.train").path
    assert [p.problem for p in load_problems(folder, split="train").problems] == ["p0", "p1", "p2"]
    held = load_problems(folder, split="test")
    assert [p.problem for p in held.problems] == ["q"] and held.num_skipped == 2


def test_a_run_records_its_resolutions_and_a_rerun_keeps_them(cache, tmp_path, capsys):
    first = place(cache, "org/model", MODEL_FILES)
    data = place(cache, "org/data", {"train.jsonl": b'{"problem": "p", "answer": "1"}\n'}, repo_type="dataset")
    cfg = load_config(None, [f"run.output_dir={tmp_path / 'run'}", "policy.model_name=org/model",
                             "data.train=org/data"])
    resolved_cfg, records = resolve_hub_ids(cfg)
    assert resolved_cfg.policy.model_name.endswith(f"snapshots/{first}") and cfg.policy.model_name == "org/model"
    assert resolved_cfg.data.train.endswith(f"snapshots/{data}")
    assert json.loads((tmp_path / "run" / RECORD_FILE).read_text()) == records
    assert records["policy.model_name"] == {"id": "org/model", "revision": "main", "commit": first,
                                            "repo_type": "model", "path": resolved_cfg.policy.model_name}

    moved = place(cache, "org/model", {**MODEL_FILES, "model.safetensors": b"newer"})
    again, _ = resolve_hub_ids(cfg)
    assert again.policy.model_name == resolved_cfg.policy.model_name
    assert f"now points at commit {moved}; this run keeps the commit it recorded, {first}" in capsys.readouterr().err
    other, _ = resolve_hub_ids(cfg.model_copy(update={"run": cfg.run.model_copy(
        update={"output_dir": str(tmp_path / "other")})}))
    assert other.policy.model_name.endswith(f"snapshots/{moved}")  # a new run takes what main is now


def test_a_config_without_hub_ids_is_left_alone(tmp_path):
    cfg = load_config(None, [f"run.output_dir={tmp_path}"])
    assert resolve_hub_ids(cfg) == (cfg, {}) and not (tmp_path / RECORD_FILE).exists()


def test_snapshot_paths_are_recognised_for_the_per_node_fetch(cache):
    commit = place(cache, "org/model", MODEL_FILES)
    path = str(cache / "models--org--model" / "snapshots" / commit)
    assert hub.is_snapshot(path) and not hub.is_snapshot(str(cache))
    assert hub.ensure_model_snapshot(path) == "present"
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE=1"):
        hub.ensure_model_snapshot(str(cache / "models--org--gone" / "snapshots" / ("b" * 40)))
