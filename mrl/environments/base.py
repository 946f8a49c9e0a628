"""The Environment interface: score (and, for multi-turn tasks, answer) a batch of conversations.

    step(message_logs, metadata) -> EnvironmentStep(rewards, observations, done, metadata, num_errors)

message_logs[i] is sample i's conversation, a list of {"role", "content"} messages ending with the policy's
response (role "assistant"). metadata[i] carries what the environment needs to judge it; the single-turn
verifiers read
    "answer":   the gold answer (str)
    "finished": True when the response ended with EOS (or a stop token), False when it was cut at the length limit.
    "prompt_token_ids", "response_token_ids": the sample's tokens (for environments that score tokens, e.g. a
                reward model; text environments ignore them)
    "row":      the problem's source row (a reasoning-gym entry, read by its task's scorer)
    "env":      in a run with several environments, the one that scores the sample
and add to the returned metadata
    "extracted_answer": the answer the verifier read in the response (None when it found none), so a user can see
                        why a sample scored what it did (`mrl eval` writes it beside every sample).
Verifiers never crash the run: a verifier that raises or times out scores 0 and is counted in `num_errors`
(logged as `train/reward_errors`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

import torch

Message = Mapping[str, str]
ANSWER = "answer"
FINISHED = "finished"
EXTRACTED_ANSWER = "extracted_answer"
PROMPT_TOKEN_IDS = "prompt_token_ids"
RESPONSE_TOKEN_IDS = "response_token_ids"
ENV = "env"  # the sample's environment, in a run with several (mrl/environments/mixed.py)
ROW = "row"  # the problem's source row (Problem.fields: e.g. a reasoning-gym entry, which its scorer reads)
REWARD_ERROR = "reward_error"  # set by an environment whose reward failed on the sample (scored 0)


@dataclass
class EnvironmentStep:
    rewards: torch.Tensor  # [N] float32
    observations: list[dict[str, str]]  # [N] the next message for each sample (empty content when done)
    done: torch.Tensor  # [N] bool
    metadata: list[dict[str, Any]]  # [N] the metadata, with what the environment learned added
    num_errors: int = 0  # verifier failures (raised or timed out), each scored 0
    error_messages: list[str] = field(default_factory=list)
    counts: dict[str, float] = field(default_factory=dict)  # samples by what the environment saw (code/timeout: 3)


class Environment(Protocol):
    def step(self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Mapping[str, Any]]) -> EnvironmentStep:
        """Score every sample. Must not raise because of what a response contains."""

    def shutdown(self) -> None:
        """Release workers (a no-op for in-process environments)."""


def last_response(messages: Sequence[Message]) -> str:
    """The content of the last assistant message of a conversation ("" when there is none)."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return message.get("content", "")
    return ""


def read_answers_and_finished(metadata: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[bool]]:
    """The gold answers and the finished flags of a batch; a missing key is a programming error of the caller."""
    answers, finished = [], []
    for i, meta in enumerate(metadata):
        missing = [k for k in (ANSWER, FINISHED) if k not in meta]
        if missing:
            raise KeyError(
                f"sample {i}: environment metadata lacks {missing}; every sample needs "
                f"'{ANSWER}' (gold answer) and '{FINISHED}' (ended with EOS)"
            )
        answers.append(str(meta[ANSWER]))
        finished.append(bool(meta[FINISHED]))
    return answers, finished


def single_turn_step(
    scores: Sequence[float],
    finished: Sequence[bool],
    metadata: Sequence[Mapping[str, Any]],
    errors: Sequence[str | None],
    extracted: Sequence[str | None],
) -> EnvironmentStep:
    """Assemble the result of a single-turn verifier: a truncated response scores 0 whatever it says."""
    rewards = torch.tensor([s if f else 0.0 for s, f in zip(scores, finished)], dtype=torch.float32)
    error_messages = [e for e in errors if e is not None]
    new_meta = [dict(m, **{EXTRACTED_ANSWER: x}) for m, x in zip(metadata, extracted)]
    for meta, error in zip(new_meta, errors):
        if error is not None:
            meta[REWARD_ERROR] = error
    return EnvironmentStep(
        rewards=rewards,
        observations=[{"role": "environment", "content": ""} for _ in scores],
        done=torch.ones(len(scores), dtype=torch.bool),
        metadata=new_meta,
        num_errors=len(error_messages),
        error_messages=error_messages,
    )
