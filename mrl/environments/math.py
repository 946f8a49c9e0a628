"""Math answers checked with math-verify (DeepScaleR-style 0/1 correctness reward), in a pool of Ray actors.

The gold answer is wrapped in \\boxed{} when it is not already, so that math-verify's LaTeX extraction reads it the
same way it reads the model's final \\boxed{} answer; both are parsed with `math_verify.parse` and compared with
`math_verify.verify` (symbolic equivalence: 0.5 == \\frac{1}{2} == 1/2). math-verify's own signal-based timeouts
are off (they only work in a process's main thread): the pool's per-sample deadline replaces them.

What real models write and math-verify reads (tests/unit/environments): "\\boxed{18}" (preferred when present),
"The answer is 18", "#### 18" as the last number, "18 dollars", "$1,000", "\\$18.00" (see `readable`), "18%" (== 18
or 0.18). Without a box it takes the number after "final answer is", else the LAST number, so "The final answer is
800,000 - 100,000 = $70,000" reads 800000 and a model that rambles on after its answer is mis-read too: every sample
records the text math-verify read (`extracted_answer`), so a mis-parse shows in the samples file.

One departure from math-verify (`restates_without_value`): where the gold is a plain number, an answer that is
arithmetic left undone ("3 * 4" for 12) scores 0, although its value is right.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Mapping, Optional, Sequence

from mrl.environments.base import EnvironmentStep, Message, last_response, read_answers_and_finished, single_turn_step
from mrl.environments.verifier_pool import VerifierPool, VerifyFn


def boxed_gold(answer: str) -> str:
    """The gold answer as math-verify should read it: inside \\boxed{} unless it already contains one."""
    return answer if "\\boxed" in answer else f"\\boxed{{{answer}}}"


def readable(response: str) -> str:
    """The response as math-verify should read it: a LaTeX-escaped dollar (`\\$18.00`, a currency sign, never a
    math delimiter) is dropped; math-verify finds no answer at all in "costs \\$18.00" otherwise."""
    return response.replace("\\$", "")


def math_verify_verdict(response: str, answer: str) -> tuple[float, Optional[str]]:
    """(1.0 when the response's final answer is mathematically equal to the gold `answer`, else 0.0; the text
    math-verify read as the response's answer, None when it found none)."""
    from math_verify import parse, verify

    gold = parse(boxed_gold(answer), parsing_timeout=None)
    if not gold:
        raise ValueError(f"math-verify cannot parse the gold answer {answer!r}")
    predicted = parse(readable(response), parsing_timeout=None)
    extracted = str(predicted[-1]) if predicted else None  # parse gives [sympy form, its string form]
    if extracted is not None and restates_without_value(extracted, answer):
        return 0.0, extracted
    return (1.0 if predicted and verify(gold, predicted, timeout_seconds=None) else 0.0), extracted


_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_NUMBERS_WITH_AN_OPERATOR = re.compile(r"\d\s*(?:[*+\-^×·÷]|\\times|\\cdot|\\div)\s*[-(]?\s*\d")


def restates_without_value(extracted: str, answer: str) -> bool:
    """Whether the answer read is arithmetic on numbers left undone ("3 * 4", "2 + 5", "3 \\cdot 4") where the gold
    is a plain number: the question restated, not answered.

    math-verify compares values, so "What is 3 times 4?" answered "3 * 4 =" reads `3*4`, which equals 12: a
    policy learns that restating the question earns the reward (GRPO on SmolLM2-135M-Instruct did within 40 steps,
    100% on held-out questions with not one product computed). A fraction ("1/2", "\\frac{1}{2}") is a value and
    stays right; a gold that is itself an expression is compared by math-verify alone."""
    gold = answer.replace(",", "").strip()
    return bool(_PLAIN_NUMBER.fullmatch(gold)) and bool(_NUMBERS_WITH_AN_OPERATOR.search(extracted))


def math_verify_reward(response: str, answer: str) -> float:
    """1.0 when the response's final answer is mathematically equal to the gold `answer`, else 0.0."""
    return math_verify_verdict(response, answer)[0]


def last_boxed(response: str) -> Optional[str]:
    """The content of the text's last \\boxed{...} (braces balanced), None when there is none (or it is cut): the
    gold answer of a MATH solution."""
    start = response.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin - 1, len(response)):
        depth += {"{": 1, "}": -1}.get(response[index], 0)
        if depth == 0:
            return response[begin:index]
    return None  # unbalanced: the response was cut inside the box


def warm_up_math_verify() -> None:
    """Import math-verify and sympy's parsers once, before the worker takes its first (timed) sample."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # the 'timeout is disabled' notice: we time out
    math_verify_reward("\\boxed{\\frac{1}{2}}", "0.5")


class MathEnvironment:
    """Single-turn math environment: reward 1 for a correct final answer, 0 otherwise (also for truncated
    responses, failing verifiers and timeouts). `verify_fn` exists for tests and custom checkers."""

    def __init__(
        self,
        *,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        verify_fn: Optional[VerifyFn] = None,
        warmup: Any = warm_up_math_verify,
    ):
        self.pool = VerifierPool(
            verify_fn or math_verify_verdict, num_workers=num_workers, timeout_s=timeout_s, warmup=warmup
        )

    @classmethod
    def from_config(cls, cfg: Any) -> "MathEnvironment":
        """From an `EnvConfig` (env.*)."""
        return cls(num_workers=cfg.num_workers, timeout_s=cfg.timeout_s)

    def step(self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Mapping[str, Any]]) -> EnvironmentStep:
        answers, finished = read_answers_and_finished(metadata)
        # Truncated responses score 0 without being verified.
        todo = [i for i, f in enumerate(finished) if f]
        result = self.pool.score([last_response(message_logs[i]) for i in todo], [answers[i] for i in todo])
        scores: list[float] = [0.0] * len(answers)
        errors: list[Optional[str]] = [None] * len(answers)
        extracted: list[Optional[str]] = [None] * len(answers)
        for j, i in enumerate(todo):
            scores[i], errors[i], extracted[i] = result.scores[j], result.errors[j], result.extracted[j]
        return single_turn_step(scores, finished, metadata, errors, extracted)

    def shutdown(self) -> None:
        self.pool.shutdown()
