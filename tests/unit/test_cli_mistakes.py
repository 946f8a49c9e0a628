"""A new user's mistakes, made through the real command line in this process (`mrl.cli.main`): each is refused before
any worker starts (Ray's cluster is never made: `no_workers` fails the test if it is), on one screen without a
traceback, with exit status 2 and a message naming the file or key, what was found and the fix.

The mistakes: data without the answer column, a data.problem_key naming no column, an empty file, a file of which no
line is JSON, a format mrl does not read (for every command that reads data, and a later stage of a staged recipe),
a model folder without a tokenizer, a head size vLLM's CPU attention has no kernel for, an `mrl score` input with no
row, not in UTF-8 or with token ids outside the model's vocabulary, a checkpoint or log folder under a file,
`mrl convert` flags the model cannot take or folders that do not exist or are not of the kind a flag takes
(answered before torch is imported), `mrl
env` counts, ranges, files and ports that cannot be meant, and a command's missing arguments (the optional overrides
not among them)."""

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
    assert "allowed: columns found: problem, solution" in err
    assert "fix: data.answer_key=solution" in err  # the column named like an answer


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


@pytest.mark.parametrize("command", ["grpo", "eval"])
def test_validation_prompts_that_are_all_too_long_are_refused_before_the_engine_starts(
        command, tmp_path, models, no_workers, capsys):
    train = _write(tmp_path / "rows.jsonl", PROBLEMS)
    long = _write(tmp_path / "long.jsonl", [{"problem": "1+1 " * 200, "answer": "2"}] * 3)  # 800 characters each
    status, err = _run(tmp_path, command, models["served"], train, f"eval.data={long}", capsys=capsys)
    assert status == 2
    assert "generation.overlong_prompt: all 3 of the first 3 validation prompts (eval.data) exceed the 112 tokens" \
        in err and "generation.overlong_prompt=truncate" in err, err


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


def test_score_refuses_an_input_not_in_utf8_or_with_ids_outside_the_vocabulary(tmp_path, models, no_workers, capsys):
    vocab = json.loads((models["served"] / "config.json").read_text())["vocab_size"]
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"text": "caf\u00e9"}\n'.encode("latin-1"))
    ids = _write(tmp_path / "ids.jsonl", [{"input_ids": [1, 2]}, {"input_ids": [1, vocab]}])
    cases = [(latin1, f"--input: {latin1} is not UTF-8 text (line 1: byte 0xe9)"),
             (ids, f"--input: {ids} line 2: token id {vocab} is outside the model's vocabulary of {vocab} tokens\n"
                   f"    allowed: token ids 0 to {vocab - 1}")]
    for source, found in cases:
        argv = ["score", "--model", str(models["served"]), "--input", str(source), "--out", str(tmp_path / "o.jsonl")]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert found in err and "Traceback" not in err, err


@pytest.mark.parametrize("override,found", [
    ("checkpointing.dir={file}/ckpt", "checkpointing.dir: checkpoints cannot be written there: {file} is a file"),
    ("logger.log_dir={file}/logs", "logger.log_dir: logs cannot be written there: {file} is a file"),
])
def test_a_checkpoint_or_log_folder_under_a_file_is_refused_before_the_workers_start(
        override, found, tmp_path, models, no_workers, capsys):
    a_file = tmp_path / "config.json"
    a_file.write_text("{}")
    train = _write(tmp_path / "rows.jsonl", PROBLEMS)
    status, err = _run(tmp_path, "sft", models["served"], train, "checkpointing.enabled=true",
                       override.format(file=a_file), capsys=capsys)
    assert status == 2
    assert found.format(file=a_file) in err and "fix: set " in err


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


def test_convert_refuses_a_folder_of_the_wrong_kind_before_torch_is_imported(tmp_path, models):
    """An HF folder without a tokenizer (its conversion could not be used as a model), an HF folder given to
    megatron-to-hf, an empty --hf folder, and an --out holding a conversion already: exit 2 with the fix, in a fresh
    process that imports neither torch nor megatron-core, and nothing written."""
    import subprocess
    import sys

    converted, empty, out = tmp_path / "converted", tmp_path / "empty", str(tmp_path / "out")
    (converted / "model").mkdir(parents=True)
    (converted / "model" / "metadata.json").write_text("{}")
    empty.mkdir()
    served, bare = str(models["served"]), str(models["bare"])
    cases = [["hf-to-megatron", "--hf", bare, "--out", out], ["megatron-to-hf", "--megatron", served, "--out", out],
             ["megatron-to-hf", "--checkpoint", served, "--out", out], ["hf-to-megatron", "--hf", str(empty), "--out",
             out], ["hf-to-megatron", "--hf", served, "--out", str(converted)]]
    code = ("import sys\nfrom mrl.cli import main\n"
            f"codes = [main(['convert', *argv]) for argv in {cases!r}]\n"
            "print(codes, sorted(m for m in ('torch', 'megatron', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "[2, 2, 2, 2, 2] []", (proc.stdout, proc.stderr[-2000:])
    err = proc.stderr
    assert "--hf: the HF model folder holds no tokenizer: none of tokenizer.json" in err
    assert f"fix: copy the tokenizer files of the model it came from (tokenizer.json, tokenizer_config.json, ...) " \
           f"into {bare}, then convert again" in err
    for flag in ("--megatron", "--checkpoint"):
        assert f"{flag}: not a Megatron checkpoint: it is an HF model folder (config.json + safetensors" in err
    assert f"fix: it is HF already: to make a Megatron checkpoint of it, mrl convert hf-to-megatron --hf {served}" \
        in err
    assert "--hf: not an HF model folder: the folder has no config.json (it is empty)" in err
    assert (f"--out: not a folder to write the conversion into: it holds a converted model already "
            f"({converted / 'model'} is not empty)") in err
    assert f"fix: choose a new --out folder, or remove {converted} first to convert into it again" in err
    assert "Traceback" not in err and not Path(out).exists()
    assert sorted(p.name for p in converted.rglob("*")) == ["metadata.json", "model"]


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


@pytest.mark.parametrize("argv,found", [
    (["--count", "-5"], "--count: the number of rows must be at least 1\n    given: -5"),  # wrote 0 rows, exit 0
    (["--max-turns", "0"], "--max-turns: a game needs at least one guess\n    given: 0"),  # games of no guess
    (["--low", "50", "--high", "10"], "fix: swap them (--low 10 --high 50)"),  # randrange's ValueError
    (["--out", "{tmp}"], "--out: it is a folder: name the jsonl file to write"),  # IsADirectoryError
    (["--out", "{tmp}/a_file/rows.jsonl"], "a_file is a file, so no folder can hold --out there"),
])
def test_env_rows_refuses_arguments_that_cannot_be_meant(argv, found, tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    argv = [arg.format(tmp=tmp_path) for arg in argv]
    out = [] if "--out" in argv else ["--out", str(tmp_path / "rows.jsonl")]
    assert main(["env", "rows", "guess_number", *out, *argv]) == 2
    err = capsys.readouterr().err
    assert found in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing written
    assert main(["env", "rows", "guess_number", "--out", str(tmp_path / "rows.jsonl"), "--count", "3"]) == 0


def test_env_serve_refuses_a_port_beyond_65535_instead_of_serving_on_another(capsys):
    assert main(["env", "serve", "guess_number", "--port", "99999"]) == 2  # the system took it modulo 65536
    err = capsys.readouterr().err
    assert "--port: not a TCP port\n    given: 99999\n    allowed: 0 to 65535 (0 picks a free one)" in err, err


@pytest.mark.parametrize("argv,required", [(["check"], "RUN_DIR, RECIPE"), (["run"], "recipe")])
def test_a_missing_argument_is_named_without_the_optional_overrides(argv, required, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "[OVERRIDE ...]" in err.splitlines()[0], err
    assert err.rstrip().endswith(f"the following arguments are required: {required}"), err


@pytest.mark.parametrize("args,found,fix", [
    (["config", "show", "my.yaml"], "'my.yaml' is a config file, not an override (key=value)",
     "fix: did you mean --config my.yaml? (mrl config show --config my.yaml [OVERRIDE ...])"),
    (["grpo", "my.yml", "grpo.max_num_steps=1"], "'my.yml' is a config file, not an override",
     "fix: did you mean --config my.yml? (mrl grpo --config my.yml [OVERRIDE ...])"),
    (["grpo", "--config", "a.yaml", "b.yaml"], "'b.yaml' is a second config file, not an override (key=value); "
     "a.yaml is the first", "list it under `defaults:`"),
    (["run", "a.yaml", "b.yaml"], "'b.yaml' is a second config file", "list it under `defaults:`"),
    (["run", "--config", "my.yaml"], "--config: `mrl run` takes the recipe as an argument, not with --config",
     "fix: mrl run my.yaml [OVERRIDE ...]"),
    (["check", "results/x", "--config=my.yaml"], "--config: `mrl check` takes the recipe as an argument",
     "fix: mrl check RUN_DIR my.yaml [OVERRIDE ...]"),
    (["sft", "--config", "a.yaml", "--config", "b.yaml"],
     "--config: given 2 times (a.yaml, b.yaml): a command reads one config file", "fix: keep one --config"),
])
def test_a_config_file_named_in_the_wrong_place_is_said_so(args, found, fix, capsys):
    assert main(args) == 2  # before the config is read: none of the files exists
    err = capsys.readouterr().err
    assert found in err and fix in err and "Traceback" not in err, err
    from mrl.app.config_args import config_argument_mistake

    assert config_argument_mistake(["submit", "--", "mrl", "run", "--config", "x.yaml"], {"grpo"}) is None
    assert config_argument_mistake(["plan", "--config", "a.yaml", "--model-config", "b.yaml"], {"plan"}) is None
