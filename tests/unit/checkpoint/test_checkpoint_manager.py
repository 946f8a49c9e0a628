"""Checkpoint folders: crash safety, retention, training-state round trip, compatibility reasons."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

from mrl.checkpoint.manager import (MARKER_FILE, CheckpointError, CheckpointManager, capture_rng_state,
                                    check_compatible, load_train_state, model_record, restore_rng_state,
                                    save_train_state)


def write_checkpoint(manager: CheckpointManager, step: int, metrics: dict | None = None, payload: str = ""):
    tmp = manager.begin(step)
    (tmp / "model").mkdir()
    (tmp / "model" / "weights.bin").write_text(payload or f"weights of step {step}")
    return manager.commit(step, tmp, metrics or {})


def hidden(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


# ------------------------------------------------------------------------------------------------ atomicity
def test_commit_publishes_a_complete_folder(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt", keep_last=3)
    assert manager.latest() is None and manager.steps() == [] and manager.best() is None
    final = write_checkpoint(manager, 5, {"reward": np.float32(0.5)})  # numpy/torch scalars are stored as numbers
    assert final == tmp_path / "ckpt" / "step_5"
    assert (final / "model" / "weights.bin").read_text() == "weights of step 5"
    assert json.loads((final / MARKER_FILE).read_text()) == {"step": 5, "metrics": {"reward": 0.5}}
    assert manager.latest() == final and manager.steps() == [5] and manager.metrics(5) == {"reward": 0.5}
    assert hidden(tmp_path / "ckpt") == []  # no temporary or trash folder left


def test_an_open_write_is_invisible(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=3)
    write_checkpoint(manager, 1)
    tmp = manager.begin(2)
    (tmp / "train_state.pt").write_bytes(b"partial")
    assert tmp.parent == tmp_path and tmp.name.startswith(".tmp-step_2-")
    assert manager.latest() == tmp_path / "step_1" and manager.steps() == [1]


def test_crash_leftovers_are_never_returned_and_get_cleaned(tmp_path):
    # a crashed run left: a temp folder with data, a step folder without marker, a folder with a marker for
    # another step, a marker that is not JSON, a half-deleted retention victim
    crashed = CheckpointManager(tmp_path, keep_last=5)
    write_checkpoint(crashed, 3)
    (crashed.begin(9) / "model").mkdir()  # crash mid-write of step 9
    (tmp_path / "step_8").mkdir()  # e.g. copied by hand and interrupted: no marker
    (tmp_path / "step_8" / "weights.bin").write_text("x")
    (tmp_path / "step_7").mkdir()
    (tmp_path / "step_7" / MARKER_FILE).write_text(json.dumps({"step": 6, "metrics": {}}))
    (tmp_path / "step_6").mkdir()
    (tmp_path / "step_6" / MARKER_FILE).write_text("{not json")
    (tmp_path / ".trash-step_1-0123abcd").mkdir()

    manager = CheckpointManager(tmp_path, keep_last=5)  # the resumed run
    assert manager.latest() == tmp_path / "step_3" and manager.steps() == [3]
    with pytest.raises(CheckpointError, match="no complete checkpoint for step 8"):
        manager.path(8)
    write_checkpoint(manager, 4)
    assert manager.steps() == [3, 4]
    assert hidden(tmp_path) == []  # stale temp and trash folders removed
    assert (tmp_path / "step_8").is_dir()  # not ours: left alone, but never returned


def test_cleanup_spares_folders_still_being_written(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=5)
    pending = manager.begin(2)
    (pending / "data").write_text("in flight")
    write_checkpoint(manager, 1)  # commit of another step cleans stale folders
    assert (pending / "data").read_text() == "in flight"
    manager.commit(2, pending, {})
    assert manager.steps() == [1, 2]


def test_recommitting_a_step_replaces_it_safely(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=5)
    write_checkpoint(manager, 2, payload="first")
    write_checkpoint(manager, 2, payload="second")  # the step re-run after resuming from an earlier one
    assert (tmp_path / "step_2" / "model" / "weights.bin").read_text() == "second"
    assert manager.steps() == [2] and hidden(tmp_path) == []


def test_crash_between_the_renames_of_a_replacement_restores_the_old_step(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=5)
    write_checkpoint(manager, 2, payload="old")
    os.rename(tmp_path / "step_2", tmp_path / ".old-step_2-deadbeef")  # first rename done, then the crash
    assert manager.latest() is None
    manager.clean_stale()
    assert manager.latest() == tmp_path / "step_2"
    assert (tmp_path / "step_2" / "model" / "weights.bin").read_text() == "old"


def test_commit_rejects_a_folder_it_did_not_open(tmp_path):
    manager = CheckpointManager(tmp_path / "a", keep_last=1)
    tmp = manager.begin(1)
    with pytest.raises(CheckpointError, match="not a temporary folder of step 2"):
        manager.commit(2, tmp, {})
    other = tmp_path / "elsewhere"
    other.mkdir()
    with pytest.raises(CheckpointError, match="begin"):
        manager.commit(1, other, {})


# ------------------------------------------------------------------------------------------------- retention
def test_keeps_the_newest_k(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (10, 20, 30, 40):
        write_checkpoint(manager, step)
    assert manager.steps() == [30, 40]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_30", "step_40"]


@pytest.mark.parametrize("higher_is_better", [True, False])
def test_keeps_the_best_k_by_metric(tmp_path, higher_is_better):
    manager = CheckpointManager(tmp_path, keep_last=1, keep_best=2, metric="val/acc",
                                higher_is_better=higher_is_better)
    scores = {1: 0.2, 2: 0.9, 3: 0.5, 4: 0.1, 5: 0.7, 6: 0.3}
    for step, score in scores.items():
        write_checkpoint(manager, step, {"val/acc": score, "loss": 1.0})
    if higher_is_better:
        assert manager.steps() == [2, 5, 6]  # best two (0.9, 0.7) + the newest
        assert manager.best() == tmp_path / "step_2"
    else:
        assert manager.steps() == [1, 4, 6]  # lowest two (0.1, 0.2) + the newest
        assert manager.best() == tmp_path / "step_4"


def test_checkpoints_without_the_metric_are_never_best(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=1, keep_best=1, metric="val/acc")
    write_checkpoint(manager, 1, {"val/acc": 0.4})
    write_checkpoint(manager, 2, {})  # no evaluation this step
    write_checkpoint(manager, 3, {"val/acc": float("nan")})
    write_checkpoint(manager, 4, {})
    assert manager.steps() == [1, 4] and manager.best() == tmp_path / "step_1"


def test_invalid_retention_settings_are_explained():
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager("x", keep_last=0)
    with pytest.raises(ValueError, match="metric"):
        CheckpointManager("x", keep_last=1, keep_best=1)


# ------------------------------------------------------------------------------------------------- train state
def draw_all():
    return random.random(), float(np.random.rand()), float(np.random.randn()), torch.rand(3).tolist()


def test_rng_state_round_trip_through_a_file(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    draw_all()
    np.random.randn()  # leaves a cached Gaussian in numpy's state
    state = {"step": 7, "consumed_samples": 224, "dataloader": {"epoch": 1, "order": torch.arange(5), "pos": 3},
             "metrics_history": [{"step": 6, "reward": np.float32(0.25)}], "best_metric": None,
             "rng": capture_rng_state()}
    expected = draw_all()
    save_train_state(tmp_path, state)

    random.seed(99), np.random.seed(99), torch.manual_seed(99)  # a fresh process would start elsewhere
    loaded = load_train_state(tmp_path)
    restore_rng_state(loaded["rng"])
    assert draw_all() == expected
    assert loaded["step"] == 7 and loaded["consumed_samples"] == 224 and loaded["best_metric"] is None
    assert torch.equal(loaded["dataloader"]["order"], torch.arange(5)) and loaded["dataloader"]["pos"] == 3
    assert loaded["metrics_history"] == [{"step": 6, "reward": 0.25}]
    assert [p.name for p in tmp_path.iterdir()] == ["train_state.pt"]  # no temporary file left


def test_train_state_rejects_values_that_would_not_load_back(tmp_path):
    with pytest.raises(TypeError, match=r"state\['dataloader'\]\['order'\] has type ndarray"):
        save_train_state(tmp_path, {"dataloader": {"order": np.arange(3)}})
    assert not (tmp_path / "train_state.pt").exists()
    with pytest.raises(CheckpointError, match="train_state.pt is missing"):
        load_train_state(tmp_path)


# ------------------------------------------------------------------------------------------------ compatibility
HF = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 500, "tie_word_embeddings": False,
      "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512}


def tokenizer_dir(path, vocab: dict, template: str = ""):
    path.mkdir()
    (path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": vocab},
                                                     "added_tokens": []}))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return path


def test_same_model_in_another_layout_is_compatible(tmp_path):
    tok = tokenizer_dir(tmp_path / "tok", {"a": 0, "b": 1})
    saved = model_record(HF, tokenizer_dir=tok, precision="float32", parallel={"tp": 1, "pp": 1})
    longer_context = {**HF, "max_position_embeddings": 4096}
    other_template = tokenizer_dir(tmp_path / "tok2", {"a": 0, "b": 1}, template="{{ messages }}")
    current = model_record(longer_context, tokenizer_dir=other_template, precision="float32",
                           parallel={"tp": 2, "pp": 2})
    assert check_compatible(saved, current) == []


def test_another_model_gives_every_reason(tmp_path):
    saved = model_record(HF, tokenizer_dir=tokenizer_dir(tmp_path / "tok", {"a": 0, "b": 1}), precision="float32")
    other = {**HF, "hidden_size": 128, "num_hidden_layers": 4, "vocab_size": 501}
    current = model_record(other, tokenizer_dir=tokenizer_dir(tmp_path / "tok2", {"a": 1, "b": 0}),
                           precision="bfloat16")
    reasons = check_compatible(saved, current)
    assert len(reasons) == 5
    assert any(r.startswith("model hidden_size: the checkpoint has 64, the current model 128") for r in reasons)
    assert any(r.startswith("model num_hidden_layers") for r in reasons)
    assert any(r.startswith("model vocab_size: the checkpoint has 500") for r in reasons)
    assert any(r.startswith("tokenizer:") for r in reasons)
    assert any(r.startswith("precision: the checkpoint was written in float32") for r in reasons)
    assert check_compatible(saved, model_record({**HF, "model_type": "llama"})) == [
        "model model_type: the checkpoint has 'qwen2', the current model 'llama' (another model: start a new run, "
        "or point policy.model_name at the checkpoint's model)"]
