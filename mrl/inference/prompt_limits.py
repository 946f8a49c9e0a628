"""Fit prompts into the engine's context before they reach it.

A prompt that, with its response budget, does not fit the engine's context would make vLLM raise for the whole
batch. We decide per prompt first, by config: "truncate" keeps the prompt's LAST tokens (the end holds the question
and the generation prompt of a chat template; the start is usually the system prompt), "reject" drops it and the
backend answers it with empty aborted samples. Both are counted so the step logs them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from mrl.inference.interface import GeneratedSample, GenerationOutput, OverlongPromptPolicy


@dataclass(frozen=True)
class FittedPrompts:
    """Prompts that go to the engine, with their original indices."""

    token_ids: list[list[int]]
    """Prompts to generate for, in original order (truncated ones already cut)."""
    indices: list[int]
    """Original index of each entry of `token_ids`."""
    truncated: frozenset[int]
    """Original indices of prompts that were cut."""
    rejected: frozenset[int]
    """Original indices of prompts that were dropped."""


def max_prompt_tokens(max_model_len: int, max_new_tokens: int) -> int:
    """Longest prompt for which every sample can still reach `max_new_tokens` within the engine's context."""
    limit = max_model_len - max_new_tokens
    if limit < 1:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the engine's context of "
            f"max_model_len={max_model_len} tokens; lower max_new_tokens or raise the engine's max_model_len"
        )
    return limit


def fit_prompts(prompts: Sequence[Sequence[int]], limit: int, policy: OverlongPromptPolicy) -> FittedPrompts:
    """Apply `policy` to every prompt longer than `limit` tokens; empty prompts are rejected whatever the policy."""
    if policy not in ("truncate", "reject"):
        raise ValueError(f"overlong prompt policy {policy!r}: choose 'truncate' or 'reject'")
    kept: list[list[int]] = []
    indices: list[int] = []
    truncated: set[int] = set()
    rejected: set[int] = set()
    for index, prompt in enumerate(prompts):
        ids = [int(t) for t in prompt]
        if not ids or (len(ids) > limit and policy == "reject"):
            rejected.add(index)
            continue
        if len(ids) > limit:
            ids = ids[-limit:]
            truncated.add(index)
        kept.append(ids)
        indices.append(index)
    return FittedPrompts(kept, indices, frozenset(truncated), frozenset(rejected))


def assemble_output(
    fitted: FittedPrompts,
    num_prompts: int,
    n: int,
    results: Mapping[int, Any],
    samples_of: Callable[[int, Optional[Any], bool], list[GeneratedSample]],
) -> GenerationOutput:
    """Every prompt's n samples in prompt order: `samples_of(index, its engine result or None if rejected,
    truncated?)` builds them from the engine's own result type."""
    samples: list[GeneratedSample] = []
    for index in range(num_prompts):
        samples.extend(samples_of(index, results.get(index), index in fitted.truncated))
    return GenerationOutput(
        samples=samples,
        num_prompts=num_prompts,
        n=n,
        num_prompts_truncated=len(fitted.truncated),
        num_prompts_rejected=len(fitted.rejected),
    )
