"""Checks made in the controller before any worker starts (mrl/app/preflight.py): a model folder without a
tokenizer, a head size vLLM's CPU attention has no kernel for, a staged recipe's later stage reading bad data, an
`mrl score` input with nothing to score or with token ids outside the model's vocabulary, a checkpoint or log folder
that cannot be written. Hand-made folders and configs; nothing starts."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from mrl.algorithms.score import ScoreRow
from mrl.app.preflight import (attention_head_size, check_engine_model, check_output_folders, check_score_rows,
                               check_stage, check_tokenizer_folder, model_vocab_size)
from mrl.config.errors import ConfigError
from mrl.config.schema import MrlConfig
from mrl.inference.vllm_backend import CPU_ATTENTION_HEAD_SIZES


def _cfg(**tree) -> MrlConfig:
    return MrlConfig.model_validate(tree)


def _files(root: Path, *names: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        (root / name).write_text("{}")
    return root


@pytest.mark.parametrize("vocabulary", ["tokenizer.json", "vocab.json", "tokenizer.model", "qwen.tiktoken"])
def test_a_folder_with_a_vocabulary_file_holds_a_tokenizer(tmp_path, vocabulary):
    check_tokenizer_folder(_files(tmp_path, "config.json", vocabulary), "policy.model_name")


def test_a_model_folder_without_tokenizer_files_is_refused_naming_what_it_holds(tmp_path):
    folder = _files(tmp_path / "model", "config.json", "model.safetensors", "tokenizer_config.json",
                    "chat_template.jinja")  # config files of a tokenizer, no vocabulary: transformers builds 1 token
    with pytest.raises(ConfigError) as err:
        check_tokenizer_folder(folder, "policy.model_name")
    assert err.value.key == "policy.model_name" and f"{folder} holds no tokenizer" in err.value.message
    assert "it holds chat_template.jinja, config.json, model.safetensors, tokenizer_config.json" in err.value.message
    assert "policy.tokenizer" in err.value.fix
    with pytest.raises(ConfigError, match="there is no such folder"):
        check_tokenizer_folder(tmp_path / "missing", "policy.tokenizer")


def test_the_head_size_is_head_dim_else_hidden_over_heads_and_none_for_latent_attention():
    assert attention_head_size({"head_dim": 128, "hidden_size": 1024, "num_attention_heads": 16}) == 128
    assert attention_head_size({"hidden_size": 64, "num_attention_heads": 4}) == 16
    assert attention_head_size({"kv_lora_rank": 512, "hidden_size": 64, "num_attention_heads": 4}) is None


@pytest.fixture
def cpu_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_a_head_size_without_a_cpu_kernel_is_refused_for_the_vllm_engine_on_cpu(cpu_only):
    cfg = _cfg(policy={"model_name": "/models/tiny"})
    with pytest.raises(ConfigError) as err:
        check_engine_model(cfg, {"hidden_size": 64, "num_attention_heads": 4})
    assert err.value.key == "policy.model_name" and err.value.given == "/models/tiny"
    assert "head size is 16 (hidden_size 64 / 4 heads)" in err.value.message
    assert "32, 64, 80" in err.value.allowed and "generation.backend=megatron" in err.value.fix
    check_engine_model(cfg, {"hidden_size": 64, "num_attention_heads": 2})  # 32: served
    check_engine_model(_cfg(generation={"backend": "megatron"}), {"head_dim": 16})  # not vLLM: any size


def test_an_engine_context_longer_than_the_model_s_is_refused_naming_the_key_that_sets_it():
    """Found running the README's own-model recipe (max_total_sequence_length 512) on a model of 256 positions: vLLM
    refused it inside its worker, and the run ended in a traceback."""
    model = {"head_dim": 64, "max_position_embeddings": 256}
    cfg = _cfg(policy={"model_name": "/m", "max_total_sequence_length": 512}, generation={"max_new_tokens": 256})
    with pytest.raises(ConfigError) as err:
        check_engine_model(cfg, model)
    assert err.value.key == "policy.max_total_sequence_length" and err.value.given == 512
    assert "max_position_embeddings 256" in err.value.message and err.value.allowed == "at most 256"
    assert "policy.max_total_sequence_length=256" in err.value.fix and "max_new_tokens below it" in err.value.fix
    engine_set = _cfg(policy={"model_name": "/m", "max_total_sequence_length": 256},
                      generation={"max_new_tokens": 64, "vllm": {"max_model_len": 300}})
    with pytest.raises(ConfigError) as err:
        check_engine_model(engine_set, model)
    assert err.value.key == "generation.vllm.max_model_len" and "max_new_tokens" not in err.value.fix
    check_engine_model(_cfg(policy={"model_name": "/m", "max_total_sequence_length": 256},
                            generation={"max_new_tokens": 64}), model)  # fits
    check_engine_model(_cfg(policy={"model_name": "/m", "max_total_sequence_length": 512},
                            generation={"backend": "megatron", "max_new_tokens": 64}), model)  # rope at any length


def test_the_head_size_rule_holds_only_where_there_is_no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_engine_model(_cfg(), {"head_dim": 16})


def test_the_cpu_head_sizes_are_those_of_the_installed_vllm():
    """Read from vLLM's source without importing it (importing vLLM takes seconds)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    source = Path(spec.submodule_search_locations[0], "v1", "attention", "backends", "cpu_attn.py").read_text()
    listed = re.search(r"def get_supported_head_sizes\(cls\) -> list\[int\]:\s*return \[([\d, ]+)\]", source)
    assert listed, "vLLM's CPUAttentionBackend.get_supported_head_sizes moved: update CPU_ATTENTION_HEAD_SIZES"
    assert tuple(int(size) for size in listed.group(1).split(",")) == CPU_ATTENTION_HEAD_SIZES


def _stage_cfg(tmp_path: Path, **data) -> MrlConfig:
    return _cfg(run={"output_dir": str(tmp_path / "out")}, data=data,
                policy={"build": {"family": "qwen2", "num_layers": 1, "hidden_size": 64, "num_attention_heads": 2}})


def test_a_stage_s_data_is_read_before_the_first_stage_starts(tmp_path):
    (tmp_path / "rows.jsonl").write_text(json.dumps({"problem": "1+1", "solution": "2"}) + "\n")
    with pytest.raises(ConfigError) as err:
        check_stage(_stage_cfg(tmp_path, train=str(tmp_path / "rows.jsonl")), "grpo")
    assert err.value.key == "data.answer_key" and "columns found: problem, solution" in err.value.allowed
    (tmp_path / "pairs.jsonl").write_text("")
    with pytest.raises(ConfigError, match="it is empty"):
        check_stage(_stage_cfg(tmp_path, train=str(tmp_path / "pairs.jsonl")), "dpo")
    check_stage(_stage_cfg(tmp_path, train="org/dataset"), "sft")  # a hub id: read when its stage starts


def test_a_stage_s_bad_rows_are_said_once_when_its_command_reads_them_not_when_checked(tmp_path, caplog):
    from mrl.data.tasks import load_task_data

    rows = [{"problem": "1+1", "answer": "2"}, {"problem": "2+2"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = _stage_cfg(tmp_path, train=str(tmp_path / "rows.jsonl"))
    check_stage(cfg, "grpo")
    assert "skipped 1 bad rows" not in caplog.text
    load_task_data(cfg)
    assert caplog.text.count("skipped 1 bad rows") == 1
    check_stage(cfg, "grpo")  # the logger's level is back after the check
    load_task_data(cfg)
    assert caplog.text.count("skipped 1 bad rows") == 2


def test_a_stage_s_random_model_is_checked_against_the_cpu_engine(tmp_path, cpu_only):
    (tmp_path / "rows.jsonl").write_text(json.dumps({"problem": "1+1", "answer": "2"}) + "\n")
    cfg = _stage_cfg(tmp_path, train=str(tmp_path / "rows.jsonl"))
    check_stage(cfg, "grpo")  # 64 / 2 heads = 32
    cfg.policy.build.num_attention_heads = 4
    check_stage(cfg, "sft")  # no engine
    with pytest.raises(ConfigError, match="head size is 16") as err:
        check_stage(cfg, "eval")
    assert err.value.key == "policy.build.num_attention_heads" and err.value.given == 4


def test_an_input_with_no_row_to_score_is_refused():
    with pytest.raises(ConfigError, match="it is empty") as err:
        check_score_rows("in.jsonl", [])
    assert err.value.key == "--input" and '{"text": ...}' in err.value.allowed
    unusable = [ScoreRow(0, None, error="a row needs 'text'"), ScoreRow(2, None, error="invalid")]
    with pytest.raises(ConfigError, match=r"none of its 2 rows can be scored \(first, line 1: a row needs 'text'\)"):
        check_score_rows("in.jsonl", unusable)
    check_score_rows("in.jsonl", [*unusable, ScoreRow(3, [1, 2, 3], start=1)])  # one to score: the rest reported


@pytest.mark.parametrize("ids,bad", [([1, 99999999], 99999999), ([-5, 3], -5)])
def test_token_ids_outside_the_model_s_vocabulary_are_refused_naming_the_line_and_the_size(ids, bad):
    rows = [ScoreRow(0, [1, 2], start=1), ScoreRow(2, None, error="invalid"), ScoreRow(3, ids, start=1),
            ScoreRow(4, [500, 1], start=1)]
    with pytest.raises(ConfigError) as err:
        check_score_rows("in.jsonl", rows, vocab_size=500)
    assert err.value.key == "--input" and err.value.allowed == "token ids 0 to 499"
    assert err.value.message == (f"in.jsonl line 4: token id {bad} is outside the model's vocabulary of 500 tokens "
                                 "(and 1 more rows)")
    assert "this model's tokenizer" in err.value.fix and "--model" in err.value.fix
    check_score_rows("in.jsonl", rows[:2], vocab_size=500)  # ids 0..499 are the model's


def test_the_vocabulary_is_the_model_config_s_else_the_tokenizer_s(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 151936}))
    assert model_vocab_size(tmp_path, tokenizer=[0] * 151665) == 151936  # the embedding's rows, past the tokenizer
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 1000}}))
    assert model_vocab_size(tmp_path, tokenizer=[0] * 900) == 1000
    (tmp_path / "config.json").write_text("{}")
    assert model_vocab_size(tmp_path, tokenizer=[0] * 900) == 900


@pytest.mark.parametrize("key,what", [("checkpointing.dir", "checkpoints"), ("logger.log_dir", "logs")])
def test_a_training_run_s_checkpoint_and_log_folders_are_checked_before_it_starts(key, what, tmp_path):
    a_file = tmp_path / "config.json"
    a_file.write_text("{}")
    section, name = key.split(".")
    tree = {"run": {"output_dir": str(tmp_path / "out")}, section: {name: str(a_file / "sub")}}
    cfg = _cfg(**tree)
    with pytest.raises(ConfigError) as err:
        check_output_folders(cfg, trains=True)
    assert err.value.key == key and err.value.given == str(a_file / "sub")
    assert err.value.message == f"{what} cannot be written there: {a_file} is a file"
    assert err.value.fix == f"set {key} to a folder you can write (one that exists, or one that can be made)"
    check_output_folders(cfg, trains=False)  # mrl eval writes neither
    off = {"enabled": False} if section == "checkpointing" else {"jsonl": False, "tensorboard": False}
    check_output_folders(_cfg(**{**tree, section: {**tree[section], **off}}), trains=True)  # nothing written there
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]  # nothing made by the checks
