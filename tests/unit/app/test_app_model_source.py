"""Which kind of model folder a path is, on hand-made folder layouts (empty files stand in for weights): an HF
folder, a Megatron checkpoint folder (`mrl convert hf-to-megatron` output, a training step, a final_megatron export),
or neither, with a message that says what the folder holds and what to pass instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from mrl.app.model_source import ModelSource, classify_model_path
from mrl.config.errors import ConfigError


QWEN2 = '{"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}'


def _files(root: Path, *names: str) -> Path:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(QWEN2 if name.endswith("config.json") else "{}")
    return root


MEGATRON = ("model/metadata.json", "model/__0_0.distcp", "hf/config.json", "hf/tokenizer.json")


@pytest.mark.parametrize("weights", ["model.safetensors", "model.safetensors.index.json"])
def test_an_hf_folder_is_its_own_config_and_weights(tmp_path, weights):
    folder = _files(tmp_path, "config.json", "tokenizer.json", weights)
    assert classify_model_path(folder) == ModelSource(config_dir=folder)
    assert not classify_model_path(str(folder)).is_megatron


@pytest.mark.parametrize("extra", [("conversion.json",), ("train_state.pt", "COMPLETE", "optimizer/metadata.json"),
                                   ("rng/layout.json", ".complete")], ids=["converted", "training_step", "final"])
def test_a_megatron_folder_takes_its_config_from_hf(tmp_path, extra):
    folder = _files(tmp_path / "step_4", *MEGATRON, *extra)
    source = classify_model_path(folder)
    assert source == ModelSource(config_dir=folder / "hf", megatron_dir=folder) and source.is_megatron


def test_a_family_mrl_cannot_build_is_named_with_the_supported_ones(tmp_path):
    folder = _files(tmp_path / "gpt2", "config.json", "model.safetensors")
    (folder / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ConfigError) as caught:
        classify_model_path(folder, key="policy.model_name")
    assert caught.value.key == "policy.model_name" and caught.value.given == str(folder)
    assert "unsupported model family" in caught.value.message and "qwen2" in caught.value.message
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        classify_model_path(folder)


def _error(path: Path, key: str = "policy.model_name") -> str:
    with pytest.raises(ConfigError) as caught:
        classify_model_path(path, key=key)
    message = caught.value.render()
    assert message.startswith(f"{key}: neither an HF model folder nor a Megatron checkpoint folder: ")
    assert f"given: '{path}'" in message and "fix: " in message
    return message


def test_a_training_step_without_its_marker_is_refused(tmp_path):
    folder = _files(tmp_path / "step_4", *MEGATRON, "train_state.pt")
    assert "a training checkpoint without its COMPLETE marker" in _error(folder)


def test_a_config_only_folder_points_at_the_megatron_folder_it_belongs_to(tmp_path):
    folder = _files(tmp_path / "meg", *MEGATRON, "conversion.json")
    message = _error(folder / "hf", key="--model")
    assert "config.json but no *.safetensors weights" in message
    assert f"pass the Megatron checkpoint folder {folder} " in message


def test_a_checkpointing_dir_points_at_its_newest_step(tmp_path):
    for step in (2, 10):
        _files(tmp_path / f"step_{step}", *MEGATRON, "train_state.pt", "COMPLETE")
    message = _error(tmp_path)
    assert "checkpoint folders step_2, step_10 (a checkpointing.dir)" in message
    assert f"pass one complete step folder, e.g. the newest, {tmp_path / 'step_10'}" in message


@pytest.mark.parametrize("names, found", [
    ((), "it is empty"),
    (("config.json", "pytorch_model.bin"), "config.json but no *.safetensors weights (pytorch_model.bin: not read)"),
    (("model/__0_0.distcp", "hf/config.json"), "model/ without metadata.json and hf/config.json"),
    (("model/metadata.json",), "model/metadata.json and no hf/config.json"),
    (("notes.txt", "data/x.jsonl"), "it holds data/, notes.txt"),
])
def test_neither_kind_says_what_was_found(tmp_path, names, found):
    folder = _files(tmp_path / "folder", *names) if names else tmp_path
    message = _error(folder)
    assert found in message
    assert "the --out folder of `mrl convert hf-to-megatron`" in message


def test_a_missing_path_or_a_file(tmp_path):
    assert "there is no such folder" in _error(tmp_path / "absent")
    assert "it is a file" in _error(_files(tmp_path, "config.json") / "config.json")


@pytest.mark.parametrize("command", ["score", "grpo"])
def test_commands_refuse_neither_kind_with_the_message_before_starting_anything(tmp_path, capsys, command):
    from mrl.cli import main
    from mrl.testing.runs import RECIPE

    folder = _files(tmp_path / "model", "config.json")
    args = (["score", "--model", str(folder), "--input", str(folder / "config.json"), "--out", str(tmp_path / "o")]
            if command == "score" else ["grpo", "--config", RECIPE, f"policy.model_name={folder}", "~policy.build",
                                        f"run.output_dir={tmp_path / 'run'}"])
    assert main(args) == 2
    key = "--model" if command == "score" else "policy.model_name"
    assert f"{key}: neither an HF model folder nor a Megatron checkpoint folder: config.json but no *.safetensors" \
        in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
