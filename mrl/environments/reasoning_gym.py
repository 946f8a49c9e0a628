"""`kind: reasoning_gym`: each sample scored by its reasoning-gym task's own scorer.

A sample's metadata carries its row (`row`: reasoning-gym's entry, question, answer and metadata, which
`metadata.source_dataset` names the task of); the scorer is reasoning-gym's for that task
(`reasoning_gym.get_score_answer_fn`), given the answer read from the response:

    the text inside the last <answer>...</answer> (reasoning-gym's own prompts ask for them), else the whole
    response; stripped of surrounding whitespace (the default scorer compares strings exactly)

Scores are floats in [0, 1]; some tasks give partial credit (a response that merely contains the gold answer earns
len(gold) / len(response)), which `partial_credit: false` turns into 0 (only full credit scores 1). A truncated
response scores 0, and a scorer that raises scores 0 and is counted (`reward_errors`), as every verifier here.
Scoring runs in the driver process: microseconds a sample (reasoning-gym 0.1.25, docs/measurements.md).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Optional, Sequence

from mrl.environments.base import (
    ROW,
    EnvironmentStep,
    Message,
    last_response,
    read_answers_and_finished,
    single_turn_step,
)

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def read_answer(response: str) -> str:
    """What the scorer is given: the last <answer>...</answer>'s text, else the response; stripped."""
    tagged = _ANSWER_TAG.findall(response)
    return (tagged[-1] if tagged else response).strip()


class ReasoningGymEnvironment:
    """Single-turn: each sample's task scores the answer read from its response."""

    def __init__(self, partial_credit: bool = True) -> None:
        self.partial_credit = partial_credit
        self._scorers: dict[str, Callable[..., float]] = {}

    def _scorer(self, task: str) -> Callable[..., float]:
        if task not in self._scorers:
            import reasoning_gym

            self._scorers[task] = reasoning_gym.get_score_answer_fn(task)
        return self._scorers[task]

    def score(self, response: str, entry: Mapping[str, Any]) -> tuple[float, Optional[str]]:
        """(reward, error): the task's score of the response's answer; (0, the message) when the scorer raises."""
        try:
            task = entry["metadata"]["source_dataset"]
            score = float(self._scorer(task)(answer=read_answer(response), entry=dict(entry)))
        except Exception as err:  # noqa: BLE001 a task's scorer failing on an odd answer scores 0, counted
            return 0.0, f"reasoning-gym scorer: {type(err).__name__}: {err}"
        return (score if self.partial_credit else float(score >= 1.0)), None

    def step(self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Mapping[str, Any]]) -> EnvironmentStep:
        _, finished = read_answers_and_finished(metadata)
        responses = [last_response(messages) for messages in message_logs]
        scored = [self.score(response, meta.get(ROW, {})) for response, meta in zip(responses, metadata)]
        extracted = [read_answer(response) or None for response in responses]
        return single_turn_step([s for s, _ in scored], finished, metadata, [e for _, e in scored], extracted)

    def shutdown(self) -> None:
        pass
