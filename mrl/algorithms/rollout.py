"""Rollouts: prompts -> engine samples -> rewards, laid out as the policy's training rows; and pass@k evaluation.

Row layout (one row per sample, prompt-major: sample k of prompt i is row i * n + k):
    input_ids            [B, T]  prompt tokens, response tokens, right padding (pad id)
    loss_mask            [B, T]  1 on the response tokens (stop token included), 0 on prompt and padding
    generation_logprobs  [B, T]  the engine's logprob of each response token, on the token's own position
No left padding: position ids are 0..T-1 in every row, as the engine saw them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from mrl.data.datasets import Problem
from mrl.environments.base import ANSWER, FINISHED
from mrl.inference.interface import FinishReason, GenerationOutput, SamplingConfig


@dataclass
class Rollouts:
    input_ids: torch.Tensor            # [B, T] int64
    loss_mask: torch.Tensor            # [B, T] float32
    generation_logprobs: torch.Tensor  # [B, T] float32
    rewards: torch.Tensor              # [B] float32
    response_lengths: torch.Tensor     # [B] int64
    truncated: torch.Tensor            # [B] bool: cut by max_new_tokens
    num_reward_errors: int = 0
    num_prompts_rejected: int = 0
    lengths: Optional[torch.Tensor] = None  # [B] prompt + response tokens of each row (the rest is padding)


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
            ids[row, p:p + r] = torch.tensor(sample.token_ids, dtype=torch.long)
            mask[row, p:p + r] = 1.0
            if sample.logprobs is not None:
                gen[row, p:p + r] = torch.tensor(sample.logprobs, dtype=torch.float32)
    return ids, mask, gen


def _response_text(tokenizer: Any, token_ids: Sequence[int]) -> str:
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)


def generate_and_score(engine: Any, env: Any, tokenizer: Any, problems: Sequence[Problem],
                       prompt_ids: Sequence[Sequence[int]], sampling: SamplingConfig) -> Rollouts:
    """Sample `sampling.n` responses per prompt and score them with the environment."""
    out = engine.generate(prompt_ids, sampling)
    texts = [_response_text(tokenizer, s.token_ids) for s in out.samples]
    logs = [[{"role": "assistant", "content": t}] for t in texts]
    meta = [{ANSWER: problems[s.prompt_index].answer, FINISHED: s.finish_reason is FinishReason.STOP}
            for s in out.samples]
    scored = env.step(logs, meta)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids, mask, gen = rows_from_output(out, pad)
    lengths = torch.tensor([len(s.prompt_token_ids) + s.length for s in out.samples], dtype=torch.long)
    return Rollouts(ids, mask, gen, scored.rewards.float(), out.lengths(),
                    torch.tensor([s.truncated for s in out.samples]), scored.num_errors, out.num_prompts_rejected,
                    lengths)


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one problem (Chen et al. 2021): 1 - C(n - c, k) / C(n, k)."""
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def evaluate(engine: Any, env: Any, tokenizer: Any, problems: Sequence[Problem],
             prompt_ids: Sequence[Sequence[int]], sampling: SamplingConfig, pass_k: Sequence[int]) -> dict[str, float]:
    """`val/accuracy` (pass@1 = mean correctness over all samples) and `val/pass@k` for each k."""
    bad = [k for k in pass_k if k > sampling.n]
    if bad:
        raise ValueError(f"eval.pass_k {bad} exceed eval.num_samples={sampling.n}: raise num_samples or lower k")
    rollouts = generate_and_score(engine, env, tokenizer, problems, prompt_ids, sampling)
    correct = (rollouts.rewards > 0.5).view(len(prompt_ids), sampling.n).sum(dim=1).tolist()
    metrics = {"val/accuracy": float(rollouts.rewards.mean()),
               "val/response_length": float(rollouts.response_lengths.float().mean())}
    for k in pass_k:
        metrics[f"val/pass@{k}"] = sum(pass_at_k(sampling.n, c, k) for c in correct) / len(correct)
    return metrics
