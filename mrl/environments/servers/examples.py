"""Two example resource servers, small enough to read whole, and the registry `mrl env serve NAME` serves from.

GuessNumber: row {"secret": 0..99, "max_turns": N} (optionally "low"/"high" for another range) -> guess(number)
    answers "higher" / "lower" / "correct" (the secret is higher / lower than the guess), "done" once found or out of
    guesses -> reward 1.0 when found, else up to 0.5 for a last guess near it.
Calculator: row {"question": "12*7+3", "answer": "87"} -> calculate(expression) evaluates + - * / and parentheses
    exactly (an AST walk over fractions, never eval) -> reward 1.0 when the final text contains the answer.
"""

from __future__ import annotations

import ast
import operator
import re
from fractions import Fraction
from typing import Any, Callable

from mrl.data.tokenizers import EOS_TOKEN
from mrl.environments.servers.resource import InputError, ResourceServer, tool

_WHOLE = re.compile(r"[-+]?\d+(?:\.0*)?")
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def parse_whole_number(value: Any) -> int:
    """An int from 42, 42.0, "42", " +42 " or "42.0"; ValueError (with what to send instead) for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a number: send a whole number such as 42")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and _WHOLE.fullmatch(value.strip()):
        return int(float(value.strip())) if "." in value else int(value.strip())
    raise ValueError(f"{value!r} is not a whole number: send one such as 42")


class GuessNumber(ResourceServer):
    """Find a secret whole number from `low` to `high` (the row's, default 0 to 99) in at most max_turns guesses."""

    name = "guess_number"
    PROMPT = "guess"  # a dataset row's problem: the game needs no words (tiny models play it)
    LOW, HIGH = 0, 99
    DEFAULT_MAX_TURNS = 7  # enough for a binary search over 100 numbers

    def seed_session(self, row: dict) -> dict:
        low, high = _row_whole(row, "low", self.LOW), _row_whole(row, "high", self.HIGH)
        secret = _row_whole(row, "secret")
        max_turns = _row_whole(row, "max_turns", self.DEFAULT_MAX_TURNS)
        if low > high:
            raise InputError(f"row['low'] is {low} and row['high'] is {high}: low must not exceed high")
        if not low <= secret <= high:
            raise InputError(f"row['secret'] is {secret}: it must be from {low} to {high}")
        if max_turns < 1:
            raise InputError(f"row['max_turns'] is {max_turns}: it must be at least 1")
        return {
            "secret": secret,
            "low": low,
            "high": high,
            "max_turns": max_turns,
            "turns": 0,
            "last_guess": None,
            "found": False,
            "tool_errors": 0,
        }

    def observation(self, state: dict, row: dict) -> str:
        return (
            f"I am thinking of a whole number from {state['low']} to {state['high']}. You have "
            f"{state['max_turns']} guesses: call guess(number) and I answer higher, lower or correct."
        )

    @tool
    def guess(self, state: dict, number: Any) -> str:
        """Guess the secret number: "higher" or "lower" says where the secret is, "correct" ends the game."""
        if state["found"]:
            return "correct"
        if state["turns"] >= state["max_turns"]:
            return "no turns left"
        try:  # a bad guess costs no turn, but is counted (tool_errors)
            value = parse_whole_number(number)
            if not state["low"] <= value <= state["high"]:
                raise ValueError(f"{value} is out of range: guess from {state['low']} to {state['high']}")
        except ValueError:
            state["tool_errors"] += 1
            raise
        state["turns"] += 1
        state["last_guess"] = value
        if value == state["secret"]:
            state["found"] = True
            return "correct"
        return "higher" if state["secret"] > value else "lower"

    def is_done(self, state: dict) -> bool:
        """Found, or every guess spent."""
        return state["found"] or state["turns"] >= state["max_turns"]

    @classmethod
    def rows(
        cls, count: int, seed: int = 0, max_turns: int = DEFAULT_MAX_TURNS, low: int = LOW, high: int = HIGH
    ) -> list[dict]:
        """`count` dataset rows (a random secret each) with the problem/answer columns mrl's data loader reads."""
        import random

        rng = random.Random(seed)
        secrets = [rng.randint(low, high) for _ in range(count)]
        bounds = {} if (low, high) == (cls.LOW, cls.HIGH) else {"low": low, "high": high}
        return [
            {"problem": cls.PROMPT, "answer": str(s), "secret": s, "max_turns": max_turns, **bounds} for s in secrets
        ]

    @classmethod
    def warmup_rows(
        cls,
        count: int,
        seed: int = 0,
        max_turns: int = DEFAULT_MAX_TURNS,
        low: int = LOW,
        high: int = HIGH,
        turn_end: str = EOS_TOKEN,
    ) -> list[dict]:
        """SFT rows from a naive player's games, for a model that has never seen the game: the prompt (PROMPT) and
        0 .. max_turns-1 earlier turns (a guess drawn uniformly from the range, `turn_end`, the server's answer on its
        own line: the plain-template layout of mrl's agent loop), the target another uniform draw. They teach the
        format (a number after any answer), not the strategy: every target ignores the answers."""
        import random

        from mrl.data.templates import PLAIN_OBSERVATION

        rng = random.Random(seed)
        rows = []
        for _ in range(count):
            secret, text = rng.randint(low, high), cls.PROMPT
            for _ in range(rng.randint(0, max_turns - 1)):
                guess = rng.randint(low, high)
                if guess == secret:
                    break  # the game would be over
                text += f"{guess}{turn_end}" + PLAIN_OBSERVATION.format("higher" if secret > guess else "lower")
            rows.append({"problem": text, "answer": str(rng.randint(low, high))})
        return rows

    def verify(self, state: dict, row: dict, response: dict) -> dict:
        """1.0 when found; else (1 - |last guess - secret| / range size) * 0.5, a shaped partial reward (0 without
        guesses)."""
        if state["found"]:
            reward = 1.0
        elif state["last_guess"] is None:
            reward = 0.0
        else:
            size = state["high"] - state["low"] + 1
            reward = max(0.0, 1.0 - abs(state["last_guess"] - state["secret"]) / size) * 0.5
        return {"reward": reward, "found": state["found"], "turns": state["turns"], "tool_errors": state["tool_errors"]}


def _row_whole(row: dict, key: str, default: int | None = None) -> int:
    if key not in row and default is not None:
        return default
    try:
        return parse_whole_number(row[key])
    except KeyError:
        raise InputError(f"the row has no {key!r}: add it (rows look like {{'secret': 42, 'max_turns': 7}})") from None
    except ValueError as exc:
        raise InputError(f"row[{key!r}]: {exc}") from None


MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = Fraction(10) ** 30  # bounds every literal and intermediate result: no unbounded big-number work
_BINARY: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_UNARY: dict[type, Callable[[Fraction], Fraction]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_ALLOWED = "use numbers, + - * / and parentheses"


def evaluate(expression: Any) -> Fraction:
    """The exact value of an arithmetic expression; ValueError, saying what is allowed, for anything else.

    Parsed with `ast` and walked over a whitelist of nodes (no eval): names, calls, attributes, **, comparisons and
    every other construct are refused before anything is computed.
    """
    if not isinstance(expression, str):
        raise ValueError(f"the expression must be a string such as '12*7+3', got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is {len(expression)} characters long: at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise ValueError(f"cannot parse {expression!r}: {_ALLOWED}") from None
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        try:
            value = Fraction(repr(node.value))  # the literal as written in decimal: 0.1 is 1/10, not a binary float
        except ValueError:  # inf: a float literal past 1e308
            raise ValueError(f"the number {node.value!r} is too large") from None
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        value = _BINARY[type(node.op)](left, right)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_evaluate(node.operand))
    else:
        raise ValueError(f"{_describe(node)} is not allowed: {_ALLOWED}")
    if abs(value) > MAX_MAGNITUDE:
        raise ValueError(f"a number in the expression exceeds {float(MAX_MAGNITUDE):g}")
    return value


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.Call):
        return "a function call"
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        return f"the operator {type(node.op).__name__}"
    if isinstance(node, ast.Constant):
        return f"the constant {node.value!r:.40}"
    return f"{type(node).__name__} syntax"


def format_number(value: Fraction) -> str:
    """87, or a decimal (0.3333333333333333) when the value is not whole."""
    return str(value.numerator) if value.denominator == 1 else repr(float(value))


class Calculator(ResourceServer):
    """Answer an arithmetic question, with a calculator tool at hand."""

    name = "calculator"

    def seed_session(self, row: dict) -> dict:
        question, answer = row.get("question"), row.get("answer")
        if not isinstance(question, str) or answer is None:
            raise InputError(
                "rows need a 'question' (str) and an 'answer', e.g. {'question': '12*7+3', 'answer': '87'}"
            )
        _number(answer, "row['answer']")
        return {"tool_calls": 0}

    def observation(self, state: dict, row: dict) -> str:
        return f"What is {row['question']}? You may call calculate(expression)."

    @tool
    def calculate(self, state: dict, expression: Any) -> str:
        """Evaluate an arithmetic expression with + - * / and parentheses, e.g. "12*7+3"."""
        state["tool_calls"] += 1
        return format_number(evaluate(expression))

    def verify(self, state: dict, row: dict, response: dict) -> dict:
        """1.0 when any number in response["text"] equals the row's answer (87 == 87.0 == 87.00), else 0.0."""
        text = response.get("text")
        if not isinstance(text, str):
            raise InputError("the response needs the model's final text as a string under 'text'")
        gold = _number(row.get("answer"), "row['answer']")
        found = any(Fraction(m.replace(",", "")) == gold for m in _NUMBER.findall(text))
        return {"reward": 1.0 if found else 0.0, "tool_calls": state["tool_calls"]}


def _number(value: Any, what: str) -> Fraction:
    try:
        return Fraction(str(value).replace(",", "").strip())
    except (ValueError, ZeroDivisionError):
        raise InputError(f"{what} is {value!r}: it must be a number such as 87 or 0.5") from None


EXAMPLES: dict[str, type[ResourceServer]] = {"guess_number": GuessNumber, "calculator": Calculator}
