"""A new user's mistakes, made through the real command line in this process (`mrl.cli.main`): each is refused before
any worker starts (Ray's cluster is never made: `no_workers` fails the test if it is), on one screen without a
traceback, with exit status 2 and a message naming the file or key, what was found and the fix.

The mistakes: data without the answer column, a data.problem_key naming no column, an empty file, a file of which no
line is JSON, a format mrl does not read (for every command that reads data, and a later stage of a staged recipe),
a model folder without a tokenizer, a head size vLLM's CPU attention has no kernel for, an `mrl score` input with no
row, and `mrl convert` flags the model cannot take or folders that do not exist (answered before torch is imported)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mrl.cli import main
from mrl.testing.tiny_models import build_tiny_hf_model

CONFIG = """run: {{name: mistakes, seed: 1, output_dir: {out}}}
cluster: {{num_nodes: 1, devices_per_node: 1}}
policy: {{model_name: {model}, precision: float32, max_total_sequence_length: 128, train_global_batch_size: 4,
          train_micro_batch_size: 4, logprob_micro_batch_size: 4}}
generation: {{backend: vllm, max_new_tokens: 16, vllm: {{kv_cache_gib: 0.25, max_model_len: 128}}}}
grpo: {{num_prompts_per_step: 2, num_generations_per_prompt: 2, max_num_steps: 1, val_every: 0}}
sft: {{max_num_steps: 1}}
dpo: {{max_num_steps: 1}}
rm: {{max_num_steps: 1}}
data: {{train: {train}, prompt_template: chat, instruction: ""}}
eval: {{data: {train}}}
env: {{kind: math, num_workers: 1}}
checkpointing: {{enabled: false}}
"""
PAIRS = [{"prompt": "1+1", "chosen": "2", "rejected": "3"}, {"prompt": "2+2", "chosen": "4", "rejected": "5"}]
PROBLEMS = [{"problem": "1+1", "answer": "2"}, {"problem": "2+2", "answer": "4"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Tiny models: head size 32 (served by vLLM on CPU), 16 (not served), and the first without its tokenizer."""
    root = tmp_path_factory.mktemp("models")
    kw = {"hidden": 64, "layers": 1, "intermediate": 64}
    served = build_tiny_hf_model(root / "served", heads=2, **kw)
    unserved = build_tiny_hf_model(root / "unserved", heads=4, **kw)
    bare = shutil.copytree(served, root / "bare")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (bare / name).unlink(missing_ok=True)
    return {"served": served, "unserved": unserved, "bare": bare}


@pytest.fixture
def no_workers(monkeypatch):
    """Fails the test if a command gets as far as starting Ray (its workers start right after)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the command went on to start Ray and its workers")

    monkeypatch.setattr("mrl.distributed.cluster.RayCluster.from_config", refuse)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU engine, as on the test machines


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def _run(tmp_path: Path, command: str, model: Path, train: Path, *overrides: str, capsys) -> tuple[int, str]:
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(out=tmp_path / "out", model=model, train=train))
    status = main([command, "--config", str(config), *overrides])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return status, err


@pytest.mark.parametrize("command", ["grpo", "sft", "eval"])
def test_data_without_the_answer_column_names_data_answer_key_and_the_columns_found(
        command, tmp_path, models, no_workers, capsys):
    train = _write(tmp_path / "rows.jsonl", [{"problem": "1+1", "solution": "2"}] * 2)
    status, err = _run(tmp_path, command, models["served"], train, capsys=capsys)
    assert status == 2
    assert f"data.answer_key: {train}: none of its 2 rows has the column 'answer'" in err
    assert "allowed: columns found: problem, solution" in err and "fix: set data.answer_key" in err


def test_a_problem_key_naming_no_column_names_data_problem_key_and_the_closest_column(
        tmp_path, models, no_workers, capsys):
    train = _write(tmp_path / "rows.jsonl", PROBLEMS)
    status, err = _run(tmp_path, "sft", models["served"], train, "data.problem_key=problems", capsys=capsys)
    assert status == 2
    assert f"data.problem_key: {train}: none of its 2 rows has the column 'problems'" in err
    assert "columns found: answer, problem" in err and "fix: data.problem_key=problem" in err


MISTAKES = {"empty": ([], ".jsonl", "holds no rows: it is empty"),
            "malformed": (["not json", "{oops"], ".jsonl", "none of its 2 lines is valid JSON"),
            "format": (["problem,answer", "1+1,2"], ".csv", "mrl does not read the format '.csv'")}


@pytest.mark.parametrize("mistake", MISTAKES)
@pytest.mark.parametrize("command,key", [("grpo", "data.train"), ("sft", "data.train"), ("dpo", "data.train"),
                                         ("rm", "data.train"), ("eval", "eval.data")])
def test_an_unreadable_data_file_names_its_key_and_how_to_write_it(command, key, mistake, tmp_path, models,
                                                                    no_workers, capsys):
    rows, suffix, found = MISTAKES[mistake]
    train = _write(tmp_path / f"rows{suffix}", rows)
    only_eval = ["data.train=null"] if command == "eval" else []  # the file as eval.data alone
    status, err = _run(tmp_path, command, models["served"], train, *only_eval, capsys=capsys)
    assert status == 2
    assert f"{key}: {train}" in err and found in err and ".jsonl" in err
    assert not (tmp_path / "out" / "reward_model_init").exists()  # mrl rm: refused before it writes its folder


@pytest.mark.parametrize("command", ["grpo", "sft", "dpo", "eval"])
def test_a_model_folder_without_a_tokenizer_is_named_as_such(command, tmp_path, models, no_workers, capsys):
    train = _write(tmp_path / "rows.jsonl", PAIRS if command == "dpo" else PROBLEMS)
    status, err = _run(tmp_path, command, models["bare"], train, capsys=capsys)
    assert status == 2
    assert f"policy.model_name: {models['bare']} holds no tokenizer" in err and "chat template" not in err
    assert "fix: copy the tokenizer files" in err


@pytest.mark.parametrize("command", ["grpo", "eval"])
def test_a_head_size_the_cpu_engine_cannot_serve_is_refused_before_the_engine_starts(
        command, tmp_path, models, no_workers, capsys):
    train = _write(tmp_path / "rows.jsonl", PROBLEMS)
    status, err = _run(tmp_path, command, models["unserved"], train, capsys=capsys)
    assert status == 2
    assert "policy.model_name: the model's attention head size is 16" in err and "no kernel" in err
    assert "allowed: a model of head size 32, 64" in err and "generation.backend=megatron" in err
    assert "re-run" not in err and "resumes" not in err


def test_a_staged_recipe_refuses_a_later_stage_s_data_before_the_first_stage_starts(
        tmp_path, models, no_workers, capsys):
    good, bad = _write(tmp_path / "good.jsonl", PROBLEMS), _write(tmp_path / "bad.jsonl", ["{", "}"])
    recipe = tmp_path / "staged.yaml"
    recipe.write_text(CONFIG.format(out=tmp_path / "out", model=models["served"], train=good) +
                      f"stages:\n  - {{name: warmup, algorithm: sft}}\n"
                      f"  - {{name: rl, algorithm: grpo, overrides: [data.train={bad}]}}\n")
    assert main(["run", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert f"data.train: stage 'rl': {bad}: none of its 2 lines is valid JSON" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # the first stage never started


def test_score_refuses_an_input_with_no_row_to_score(tmp_path, models, no_workers, capsys):
    empty = _write(tmp_path / "in.jsonl", [])
    argv = ["score", "--model", str(models["served"]), "--input", str(empty), "--out", str(tmp_path / "o.jsonl")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--input: {empty} holds no rows" in err and '{"text": ...}' in err and "Traceback" not in err


@pytest.mark.parametrize("flags,found", [
    (["--tp", "3"], "--tp: does not divide the model's 2 attention heads"),
    (["--tp", "-1"], "--tp: must be 1 or more"),
    (["--pp", "2"], "--pp: the model's 1 layers do not split evenly over 2 pipeline stages"),
    (["--ep", "2"], "--ep: expert parallelism needs a mixture-of-experts model; this one is dense"),
])
def test_convert_flags_are_checked_as_the_config_tree_checks_them(flags, found, tmp_path, models, capsys):
    out = tmp_path / "converted"
    assert main(["convert", "hf-to-megatron", "--hf", str(models["served"]), "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert found in err and "allowed: " in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("path", ["./models/none-such", "/nonexistent/model"])
def test_convert_names_a_missing_local_folder_instead_of_looking_it_up_on_the_hub(path, tmp_path, capsys):
    assert main(["convert", "hf-to-megatron", "--hf", path, "--out", str(tmp_path / "converted")]) == 2
    err = capsys.readouterr().err
    assert f"--hf: not an HF model folder: there is no such folder\n    given: '{path}'" in err
    assert "hub" not in err.split("fix:")[0]  # not read as a hub id


def test_convert_refuses_an_out_it_would_overwrite_mix_or_cannot_make(tmp_path, models, capsys):
    served = str(models["served"])
    before = sorted(p.name for p in models["served"].iterdir())
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [
        (["hf-to-megatron", "--hf", served, "--out", str(a_file)], "it is a file"),
        (["hf-to-megatron", "--hf", served, "--out", served], "it is the folder converted"),
        (["megatron-to-hf", "--megatron", str(tmp_path), "--out", served], "the folder is not empty"),
    ]
    for argv, found in cases:
        assert main(["convert", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert f"--out: not a folder to write the conversion into: {found}" in err and "new --out" in err, err
    assert sorted(p.name for p in models["served"].iterdir()) == before  # nothing written into the model folder


def test_an_output_folder_that_cannot_be_written_is_named_before_anything_starts(tmp_path):
    from mrl.app.preflight import check_output_file, check_output_folder
    from mrl.config.errors import ConfigError

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for folder in (a_file, a_file / "sub"):
        with pytest.raises(ConfigError, match=f"results cannot be written there: {a_file} is a file") as err:
            check_output_folder(folder)
        assert err.value.key == "run.output_dir" and err.value.given == str(folder)
    check_output_folder(tmp_path / "new" / "deeper")  # can be made: made by the run, not by the check
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
    with pytest.raises(ConfigError, match="it is a folder") as err:
        check_output_file(tmp_path, "--out")
    assert err.value.key == "--out"


def test_ctrl_c_ends_a_command_with_one_line_and_the_shells_status(monkeypatch, capsys):
    import mrl.cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(mrl.cli, "_run_config_command", interrupted)
    assert main(["sft", "--config", "whatever.yaml"]) == 130
    err = capsys.readouterr().err
    assert "mrl: interrupted (Ctrl-C)" in err and "kill -TERM" in err and "Traceback" not in err


@pytest.mark.parametrize("args,fix", [
    (["--policy.optimizer.lr=1e-5"], "fix: write policy.optimizer.lr=1e-5"),
    (["--grpo.max_num_steps", "3"], "fix: write grpo.max_num_steps=3"),
    (["--grpo.max_num_steps"], "fix: write grpo.max_num_steps=<value>"),
])
def test_an_override_written_as_an_option_is_named_with_the_words_to_write(args, fix, capsys):
    assert main(["grpo", "--config", "whatever.yaml", *args]) == 2  # before the config is read
    err = capsys.readouterr().err
    assert f"{args[0]}: an override is key=value, without dashes" in err and fix in err
    from mrl.cli import _dashed_override

    assert _dashed_override(["submit", "--", "mrl", "grpo", "--grpo.max_num_steps=3"]) is None  # the command's own


@pytest.mark.parametrize("command,override,found", [
    ("grpo", "grpo.num_prompts_per_step=4", "grpo.num_prompts_per_step: data.train has 2 usable prompts"),
    ("sft", "policy.train_global_batch_size=8", "policy.train_global_batch_size: data.train has 2 usable examples"),
    ("dpo", "policy.train_global_batch_size=8",
     "policy.train_global_batch_size: data.train has 4 usable sequences (two a pair)"),
])
def test_fewer_rows_than_one_step_takes_are_refused_before_the_workers(command, override, found, tmp_path, models,
                                                                       no_workers, capsys):
    train = _write(tmp_path / "rows.jsonl", PAIRS if command == "dpo" else PROBLEMS)
    status, err = _run(tmp_path, command, models["served"], train, override, capsys=capsys)
    assert status == 2
    assert found in err and "fewer than one step takes" in err and "allowed: at most" in err, err


def test_convert_folder_mistakes_are_answered_before_torch_is_imported(tmp_path):
    """A mistyped folder is answered in a fresh process without importing torch or megatron-core (seconds before),
    for each folder flag of `mrl convert`; exit 2 and the flag named."""
    import subprocess
    import sys

    missing, out = str(tmp_path / "none-such"), str(tmp_path / "out")
    cases = [["hf-to-megatron", "--hf", missing, "--out", out], ["megatron-to-hf", "--megatron", missing, "--out", out],
             ["megatron-to-hf", "--checkpoint", missing, "--out", out]]
    code = ("import sys\nfrom mrl.cli import main\n"
            f"codes = [main(['convert', *argv]) for argv in {cases!r}]\n"
            "print(codes, sorted(m for m in ('torch', 'megatron', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "[2, 2, 2] []", (proc.stdout, proc.stderr[-2000:])
    for flag in ("--hf: not an HF model folder", "--megatron: not a folder to convert",
                 "--checkpoint: not a folder to convert"):
        assert f"{flag}: there is no such folder" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not Path(out).exists()
