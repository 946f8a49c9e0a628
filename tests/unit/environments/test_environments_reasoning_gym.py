"""reasoning-gym as a task source and verifier (mrl/data/reasoning_gym.py, mrl/environments/reasoning_gym.py), with the
real package (reasoning-gym 0.1.25, in the CPU lock): rows generated deterministically by weight, validation held out,
each answer scored by its task's own scorer, and the refusals that name the key."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from mrl.config import load_config
from mrl.config.errors import ConfigError
from mrl.data.reasoning_gym import generate
from mrl.data.tasks import load_task_data
from mrl.environments.base import ANSWER, FINISHED, ROW
from mrl.environments.reasoning_gym import ReasoningGymEnvironment, read_answer

pytestmark = pytest.mark.unit

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "arith-tiny-cpu.yaml"
EASY = {
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"],
                         "allow_parentheses": False, "allow_negation": False},
    "chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1},
}


def source(**changes):
    fields = {"tasks": {"basic_arithmetic": 1.0, "chain_sum": 3.0}, "size": 400, "val_size": 100, "seed": 7,
              "config": EASY, "prompt_key": "question"}
    return SimpleNamespace(**{**fields, **changes})


@pytest.fixture(scope="module")
def rows():
    return generate(source(), "data.sources[0].reasoning_gym")


def task(problem) -> str:
    return problem.fields["metadata"]["source_dataset"]


def test_the_rows_are_the_tasks_drawn_by_weight_and_the_same_every_time(rows):
    train, val, dropped = rows
    assert len(train) == 400
    drawn = sum(task(p) == "basic_arithmetic" for p in train)
    assert 65 <= drawn <= 135  # weight 1 of 4: 100 expected, 4 standard deviations either side
    again, _, _ = generate(source(), "k")
    assert [(p.problem, p.answer) for p in again] == [(p.problem, p.answer) for p in train]
    other, _, _ = generate(source(seed=8), "k")
    assert [p.problem for p in other] != [p.problem for p in train]


def test_validation_is_held_out_and_what_was_dropped_is_counted(rows):
    train, val, dropped = rows
    questions = {p.problem for p in train}
    assert val and not any(p.problem in questions for p in val)
    assert len(val) + sum(dropped.values()) == 100


def test_the_gold_answers_are_the_expressions_values(rows):
    """An independent check of the rows: basic_arithmetic's answer is its expression evaluated (Python's arithmetic)."""
    train, _, _ = rows
    for p in [p for p in train if task(p) == "basic_arithmetic"][:50]:
        assert int(p.answer) == eval(p.fields["metadata"]["expression"])  # noqa: S307 digits, + and - only


def test_prompts_can_be_a_metadata_field_and_a_missing_one_is_named():
    train, _, _ = generate(source(prompt_key="expression", size=20, val_size=0), "k")
    assert all(set(p.problem) <= set("0123456789+- ") for p in train)
    with pytest.raises(ConfigError, match=r"(?s)metadata has no 'equation'.*question.*expression"):
        generate(source(prompt_key="equation", size=5, val_size=0), "data.sources[0].reasoning_gym")


def test_unknown_tasks_and_bad_configs_are_refused_with_the_key():
    with pytest.raises(ConfigError, match=r"(?s)data.sources\[0\].reasoning_gym.tasks.*no task 'chain_summ'.*'chain_sum'"):
        generate(source(tasks={"chain_summ": 1.0}, config={}), "data.sources[0].reasoning_gym")
    with pytest.raises(ConfigError, match=r"data.sources\[0\].reasoning_gym.config"):
        generate(source(config={"chain_sum": {"no_such_field": 1}}), "data.sources[0].reasoning_gym")


def test_each_answer_is_scored_by_its_tasks_scorer(rows):
    train, _, _ = rows
    env = ReasoningGymEnvironment()
    strict = ReasoningGymEnvironment(partial_credit=False)
    sample = train[0]
    gold = sample.answer
    cases = [gold, f" {gold}\n", f"thinking... <answer>{gold}</answer>", f"The answer is {gold}", "no idea"]
    logs = [[{"role": "assistant", "content": text}] for text in cases]
    meta = [{ANSWER: gold, FINISHED: True, ROW: sample.fields} for _ in cases]
    rewards = env.step(logs, meta).rewards.tolist()
    assert rewards[:3] == [1.0, 1.0, 1.0] and rewards[4] == 0.0
    assert 0.0 < rewards[3] < 1.0  # the task's partial credit for an answer inside other text
    assert strict.step(logs, meta).rewards.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    cut = env.step(logs[:1], [{**meta[0], FINISHED: False}])
    assert cut.rewards.tolist() == [0.0]  # a truncated response scores 0


def test_a_scorer_that_raises_scores_zero_and_is_counted():
    step = ReasoningGymEnvironment().step(
        [[{"role": "assistant", "content": "7"}]], [{ANSWER: "7", FINISHED: True, ROW: {"metadata": {}}}]
    )
    assert step.rewards.tolist() == [0.0] and step.num_errors == 1 and "KeyError" in step.error_messages[0]


def test_read_answer():
    assert read_answer("a <answer>1</answer> b <answer> 2 </answer>") == "2"
    assert read_answer("  42\n") == "42"


def test_a_mixed_run_of_arithmetic_and_reasoning_gym_loads(tmp_path):
    cfg = load_config(RECIPE, [
        "~data.arith", "data.prompt_template=plain", f"run.output_dir={tmp_path}",
        "+envs={add: {kind: arith}, rg: {kind: reasoning_gym, partial_credit: false}}",
        "+data.sources=[{env: add, arith: {digits: 2, num_heldout: 20}}, {env: rg, weight: 2, reasoning_gym: "
        "{tasks: {basic_arithmetic: 1, chain_sum: 1}, size: 50, val_size: 10, prompt_key: expression, config: "
        "{basic_arithmetic: {max_digits: 1, min_terms: 2, max_terms: 2, operators: ['+', '-'], "
        "allow_parentheses: false, allow_negation: false}, chain_sum: {max_digits: 1, min_digits: 1}}}}]",
    ])
    data = load_task_data(cfg)
    rg_rows = [p for p in data.train if p.env == "rg"]
    assert len(rg_rows) == round(len(data.train) * 2 / 3)  # weight 2 of 3
    assert {task(p) for p in rg_rows} == {"basic_arithmetic", "chain_sum"}
    assert {p.env for p in data.val} == {"add", "rg"}


def test_task_weights_that_sum_to_nothing_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"(?s)reasoning_gym.tasks.*sum to more than 0"):
        load_config(RECIPE, [
            "~data.arith", f"run.output_dir={tmp_path}", "+envs={rg: {kind: reasoning_gym}}",
            "+data.sources=[{env: rg, reasoning_gym: {tasks: {chain_sum: 0}}}]",
        ])
