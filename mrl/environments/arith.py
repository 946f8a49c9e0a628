"""The arithmetic environment of the embedded CPU recipe: exact match of the first integer of the response.

It runs in the driver process: the check is one regex on a few characters (microseconds, cannot hang), so a pool
of actors would only add latency and memory on a 2-core machine.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional, Sequence

from mrl.environments.base import EnvironmentStep, Message, last_response, read_answers_and_finished, single_turn_step

_FIRST_INTEGER = re.compile(r"-?\d+")


def first_integer(response: str) -> Optional[str]:
    """The answer the reward reads: the first integer in the response (None when there is none)."""
    match = _FIRST_INTEGER.search(response)
    return None if match is None else match.group()


def arith_reward(response: str, answer: str) -> float:
    """1.0 when the first integer in `response` equals the integer `answer` ("42" and "042" both match 42). A gold
    `answer` that is not an integer raises ValueError whatever the response says: a data problem, never a 0 that
    looks like a wrong answer."""
    try:
        gold = int(answer)
    except ValueError:
        raise ValueError(f"the gold answer {answer!r} is not an integer, which env.kind=arith compares") from None
    found = first_integer(response)
    return float(found is not None and int(found) == gold)


class ArithEnvironment:
    """Single-turn exact-match reward; a truncated response scores 0."""

    def step(self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Mapping[str, Any]]) -> EnvironmentStep:
        answers, finished = read_answers_and_finished(metadata)
        scores: list[float] = []
        errors: list[Optional[str]] = []
        for messages, answer in zip(message_logs, answers):
            try:
                scores.append(arith_reward(last_response(messages), answer))
                errors.append(None)
            except ValueError as err:  # a gold answer that is not an integer: a data problem, scored 0
                scores.append(0.0)
                errors.append(str(err))
        extracted = [first_integer(last_response(messages)) for messages in message_logs]
        return single_turn_step(scores, finished, metadata, errors, extracted)

    def shutdown(self) -> None:
        pass
