"""Rollouts: prompts -> engine samples -> rewards, laid out as the policy's training rows.

Row layout (one row per sample, prompt-major: sample k of prompt i is row i * n + k):
    input_ids            [B, T]  prompt tokens, response tokens, right padding (pad id)
    loss_mask            [B, T]  1 on the response tokens (stop token included), 0 on prompt and padding
    generation_logprobs  [B, T]  the engine's logprob of each response token, on the token's own position
    routing              [B, T, layers, k] or None  the engine's experts of each token (router replay), no_route = none
No left padding: position ids are 0..T-1 in every row, as the engine saw them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

import torch

from mrl.data.datasets import Problem
from mrl.environments.base import (
    ANSWER,
    ENV,
    EXTRACTED_ANSWER,
    FINISHED,
    PROMPT_TOKEN_IDS,
    RESPONSE_TOKEN_IDS,
    REWARD_ERROR,
    ROW,
    Environment,
)
from mrl.inference.interface import FinishReason, GenerationBackend, GenerationOutput, SamplingConfig, routing_rows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class Rollouts:
    input_ids: torch.Tensor  # [B, T] int64
    loss_mask: torch.Tensor  # [B, T] float32
    generation_logprobs: torch.Tensor  # [B, T] float32
    rewards: torch.Tensor  # [B] float32
    response_lengths: torch.Tensor  # [B] int64
    truncated: torch.Tensor  # [B] bool: cut by max_new_tokens
    num_reward_errors: int = 0
    num_prompts_rejected: int = 0
    lengths: Optional[torch.Tensor] = None  # [B] prompt + response tokens of each row (the rest is padding)
    responses: list[str] = field(default_factory=list)  # [B] decoded responses
    extracted_answers: list[Optional[str]] = field(default_factory=list)  # [B] what the environment read as answer
    finish_reasons: list[FinishReason] = field(default_factory=list)  # [B]
    policy_version: int = 0  # the training step whose weights generated them (0: the initial model)
    reward_errors: list[str] = field(default_factory=list)  # the reward's failure messages (at most a few)
    routing: Optional[torch.Tensor] = None  # [B, T, layers, k] uint8 / int16: the engine's experts (router replay)
    envs: list[str] = field(default_factory=list)  # [B] each row's environment (a run with several; else [])
    reward_errored: list[bool] = field(default_factory=list)  # [B] whether the reward failed on the row (scored 0)
    counts: dict[str, float] = field(default_factory=dict)  # the environment's counts of the batch (logged as is)

    def state_dict(self) -> dict:
        """Tensors, numbers and strings only (a checkpoint's train state loads with weights_only=True)."""
        state = {name: getattr(self, name) for name in self.__dataclass_fields__}
        state["finish_reasons"] = [reason.value for reason in self.finish_reasons]
        return state

    @classmethod
    def from_state_dict(cls, state: dict) -> "Rollouts":
        return cls(**{**state, "finish_reasons": [FinishReason(value) for value in state["finish_reasons"]]})


def decode_text(tokenizer: "PreTrainedTokenizerBase", token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
    """The text of one sequence of token ids (`decode` is typed for a batch too, whose result is a list)."""
    text = tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
    assert isinstance(text, str)  # one sequence decodes to one string
    return text


def rows_from_output(out: GenerationOutput, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, loss_mask, generation_logprobs), each [B, T], from the engine's samples (see the module doc)."""
    width = max((len(s.prompt_token_ids) + s.length for s in out.samples), default=1)
    ids = torch.full((len(out.samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(out.samples), width), dtype=torch.float32)
    gen = torch.zeros((len(out.samples), width), dtype=torch.float32)
    for row, sample in enumerate(out.samples):
        p, r = len(sample.prompt_token_ids), sample.length
        ids[row, :p] = torch.tensor(sample.prompt_token_ids, dtype=torch.long)
        if r:
            ids[row, p : p + r] = torch.tensor(sample.token_ids, dtype=torch.long)
            mask[row, p : p + r] = 1.0
            if sample.logprobs is not None:
                gen[row, p : p + r] = torch.tensor(sample.logprobs, dtype=torch.float32)
    return ids, mask, gen


def generate_and_score(
    engine: GenerationBackend,
    env: Environment,
    tokenizer: "PreTrainedTokenizerBase",
    problems: Sequence[Problem],
    prompt_ids: Sequence[Sequence[int]],
    sampling: SamplingConfig,
) -> Rollouts:
    """Sample `sampling.n` responses per prompt and score them with the environment."""
    out = engine.generate(prompt_ids, sampling)
    texts = [decode_text(tokenizer, s.token_ids, skip_special_tokens=True) for s in out.samples]
    logs = [[{"role": "assistant", "content": t}] for t in texts]
    meta = [
        {
            ANSWER: problems[s.prompt_index].answer,
            FINISHED: s.finish_reason is FinishReason.STOP,
            PROMPT_TOKEN_IDS: list(s.prompt_token_ids),
            RESPONSE_TOKEN_IDS: list(s.token_ids),
            ROW: problems[s.prompt_index].fields,
            **({ENV: problems[s.prompt_index].env} if problems[s.prompt_index].env else {}),
        }
        for s in out.samples
    ]
    scored = env.step(logs, meta)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids, mask, gen = rows_from_output(out, pad)
    lengths = torch.tensor([len(s.prompt_token_ids) + s.length for s in out.samples], dtype=torch.long)
    return Rollouts(
        ids,
        mask,
        gen,
        scored.rewards.float(),
        out.lengths(),
        torch.tensor([s.truncated for s in out.samples]),
        scored.num_errors,
        out.num_prompts_rejected,
        lengths,
        texts,
        [m.get(EXTRACTED_ANSWER) for m in scored.metadata],
        [s.finish_reason for s in out.samples],
        reward_errors=scored.error_messages[:4],
        routing=routing_rows([s.routing for s in out.samples], ids.shape[1]),
        envs=[str(m[ENV]) for m in meta if ENV in m],
        reward_errored=[REWARD_ERROR in m for m in scored.metadata],
        counts=dict(scored.counts),
    )


def concat_rollouts(parts: Sequence[Rollouts], pad_id: int) -> Rollouts:
    """Several groups' rollouts as one batch (rows in the order of `parts`, each part's rows whole groups): the
    [B, T] tensors padded to the widest part (pad id, mask and logprobs 0), counts summed, lists joined."""
    if len(parts) == 1:
        return parts[0]
    if any(part.routing is not None for part in parts):
        raise ValueError("router replay's routing cannot join rollouts of several environments")
    width = max(part.input_ids.shape[1] for part in parts)

    def padded(name: str, value: float) -> torch.Tensor:
        tensors = [getattr(part, name) for part in parts]
        return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value) for t in tensors])

    joined = lambda name: [x for part in parts for x in getattr(part, name)]  # noqa: E731
    lengths = [part.lengths for part in parts]
    return Rollouts(
        padded("input_ids", pad_id),
        padded("loss_mask", 0.0),
        padded("generation_logprobs", 0.0),
        torch.cat([part.rewards.float() for part in parts]),
        torch.cat([part.response_lengths for part in parts]),
        torch.cat([part.truncated for part in parts]),
        sum(part.num_reward_errors for part in parts),
        sum(part.num_prompts_rejected for part in parts),
        torch.cat([t for t in lengths if t is not None]) if all(t is not None for t in lengths) else None,
        joined("responses"),
        joined("extracted_answers"),
        joined("finish_reasons"),
        parts[0].policy_version,
        joined("reward_errors")[:4],
        envs=joined("envs"),
        reward_errored=joined("reward_errored"),
        counts=add_counts(part.counts for part in parts),
    )


def add_counts(parts: Iterable[dict[str, float]]) -> dict[str, float]:
    """Counts of several batches, key by key."""
    total: dict[str, float] = {}
    for counts in parts:
        for key, value in counts.items():
            total[key] = total.get(key, 0.0) + value
    return total
