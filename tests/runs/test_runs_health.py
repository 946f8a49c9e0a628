"""A run that cannot learn says so (mrl/algorithms/health.py).

Checked:
- prompts that cannot fit stop the run with a configuration error naming the figures and the keys, before any worker
  starts: the configuration of a new user's first try (the default instruction with 28 tokens left for the prompt)
  through the command line (exit 2, no traceback), a task whose every prompt is longer than the engine leaves for it
  in-process;
- SFT rows whose prompts fill the sequence length, and preference pairs none of which fits, stop `mrl sft`, `mrl dpo`
  and `mrl rm` the same way (in-process); SFT rows that are all longer than it warn, and the run trains on their
  first tokens;
- a run whose every step trains on nothing (groups of one sample: every advantage is 0) warns at each step, stops
  with exit 2 after grpo.max_idle_steps such steps, with that message and no traceback, and saves nothing from the
  idle step that stopped it; the step's health figures are in the metrics;
- an environment that cannot read its answers (gold answers that are not integers, for env.kind=arith) with
  generation.max_new_tokens 1: the step warns that every response was cut and that the reward failed on every
  sample, with the environment's message, and stops.
Not provoked for real: a reward that finds no answer in any response (a random model writes a digit by chance, so
"none" is not deterministic); tests/unit/algorithms/test_algorithms_health.py checks it by hand. The stop after the
default 3 idle steps (a model whose every answer is wrong) is a loop's control path: tests/unit/algorithms/
test_algorithms_loops.py drives it with fake workers in milliseconds.
"""

from __future__ import annotations

import json
import re

import pytest

from mrl.algorithms.health import PREFLIGHT_ROWS
from mrl.app.commands import RUNNERS
from mrl.config import load_config
from mrl.config.errors import ConfigError
from mrl.testing.runs import RECIPE, SHORT_ARITH, metrics, mrl

#: 8 tokens of context less 6 new ones: a prompt may take 2 tokens, and "3+4=" takes more.
TOO_LONG = ("policy.max_total_sequence_length=8", "generation.max_new_tokens=6", "generation.vllm.max_model_len=8")
#: 4 tokens in all: a 1-digit task's prompt ("3+4=") fills them.
FILLED = ("policy.max_total_sequence_length=4", "generation.max_new_tokens=2", "generation.vllm.max_model_len=4")
#: One sample per prompt, so every group's rewards are equal whatever the model answers.
GROUPS_OF_ONE = ("grpo.num_generations_per_prompt=1", "policy.train_global_batch_size=32",
                 "policy.train_micro_batch_size=32")


def stopped_at_start(proc) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, out[-4000:]
    assert "Traceback" not in out and "mrl: configuration error" in out, out[-4000:]
    assert "[mrl] colocated start-up" not in out  # no worker started
    return out


def test_the_default_instruction_with_28_tokens_left_stops_before_any_worker_starts(tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{a}+4=", "answer": str(a + 4)}) + "\n" for a in range(8)))
    out = stopped_at_start(mrl("grpo", "--config", RECIPE, "data.arith=null", f"data.train={data}", "env.kind=math",
                               "policy.max_total_sequence_length=32", "generation.max_new_tokens=4",
                               "generation.vllm.max_model_len=32", f"run.output_dir={tmp_path / 'run'}"))
    found = re.search(r"data.instruction: the prompt template and instruction alone take (\d+) tokens, more than "
                      r"the 28 a prompt may take", out)
    assert found and int(found.group(1)) > 28, out[-4000:]
    assert "shorten data.instruction" in out and "policy.max_total_sequence_length" in out


def test_a_task_whose_every_prompt_is_too_long_stops_before_any_worker_starts(tmp_path):
    cfg = load_config(RECIPE, [*SHORT_ARITH, *TOO_LONG, f"run.output_dir={tmp_path}"])
    with pytest.raises(ConfigError) as caught:  # in-process: the command line's handling is checked above
        RUNNERS["grpo"](cfg)
    found = re.search(rf"all {PREFLIGHT_ROWS} of the first {PREFLIGHT_ROWS} training prompts exceed the 2 tokens a "
                      r"prompt may take \(shortest (\d+), longest (\d+) tokens\)", str(caught.value))
    assert found and 2 < int(found.group(1)) <= int(found.group(2)), str(caught.value)
    assert "generation.overlong_prompt=truncate" in str(caught.value)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "logs").exists()


def test_steps_that_train_on_nothing_warn_each_step_and_stop_with_exit_2(tmp_path):
    proc = mrl("grpo", "--config", RECIPE, *SHORT_ARITH, *GROUPS_OF_ONE, f"run.output_dir={tmp_path}",
               "grpo.max_idle_steps=2", "grpo.max_num_steps=4", "grpo.val_every=0", "checkpointing.save_every=1")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 2, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    warnings = re.findall(r"\[mrl\] step (\d): every group's rewards were equal \(rewards seen: [0-9., ]+\): every "
                          r"advantage is 0, so the step changes nothing\. Every group is one sample "
                          r"\(grpo.num_generations_per_prompt is 1\)", out)
    assert warnings == ["1", "2"], out[-4000:]
    assert "mrl: training stopped: steps 1..2 trained on nothing (2 in a row; grpo.max_idle_steps=2)" in out
    # stopped, it still writes its summary, saying why, and says where its results are
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stopped"]["by"] == "grpo.max_idle_steps" and len(summary["reward_curve"]) == 2
    assert f"results so far in {tmp_path}/" in out and f"tensorboard --logdir {tmp_path}/logs/tensorboard" in out
    logged = metrics(tmp_path / "logs")
    assert logged[2]["train/zero_variance_groups"] == 1.0 and logged[2]["train/prompts_rejected_fraction"] == 0.0
    assert (tmp_path / "checkpoints" / "step_1").is_dir()  # one idle step, under the limit: saved as usual
    assert not (tmp_path / "checkpoints" / "step_2").exists()  # stopped before the second one's save


def test_training_rows_that_cannot_fit_stop_sft_dpo_and_rm_before_any_worker_starts(tmp_path):
    overrides = [*SHORT_ARITH, *FILLED]
    with pytest.raises(ConfigError, match=rf"policy.max_total_sequence_length: all {PREFLIGHT_ROWS} of the first "
                                          rf"{PREFLIGHT_ROWS} training rows have a prompt of 4 tokens or more "
                                          r"\(shortest 4, longest 4\)"):
        RUNNERS["sft"](load_config(RECIPE, [*overrides, f"run.output_dir={tmp_path / 'sft'}"]))
    for command in ("dpo", "rm"):
        with pytest.raises(ConfigError) as caught:
            RUNNERS[command](load_config(RECIPE, [*overrides, f"run.output_dir={tmp_path / command}"]))
        found = re.search(r"policy.max_total_sequence_length: no preference pair of arith fits: the prompts of (\d+) "
                          r"leave no room for a response", str(caught.value))
        assert found and int(found.group(1)) > 0, str(caught.value)
    assert not any((tmp_path / command / "logs").exists() for command in ("sft", "dpo", "rm"))


def test_sft_rows_all_longer_than_the_length_warn_and_train_on_their_first_tokens(tmp_path):
    proc = mrl("sft", "--config", RECIPE, *SHORT_ARITH, "policy.max_total_sequence_length=5",
               "generation.max_new_tokens=2", "generation.vllm.max_model_len=5", "sft.max_num_steps=2", "sft.val_every=0",
               f"run.output_dir={tmp_path}")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "Traceback" not in out, out[-4000:]
    assert re.search(rf"all {PREFLIGHT_ROWS} of the first {PREFLIGHT_ROWS} training rows are longer than "
                     r"policy.max_total_sequence_length=5 \(shortest 6, longest 7 tokens\)", out), out[-4000:]
    logged = metrics(tmp_path / "logs")
    assert logged[1]["train/rows_truncated"] > 0 and logged[2]["train/loss"] > 0


#: A task of the user's own rows (data.train) under env.kind=arith, no instruction, 8 prompts x 4 samples a step, no
#: validation.
OWN_ROWS = ("data.arith=null", "data.instruction=", "env.kind=arith", "grpo.num_prompts_per_step=8",
            "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=32",
            "policy.train_micro_batch_size=32", "grpo.val_every=0", "policy.max_total_sequence_length=16",
            "generation.vllm.max_model_len=16", "grpo.max_num_steps=5", "grpo.max_num_epochs=4",
            "checkpointing.enabled=false", "logger.log_every=1")


def rows(tmp_path, answer) -> str:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{a}+4=", "answer": answer}) + "\n" for a in range(16)))
    return f"data.train={data}"


def stopped_idle(proc, steps: int) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 2 and "Traceback" not in out, out[-4000:]
    assert f"mrl: training stopped: steps 1..{steps} trained on nothing ({steps} in a row" in out, out[-4000:]
    return out


def test_an_environment_that_cannot_read_its_answers_and_one_new_token_warn_and_stop(tmp_path):
    out = stopped_idle(mrl("grpo", "--config", RECIPE, *OWN_ROWS, rows(tmp_path, "seven"), "grpo.max_idle_steps=1",
                           "generation.max_new_tokens=1", f"run.output_dir={tmp_path / 'run'}"), steps=1)
    assert re.search(r"\[mrl\] step 1: every response was cut at generation.max_new_tokens=1 before it ended", out), \
        out[-4000:]
    assert ("[mrl] step 1: the reward failed on every sample (the gold answer 'seven' is not an integer, which "
            "env.kind=arith compares), so each scored 0") in out, out[-4000:]
    logged = metrics(tmp_path / "run" / "logs")[1]
    assert logged["train/reward_error_fraction"] == 1.0 and logged["train/truncated_fraction"] > 0
    assert logged["train/health_warnings"] == 3.0  # cut, reward failed, and every reward equal (all 0)
